"""Where a process keeps its sandboxes' temporary directories, and who removes them.

Each Python process gets one directory, `<runtime>/p<pid>-<random>`, and one janitor: a tiny child
process in its own session that waits for this process to die, however it dies, and then deletes
that directory. A sandbox's temporary upper layer therefore never outlives its controller.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import _cleanup

_lock = threading.Lock()
_process_dir: Path | None = None
_janitor: subprocess.Popen[bytes] | None = None
_owner_pid: int | None = None


def runtime_root(explicit: Path | None = None) -> Path:
    base = explicit or os.environ.get("MINISANDBOX_RUNTIME")
    if base:
        return Path(base)
    return Path(tempfile.gettempdir()) / f"minisandbox-{os.geteuid()}"


def process_dir(explicit_root: Path | None = None) -> Path:
    """This process's runtime directory; created, with its janitor, on first use."""
    global _process_dir, _janitor, _owner_pid
    with _lock:
        if _process_dir is not None and _owner_pid == os.getpid():
            return _process_dir
        root = runtime_root(explicit_root)
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o711)  # others may traverse (a root caller's sandbox uid), never list
        path = Path(tempfile.mkdtemp(prefix=f"p{os.getpid()}-", dir=root))
        os.chmod(path, 0o711)
        _janitor = subprocess.Popen(
            [sys.executable, "-I", "-S", _cleanup.__file__, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # survives a Ctrl-C or SIGKILL aimed at our process group
            close_fds=True,
        )
        _process_dir, _owner_pid = path, os.getpid()
        return path


def remove_tree(path: Path) -> bool:
    return _cleanup.remove_tree(str(path))
