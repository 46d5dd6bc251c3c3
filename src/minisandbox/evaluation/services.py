"""Test-time services a task's test suite reaches over the network, served inside its sandbox.

Evaluation keeps the network off. Some suites call a public service (requests' tests call
httpbin.org) or rely on how a connected network behaves (a connect to an unroutable address
times out); a task lists such services (`Task.services`, usually set by the recipe overrides),
and each is started inside the sandbox for the test run, with the environment variables that
point the suite at it. docs/recipes.md describes them.

A service runs from a tools environment the task's own venv does not see: a uv venv of pinned
packages at `TOOLS_ROOT/<service>`, built once from a host interpreter of our choosing (not the
task's: the task may need a Python too old for the service), published to the layer store as
`tools/<service>-<key>`, and added to the task's sandbox as one more read-only lower layer with
its interpreter's prefix bound read-only (`tools_layers`, called by `Builder.sandbox`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from minisandbox.envs.toolchains import Interpreter, ToolchainNotFoundError, find_interpreter
from minisandbox.errors import MiniSandboxError
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.tasks.specs import Task

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from minisandbox.tasks.builder import Builder

TOOLS_ROOT = "/opt/minisandbox-tools"
# Tried in order for the tools environments; the pins below are known to install on each.
TOOLS_PYTHONS = ("3.12", "3.11", "3.13", "3.10")
_TOOLS_FORMAT = 1  # bump when what a tools layer holds changes

# httpbin (the PyPI package of httpbin.org's code) and its whole dependency closure, pinned.
HTTPBIN_REQUIREMENTS = (
    "httpbin==0.10.4",
    "flask==3.1.3",
    "werkzeug==3.1.9",
    "blinker==1.9.0",
    "brotlicffi==1.2.1.0",
    "cffi==2.1.1",
    "click==8.5.1",
    "decorator==5.3.1",
    "greenlet==3.5.6",
    "itsdangerous==2.2.0",
    "jinja2==3.1.6",
    "markupsafe==3.0.4",
    "pycparser==3.12",
    "six==1.17.0",
    # Certificates for the public names it answers as (see `_httpbin`).
    "trustme==1.2.1",
    "cryptography==50.0.2",
    "idna==3.20",
)
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0

# Serves httpbin's WSGI app on 127.0.0.1 with a port the kernel picks (nothing the tests bind
# can collide with it). Given public host names, also on ports 80 (HTTP) and 443 (HTTPS, with a
# certificate for those names from a CA made now, written to <info>.ca.pem). Then publishes
# "<port> <pid>" atomically: once the file exists every socket listens.
_HTTPBIN_SERVER = """\
import os, ssl, sys, threading
from werkzeug.serving import make_server
if not sys.argv[2]:
    from httpbin import app

info, files, names = sys.argv[1], sys.argv[2], [n for n in sys.argv[3:] if n]
if files:  # the "web" service: files/<host>/<path>, else 404
    import mimetypes

    root = os.path.realpath(files)

    def app(environ, start_response):
        host = environ.get("HTTP_HOST", "").split(":")[0].lower()
        path = os.path.realpath(os.path.join(root, host, environ.get("PATH_INFO", "").lstrip("/")))
        if os.path.isdir(path):  # a directory's page: its index.html
            path = os.path.join(path, "index.html")
        if path.startswith(root + os.sep) and os.path.isfile(path):
            with open(path, "rb") as fh:
                body = fh.read()
            kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
            start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found"]
servers = [make_server("127.0.0.1", 0, app, threaded=True)]
if names:
    import trustme

    ca = trustme.CA(organization_name="minisandbox test services")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(*names).configure_cert(context)
    ca.cert_pem.write_to_path(info + ".ca.pem")
    servers.append(make_server("127.0.0.1", 80, app, threaded=True))
    servers.append(make_server("127.0.0.1", 443, app, threaded=True, ssl_context=context))
for server in servers[1:]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
with open(info + ".tmp", "w") as f:
    f.write(f"{servers[0].socket.getsockname()[1]} {os.getpid()}\\n")
os.rename(info + ".tmp", info)
servers[0].serve_forever()
"""
# A request through the real server: ready means serving, not only listening (any HTTP answer:
# the web service answers 404 where httpbin answers 200).
_HTTPBIN_PROBE = """\
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/get", timeout=5).close()
except urllib.error.HTTPError:
    pass
