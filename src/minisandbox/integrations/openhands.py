"""OpenHands SDK on minisandbox: a workspace whose agent server runs inside a task sandbox.

    from openhands.sdk import Conversation
    from minisandbox.integrations.openhands import MiniSandboxWorkspace

    with MiniSandboxWorkspace(task="examples__semverkit-1", llm_urls=[llm.base_url]) as ws:
        conversation = Conversation(agent=agent, workspace=ws)   # a RemoteConversation
        conversation.send_message("Fix the issue in /testbed ...")
        conversation.run()
        reward = ws.evaluate().reward                             # graded in a fresh sandbox

As the SDK's DockerWorkspace does with a container, the agent server (openhands-agent-server)
runs in the sandbox and the SDK talks to it over HTTP and a websocket; the agent loop, its LLM
calls and its tools (terminal, file editor) all run inside. The sandbox keeps its own network
namespace with nothing but loopback, where the server listens (127.0.0.1). The host reaches it
without opening that namespace: a helper enters it only to create sockets, which it hands back
(SCM_RIGHTS); the host connects them to the server, so each connection of the SDK's clients to
a host-loopback relay port is carried by a socket of the sandbox's namespace. The agent's
commands run in that sandbox too and could replace the server, so the relay does not trust it: it
carries connections only from processes of this process's user (the TCP peer's owner, from
/proc/net/tcp), at most 64 at a time. Files go in and out through the sandbox's own file API
(capped reads), not through the server. The server answers only requests with the workspace's
random session key. The other way, the server reaches its LLM, and only that (`llm_urls`),
through the sandbox's egress proxy (sandbox/egress.py).

The server's Python environment (by default this process's: the SDK's packages beside
minisandbox) is bound read-only into the sandbox, at its own path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import posixpath
import secrets
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

try:
    from openhands.sdk.workspace import CommandResult, FileOperationResult, RemoteWorkspace
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"minisandbox.integrations.openhands needs the OpenHands SDK ({e}): pip install "
        "openhands-sdk openhands-tools openhands-agent-server (tested: 1.58; in a checkout of "
        "swe-minisandbox: scripts/test-stack openhands)"
    ) from e

from minisandbox.errors import AgentEnvironmentError, MiniSandboxError, SandboxConfigError
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.integrations.tasks import DEFAULT_DATASET, TaskSandbox, resolve_task_async
from minisandbox.runtime import Runtime
from minisandbox.sandbox.config import Limits
from minisandbox.sandbox.egress import EgressPolicy
from minisandbox.sandbox.files import READ_MAX_BYTES
from minisandbox.sandbox.hostpython import hidden_dirs
from minisandbox.sandbox.sync import background_loop, run_sync

__all__ = ["MiniSandboxWorkspace"]

logger = logging.getLogger(__name__)

_SERVER_HOST = "127.0.0.1"  # inside the sandbox: its own loopback
_SERVER_DIR = "/tmp/openhands-agent-server"  # its conversations and settings: not in /testbed
_SYSTEM = ("/usr/", "/bin/", "/lib", "/sbin/", "/etc/")  # bound into every sandbox already
_MAX_CONNECTIONS = 64  # carried by the relay at once (each holds descriptors here and inside)

# Runs on the host: enters the namespaces whose descriptors argv[2:] name ("net:5"; the
# sandbox's user namespace first for unprivileged callers), then, for every byte read on the
# descriptor argv[1], sends back a new TCP socket of that network namespace; the host connects
# it (a socket's namespace is the one it was created in).
_SOCKETS = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
for arg in sys.argv[2:]:
    ns, fd = arg.split(":")
    if libc.setns(int(fd), 0) != 0:
        sys.exit(f"setns {ns}: {os.strerror(ctypes.get_errno())}")
    os.close(int(fd))
back = socket.socket(fileno=int(sys.argv[1]))
while back.recv(1):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    socket.send_fds(back, [b"s"], [s.fileno()])
    s.close()
"""

