"""The warm process's side of `cli/warm.py`: it imports the CLI once, listens on the caller's
socket, and forks a worker per command that runs it as the caller's own process would (its
streams, working directory, environment, umask, ignored signals), then reports the status.

Started by `warm.after_run_here` (or `python -m minisandbox.cli.warmserver [SOCKET]`); see
`warm` for who may use it and why.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import io
import marshal
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from minisandbox.cli.warm import IDLE_SECONDS, ShortAddress

_MAX_REQUEST = 4 << 20  # the caller's argv and environment
_REQUEST_TIMEOUT = 30.0


def serve(path: str, idle: float = IDLE_SECONDS) -> None:
    """Be the warm process at `path` (its directory must be the caller's private runtime
    directory), until `idle` seconds pass without a command or another takes the path. Returns
    at once when another warm process holds it."""
    from minisandbox.sandbox.runtime import private_root

    private_root(Path(path).parent)  # ours alone, or no warm process
    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return  # another one serves this path
    from minisandbox.cli.main import preload, refresh

    preload()  # what every worker then has for free
    listener, inode = _listen(path)
    gc.collect()
    gc.freeze()  # the workers' copies of these pages stay shared
    workers: dict[int, socket.socket] = {}
    last = refreshed = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([listener], [], [], 1.0)
            if ready:
                _accept(listener, lock, workers)
            _reap(workers)
            # Between commands: a worker forks what the warm process holds.
            if time.monotonic() - refreshed > _REFRESH_SECONDS:
                refresh()
                refreshed = time.monotonic()
            if workers or ready:
                last = time.monotonic()
            elif time.monotonic() - last > idle or not _still_ours(path, inode):
                break
        # Gone from the path first, then every connection already queued is served: a caller
        # never finds its command refused by a warm process that was ending.
        if _still_ours(path, inode):
            os.unlink(path)
        listener.setblocking(False)
        while _accept(listener, lock, workers):
            pass
    finally:
        listener.close()
        if _still_ours(path, inode):
            os.unlink(path)
        os.close(lock)


# Seconds between the warm process's checks of what its workers inherit (the system layer).
_REFRESH_SECONDS = 10.0


def _accept(listener: socket.socket, lock: int, workers: dict[int, socket.socket]) -> bool:
    """Take one queued connection and fork its worker; False when none is queued. A peer that
    is not one of the caller's own processes on the host (another uid, or a process in another
    user, mount or pid namespace: a sandbox, which can share the caller's uid) is refused."""
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return False
    if not _peer_is_ours(conn):
        conn.close()
        return True
    pid = os.fork()
    if pid == 0:
        listener.close()
        os.close(lock)
        for other in workers.values():  # (their callers' sockets are not this worker's)
            other.close()
        _work(conn)  # never returns
    workers[pid] = conn
    return True


def _listen(path: str) -> tuple[socket.socket, int]:
    """The listening socket at `path` (mode 600), and its inode: bound under a temporary
    name and listening before it is renamed there, so a caller never meets it unready."""

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    staging = f"{path}.{os.getpid()}.new"
    old = os.umask(0o177)
    try:
        with ShortAddress(staging) as address:
            listener.bind(address)
    finally:
        os.umask(old)
    listener.listen(128)
    os.replace(staging, path)  # (a dead warm process's socket: we hold the lock)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return listener, os.stat(path).st_ino


_SO_PEERPIDFD = 77  # (Linux 6.5; the socket module names it from Python 3.13)


def _peer_is_ours(conn: socket.socket) -> bool:
    """Whether the peer is a process of our uid in our own user, mount and pid namespaces.
    Its pid is pinned by a pidfd (SO_PEERPIDFD, else pidfd_open at once) and checked alive
    after its namespaces were read: a pid reused meanwhile cannot pass for it."""

    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.geteuid() or pid <= 0:
        return False
    try:
        try:
            pidfd = struct.unpack("i", conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4))[0]
        except OSError:
            pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        for ns in ("user", "mnt", "pid"):
            if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
                return False

        signal.pidfd_send_signal(pidfd, 0)  # still the process whose namespaces were read
    except OSError:
        return False
    finally:
        os.close(pidfd)
    return True


