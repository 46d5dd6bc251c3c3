"""The test services a task may name (`Task.services`), and checking what it names.

"httpbin", "web:<host>,..." and "tarpit" run inside the task's sandbox at evaluation
(evaluation.services); "web" serves the files the package holds under data/web/<host>/.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable

from minisandbox.errors import ServiceError
from minisandbox.tasks.specs import Task

KNOWN_SERVICES: tuple[str, ...] = ("httpbin", "web", "tarpit")


def parse_service(spec: str) -> tuple[str, list[str]]:
    """ "httpbin:httpbin.org,example.com" -> ("httpbin", ["httpbin.org", "example.com"])."""
    name, _, args = spec.partition(":")
    return name.strip(), [a.strip() for a in args.split(",") if a.strip()]


_HOST_NAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))+$")


def check_services(task: Task) -> None:
    """Raises ServiceError for an unknown service, a public name that is not a DNS host name,
    a `web` host the package holds no files for, or two services answering as public hosts
    (both would serve ports 80 and 443)."""
    unknown = [s for s in task.services if parse_service(s)[0] not in KNOWN_SERVICES]
    if unknown:
        raise ServiceError(
            f"task {task.id}: unknown service {unknown[0]!r} (known: {', '.join(KNOWN_SERVICES)})"
        )
    public = [parse_service(s) for s in dict.fromkeys(task.services)]
    public = [(name, args) for name, args in public if name in ("httpbin", "web") and args]
    if len(public) > 1:
        raise ServiceError(
            f"task {task.id}: services {', '.join(n for n, _ in public)} both answer as public "
            "hosts on ports 80 and 443: name all the hosts in one of them"
        )
    for name, hosts in public:
        for host in hosts:
            if not _HOST_NAME.match(host):
                raise ServiceError(f"task {task.id}: {name}: {host!r} is not a host name")
            if name == "web" and not (web_root() / host).is_dir():
                raise ServiceError(
                    f"task {task.id}: web: no files for {host} (data/web/{host}/ in the package)"
                )


def web_root() -> Traversable:
    return resources.files("minisandbox") / "data" / "web"
