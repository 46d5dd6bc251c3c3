"""The warm process: the CLI's imports (typer, pydantic, asyncio, the sandbox; a few hundred
milliseconds) made once per node and user, then a fork of them per command.

A short command (`exec`) is mostly imports: the sandbox itself starts in a few tens of
milliseconds. So the `minisandbox` console script first tries the caller's warm process, a
Python process with the whole CLI imported that listens on a socket in the caller's private
runtime directory (mode 700, as its sandboxes' directories). It forks a worker per command;
the worker takes the caller's standard streams (passed over the socket), working directory,
environment and umask, runs the command exactly as the CLI would, and reports its exit status.
Ctrl-C and other signals the caller gets are passed on; a caller that dies kills its worker
(whose sandboxes its janitor then removes, as for any CLI process that dies).

Nothing else of the caller can be passed to a process it did not start: its credentials,
limits, cgroup, namespaces, and the Python and packages it runs. These name the warm process
(`socket_path`), so a caller only ever reaches one that a caller like it started, from the same
code; the first command of a kind runs in its own process and starts one for the next. It
exits after `IDLE_SECONDS` without a command.

`MINISANDBOX_WARM=0` never uses or starts one; `MINISANDBOX_WARM=require` fails (exit 2)
instead of running a command without one. Only the standard library is imported here.
"""

from __future__ import annotations

import _signal  # (the caller's side uses the C modules: socket and signal import enum, 6 ms)
import _socket
import marshal
import os
import struct
import sys
from array import array

TYPE_CHECKING = False  # (not typing's: importing typing costs a caller 10 ms)
if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence
    from typing import Any

# The commands a warm process runs: short, and needing no controlling terminal.
ROUTED = frozenset({"exec"})
SWITCH = "MINISANDBOX_WARM"
IDLE_SECONDS = 600.0
_MAX_REQUEST = 4 << 20  # the caller's argv and environment
_REQUEST_TIMEOUT = 30.0
# Environment variables that can change what the warm process imported, or how: the rest of
# the caller's environment is the worker's own, set at each command.
_KEYED_ENV = ("PYTHON", "MINISANDBOX_", "LD_", "TMPDIR", "TEMP", "TMP", "HOME", "XDG_")
_STATUS_KEYS = (
    "Uid:",
    "Gid:",
    "Groups:",
    "CapInh:",
    "CapPrm:",
    "CapEff:",
    "CapBnd:",
    "CapAmb:",
    "NoNewPrivs:",
    "Seccomp:",
    "Cpus_allowed_list:",
    "Mems_allowed_list:",
)

_spawn_at: str | None = None  # set when a command ran here for want of a warm process


def mode() -> str:
    """`off`, `require` or `auto` (the default), from MINISANDBOX_WARM."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return "off"
    return "require" if value == "require" else "auto"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return ""


def _code_stamp() -> list[Any]:
    """The package's own files and the directories of installed packages: an edit or an
    install makes another key (and so another warm process)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stamp: list[Any] = []
    stack = [package]
    while stack:
        top = stack.pop()
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    stack.append(entry.path)
            elif entry.name.endswith(".py"):
                st = entry.stat(follow_symlinks=False)
                stamp.append((entry.path, st.st_mtime_ns, st.st_size))
    for path in sys.path:
        if path.endswith(("site-packages", "dist-packages")):
            try:
                stamp.append((path, os.stat(path).st_mtime_ns))
            except OSError:
                pass
    return stamp


def key() -> str:
    """What a warm process must share with its caller to run the caller's commands as the
    caller would: the Python, its path and flags, the code, the process's credentials,
    capabilities, limits, cgroup and namespaces, and the environment that shapes imports."""
    import resource

    status = _read("/proc/self/status").splitlines()
    namespaces = []
    for ns in ("mnt", "pid", "net", "user", "uts", "ipc", "cgroup"):
        try:
            namespaces.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            namespaces.append("")
    limits = [
        resource.getrlimit(getattr(resource, name))
        for name in sorted(dir(resource))
        if name.startswith("RLIMIT_")
    ]
    doc = [
        sys.executable,
        sys.version,
        # Not sys.path[0]: the script's directory or the working directory, which differ
        # between `minisandbox` and `python -m minisandbox.cli` and from one place to another.
        sys.path[1:],
        list(sys.flags),
        [line for line in status if line.startswith(_STATUS_KEYS)],
        _read("/proc/self/cgroup"),
        _read("/proc/self/oom_score_adj"),
        namespaces,
        os.getpriority(os.PRIO_PROCESS, 0),
        limits,
        sorted((k, v) for k, v in os.environ.items() if k.startswith(_KEYED_ENV) and k != SWITCH),
        _code_stamp(),
    ]
    return _digest(repr(doc).encode())


