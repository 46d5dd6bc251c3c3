"""A sandbox's processes as the host sees them, and killing what one command or shell started.

A command inside a sandbox can leave its process group and session (`setsid`), and a double
fork reparents it to the sandbox's init: neither `kill -- -PGID` nor `pkill -s SID` reaches it
any more. So the host looks itself: the sandbox's processes are the host /proc entries whose pid
namespace is that of the sandbox's pid 1, and each carries in /proc/<pid>/stat its parent,
process group and session, and in /proc/<pid>/environ the marker variable (`MARKER_VAR`) that
every command and shell is started with and that its descendants inherit.

Reading another process's namespace link and environ needs ptrace-read access: a root caller
has it, and so does an unprivileged caller, whose uid the sandbox's processes run as (and who
owns the sandbox's user namespace). Processes come and go while we look: every read tolerates a
vanished process, and signals go through a pidfd opened after checking that the pid still
names the process we saw (same start time, same namespace), so a reused pid is never signalled.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from minisandbox.utils.procfs import stat_fields

# The environment variable that marks a command's (or a shell session's) processes.
MARKER_VAR = "MINISANDBOX_JOB"
# How much of a process's environment we read when looking for the marker. The marker is
# placed right after the sandbox's base environment, well inside this.
ENVIRON_LIMIT = 1 << 20
_GONE = (errno.ESRCH, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EINVAL)


@dataclass(frozen=True)
class HostProcess:
    """One process of a sandbox; every id is a host pid except `ns_pid`."""

    pid: int
    ns_pid: int  # its pid inside the sandbox
    ppid: int
    pgid: int
    sid: int
    start: int  # start time in clock ticks since boot: with `pid`, names the process


def marker_word(token: str) -> str:
    """The `NAME=value` that marks a command's processes in their environment."""
    return f"{MARKER_VAR}={token}"


def _ns_key(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stat_fields(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, pgid, sid, start time) from /proc/<pid>/stat."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _ns_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(16384).splitlines():
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def environ_has(pid: int, word: bytes, limit: int = ENVIRON_LIMIT) -> bool:
    """Whether `word` (`NAME=value`) is one of the first `limit` bytes of the process's
    environment strings; False when it is gone or unreadable."""
    needle = b"\0" + word + b"\0"
    try:
        with open(f"/proc/{pid}/environ", "rb", buffering=0) as f:
            seen = b"\0"
            while len(seen) <= limit:
                chunk = f.read(65536)
                if not chunk:
                    return needle in seen + b"\0"
                seen += chunk
                if needle in seen:
                    return True
    except OSError:
        return False
    return False


def sandbox_processes(init_pid: int) -> list[HostProcess]:
    """Every live process in the pid namespace whose init is host pid `init_pid`."""
    ns = _ns_key(init_pid)
    if ns is None:
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if _ns_key(pid) != ns:
            continue
        fields = _stat_fields(pid)
        ns_pid = _ns_pid(pid)
        if fields is None or ns_pid is None:
            continue
        ppid, pgid, sid, start = fields
        found.append(HostProcess(pid, ns_pid, ppid, pgid, sid, start))
    return found


def _signal(proc: HostProcess, ns: tuple[int, int], sig: int) -> bool:
    """Send `sig` to `proc` if its pid still names it; False when it is gone."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return False
    try:
        # The pidfd pins whatever process has the pid now: check that it is the one we saw.
        fields = _stat_fields(proc.pid)
        if fields is None or fields[3] != proc.start or _ns_key(proc.pid) != ns:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError as e:
        if e.errno in _GONE:
            return False
        raise
    finally:
        os.close(fd)


# long: its docstring states the search that the body implements, in one place.
def kill_tree(
    init_pid: int,
    *,
    ns_pids: Iterable[int] = (),
    pids: Iterable[int] = (),
    groups: Iterable[int] = (),
    marker: str | None = None,
    max_rounds: int = 100,
) -> int:
    """SIGKILL everything a command or shell started, in the sandbox whose init is `init_pid`.

    Selected: the processes `pids` (host pids) and `ns_pids` (pids inside the sandbox); every
    member of the process groups or sessions `groups` (host ids); every descendant of a selected
    process; every member of a group or session that a selected process leads; and every
    process whose environment holds `marker` (a token, see `marker_word`). The sandbox's init
    is never selected.

    The search repeats until it finds nothing new, stopping (SIGSTOP) each selected process
    whose parent is selected too: a stopped process cannot fork, and its children keep it as
    their parent. The others (the tops: a command, a shell's foreground job) are not stopped,
    as a job-control shell above them would notice and report the stop; they get SIGKILL first,
    then the stopped ones, then whatever a top started in between (still in the groups or
    carrying the marker). Returns how many processes were killed.

    The gap: a process that both dropped the marker (cleared or rewrote its environment, or
    pushed the marker past ENVIRON_LIMIT) and, before this runs, left the selected groups and
    sessions and lost its selected ancestors (a double fork reparents it to init) is not
    found; it lives until the sandbox stops. A command leads its process group, not a session
    (it shares the control shell's: channel.start_command), so leaving its group (setpgid, as
    GNU timeout does) is enough for that.
    """
    ns = _ns_key(init_pid)
    if ns is None:
        return 0
    want_ns, want_pids, leaders = set(ns_pids), set(pids), set(groups)
    word = marker_word(marker).encode() if marker else None
    selected: dict[int, HostProcess] = {}

    def search() -> list[HostProcess]:
        new = []
        for p in sandbox_processes(init_pid):
            if p.pid == init_pid or p.pid in selected:
                continue
            if (
                p.pid in want_pids
                or p.ns_pid in want_ns
                or p.ppid in selected
                or p.pgid in leaders
                or p.sid in leaders
                or p.pgid in selected
                or p.sid in selected
                or (word is not None and environ_has(p.pid, word))
            ):
                new.append(p)
        selected.update((p.pid, p) for p in new)
        return new

    killed = 0
    try:
        for _ in range(max_rounds):
            new = search()
            if not new:
                break
            for p in new:
                if p.ppid in selected:
                    _signal(p, ns, signal.SIGSTOP)
    finally:
        tops = [p for p in selected.values() if p.ppid not in selected]
        rest = [p for p in selected.values() if p.ppid in selected]
        killed += sum(_signal(p, ns, signal.SIGKILL) for p in [*tops, *rest])
    for _ in range(max_rounds):
        new = search()
        if not new:
            break
        killed += sum(_signal(p, ns, signal.SIGKILL) for p in new)
    return killed


__all__ = [
    "ENVIRON_LIMIT",
    "MARKER_VAR",
    "HostProcess",
    "environ_has",
    "kill_tree",
    "marker_word",
    "sandbox_processes",
]