"""

KNOWN_SERVICES: tuple[str, ...] = ("httpbin", "web", "tarpit")
# The tools environments, by their requirements, and the services that run from each.
_REQUIREMENTS = {"httpbin": HTTPBIN_REQUIREMENTS}
_TOOLS = {"httpbin": "httpbin", "web": "httpbin"}


class ServiceError(MiniSandboxError):
    """A service could not be built or did not become ready."""


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
            if name == "web" and not (_web_root() / host).is_dir():
                raise ServiceError(
                    f"task {task.id}: web: no files for {host} (data/web/{host}/ in the package)"
                )


def _web_root() -> Traversable:
    return resources.files("minisandbox") / "data" / "web"


# ---------------------------------------------------------------- tools environments


@functools.cache  # discovery runs programs: once per process, as Builder.interpreter does
def tools_interpreter() -> Interpreter:
    for version in TOOLS_PYTHONS:
        with contextlib.suppress(ToolchainNotFoundError):
            return find_interpreter(version)
    raise ServiceError(
        f"test services need a Python {' or '.join(TOOLS_PYTHONS)} on the host: "
        f"uv python install {TOOLS_PYTHONS[0]}"
    )


def tools_ref(service: str, interp: Interpreter) -> str:
    spec = {
        "format": _TOOLS_FORMAT,
        "service": service,
        "python": interp.version,
        "requirements": list(_REQUIREMENTS[service]),
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return f"tools/{service}-{digest[:32]}"


async def tools_layers(builder: Builder, task: Task) -> tuple[list[str], list[Path]]:
    """The task's services' tools layers (built when missing) and the host paths they need."""
    check_services(task)
    if not task.services:
        return [], []
    names = (parse_service(s)[0] for s in task.services)
    wanted = list(dict.fromkeys(_TOOLS[s] for s in names if s in _TOOLS))
    if not wanted:
        return [], []
    interp = tools_interpreter()
    return [await build_tools_layer(builder, s, interp) for s in wanted], [interp.prefix]


async def build_tools_layer(builder: Builder, service: str, interp: Interpreter) -> str:
    """The layer id of `service`'s tools environment, built and published once per store."""
    ref = tools_ref(service, interp)
    existing = builder.store.resolve(ref)  # the usual case, without taking the build lock
    if existing:
        return existing

    async def make() -> str:
        # The builder's own steps: a build sandbox with the network, logged.
        venv = f"{TOOLS_ROOT}/{service}"
        logs = builder._log_dir(ref)
        with builder._workdir("tools-") as work:
            upper = work / "upper"
            async with Sandbox(builder._build_config(interp, upper=upper)) as sb:
                await builder._step(
                    sb, ref, logs, "venv", f"uv venv --python {interp.executable} {venv}"
                )
                await sb.write_file("/tmp/requirements.txt", "\n".join(_REQUIREMENTS[service]))
                await builder._step(
                    sb,
                    ref,
                    logs,
                    "requirements",
                    f"uv pip install --python {venv}/bin/python --link-mode copy "
                    "--compile-bytecode --no-deps -r /tmp/requirements.txt",
                )
            layer_dir = work / "layer"
            (layer_dir / TOOLS_ROOT.lstrip("/")).mkdir(parents=True)
            builder._collect(upper, venv, layer_dir, ref, logs)  # refuses a planted link
            meta = {"kind": "tools", "service": service}
            return await builder._publish(ref, layer_dir, meta, interp, logs, [])

    return await builder._once(ref, False, make)


# ---------------------------------------------------------------- running services


@contextlib.asynccontextmanager
async def start_services(sb: Sandbox, task: Task) -> AsyncIterator[dict[str, str]]:
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
async def _httpbin(sb: Sandbox, public_names: list[str]) -> AsyncIterator[dict[str, str]]:
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
async def _web(sb: Sandbox, public_names: list[str]) -> AsyncIterator[dict[str, str]]:
    """Public web hosts ("web:www.python.org,www.google.com") answering inside the sandbox, on
    ports 80 and 443 (HTTPS with a certificate the task trusts, as for httpbin): each serves the
    files the package holds for it under data/web/<host>/ (a directory's page is its
    index.html) and 404 for any other path. For test suites that fetch known public pages
    (sphinx's remote images, its linkcheck builder's links and anchors) and expect a 404
    elsewhere."""
    if not public_names:
        raise ServiceError("web: name the public hosts it answers as (web:host,...)")
    root = _web_root()  # the names are checked host names with files (check_services)
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
    sb: Sandbox, service: str, public_names: list[str], files: str
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
    await sb.write_file(f"{info}.py", _HTTPBIN_SERVER)
    await sb.write_file(f"{info}-probe.py", _HTTPBIN_PROBE)
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
            server.cancel()
            with contextlib.suppress(BaseException):
                await server


async def _serve_names(sb: Sandbox, names: list[str], hosts_path: str) -> None:
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
async def _trust(sb: Sandbox, ca_path: str) -> AsyncIterator[None]:
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


# Binds a file of the sandbox read-only over another, in the sandbox's mount namespace. The
# target is a file bwrap bound and then unlinked (nothing can be mounted on an unlinked file), so
# that mount is detached first. A fresh single-threaded interpreter: setns needs one.
_BIND_OVER = """\
import ctypes, os, sys

libc = ctypes.CDLL(None, use_errno=True)
pid, source, target = sys.argv[1:4]


def check(result, what):
    if result != 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")


root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
    check(libc.setns(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY), 0x10000000), "setns user")
check(libc.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), 0x00020000), "setns mnt")
os.fchdir(root)
os.chroot(".")
MS_RDONLY, MS_REMOUNT, MS_BIND, MNT_DETACH = 1, 32, 4096, 2
check(libc.umount2(target.encode(), MNT_DETACH), "umount")
check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind")
check(libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "ro")
"""


async def _bind_over(sb: Sandbox, source: str, target: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        _BIND_OVER,
        str(sb.pid),
        source,
        target,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise ServiceError(f"binding {source} over {target} failed: {out.decode().strip()}")


async def _nsenter(sb: Sandbox, namespaces: list[str], argv: list[str]) -> None:
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


async def _wait_ready(sb: Sandbox, server: asyncio.Task, python: str, info: str) -> tuple[str, str]:
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
async def _tarpit(sb: Sandbox, _args: list[str]) -> AsyncIterator[dict[str, str]]:
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
