"""Removing sandbox directories and processes, also after the controlling process was SIGKILLed.

The janitor runs this module in a bare `python -I -S`, so that it starts in milliseconds and holds
little memory: standard library only, plus this package's `safefs` (itself standard library only).

A SIGKILL can land at any point of a sandbox start, and bwrap's --die-with-parent is armed in its
inner process only after a sync point with the outer one: if the outer bwrap dies before that,
the inner one (pid 1 of the new namespaces) waits forever. Every bwrap we start names this
process's runtime directory in its arguments, and the inner one is a fork of it, so the janitor
kills every process of ours whose argv does. A fork that had not yet exec'd bwrap when we died
does not name it yet: every such fork holds a "lifeline" pipe (the write end is inherited across
fork and passed to bwrap as its --sync-fd, which bwrap keeps open in its setup and its pid 1),
so the janitor keeps looking until the lifeline reports that no such process is left.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

if __package__:
    from minisandbox.utils import safefs
else:  # the janitor script: the package's parent directory, no site-packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from minisandbox.utils import safefs

# In a sandbox's runtime directory (never in its io/ channel directory, which the sandbox can
# write): directories elsewhere that the janitor removes too, one absolute path a line (a kept
# upper layer's overlay work directory).
EXTERNAL_DIRS = "external-dirs"
_DEADLINE = 30.0


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(1 << 20).split(b"\0")
    except OSError:
        return []


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _names(argv: list[bytes], directory: bytes) -> bool:
    inside = directory + b"/"
    return any(arg == directory or inside in arg for arg in argv)


def kill_holders(directory: str) -> int:
    """SIGKILL every process of our uid (other than us) with `directory`, or a path below it, in
    its arguments; returns how many were signalled. A pid is signalled through a pidfd opened
    before its argv and uid are checked: if the pid was reused meanwhile, the pidfd names the
    old, dead process and the signal goes nowhere."""
    wanted = os.fsencode(directory)  # as our bwraps got it
    me, uid = os.getpid(), os.getuid()
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        if not _names(_argv(pid), wanted):  # cheap first look, no descriptor
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _real_uid(pid) == uid and _names(_argv(pid), wanted):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return killed


def _external_dirs(directory: str) -> list[str]:
    """The directories that the sandboxes of runtime dir `directory` registered."""
    found = []
    with contextlib.suppress(OSError):
        for sandbox in os.listdir(directory):
            try:
                data = safefs.read_bounded(os.path.join(directory, sandbox), EXTERNAL_DIRS, 1 << 20)
            except (OSError, NotADirectoryError):
                continue
            found += [p for p in data.decode(errors="surrogateescape").splitlines() if p]
    return found


def _lifeline_closed(fd: int | None) -> bool:
    """True once every process holding the lifeline's write end is gone (EOF)."""
    if fd is None:
        return True
    while select.select([fd], [], [], 0)[0]:
        try:
            if not os.read(fd, 65536):
                return True
        except OSError:
            return True
    return False


def janitor_main(directory: str, lifeline: int | None = None) -> None:
    """Wait until our parent dies (stdin reaches EOF), then kill what is left of its sandboxes
    and delete its runtime directory and the directories its sandboxes registered.

    Retries while the sandboxes' overlays are being torn down, and until no fork that may still
    become a bwrap is left (the lifeline); gives up after a deadline."""
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except OSError:
        pass
    deadline = time.monotonic() + _DEADLINE
    external: list[str] = []
    while True:
        killed = kill_holders(directory)
        external = sorted(set(external) | set(_external_dirs(directory)))
        gone = all([safefs.discard_tree(p) for p in external])
        gone = safefs.discard_tree(directory) and gone
        if (gone and not killed and _lifeline_closed(lifeline)) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    janitor_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
