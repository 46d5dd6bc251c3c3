"""Test-time services a task's test suite reaches over the network, served inside its sandbox.

Evaluation keeps the network off. Some suites call a public service (requests' tests call
httpbin.org) or rely on how a connected network behaves (a connect to an unroutable address
times out); a task lists such services (`Task.services`, usually set by the recipe overrides),
and each is started inside the sandbox for the test run, with the environment variables that
point the suite at it. docs/recipes.md describes them.

A service runs from a tools environment the task's own venv does not see (envs.tools: a layer
kind of the builder, added to the task's sandbox by `Builder.sandbox`). This module is the
run-time half: starting and stopping services in a running sandbox. Which services a task may
name, and their host names, are checked with the task (tasks.service_specs). The programs that
run inside the sandbox are files of this package (helpers/).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
from collections.abc import AsyncIterator
from importlib.abc import Traversable

from minisandbox.envs.layout import TOOLS_ROOT
from minisandbox.errors import MiniSandboxError, SandboxFileError, ServiceError
from minisandbox.evaluation.mounts import mount_in
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.tasks.service_specs import check_services, parse_service, web_root
from minisandbox.tasks.specs import Task
from minisandbox.utils.aio import cancel_and_wait
from minisandbox.utils.resources import package_text

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0

# ---------------------------------------------------------------- running services


@contextlib.asynccontextmanager
async def start_services(sb: SandboxAPI, task: Task) -> AsyncIterator[dict[str, str]]:
    """Start the task's services in `sb`; yields the environment variables for the tests.
    The services stop when the block ends."""
    check_services(task)
    env: dict[str, str] = {}
    async with contextlib.AsyncExitStack() as stack:
        for spec in dict.fromkeys(task.services):
            name, args = parse_service(spec)
            env.update(await stack.enter_async_context(_STARTERS[name](sb, args)))
        yield env


@contextlib.asynccontextmanager
async def _httpbin(sb: SandboxAPI, public_names: list[str]) -> AsyncIterator[dict[str, str]]:
    """httpbin on loopback: HTTPBIN_URL=http://127.0.0.1:<port>/. With public names
    ("httpbin:httpbin.org,..."), the sandbox also resolves those names to it, where it answers
    on ports 80 and 443 as the public hosts would, with a certificate the task trusts (a CA made
    for this run, appended to the CA bundles in the task: see `_trust`); HTTPBIN_URL is then
    http://<first name>/, the URL suites default to."""
    async with _serve(sb, "httpbin", public_names, files="") as port:
        yield {"HTTPBIN_URL": f"http://{public_names[0] if public_names else '127.0.0.1:' + port}/"}


# Files the "web" service serves: data/web/<host>/<path>.
_WEB_FILES = "/tmp/.minisandbox-web-files"


@contextlib.asynccontextmanager
async def _web(sb: SandboxAPI, public_names: list[str]) -> AsyncIterator[dict[str, str]]:
    """Public web hosts ("web:www.python.org,www.google.com") answering inside the sandbox, on
    ports 80 and 443 (HTTPS with a certificate the task trusts, as for httpbin): each serves the
    files the package holds for it under data/web/<host>/ (a directory's page is its
    index.html) and 404 for any other path. For test suites that fetch known public pages
    (sphinx's remote images, its linkcheck builder's links and anchors) and expect a 404
    elsewhere."""
    if not public_names:
        raise ServiceError("web: name the public hosts it answers as (web:host,...)")
    root = web_root()  # the names are checked host names with files (check_services)
    for host in public_names:
        for path, data in _files_under(root / host, host):
            await sb.write_file(f"{_WEB_FILES}/{path}", data)
    await sb.execute(["mkdir", "-p", _WEB_FILES])
    async with _serve(sb, "web", public_names, files=_WEB_FILES):
        yield {}


def _files_under(node: Traversable, prefix: str) -> list[tuple[str, bytes]]:
    if node.is_file():
        return [(prefix, node.read_bytes())]
    if not node.is_dir():
        return []
    return [f for child in node.iterdir() for f in _files_under(child, f"{prefix}/{child.name}")]


@contextlib.asynccontextmanager
async def _serve(
    sb: SandboxAPI, service: str, public_names: list[str], files: str
) -> AsyncIterator[str]:
    """Run the server script (httpbin's app, or `files` as the web service) from the httpbin
    tools environment for the block; yields its loopback port."""
    python = f"{TOOLS_ROOT}/httpbin/bin/python"
    probe = await sb.execute(["test", "-x", python])
    if probe.exit_code != 0:
        raise ServiceError(
            f"{service}: no tools environment at {python} in this sandbox "
            "(start it with Builder.sandbox, which adds the task's tools layers)"
        )
    info = f"/tmp/.minisandbox-{service}"
    if public_names:
        await _serve_names(sb, public_names, f"{info}.hosts")
    await sb.write_file(
        f"{info}.py", package_text("minisandbox.evaluation", "helpers", "http_server.py")
    )
    await sb.write_file(
        f"{info}-probe.py", package_text("minisandbox.evaluation", "helpers", "http_probe.py")
    )
    # -I: none of the task's variables (PYTHONPATH...) reach the tools interpreter.
    server = asyncio.create_task(
        sb.execute(
            [python, "-I", f"{info}.py", info, files, *public_names],
            cwd="/tmp",
            timeout=365 * 86400.0,  # stopped below, never by a timeout
            merge_stderr=True,
            max_output=1 << 20,
        )
    )
    pid = ""
    try:
        port, pid = await _wait_ready(sb, server, python, info)
        if not public_names:
            yield port
        else:
            async with _trust(sb, f"{info}.ca.pem"):
                yield port
    finally:
        if pid:
            await sb.execute(f"kill {shlex.quote(pid)} 2>/dev/null")
        try:
            await asyncio.wait_for(asyncio.shield(server), STOP_TIMEOUT)
        except (asyncio.TimeoutError, MiniSandboxError):
            if pid:
                await sb.execute(f"kill -KILL {shlex.quote(pid)} 2>/dev/null")
            await cancel_and_wait([server])


