"""Processes on a terminal inside a sandbox: a pty of the sandbox's own devpts instance.

The pty is allocated in the sandbox's devpts (its /dev/pts/ptmx, reached through
/proc/<pid>/root), so the process has a real controlling terminal: job control, Ctrl-C, and
programs that want a tty (a Python REPL) behave as they do for a person. The host holds the
master end; the process is started by the control shell (ControlChannel.start_on_terminal).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import stat
import struct
import termios
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from minisandbox.errors import SessionError
from minisandbox.sandbox.channel import ControlChannel

_TIOCSPTLCK = 0x40045431
_TIOCGPTN = 0x80045430
_TIOCGPTPEER = 0x5441
_TIOCGSID = 0x5429
_PTMX_RDEV = os.makedev(5, 2)
# How long the terminal's process may take to start and take its terminal.
_START_TIMEOUT = 30.0


class TerminalHost(Protocol):
    """What a terminal needs of its sandbox (a running Sandbox is one)."""

    @property
    def pid(self) -> int | None: ...  # host pid of the sandbox's pid 1

    @property
    def owner(self) -> tuple[int, int] | None: ...  # whom to give the terminal, if anyone

    @property
    def channel(self) -> ControlChannel: ...  # raises when the sandbox is not running


class Terminal:
    """A process inside a sandbox on a pty of the sandbox's own devpts; we hold the master."""

    def __init__(self, master: int, peer: int, number: int) -> None:
        self.master = master
        self._peer: int | None = peer
        self.number = number

    def release_peer(self) -> None:
        """Drop our handle on the terminal's other end once the process has it open; from then
        on, reading the master fails (EIO) when the process is gone."""
        if self._peer is not None:
            os.close(self._peer)
            self._peer = None

    def close(self) -> None:
        self.release_peer()
        with contextlib.suppress(OSError):
            os.close(self.master)


def _open_pty(sandbox: TerminalHost, rows: int, columns: int, echo: bool) -> Terminal:
    """A new pty of the sandbox's devpts, sized, with echo off unless `echo`; the peer end is
    given to the sandbox's root.

    Raises:
        SessionError: the sandbox's /dev/pts/ptmx is not the pty multiplexer.
    """
    # dev and dev/pts are mount points inside the sandbox: it cannot swap them for symlinks.
    fd = os.open(
        f"/proc/{sandbox.pid}/root/dev/pts/ptmx",
        os.O_RDWR | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC,
    )
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != _PTMX_RDEV:
        os.close(fd)
        raise SessionError("the sandbox's /dev/pts/ptmx is not the pty multiplexer")
    try:
        fcntl.ioctl(fd, _TIOCSPTLCK, struct.pack("i", 0))
        (number,) = struct.unpack("I", fcntl.ioctl(fd, _TIOCGPTN, b"\0" * 4))
        peer = fcntl.ioctl(fd, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
    except BaseException:
        os.close(fd)
        raise
    try:
        if not echo:
            attrs = termios.tcgetattr(peer)
            attrs[1] &= ~termios.ONLCR  # oflag: keep "\n" as it was written
            attrs[3] &= ~(termios.ECHO | termios.ECHONL)  # lflag: no echo of our input
            termios.tcsetattr(peer, termios.TCSANOW, attrs)
        fcntl.ioctl(peer, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        if sandbox.owner is not None:
            os.fchown(peer, *sandbox.owner)
    except BaseException:
        os.close(peer)
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return Terminal(fd, peer, number)


async def open_terminal(
    sandbox: TerminalHost,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    rows: int = 24,
    columns: int = 80,
    echo: bool = True,
) -> Terminal:
    """Start `argv` inside the sandbox as the leader of a new session whose controlling terminal
    is a fresh pty. We keep the peer end open until the caller calls `release_peer()`: a master
    whose slave was never opened reads as EIO, which would look like a process that exited.
    The master is non-blocking.

    Raises:
        SessionError: no pty, or the process was not started or did not take its terminal
            in time.
        InvalidCommandError: a variable of `env` cannot be passed.
        SandboxNotRunningError: the sandbox is not running, or died meanwhile.
        SandboxLimitError: the sandbox was stopped for exceeding a limit.
        ControlProtocolError: the control shell's reply about the start was malformed.
    """
    channel = sandbox.channel
    term = _open_pty(sandbox, rows, columns, echo)
    try:
        job = channel.start_on_terminal(argv, env=env or {}, terminal=f"/dev/pts/{term.number}")
        try:
            await asyncio.wait_for(job.started, _START_TIMEOUT)
        except asyncio.TimeoutError:
            raise SessionError(
                f"the control shell did not start {argv[0]!r} on a terminal within "
                f"{_START_TIMEOUT} s"
            ) from None
        finally:
            channel.forget(job)
        await _until_controlling(term.master, _START_TIMEOUT)
    except BaseException:
        term.close()
        raise
    return term


async def until_writable(master: int, timeout: float, current: Callable[[], int | None]) -> None:
    """Return once the terminal master `master` takes input again, or after `timeout` seconds.
    Waits on the event loop, never blocking it. `current()` is the owner's master at the end:
    if it is no longer `master` (closed meanwhile, its number maybe reused), the wait's writer
    callback was removed with it and is left alone."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(master, wake)
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ready, timeout)
    finally:
        if current() == master:
            loop.remove_writer(master)


async def _until_controlling(master: int, timeout: float) -> None:
    """Wait until the terminal is the controlling terminal of the new session (setsid -c has
    run, so the process holds the terminal open). Output alone proves nothing: the terminal
    echoes typed input by itself.

    Raises:
        SessionError: it did not happen within `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            (sid,) = struct.unpack("i", fcntl.ioctl(master, _TIOCGSID, b"\0" * 4))
            if sid > 0:
                return
        except OSError:
            pass
        if loop.time() > deadline:
            raise SessionError("the terminal's process did not start")
        await asyncio.sleep(0.001)