# Asked of the server's Python: where its environment is, that it has the agent server, and
# whether the server's modules are byte-compiled. Found, not imported (that takes seconds).
_PROBE = """
import importlib.util as u, json, os, sys, sysconfig
def spec(name):
    try:
        return u.find_spec(name)
    except ImportError:
        return None
names = ("openhands.agent_server", "openhands.tools", "openhands.sdk")
found = [spec(m) for m in names]
if None in found:
    sys.exit("no module " + ", ".join(m for m, f in zip(names, found) if f is None))
dirs = [d for f in found for d in f.submodule_search_locations]
api = os.path.join(found[0].submodule_search_locations[0], "api.py")
paths = sysconfig.get_paths()
print(json.dumps({
    "bind": [sys.prefix, sys.base_prefix, *dirs],
    "modules": dirs,
    "site": sorted({paths["purelib"], paths["platlib"]}),
    "compiled": os.path.exists(u.cache_from_source(api)),
}))
"""


def _namespace_fds(pid: int, names: list[str], alive: Callable[[], bool]) -> dict[str, int]:
    """Descriptors of the namespaces `names` of process `pid`, the sandbox's init while
    `alive()`. They are opened through a descriptor of /proc/<pid>, which stays that process's
    (once it is gone, nothing opens through it, whichever process gets its number next), and
    `alive()` is asked once that descriptor is held: a recycled pid cannot lead into another
    process's namespaces.

    Raises:
        AgentEnvironmentError: the process is gone, or the sandbox is no longer running.
    """
    fds: dict[str, int] = {}
    try:
        proc = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise AgentEnvironmentError(
            f"cannot open a connection into the sandbox: its process {pid} is gone ({e})"
        ) from e
    try:
        if not alive():
            raise AgentEnvironmentError(
                "cannot open a connection into the sandbox: it is not running"
            )
        for name in names:
            fds[name] = os.open(f"ns/{name}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
    except BaseException as e:
        for fd in fds.values():
            os.close(fd)
        if isinstance(e, OSError):
            raise AgentEnvironmentError(
                f"cannot open a connection into the sandbox: its namespaces: {e}"
            ) from e
        raise
    finally:
        os.close(proc)
    return fds


class _NamespaceSockets:
    """New sockets of a sandbox's network namespace, from a helper living in it. `pid` is the
    sandbox's init, which `alive()` says still runs.

    Raises:
        AgentEnvironmentError: the sandbox's process is gone or the sandbox is not running.
    """

    def __init__(self, pid: int, alive: Callable[[], bool]) -> None:
        names = ["net"] if os.geteuid() == 0 else ["user", "net"]
        fds = _namespace_fds(pid, names, alive)
        try:
            self._ours, theirs = socket.socketpair()
            with theirs:
                argv = [sys.executable, "-I", "-S", "-c", _SOCKETS, str(theirs.fileno())]
                self._helper = subprocess.Popen(
                    [*argv, *(f"{name}:{fd}" for name, fd in fds.items())],
                    pass_fds=(theirs.fileno(), *fds.values()),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
        finally:
            for fd in fds.values():
                os.close(fd)
        self._lock = threading.Lock()

    def new(self) -> socket.socket:
        """A TCP socket of the sandbox's namespace (unconnected).

        Raises:
            AgentEnvironmentError: the helper is gone (it could not enter the namespace).
        """
        with self._lock:
            fds: list[int] = []
            with contextlib.suppress(OSError):
                self._ours.sendall(b"s")
                _msg, fds, _flags, _addr = socket.recv_fds(self._ours, 16, 1)
        if not fds:
            err = b""
            # (stderr is closed by a concurrent close(): then there is nothing to tell)
            with contextlib.suppress(OSError, ValueError):
                if self._helper.poll() is not None and self._helper.stderr is not None:
                    err = self._helper.stderr.read()
            raise AgentEnvironmentError(
                f"cannot open a connection into the sandbox: {err.decode(errors='replace')}"
            )
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        """Stop the helper, at once: a `new()` waiting for it gets no socket."""
        # A shutdown, not just a close, wakes a thread blocked on the socket in new() (a
        # close would wait for that thread, and so would the helper's EOF).
        with contextlib.suppress(OSError):
            self._ours.shutdown(socket.SHUT_RDWR)
        self._ours.close()
        self._helper.kill()  # it holds nothing worth waiting for
        self._helper.wait()
        if self._helper.stderr is not None:
            self._helper.stderr.close()


def _proc_net_address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address:port of /proc/net/tcp{,6}: the address's 32-bit words in the host's byte
    order, in hex; the port in hex."""
    addr, port = field.split(":")
    raw = b"".join(struct.pack("=I", int(addr[i : i + 8], 16)) for i in range(0, len(addr), 8))
    return _plain_ip(ipaddress.ip_address(raw)), int(port, 16)


def _plain_ip(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """`ip`, an IPv4-mapped IPv6 address as the IPv4 one."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def tcp_peer_uid(peer: tuple[Any, ...], local: tuple[Any, ...]) -> int | None:
    """The user owning the TCP socket of this host (this network namespace) at `peer` that is
    connected to `local` (an accepted connection's two ends), from /proc/net/tcp and tcp6;
    None when there is no such socket (the peer is gone, or not of this network namespace).
    Users are numbered as this process's user namespace numbers them."""
    want = (_plain_ip(ipaddress.ip_address(peer[0])), int(peer[1]))
    ours = (_plain_ip(ipaddress.ip_address(local[0])), int(local[1]))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    # The peer's socket: its local address is the peer, its remote is ours.
                    if tuple(map(_proc_net_address, fields[1:3])) == (want, ours):
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


class _Relay:
    """A host-loopback port whose connections go to `port` on the sandbox's loopback: only
    those of processes of this process's user, `max_connections` at a time. (Whatever listens
    on that port inside may be the agent's own program: the relay must not be a way in for
    other users of the host.)"""

    def __init__(
        self, sockets: _NamespaceSockets, port: int, *, max_connections: int = _MAX_CONNECTIONS
    ) -> None:
        self._sockets = sockets
        self._port = port
        self._max = max_connections
        self._active = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.refused: list[str] = []
        """Why connections were refused (the last 100)."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        logger.warning("relay of the agent server: refused a connection: %s", why)
        self.refused.append(why)
        del self.refused[:-100]
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._active >= self._max:
            self._refuse(writer, f"{self._max} connections already (the cap)")
            return
        self._active += 1
        self._writers.add(writer)
        try:
            await self._serve_allowed(reader, writer)
        finally:
            self._active -= 1
            self._writers.discard(writer)
            writer.close()

    async def _serve_allowed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer, local = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        uid = await asyncio.to_thread(tcp_peer_uid, peer, local)
        if uid != os.geteuid():
            owner = "an unknown user" if uid is None else f"user {uid}"
            self._refuse(writer, f"from {peer[0]}:{peer[1]}, a socket of {owner}")
            return
        try:
            sock = await asyncio.to_thread(self._sockets.new)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, (_SERVER_HOST, self._port))
            except OSError:
                sock.close()
                raise
            inner_reader, inner_writer = await asyncio.open_connection(sock=sock)
        except (OSError, AgentEnvironmentError) as e:
            logger.debug("relay: no connection to the agent server: %s", e)
            return
        self._writers.add(inner_writer)
        try:
            await asyncio.gather(_copy(reader, inner_writer), _copy(inner_reader, writer))
        finally:
            inner_writer.close()
            self._writers.discard(inner_writer)


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()  # a half close, as the peer made it
        else:
            dst.close()
    except (OSError, RuntimeError):
        dst.close()


def egress_policy(urls: list[str]) -> EgressPolicy | None:
    """The egress that lets the sandbox reach exactly the `urls`' host:port pairs (and no
    other host); None for none.

    Raises:
        SandboxConfigError: a URL has no host, or names the loopback by address.
    """
    allowed = []
    for url in urls:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if not parts.hostname:
            raise SandboxConfigError(f"llm_urls: {url!r} names no host")
        if parts.hostname in ("127.0.0.1", "::1"):
            # The server calls itself on 127.0.0.1: that address must stay the sandbox's own.
            raise SandboxConfigError(
                f"llm_urls: {url!r}: the sandbox's 127.0.0.1 is its own; name the host's "
                "loopback `localhost` (in the LLM's base_url too)"
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        allowed.append(f"{parts.hostname}:{port}")
    # `local`: exactly these host:port pairs, wherever they resolve (a model served on the
    # host's loopback or network included).
    return EgressPolicy(hosts=(), local=tuple(dict.fromkeys(allowed))) if allowed else None


def server_paths(python: str, *, compile_bytecode: bool = True) -> list[Path]:
    """The host directories `python`'s agent server needs inside the sandbox (its venv, its
    interpreter, and its packages when they live elsewhere). With `compile_bytecode`, its
    site-packages are byte-compiled first when the server's modules are not (read-only inside,
    they would be compiled again, in memory, at every start of a server).

    Raises:
        SandboxConfigError: `python` cannot run or has no openhands-agent-server, or has it
            among an interpreter's own packages (which sandboxes hide: sandbox.hostpython).
    """
    try:
        r = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
        )
    except OSError as e:
        raise SandboxConfigError(f"server_python: cannot run {python}: {e}") from e
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise SandboxConfigError(
            f"server_python: {python} has no OpenHands agent server ({last}): install "
            "openhands-agent-server and openhands-tools there, or set server_python to a "
            "Python that has them"
        )
    found = json.loads(r.stdout)
    if compile_bytecode and not found["compiled"]:
        subprocess.run(
            [python, "-m", "compileall", "-q", "-j", "0", *found["site"]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
    keep: list[Path] = []
    for d in sorted({Path(p) for p in found["bind"]}):
        if str(d).startswith(_SYSTEM) or any(d.is_relative_to(k) for k in keep):
            continue
        keep.append(d)
    # Sandboxes cover the packages of every interpreter prefix they bind (and /usr's).
    hidden = hidden_dirs(keep)
    for d in map(Path, found["modules"]):
        covered = next((h for h in hidden if d.is_relative_to(h)), None)
        if covered is not None:
            raise SandboxConfigError(
                f"server_python: {python} has the agent server among an interpreter's own "
                f"packages ({covered}), which sandboxes hide: set server_python to the Python "
                "of a venv with openhands-agent-server and openhands-tools"
            )
    return keep


class MiniSandboxWorkspace(RemoteWorkspace):
    """A RemoteWorkspace whose agent server runs in a minisandbox task sandbox (started when
    the workspace is made, stopped by `cleanup()` or the end of its `with` block)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    task: str | None = None
    """A task id of `dataset`, or an official SWE-bench image name. None: a plain sandbox
    (the host's system, an empty /testbed)."""
    dataset: str = DEFAULT_DATASET
    """Where the tasks come from (a name `load_tasks` knows, or a path)."""
    envs_dir: str | None = None
    """SWE-bench conda exports, for datasets that need them (default $MINISANDBOX_ENVS_DIR)."""
    build: bool = True
    """Build the task's layers on first use when they are missing."""
    working_dir: str = "/testbed"
    """Where the agent works (the task's repository)."""
    host: str = ""
    """The agent server's URL as the host reaches it (set when the sandbox starts)."""
    llm_urls: list[str] = Field(default_factory=list)
    """Base URLs of the LLMs the agent uses (each `LLM.base_url`): the agent server calls
    them from inside the sandbox, which reaches these host:port pairs and nothing else. A
    model on the host's loopback is `http://localhost:PORT/...`. Empty: no network at all."""
    server_python: str | None = None
    """A Python with openhands-agent-server and openhands-tools, whose environment is bound
    read-only into the sandbox; default: this process's."""
    compile_bytecode: bool = True
    """Byte-compile the server environment's modules on the host where they are not yet (a
    read-only environment inside cannot keep them: each start would compile them again)."""
    server_port: int = 8000
    """The agent server's port on the sandbox's loopback."""
    server_env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for the agent server (and the agent's commands)."""
    limits: Limits = Field(default_factory=Limits)
    """The sandbox's resource limits."""
    download_max_bytes: int = Field(default=READ_MAX_BYTES, ge=0)
    """The largest file `file_download` copies out of the sandbox (a larger one fails)."""
    startup_timeout: float = 600.0
    """Seconds to wait for the sandbox (a build of the task included) and the server."""
    server_lifetime: float = 7 * 24 * 3600.0
    """Seconds the agent server may run (then it is stopped like any command)."""
    runtime: Runtime | None = Field(default=None, exclude=True)
    """Where sandboxes and grades come from (default: this host's, over the default store)."""

    _box: TaskSandbox | None = PrivateAttr(default=None)
    _sockets: _NamespaceSockets | None = PrivateAttr(default=None)
    _relay: _Relay | None = PrivateAttr(default=None)
    _server: asyncio.Task[Any] | None = PrivateAttr(default=None)
    _server_log: list[str] = PrivateAttr(default_factory=list)

    @field_validator("host")
    @classmethod
    def _no_host(cls, value: str) -> str:
        if value:
            raise SandboxConfigError(
                "MiniSandboxWorkspace: `host` is set when its sandbox starts; leave it unset"
            )
        return value

    @field_validator("llm_urls")
    @classmethod
    def _reachable_urls(cls, value: list[str]) -> list[str]:
        egress_policy(value)
        return value

    def model_post_init(self, context: Any) -> None:
        """Start the sandbox and the agent server in it, then the RemoteWorkspace.

        Raises:
            pydantic.ValidationError: a setting is wrong (`llm_urls`, `host`, `server_python`:
                the message names it and says what to set).
            TaskNotFoundError: no such task in `dataset`.
            AgentEnvironmentError: the agent server did not come up (its output says why).
        """
        key = secrets.token_urlsafe(24)
        try:
            port = run_sync(asyncio.wait_for(self._start(key), self.startup_timeout))
        except asyncio.TimeoutError:
            self.cleanup()
            raise AgentEnvironmentError(
                f"the sandbox and its agent server did not start within {self.startup_timeout}"
                f" s (startup_timeout){self._log_tail()}"
            ) from None
        except BaseException:
            self.cleanup()
            raise
        self.host, self.api_key = f"http://127.0.0.1:{port}", key
        super().model_post_init(context)

    async def _start(self, key: str) -> int:
        policy = egress_policy(self.llm_urls)
        python = self.server_python or sys.executable
        paths = await asyncio.to_thread(
            server_paths, python, compile_bytecode=self.compile_bytecode
        )
        task = None
        if self.task:  # (loading a dataset may download it: not on the shared loop)
            task = await resolve_task_async(self.task, self.dataset, self.envs_dir)
        # The server's environment: more read-only binds, beside the task's own.
        overrides: dict[str, Any] = {"egress": policy, "limits": self.limits, "ro_paths": paths}
        if task is not None:
            overrides["build"] = self.build
        box = self._box = TaskSandbox(task, runtime=self.runtime, **overrides)
        sb = await box.start()
        env = {
            "SESSION_API_KEY": key,
            "OH_ENABLE_VSCODE": "false",
            "OH_PRELOAD_TOOLS": "false",  # a browser, which the sandbox does not have
            # litellm fetches its model price list at import unless told not to.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PYTHONUNBUFFERED": "1",
            **self.server_env,
        }
        await sb.execute(["mkdir", "-p", _SERVER_DIR])
        argv = [python, "-m", "openhands.agent_server", "--host", _SERVER_HOST]
        argv += ["--port", str(self.server_port)]

        def log(_fd: int, chunk: bytes) -> None:
            text = chunk.decode(errors="replace")
            self._server_log.append(text)
            del self._server_log[:-200]
            logger.debug("agent server: %s", text.rstrip())

        self._server = asyncio.ensure_future(
            sb.execute(
                argv,
                cwd=_SERVER_DIR,
                env=env,
                timeout=self.server_lifetime,
                merge_stderr=True,
                max_output=64 * 1024,
                on_output=log,
            )
        )
        if sb.pid is None:
            raise AgentEnvironmentError(
                "MiniSandboxWorkspace needs its sandbox on this host (the runtime's backend "
                "runs it elsewhere): use a Runtime of this host"
            )
        self._sockets = _NamespaceSockets(sb.pid, lambda: sb.running)
        self._relay = _Relay(self._sockets, self.server_port)
        await self._relay.start()
        await self._wait_healthy(self._relay.port, key)
        return self._relay.port

    async def _wait_healthy(self, port: int, key: str) -> None:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"X-Session-API-Key": key},
            timeout=5,
            trust_env=False,  # the host's proxy settings must not apply to its loopback
        ) as client:
            while True:
                if self._server is not None and self._server.done():
                    exc = self._server.exception()
                    raise AgentEnvironmentError(
                        f"the agent server exited at start ({exc or self._server.result()})"
                        f"{self._log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        return
                await asyncio.sleep(0.2)

    def _log_tail(self) -> str:
        tail = "".join(self._server_log)[-3000:].strip()
        return f"; its output:\n{tail}" if tail else ""

    async def _stop(self) -> None:
        relay, sockets, server, box = self._relay, self._sockets, self._server, self._box
        self._relay = self._sockets = self._server = None
        if relay is not None:
            await relay.close()
        if sockets is not None:
            await asyncio.to_thread(sockets.close)
        if server is not None:
            server.cancel()
            with contextlib.suppress(BaseException):
                await server
        if box is not None:
            await box.stop()

    def cleanup(self) -> None:
        """Stop the agent server and the sandbox (the task stays: `evaluate()` works)."""
        self.reset_client()
        run_sync(self._stop())

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        self.cleanup()

    def __del__(self) -> None:
        # A workspace dropped without cleanup(): stop its sandbox, without waiting (a
        # collection on the loop's thread, or at interpreter exit, would hang).
        private = getattr(self, "__pydantic_private__", None)
        if not private or private.get("_relay") is None or sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), background_loop())

    def execute_command(
        self, command: str, cwd: str | Path | None = None, timeout: float = 30.0
    ) -> CommandResult:
        """Run `command` in the sandbox, from `cwd` (default: `working_dir`)."""
        return super().execute_command(command, cwd or self.working_dir, timeout)

    def _inside(self, path: str | Path) -> str:
        return posixpath.join(self.working_dir, os.fspath(path))

    def file_upload(
        self, source_path: str | Path | bytes, destination_path: str | Path
    ) -> FileOperationResult:
        """Copy a host file (or bytes) to `destination_path` in the sandbox (relative: to
        `working_dir`), by the sandbox's own file API: the agent server is not involved."""
        source = "<bytes>" if isinstance(source_path, bytes) else os.fspath(source_path)
        dest = self._inside(destination_path)
        try:
            data = source_path if isinstance(source_path, bytes) else Path(source).read_bytes()
            run_sync(self.task_sandbox.sandbox.write_file(dest, data))
        except (OSError, MiniSandboxError) as e:
            return FileOperationResult(
                success=False, source_path=source, destination_path=dest, error=str(e)
            )
        return FileOperationResult(
            success=True, source_path=source, destination_path=dest, file_size=len(data)
        )

    def file_download(
        self, source_path: str | Path, destination_path: str | Path
    ) -> FileOperationResult:
        """Copy the regular file `source_path` of the sandbox (relative: to `working_dir`) to
        the host, by the sandbox's own file API (read inside, at most `download_max_bytes`),
        not through the agent server (the agent may have replaced it)."""
        source = self._inside(source_path)
        dest = Path(destination_path)
        try:
            data = run_sync(
                self.task_sandbox.sandbox.read_file(source, max_bytes=self.download_max_bytes)
            )
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        except (OSError, MiniSandboxError) as e:
            return FileOperationResult(
                success=False, source_path=source, destination_path=str(dest), error=str(e)
            )
        return FileOperationResult(
            success=True, source_path=source, destination_path=str(dest), file_size=len(data)
        )

    @property
    def alive(self) -> bool:
        """Whether the agent server answers its health check."""
        if self._relay is None:
            return False
        return super().alive

    @property
    def task_sandbox(self) -> TaskSandbox:
        """The sandbox (a TaskSandbox: `diff()` and `evaluate()` as every integration's).

        Raises:
            AgentEnvironmentError: the workspace was cleaned up before it started.
        """
        if self._box is None:
            raise AgentEnvironmentError("the workspace has no sandbox")
        return self._box

    @property
    def egress_refused(self) -> list[str]:
        """What the sandbox's egress proxy refused ("host:port (why)"): a call of the agent
        server to an LLM not in `llm_urls` is listed here."""
        box = self._box
        sb = getattr(box.sandbox, "egress_refused", None) if box and box.running else None
        return list(sb) if sb is not None else []

    def diff(self) -> str:
        """What the agent changed in /testbed, as a patch against the task's base commit."""
        return run_sync(self.task_sandbox.diff())

    def evaluate(self, patch: str | None = None, *, timeout: float = 1800.0) -> EvalResult:
        """Grade `patch` (default: the agent's changes in /testbed) in a fresh sandbox; a
        stopped workspace needs the patch (its /testbed is gone)."""
        if patch is None:
            patch = self.diff()
        return run_sync(self.task_sandbox.evaluate(patch, timeout=timeout))