async def _serve_names(sb: SandboxAPI, names: list[str], hosts_path: str) -> None:
    """Make `names` resolve to 127.0.0.1 in the sandbox, and ports below 1024 bindable by it.
    Both from the host, in the sandbox's namespaces: its /etc/hosts is a read-only mount and it
    holds no capabilities."""
    for name in names:
        if not all(c.isalnum() or c in "-." for c in name):
            raise ServiceError(f"{name!r} is not a host name")
    hosts = (await sb.execute(["cat", "/etc/hosts"])).stdout
    await sb.write_file(hosts_path, hosts + "".join(f"127.0.0.1 {n}\n" for n in names))
    await _bind_over(sb, hosts_path, "/etc/hosts")
    await _nsenter(
        sb, ["--net"], ["sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start"]
    )


# CA bundles a test suite may verify against: its own vendored ones (requests ships
# requests/cacert.pem) and certifi's in the venv. Appending keeps every public CA trusted.
_BUNDLES = (
    "find /testbed /opt/venv -name .git -prune -o -type f -name cacert.pem -print 2>/dev/null"
)


@contextlib.asynccontextmanager
async def _trust(sb: SandboxAPI, ca_path: str) -> AsyncIterator[None]:
    """Trust the CA at `ca_path` in the task's CA bundles for the block; restore them after."""
    found = (await sb.execute(_BUNDLES)).stdout.split("\n")
    bundles = [b for b in found if b.strip()]
    saved = "/tmp/.minisandbox-bundles"
    await sb.execute(["mkdir", "-p", saved])
    for i, bundle in enumerate(bundles):
        r = await sb.execute(
            f"cp -p -- {shlex.quote(bundle)} {saved}/{i} && "
            f"cat {shlex.quote(ca_path)} >> {shlex.quote(bundle)}"
        )
        if r.exit_code != 0:
            raise ServiceError(f"cannot add the test CA to {bundle}: {r.stdout}")
    try:
        yield
    finally:
        for i, bundle in enumerate(bundles):
            await sb.execute(f"cp -p -- {saved}/{i} {shlex.quote(bundle)}")


async def _bind_over(sb: SandboxAPI, source: str, target: str) -> None:
    try:
        await mount_in(sb, "bind-over", source, target)
    except SandboxFileError as e:
        raise ServiceError(f"binding {source} over {target} failed: {e}") from None


async def _nsenter(sb: SandboxAPI, namespaces: list[str], argv: list[str]) -> None:
    """Run `argv` on the host in the sandbox's `namespaces` (nsenter options)."""
    if sb.pid is None:
        raise ServiceError("the sandbox is not running")
    enter = ["nsenter", f"--target={sb.pid}", *namespaces]
    if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
        enter += ["--user", "--preserve-credentials"]
    try:
        proc = await asyncio.create_subprocess_exec(
            *enter, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except FileNotFoundError as e:
        raise ServiceError(f"the host has no {e.filename}") from None
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise ServiceError(f"`{' '.join(argv)}` in the sandbox failed: {out.decode().strip()}")


async def _wait_ready(
    sb: SandboxAPI, server: asyncio.Task, python: str, info: str
) -> tuple[str, str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT
    while loop.time() < deadline:
        if server.done():
            out = server.result().stdout if not server.exception() else str(server.exception())
            raise ServiceError(f"the test service exited before it was ready:\n{out[-2000:]}")
        r = await sb.execute(f"cat {info} 2>/dev/null")
        words = r.stdout.split()
        if r.exit_code == 0 and len(words) == 2:
            port, pid = words
            if (await sb.execute([python, "-I", f"{info}-probe.py", port])).exit_code == 0:
                return port, pid
        await asyncio.sleep(0.05)
    raise ServiceError(f"the test service was not ready after {READY_TIMEOUT:g} s")


@contextlib.asynccontextmanager
async def _tarpit(sb: SandboxAPI, _args: list[str]) -> AsyncIterator[dict[str, str]]:
    """Connections to addresses outside the sandbox hang until the client's timeout, as they do
    to an unroutable address (a "tarpit" such as 10.255.255.1) on a connected host, instead of
    failing at once with "network is unreachable". Suites test connect timeouts that way.

    The sandbox's network namespace gets a default route into its loopback device: a packet
    for another address comes back in on `lo`, is not local, and is dropped. Loopback traffic
    is unchanged. Set from the host (the sandbox has no capabilities); needs `nsenter` and
    `ip` there."""
    await _nsenter(sb, ["--net"], ["ip", "-4", "route", "add", "default", "dev", "lo"])
    # IPv6 may be disabled on the host; IPv4 is what the suites use.
    with contextlib.suppress(ServiceError):
        await _nsenter(sb, ["--net"], ["ip", "-6", "route", "add", "default", "dev", "lo"])
    yield {}


_STARTERS = {"httpbin": _httpbin, "web": _web, "tarpit": _tarpit}
