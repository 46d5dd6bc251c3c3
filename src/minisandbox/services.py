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
import hashlib
import json
import os
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MiniSandboxError
from .sandbox import Sandbox
from .specs import Task
from .toolchains import Interpreter, ToolchainNotFoundError, find_interpreter

if TYPE_CHECKING:
    from .builder import Builder

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
)
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0

# Serves httpbin's WSGI app on 127.0.0.1 with a port the kernel picks (nothing the tests bind
# can collide with it), then publishes "<port> <pid>" atomically: once the file exists the socket
# listens, so connections queue until the server accepts them.
_HTTPBIN_SERVER = """\
import os, sys
from httpbin import app
from werkzeug.serving import make_server

server = make_server("127.0.0.1", 0, app, threaded=True)
info = sys.argv[1]
with open(info + ".tmp", "w") as f:
    f.write(f"{server.socket.getsockname()[1]} {os.getpid()}\\n")
os.rename(info + ".tmp", info)
server.serve_forever()
"""
# A request through the real server: ready means serving, not only listening.
_HTTPBIN_PROBE = """\
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/get", timeout=5) as r:
    sys.exit(0 if r.status == 200 else 1)
"""

KNOWN_SERVICES: tuple[str, ...] = ("httpbin", "tarpit")
# The services that run from a tools environment, and its requirements.
_REQUIREMENTS = {"httpbin": HTTPBIN_REQUIREMENTS}


class ServiceError(MiniSandboxError):
    """A service could not be built or did not become ready."""


def check_services(task: Task) -> None:
    unknown = [s for s in task.services if s not in KNOWN_SERVICES]
    if unknown:
        raise ServiceError(
            f"task {task.id}: unknown service {unknown[0]!r} (known: {', '.join(KNOWN_SERVICES)})"
        )


# ---------------------------------------------------------------- tools environments


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
    wanted = [s for s in dict.fromkeys(task.services) if s in _REQUIREMENTS]
    if not wanted:
        return [], []
    interp = tools_interpreter()
    return [await build_tools_layer(builder, s, interp) for s in wanted], [interp.prefix]


async def build_tools_layer(builder: Builder, service: str, interp: Interpreter) -> str:
    """The layer id of `service`'s tools environment, built and published once per store."""
    ref = tools_ref(service, interp)
    existing = builder.store.resolve(ref)
    if existing:
        return existing
    # The builder's own steps: a build sandbox with the network, logged, one build at a time.
    async with builder._lock(ref):
        existing = builder.store.resolve(ref)
        if existing:
            return existing
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
            os.rename(upper / venv.lstrip("/"), layer_dir / venv.lstrip("/"))
            meta = {"kind": "tools", "service": service}
            return await builder._publish(ref, layer_dir, meta, interp, logs, [])


# ---------------------------------------------------------------- running services


@contextlib.asynccontextmanager
async def start_services(sb: Sandbox, task: Task) -> AsyncIterator[dict[str, str]]:
    """Start the task's services in `sb`; yields the environment variables for the tests.
    The services stop when the block ends."""
    check_services(task)
    env: dict[str, str] = {}
    async with contextlib.AsyncExitStack() as stack:
        for service in dict.fromkeys(task.services):
            env.update(await stack.enter_async_context(_STARTERS[service](sb)))
        yield env


@contextlib.asynccontextmanager
async def _httpbin(sb: Sandbox) -> AsyncIterator[dict[str, str]]:
    python = f"{TOOLS_ROOT}/httpbin/bin/python"
    probe = await sb.execute(["test", "-x", python])
    if probe.exit_code != 0:
        raise ServiceError(
            f"httpbin: no tools environment at {python} in this sandbox "
            "(start it with Builder.sandbox, which adds the task's tools layers)"
        )
    info = "/tmp/.minisandbox-httpbin"
    await sb.write_file(f"{info}.py", _HTTPBIN_SERVER)
    await sb.write_file(f"{info}-probe.py", _HTTPBIN_PROBE)
    # -I: none of the task's variables (PYTHONPATH...) reach the tools interpreter.
    server = asyncio.create_task(
        sb.execute(
            [python, "-I", f"{info}.py", info],
            cwd="/tmp",
            timeout=365 * 86400.0,  # stopped below, never by a timeout
            merge_stderr=True,
            max_output=1 << 20,
        )
    )
    pid = ""
    try:
        port, pid = await _wait_ready(sb, server, python, info)
        yield {"HTTPBIN_URL": f"http://127.0.0.1:{port}/"}
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


async def _wait_ready(sb: Sandbox, server: asyncio.Task, python: str, info: str) -> tuple[str, str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT
    while loop.time() < deadline:
        if server.done():
            out = server.result().stdout if not server.exception() else str(server.exception())
            raise ServiceError(f"httpbin exited before it was ready:\n{out[-2000:]}")
        r = await sb.execute(f"cat {info} 2>/dev/null")
        words = r.stdout.split()
        if r.exit_code == 0 and len(words) == 2:
            port, pid = words
            if (await sb.execute([python, "-I", f"{info}-probe.py", port])).exit_code == 0:
                return port, pid
        await asyncio.sleep(0.05)
    raise ServiceError(f"httpbin was not ready after {READY_TIMEOUT:g} s")


@contextlib.asynccontextmanager
async def _tarpit(sb: Sandbox) -> AsyncIterator[dict[str, str]]:
    """Connections to addresses outside the sandbox hang until the client's timeout, as they do
    to an unroutable address (a "tarpit" such as 10.255.255.1) on a connected host, instead of
    failing at once with "network is unreachable". Suites test connect timeouts that way.

    The sandbox's network namespace gets a default route into its loopback device: a packet
    for another address comes back in on `lo`, is not local, and is dropped. Loopback traffic
    is unchanged. Set from the host (the sandbox has no capabilities); needs `nsenter` and
    `ip` there."""
    if sb.pid is None:
        raise ServiceError("tarpit: the sandbox is not running")
    enter = ["nsenter", f"--target={sb.pid}", "--net"]
    if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
        enter += ["--user", "--preserve-credentials"]
    for family in ("-4", "-6"):
        argv = [*enter, "ip", family, "route", "add", "default", "dev", "lo"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except FileNotFoundError as e:
            raise ServiceError(f"tarpit: the host has no {e.filename}") from None
        out, _ = await proc.communicate()
        # IPv6 may be disabled on the host; IPv4 is what the suites use.
        if proc.returncode != 0 and family == "-4":
            raise ServiceError(f"tarpit: setting the route failed: {out.decode().strip()}")
    yield {}


_STARTERS = {"httpbin": _httpbin, "tarpit": _tarpit}
