"""Reading a process's /proc/<pid>/stat: its start time tells a reused pid apart."""

from __future__ import annotations


class _Gone(Exception):
    pass


def _read_stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name (field 3 on: state, ppid, ...).

    Raises:
        _Gone: there is no such process.
        OSError: the file cannot be read.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        raise _Gone from None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return data[data.rfind(b")") + 2 :].split()


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat's fields from the state on (index 0 is field 3), or None when the
    process is gone or its stat cannot be read."""
    try:
        return _read_stat(pid)
    except (_Gone, OSError):
        return None


def start_time(pid: int, *, unreadable: str | None = None) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process):
    None when there is no such process, `unreadable` when its stat cannot be read or parsed
    (another user's process may be alive but unreadable)."""
    try:
        fields = _read_stat(pid)
    except _Gone:
        return None
    except OSError:
        return unreadable
    return fields[19].decode() if len(fields) > 19 else unreadable