def _still_ours(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _reap(workers: dict[int, socket.socket]) -> None:
    """Collect the workers that ended; tell each one's caller its wait status (a worker that
    reported its own exit status first has its caller gone already: nothing is sent then)."""
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is not None:
            try:
                conn.setblocking(False)
                conn.send(b"W %d\n" % status)
            except OSError:
                pass
            conn.close()


def _work(conn: socket.socket) -> None:
    """A worker: take the caller's request and streams, run the command as the CLI does in
    the caller's process, report its exit status. Never returns."""
    try:
        request = _take_request(conn)
    except BaseException:  # a broken request (or its caller gone): nothing of it ran
        os._exit(2)
    try:
        conn.sendall(b"A\n")  # taken: from here on the caller waits for this command's status
        code = _run(conn, request)
    except KeyboardInterrupt:  # (as the interpreter ends on one that nothing caught)
        code = 130
    except BaseException as e:
        traceback.print_exc()
        try:
            os.write(2, f"minisandbox: the warm process could not run the command: {e}\n".encode())
        except OSError:
            pass
        code = 2
    try:
        conn.sendall(b"X %d\n" % code)
    except OSError:
        pass
    os._exit(code)


def _take_request(conn: socket.socket) -> dict[str, Any]:

    conn.settimeout(_REQUEST_TIMEOUT)
    header, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    size, count = struct.unpack("!II", header)
    if size > _MAX_REQUEST or len(fds) != count:
        raise ValueError("malformed request")
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("truncated request")
        data += chunk
    request = marshal.loads(data)  # from a process of our own uid (checked at accept)
    if not isinstance(request, dict):
        raise ValueError("malformed request")
    targets = request["fds"]
    if len(targets) != len(fds) or not set(targets) <= {0, 1, 2}:
        raise ValueError("malformed request")
    # The caller's streams, in place of the warm process's: fds 0, 1, 2 (those it had; the
    # others are /dev/null, never the warm process's own).
    null = os.open(os.devnull, os.O_RDWR)
    for target in {0, 1, 2} - set(targets):
        os.dup2(null, target)
    os.close(null)
    for target, fd in zip(targets, fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    conn.settimeout(None)
    return request


def _run(conn: socket.socket, request: dict[str, Any]) -> int:

    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    _take_streams(request["streams"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for sig in request.get("ignored", ()):  # as the caller had them (nohup, `cmd &`)
        signal.signal(sig, signal.SIG_IGN)
    relay = threading.Thread(target=_relay, args=(conn,), name="minisandbox-warm-relay")
    relay.daemon = True
    relay.start()
    from minisandbox.cli.main import main

    try:
        main()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    finally:
        atexit._run_exitfuncs()
        for out in (sys.stdout, sys.stderr):
            try:
                out.flush()
            except (OSError, ValueError):
                pass
    return code


def _take_streams(streams: list[tuple[str, str] | None]) -> None:
    """sys.stdin, stdout and stderr on fds 0, 1, 2 (now the caller's), as the caller's own
    interpreter made them: its encodings, line buffering on a terminal."""

    for i, name in enumerate(("stdin", "stdout", "stderr")):
        entry = streams[i]
        if entry is None:
            continue
        encoding, errors = entry
        raw = io.FileIO(i, "rb" if i == 0 else "wb", closefd=False)
        buffered = io.BufferedReader(raw) if i == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            line_buffering=raw.isatty() or i == 2,
            write_through=i == 2,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _relay(conn: socket.socket) -> None:
    """The caller's signals, as its own; the caller gone, the command goes with it."""

    got = b""
    while True:
        try:
            chunk = conn.recv(256)
        except OSError:
            chunk = b""
        if not chunk:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        got += chunk
        *lines, got = got.split(b"\n")
        for line in lines:
            if line.startswith(b"S ") and line[2:].isdigit():
                os.kill(os.getpid(), int(line[2:]))


def _exit_code(value: object) -> int:
    """What the interpreter makes of SystemExit(value)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    from minisandbox.cli.warm import socket_path

    serve(sys.argv[1] if len(sys.argv) > 1 else socket_path())