def _digest(data: bytes) -> str:
    try:  # (hashlib loads OpenSSL: 3 ms of a caller's budget)
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - an interpreter built without it
        from hashlib import blake2b
    return blake2b(data, digest_size=16).hexdigest()


def socket_path() -> str:
    """The socket of the caller's warm process, in its private runtime directory."""
    base = os.environ.get("MINISANDBOX_RUNTIME")
    if not base:
        # tempfile.gettempdir's first choice (importing tempfile costs 3 ms); where it would
        # choose otherwise (an unusable TMPDIR), the warm process just has another place.
        tmp = next((os.environ[v] for v in ("TMPDIR", "TEMP", "TMP") if os.environ.get(v)), "/tmp")
        base = os.path.join(tmp, f"minisandbox-{os.geteuid()}")
    return os.path.join(os.path.abspath(base), f"warm-{key()}.sock")


# ---------------------------------------------------------------- the caller

_FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT)


def run_warm(argv: Sequence[str]) -> int | None:
    """Run the command `argv` in the caller's warm process: its exit status, or None when
    the command is not one it runs, or there is no usable one (the caller runs it, then
    `after_run_here` starts one), or MINISANDBOX_WARM=0. A warm process that ends before it
    took the command counts as none: the command runs here, once."""
    global _spawn_at
    how = mode()
    if how == "off" or len(argv) < 2 or argv[1] not in ROUTED:
        return None
    path = socket_path()
    try:
        conn = _connect(path)
        try:
            if _forward(conn, argv):
                return _wait(conn)
        finally:
            conn.close()
        why = "it ended before taking the command"
    except OSError as e:
        why = e.strerror or str(e)
    if how == "require":
        sys.stderr.write(
            f"minisandbox: no usable warm process at {path} ({why}), and {SWITCH}=require: "
            "start one "
            f"with `python -m minisandbox.cli.warm serve`, or unset {SWITCH}\n"
        )
        return 2
    _spawn_at = path
    return None


def _connect(path: str) -> _socket.socket:
    """A connection to the warm process at `path`, checked to be the caller's own: the
    directory is the caller's and writable by no one else, and the process listening is of
    the caller's uid (else another user could plant a listener and take its streams).

    Raises:
        OSError: none there, or not the caller's.
    """
    st = os.lstat(os.path.dirname(path))
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or (st.st_mode & 0o170000) != 0o040000:
        raise PermissionError(f"{os.path.dirname(path)} is not the caller's private directory")
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        with _short(path) as address:
            conn.connect(address)
        creds = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        if struct.unpack("3i", creds)[1] != os.geteuid():
            raise PermissionError(f"the process listening at {path} is another user's")
    except BaseException:
        conn.close()
        raise
    return conn


class _short:
    """A socket address for `path` that fits AF_UNIX's 108 bytes: the path, or the same file
    through /proc/self/fd/N of its directory, held open while the address is used."""

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> str:
        if len(os.fsencode(self.path)) < 100:
            return self.path
        self.fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self.fd}/{os.path.basename(self.path)}"

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _forward(conn: _socket.socket, argv: Sequence[str]) -> bool:
    """Send the command; True once a worker has taken it (its "A" line), False when the warm
    process hung up before (it was ending: nothing of the command ran)."""
    umask = os.umask(0o022)
    os.umask(umask)
    streams = [(s.encoding, s.errors) if s else None for s in (sys.stdin, sys.stdout, sys.stderr)]
    fds = [fd for fd in (0, 1, 2) if _valid(fd)]
    # Signals the caller ignores (nohup, a background job of a script) stay ignored there.
    ignored = [sig for sig in _FORWARDED if _signal.getsignal(sig) == _signal.SIG_IGN]
    # marshal: the same interpreter on both ends (the key names it), and no import (json
    # brings re and enum: 7 ms).
    request = marshal.dumps(
        {
            "argv": list(argv),
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": umask,
            "streams": streams,
            "fds": fds,
            "ignored": ignored,
        }
    )
    header = struct.pack("!II", len(request), len(fds))
    try:
        conn.sendmsg([header], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array("i", fds))])
        conn.sendall(request)
        taken = conn.recv(2)
    except (BrokenPipeError, ConnectionResetError):
        return False
    if taken != b"A\n":
        return False

    def forward(signum: int, _frame: object) -> None:
        try:
            conn.sendall(b"S %d\n" % signum)
        except OSError:
            pass

    for sig in _FORWARDED:
        if sig not in ignored:
            _signal.signal(sig, forward)
    return True


