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
instead of running a command without one. Only the standard library is imported here; the warm
process's side is `warmserver`.
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
    from collections.abc import Sequence
    from typing import Any

# The commands a warm process runs: short, and needing no controlling terminal.
ROUTED = frozenset({"exec"})
SWITCH = "MINISANDBOX_WARM"
IDLE_SECONDS = 600.0
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
            f"with `python -m minisandbox.cli.warmserver`, or unset {SWITCH}\n"
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
        with ShortAddress(path) as address:
            conn.connect(address)
        creds = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        if struct.unpack("3i", creds)[1] != os.geteuid():
            raise PermissionError(f"the process listening at {path} is another user's")
    except BaseException:
        conn.close()
        raise
    return conn


class ShortAddress:
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


def after_run_here() -> None:
    """After a command ran in the caller's own process for want of a warm process: start one
    for the next, detached (its own session, no streams of the caller's)."""
    if _spawn_at is None:
        return
    import subprocess

    code = (
        "import sys; sys.path[:] = " + repr(list(sys.path)) + "\n"
        "from minisandbox.cli.warmserver import serve; serve(" + repr(_spawn_at) + ")\n"
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
