"""Where a process keeps its sandboxes' temporary directories, and who removes them.

Each Python process gets one directory, `<runtime>/p<pid>-<random>`, and one janitor: a tiny child
process in its own session that waits for this process to die, however it dies, then kills what
is left of its sandboxes (see cleanup) and deletes that directory and the directories its
sandboxes registered. A sandbox's temporary upper layer therefore never outlives its controller.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from minisandbox.errors import RuntimeDirError
from minisandbox.sandbox import cleanup

_lock = threading.Lock()
_process_dir: Path | None = None
_janitor: subprocess.Popen[bytes] | None = None
_owner_pid: int | None = None
_lifeline: int | None = None  # write end; see lifeline_fd()


def runtime_root(explicit: Path | None = None) -> Path:
    base = explicit or os.environ.get("MINISANDBOX_RUNTIME")
    if base:
        return Path(base)
    return Path(tempfile.gettempdir()) / f"minisandbox-{os.geteuid()}"


def private_root(root: Path) -> None:
    """Create `root` (mode 700), or accept it only if it is ours: a real directory we own that
    nobody else can write. A predictable name under /tmp could have been planted by another
    user, as a symlink (we would chmod its target) or a directory (they could swap entries)."""
    try:
        root.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeDirError(
            f"runtime directory {root} is not a directory owned by uid {os.geteuid()} and "
            "writable only by it; remove it, or set MINISANDBOX_RUNTIME to a private directory"
        )


def process_dir(explicit_root: Path | None = None) -> Path:
    """This process's runtime directory; created, with its janitor, on first use.

    Everything below it is private (mode 700): a sandbox's upper layer may hold any file the
    sandbox made, setuid ones included, and no other host user may reach them."""
    global _process_dir, _janitor, _owner_pid, _lifeline
    with _lock:
        if _process_dir is not None and _owner_pid == os.getpid():
            return _process_dir
        root = runtime_root(explicit_root)
        private_root(root)
        path = Path(tempfile.mkdtemp(prefix=f"p{os.getpid()}-", dir=root))  # mode 700
        life_r, life_w = os.pipe()  # both close-on-exec: only bwrap gets the write end
        try:
            _janitor = subprocess.Popen(
                [sys.executable, "-I", "-S", cleanup.__file__, str(path), str(life_r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # survives a Ctrl-C or SIGKILL aimed at our process group
                close_fds=True,
                pass_fds=(life_r,),
            )
        except OSError:
            os.close(life_w)
            os.rmdir(path)
            raise
        finally:
            os.close(life_r)
        _process_dir, _owner_pid, _lifeline = path, os.getpid(), life_w
        return path


def lifeline_fd() -> int:
    """The write end of this process's lifeline to its janitor (after process_dir()): pass it to
    every bwrap as --sync-fd. Every fork holds it until it execs something else, so the janitor
    knows when no fork that may still become a bwrap naming our runtime dir is left."""
    assert _lifeline is not None and _owner_pid == os.getpid(), "process_dir() first"
    return _lifeline


def _forget_parent_lifeline() -> None:
    # A child made by os.fork() (without exec) must not hold its parent's lifeline open: the
    # parent's janitor would wait for it. It gets a runtime dir and janitor of its own.
    global _lifeline
    if _lifeline is not None and _owner_pid != os.getpid():
        with contextlib.suppress(OSError):
            os.close(_lifeline)
        _lifeline = None


os.register_at_fork(after_in_child=_forget_parent_lifeline)