def _wait(conn: _socket.socket) -> int:
    """The command's exit status. A worker killed by a signal kills the caller with the same
    signal, as the command's own death would show to whoever waits for the caller."""
    got = b""
    while True:
        chunk = conn.recv(4096)
        if not chunk:
            sys.stderr.write("minisandbox: the warm process ended the command without a status\n")
            return 1
        got += chunk
        for line in got.split(b"\n")[:-1]:
            kind, _, value = line.partition(b" ")
            if kind == b"X":  # the worker's own exit status
                return int(value)
            if kind == b"W":  # its wait status, as the warm process reaped it
                status = int(value)
                if os.WIFSIGNALED(status):
                    sig = os.WTERMSIG(status)
                    _signal.signal(sig, _signal.SIG_DFL)
                    os.kill(os.getpid(), sig)
                return _status_code(status)
        got = got.rsplit(b"\n", 1)[-1]


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _status_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def after_run_here(argv: Sequence[str]) -> None:
    """After a command ran in the caller's own process for want of a warm process: start one
    for the next, detached (its own session, no streams of the caller's)."""
    if _spawn_at is None:
        return
    import subprocess

    code = (
        "import sys; sys.path[:] = " + repr(list(sys.path)) + "\n"
        "from minisandbox.cli.warm import serve; serve(" + repr(_spawn_at) + ")\n"
    )
    try:
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]  # (the key holds sys.flags)
        subprocess.Popen(
            [sys.executable, *flags, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    except OSError:
        pass  # no warm process: the next command runs in its own process again


# ---------------------------------------------------------------- the warm process


def serve(path: str, idle: float = IDLE_SECONDS) -> None:
    """Be the warm process at `path` (its directory must be the caller's private runtime
    directory), until `idle` seconds pass without a command or another takes the path. Returns
    at once when another warm process holds it."""
    import fcntl
    import gc
    import select
    from pathlib import Path

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
    last = refreshed = _now()
    try:
        while True:
            ready, _, _ = select.select([listener], [], [], 1.0)
            if ready:
                _accept(listener, lock, workers)
            _reap(workers)
            if _now() - refreshed > _REFRESH_SECONDS:  # (between commands: a worker forks it)
                refresh()
                refreshed = _now()
            if workers or ready:
                last = _now()
            elif _now() - last > idle or not _still_ours(path, inode):
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
    import signal
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    staging = f"{path}.{os.getpid()}.new"
    old = os.umask(0o177)
    try:
        with _short(staging) as address:
            listener.bind(address)
    finally:
        os.umask(old)
    listener.listen(128)
    os.replace(staging, path)  # (a dead warm process's socket: we hold the lock)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return listener, os.stat(path).st_ino


def _now() -> float:
    import time

    return time.monotonic()


_SO_PEERPIDFD = 77  # (Linux 6.5; the socket module names it from Python 3.13)


def _peer_is_ours(conn: socket.socket) -> bool:
    """Whether the peer is a process of our uid in our own user, mount and pid namespaces.
    Its pid is pinned by a pidfd (SO_PEERPIDFD, else pidfd_open at once) and checked alive
    after its namespaces were read: a pid reused meanwhile cannot pass for it."""
    import socket

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
        import signal

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
    code = 1
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
        import traceback

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
    import socket

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
    import atexit
    import signal
    import threading

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
    import io

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
    import signal

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
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2] if len(sys.argv) > 2 else socket_path())
    else:
        sys.stderr.write("usage: python -m minisandbox.cli.warm serve [SOCKET]\n")
        sys.exit(2)
