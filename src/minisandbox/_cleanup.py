"""Removing sandbox directories, also after the controlling process was SIGKILLed.

Standard library only: the janitor runs this module in a bare `python -I -S` so that it starts in
milliseconds and holds little memory.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time


def remove_tree(path: str) -> bool:
    """Delete `path` even where a sandbox left directories without write or search permission
    (the overlay's own work dir is mode 000). Returns True when nothing is left."""

    def fix_and_retry(func, p, _exc):  # type: ignore[no-untyped-def]
        for q in (os.path.dirname(p), p):
            try:
                st = os.lstat(q)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(q, stat.S_IRWXU)
            except OSError:
                pass
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    if not os.path.lexists(path):
        return True
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=fix_and_retry)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
    return not os.path.lexists(path)


def janitor_main(directory: str) -> None:
    """Wait until our parent dies (stdin reaches EOF), then delete its runtime directory.

    bwrap's --die-with-parent kills the sandboxes at the same moment; retry while their overlays
    are being torn down."""
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except OSError:
        pass
    deadline = time.monotonic() + 30
    while not remove_tree(directory) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    janitor_main(sys.argv[1])
