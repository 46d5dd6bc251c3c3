"""Egress for sandboxes that need a few hosts (builds: package indexes, git hosts) and nothing
else: their own network namespace, and an HTTP proxy inside it that a host-side forwarder
serves with an allow-list.

A sandbox with `SandboxConfig.egress` set has no network but its loopback, exactly like one
without network: the host's 127.0.0.1, its abstract unix sockets and `/proc/net` are not its
own. The host opens a listening socket at EGRESS_ADDRESS *inside* that namespace (a helper
process enters it, binds, and hands the socket back), before anything of the sandbox runs, and
accepts on it: every connection is read as an HTTP proxy request (CONNECT host:port, or a
plain-HTTP request in absolute form) and forwarded from the host only if the host name is
allowed, the port is, and no address it resolves to is the host's own (loopback), link-local
(cloud metadata services live there), unspecified or multicast, unless the policy names that
host:port as a local index. An allowed name that resolves to a private address is followed:
that is what the network's DNS says of a name the policy allows (a corporate mirror, a
TLS-intercepting proxy); IP literals are names like any other, refused unless listed. The
sandbox's HTTP(S)_PROXY variables point at it (pip, uv, git and curl honour them and resolve
nothing themselves). What was refused is kept (`EgressProxy.refused`) so that
a failed build can say what to allow.

Where the host itself must use a proxy (`EgressPolicy.upstream`), the forwarder goes through
it; a TLS-intercepting proxy needs nothing more here than its CA in the sandbox's CA store.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import subprocess
import sys
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from minisandbox.errors import SandboxStartError

logger = logging.getLogger(__name__)

EGRESS_HOST = "127.0.0.1"
EGRESS_PORT = 3128
EGRESS_ADDRESS = f"http://{EGRESS_HOST}:{EGRESS_PORT}"
_HEAD_LIMIT = 64 * 1024
_HEAD_TIMEOUT = 60.0
_CONNECT_TIMEOUT = 60.0


class EgressPolicy(BaseModel):
    """Which hosts a sandbox may reach through its proxy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: tuple[str, ...] = Field(
        description="host names allowed: exact, or '.example.org' for it and every subdomain"
    )
    ports: tuple[int, ...] = (80, 443)
    """Ports allowed on those hosts (a `local` entry brings its own)."""
    local: tuple[str, ...] = ()
    """'host:port' pairs that may resolve to loopback or private addresses (an index the user
    runs on their network, named in their pip or uv settings)."""
    upstream: str | None = None
    """An HTTP proxy the host itself must use (http://host:port), or None."""

    def names_local(self, host: str) -> bool:
        """Whether a `local` entry is on `host` (any port)."""
        return any(entry.rpartition(":")[0] == host for entry in self.local)

    def allows(self, host: str, port: int) -> bool:
        """Whether `host:port` passes the name and port rules (addresses are checked later)."""
        host = host.lower().rstrip(".")
        if f"{host}:{port}" in self.local:
            return True
        if port not in self.ports:
            return False
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.hosts)


def proxy_env(policy: EgressPolicy) -> dict[str, str]:
    """The variables that send a sandbox's HTTP(S) clients through its proxy: all but its own
    loopback, unless the policy allows a host's loopback index (then that goes through too)."""
    env = {}
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[name] = EGRESS_ADDRESS
    own = [h for h in ("localhost", "127.0.0.1", "::1") if not policy.names_local(h)]
    for name in ("no_proxy", "NO_PROXY"):
        env[name] = ",".join(own)
    return env


# Runs on the host, in the sandbox's user (unprivileged callers) and network namespaces: binds
# the proxy's address there and sends the listening socket back on the descriptor argv[2].
_LISTENER = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
for ns in sys.argv[3:]:
    fd = os.open(f"/proc/{sys.argv[1]}/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0) != 0:
        err = ctypes.get_errno()
        sys.exit(f"setns {ns}: {os.strerror(err)}")
    os.close(fd)
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind((HOST, PORT))
s.listen(128)
back = socket.socket(fileno=int(sys.argv[2]))
socket.send_fds(back, [b"ok"], [s.fileno()])
"""


def open_listener(pid: int) -> socket.socket:
    """A socket listening at EGRESS_ADDRESS in the network namespace of `pid` (the sandbox's
    pid 1, as the host sees it).

    Raises:
        SandboxStartError: the namespace could not be entered or the address bound.
    """
    namespaces = ["net"] if os.geteuid() == 0 else ["user", "net"]
    code = _LISTENER.replace("HOST", repr(EGRESS_HOST)).replace("PORT", str(EGRESS_PORT))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        os.set_inheritable(theirs.fileno(), True)
        argv = [sys.executable, "-I", "-S", "-c", code, str(pid), str(theirs.fileno())]
        r = subprocess.run(
            [*argv, *namespaces],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0:
            raise SandboxStartError(f"cannot open the egress proxy in the sandbox: {r.stderr}")
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 16, 1)
    if not fds:
        raise SandboxStartError("the egress proxy's listener was not handed back")
    return socket.socket(fileno=fds[0])


class _Refused(Exception):
    """The request may not pass; the message says why (sent back as the 403's body)."""


class EgressProxy:
    """The host side of a sandbox's proxy: serves `listener` (see the module docstring)."""

    def __init__(self, policy: EgressPolicy, listener: socket.socket, name: str) -> None:
        self.policy = policy
        self.name = name
        self.refused: list[str] = []  # "host:port (why)", each once
        self._listener = listener
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._listener.setblocking(False)
        self._server = await asyncio.start_server(self._serve, sock=self._listener)

    async def close(self) -> None:
        try:
            if self._server is not None:
                self._server.close()
            # The connections first: from 3.12 on, wait_closed() waits for them.
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._server.wait_closed(), 5)
        finally:
            self._listener.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._one(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            # Only close() cancels a connection's task, and nothing awaits it: ending
            # normally keeps asyncio's server callback (3.11) from logging the cancel as an
            # error ("Exception in callback ... CancelledError") after every build.
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT)
        if len(head) > _HEAD_LIMIT:
            return
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            return
        method, target, version = parts
        try:
            if method == "CONNECT":
                host, port = _split_host_port(target, 443)
                upstream = await self._open(host, port)
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                url = urlsplit(target)
                if url.scheme != "http" or not url.hostname:
                    raise _Refused(f"not a proxy request: {method} {target[:100]}")
                host, port = url.hostname, url.port or 80
                upstream = await self._open(host, port, plain=True)
                path = url.path or "/"
                if url.query:
                    path += "?" + url.query
                headers = [
                    h
                    for h in rest.split(b"\r\n")
                    if h and not h.lower().startswith((b"proxy-", b"connection:"))
                ]
                request = f"{method} {path} {version}\r\n".encode()
                request += b"".join(h + b"\r\n" for h in headers)
                upstream[1].write(request + b"Connection: close\r\n\r\n")
        except _Refused as e:
            body = f"minisandbox: {e}\n".encode()
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            return
        await _pipe(reader, writer, *upstream)

    async def _open(
        self, host: str, port: int, plain: bool = False
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to `host:port`, if the policy allows it.

        Raises:
            _Refused: the name, the port or an address it resolves to is not allowed.
        """
        if not self.policy.allows(host, port):
            self._refuse(host, port, "not in the allow-list")
        if self.policy.upstream:
            return await self._through_upstream(host, port, plain)
        local = f"{host.lower()}:{port}" in self.policy.local
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as e:
            raise _Refused(f"{host}: {e}") from None
        addresses = [str(info[4][0]) for info in infos]
        for address in addresses:
            if not local and not _reachable(address):
                self._refuse(host, port, f"resolves to {address}, an address of this host's")
        return await asyncio.wait_for(asyncio.open_connection(addresses[0], port), _CONNECT_TIMEOUT)

    async def _through_upstream(
        self, host: str, port: int, plain: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self.policy.upstream is not None
        proxy = urlsplit(self.policy.upstream)
        conn = await asyncio.wait_for(
            asyncio.open_connection(proxy.hostname, proxy.port or 3128), _CONNECT_TIMEOUT
        )
        if plain:  # the request itself goes to the upstream, in absolute form
            return conn
        conn[1].write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        reply = await asyncio.wait_for(conn[0].readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT)
        if b" 200" not in reply.split(b"\r\n", 1)[0]:
            conn[1].close()
            raise _Refused(f"the upstream proxy refused {host}:{port}")
        return conn

    def _refuse(self, host: str, port: int, why: str) -> None:
        entry = f"{host}:{port} ({why})"
        if entry not in self.refused:
            self.refused.append(entry)
            logger.warning("sandbox %s: egress to %s refused", self.name, entry)
        raise _Refused(f"egress to {entry} refused")


def _split_host_port(target: str, default: int) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return target, default
    return host.strip("[]"), int(port)


def _reachable(address: str) -> bool:
    """Not loopback, link-local, unspecified or multicast (IPv4-mapped IPv6 included)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified)


async def _pipe(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while chunk := await src.read(65536):
                dst.write(chunk)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()

    try:
        await asyncio.gather(copy(a_reader, b_writer), copy(b_reader, a_writer))
    finally:
        b_writer.close()
