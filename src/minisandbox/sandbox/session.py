"""Persistent interactive bash sessions inside a sandbox, each on its own pseudo-terminal.

The pty is allocated in the sandbox's own devpts instance (its /dev/pts/ptmx, reached through
/proc/<pid>/root), so the session's bash has a real controlling terminal: job control, Ctrl-C,
and programs that want a tty (a Python REPL) behave as they do for a person.

Each command is written to a file in the sandbox's channel directory and sourced, so multi-line
commands and heredocs need no escaping and arrive in one piece (a tty line is at most 4 KiB).
The end of a command is its prompt: PS1 carries a random marker and `$?`.

A shell that ignores Ctrl-C while it loops in itself (`trap '' INT; while :; do :; done`) cannot
be interrupted: `interrupt()` then kills the shell with everything it started (found from the
host, see procs.kill_tree) and starts a new one under the same name and environment, and says
so (`SessionResult.restarted`, and a note in the output): the shell's state is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import shlex
import signal
import stat
import struct
import termios
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel

from minisandbox.errors import CommandTimeoutError, SessionError
from minisandbox.sandbox import procs
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT, CappedOutput, decode
from minisandbox.sandbox.rootfs import IO_DIR, RESET_SIGNALS

if TYPE_CHECKING:
    from minisandbox.sandbox.sandbox import Sandbox

_TIOCSPTLCK = 0x40045431
_TIOCGPTN = 0x80045430
_TIOCGPTPEER = 0x5441
_TIOCGSID = 0x5429
_PTMX_RDEV = os.makedev(5, 2)


# The shell function that puts the prompt marker back; a caller whose startup files replace
# PROMPT_COMMAND restores it by this name.
PROMPT_HOOK = "__msb_prompt"


class SessionResult(BaseModel):
    """What a session command printed (stdout and stderr interleaved, as on a terminal)."""

    output: str
    exit_code: int | None  # None when the command ended at an `expect` pattern, not a prompt
    truncated: bool = False
    match: str | None = None
    # interrupt() had to kill the shell and start a new one: cwd, variables, functions, aliases
    # and background jobs of the old shell are gone.
    restarted: bool = False


# The exit code an interrupt reports when it had to kill and restart the shell (128 + SIGKILL).
RESTARTED_EXIT_CODE = 128 + signal.SIGKILL
RESTART_NOTE = (
    "\n[minisandbox: the shell did not return to its prompt after Ctrl-C and after its "
    "foreground job was killed; it was killed with everything it started and restarted. "
    "Its state is lost: working directory, variables, functions, aliases, background jobs.]\n"
)


class ShellSession:
    """One persistent bash. Not for concurrent use: one command at a time."""

    def __init__(
        self,
        sandbox: Sandbox,
        name: str,
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> None:
        self.sandbox = sandbox
        self.name = name
        self._env = {
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "VIRTUAL_ENV_DISABLE_PROMPT": "1",
            "CONDA_CHANGEPS1": "false",
            **(env or {}),
        }
        self._max_output = max_output
        self._size = (rows, columns)
        self._nonce = secrets.token_hex(8)
        self._marker = re.compile(rb"__MSB" + self._nonce.encode() + rb"_(\d+)__")
        self._master: int | None = None
        self._buf = CappedOutput(max_output)
        self._scan = bytearray()  # the recent bytes that a marker or an expect pattern may span
        self._data = asyncio.Event()
        self._eof = False
        self._busy = False
        self._shell_pgid: int | None = None  # host pid of the shell: its group and session
        self._mark = ""  # marks (in the environment) everything the current shell starts
        self._seq = 0

    # ---------------------------------------------------------------- setup

    async def _start(self) -> None:
        rows, cols = self._size
        self._mark = secrets.token_hex(8)
        term = await open_terminal(
            self.sandbox,
            ["/bin/bash", "--noprofile", "--norc", "--noediting", "-i"],
            env=self._shell_env(),
            rows=rows,
            columns=cols,
            echo=False,
        )
        self._master = term.master
        asyncio.get_running_loop().add_reader(self._master, self._on_readable)
        # PROMPT_COMMAND puts the marker back should a command rewrite PS1 (venv activation).
        init = (
            f"{PROMPT_HOOK}() {{ __msb_rc=$?; PS1='__MSB{self._nonce}_${{__msb_rc}}__'; }}; "
            f"PROMPT_COMMAND={PROMPT_HOOK}; PS2=''; PS0=''; unset HISTFILE; set +o history\n"
        )
        try:
            await self._write(init.encode(), 30)
            await self._wait(None, 30, discard=True)
        finally:
            term.release_peer()
        self._shell_pgid = self._foreground_pgid()

    def _shell_env(self) -> dict[str, str]:
        # The marker first: it then sits near the start of every environ the shell passes on.
        env = {procs.MARKER_VAR: self._mark}
        env.update((k, v) for k, v in self._env.items() if k != procs.MARKER_VAR)
        return env

    # ---------------------------------------------------------------- io

    def _on_readable(self) -> None:
        assert self._master is not None
        try:
            chunk = os.read(self._master, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO: the last process holding the terminal is gone
            chunk = b""
        if not chunk:
            self._eof = True
            asyncio.get_running_loop().remove_reader(self._master)
        else:
            self._buf.write(chunk)
            self._scan += chunk
            if len(self._scan) > 1 << 16:
                del self._scan[: len(self._scan) - (1 << 16)]
        self._data.set()

    async def _write(self, data: bytes, timeout: float) -> None:
        """Type `data` into the terminal. When its input queue is full, wait (without holding up
        the event loop) for the program to read, at most `timeout` seconds.

        Raises:
            SessionError: the shell has exited.
            CommandTimeoutError: the program did not read its input in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        view = memoryview(data)
        while view:
            master = self._master
            if master is None or self._eof:
                raise SessionError(f"session {self.name!r} has exited")
            try:
                view = view[os.write(master, view) :]
                continue
            except BlockingIOError:
                pass
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise CommandTimeoutError(
                    f"session {self.name!r}: the terminal's input was not read within "
                    f"{timeout} s ({len(view)} of {len(data)} bytes not typed)",
                    output=decode(self._buf.getvalue()),
                )
            writable = loop.create_future()
            loop.add_writer(master, lambda f=writable: f.done() or f.set_result(None))
            try:
                # Bounded: should a wakeup be missed, we simply try the write again.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(writable, min(remaining, 0.05))
            finally:
                if self._master == master:
                    loop.remove_writer(master)

    def _take(self, end: int) -> tuple[bytes, bool]:
        """Everything read so far, up to `end` bytes before the end of the scan window."""
        data = self._buf.getvalue()
        truncated = self._buf.truncated
        cut = len(self._scan) - end
        if cut > 0:
            data = data[: len(data) - cut]
        self._buf = CappedOutput(self._max_output)
        rest = bytes(self._scan[end:])
        self._buf.write(rest)
        self._scan = bytearray(rest)
        return data, truncated

    async def _wait(
        self, expect: Sequence[str] | None, timeout: float, discard: bool = False
    ) -> SessionResult:
        patterns = [re.compile(p.encode()) for p in expect or ()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            m = self._marker.search(self._scan)
            if m:
                data, truncated = self._take(m.end())
                data = data[: len(data) - (m.end() - m.start())]
                return SessionResult(
                    output="" if discard else decode(data),
                    exit_code=int(m.group(1)),
                    truncated=truncated,
                )
            for p in patterns:
                pm = p.search(self._scan)
                if pm:
                    data, truncated = self._take(pm.end())
                    return SessionResult(
                        output=decode(data),
                        exit_code=None,
                        truncated=truncated,
                        match=decode(pm.group(0)),
                    )
            if self._eof:
                self._close()
                raise SessionError(
                    f"session {self.name!r} exited"
                    f"; it printed: {decode(self._buf.getvalue())[-500:]!r}"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise CommandTimeoutError(
                    f"session {self.name!r}: no prompt within {timeout} s",
                    output=decode(self._buf.getvalue()),
                )
            self._data.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._data.wait(), remaining)

    # ---------------------------------------------------------------- commands

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult:
        """Run `command` (any bash: several lines, heredocs, `cd`, `export`, `source venv`).

        Returns at the next prompt, or as soon as the output matches a regex in `expect` (for
        programs that wait for input, like a REPL; continue with `send`). On timeout raises
        CommandTimeoutError and the session stays busy until `interrupt()`. `input` is typed
        into the terminal once the command has started, for commands that read stdin."""
        self.sandbox._require_running()
        if self._busy:
            raise SessionError(
                f"session {self.name!r} is still running a command; interrupt() it first"
            )
        if "\0" in command:
            raise ValueError("commands cannot contain NUL bytes")
        timeout = self.sandbox.config.limits.command_timeout if timeout is None else timeout
        self._seq += 1
        name = f"s{self.sandbox.id}-{self.name}-{self._seq}.sh".replace("/", "_")
        self.sandbox._write_channel_file(name, command.encode())
        try:
            self._busy = True
            loop = asyncio.get_running_loop()
            began = loop.time()
            await self._write(f". {IO_DIR}/{name}\n".encode() + (input or "").encode(), timeout)
            return await self._finish(expect, max(0.0, timeout - (loop.time() - began)))
        finally:
            self.sandbox._unlink_channel(name)

    async def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        """Type `text` into the session's terminal (e.g. a line for a REPL), then wait for a
        pattern in `expect`, or for the shell's prompt when `expect` is empty."""
        self.sandbox._require_running()
        timeout = self.sandbox.config.limits.command_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        began = loop.time()
        self._busy = True
        await self._write(text.encode(), timeout)
        return await self._finish(expect, max(0.0, timeout - (loop.time() - began)))

    async def _finish(self, expect: Sequence[str] | None, timeout: float) -> SessionResult:
        self._busy = True
        result = await self._wait(expect, timeout)
        # Still inside an interactive program when we stopped at an expect pattern.
        self._busy = result.exit_code is None
        return result

    def _foreground_pgid(self) -> int | None:
        if self._master is None:
            return None
        try:
            (pgid,) = struct.unpack("i", fcntl.ioctl(self._master, termios.TIOCGPGRP, b"\0" * 4))
        except OSError:
            return None
        return pgid

    async def interrupt(self, timeout: float = 2.0) -> SessionResult:
        """Stop what the session is running, each step given `timeout` seconds to bring the
        prompt back: Ctrl-C; then SIGKILL to the foreground job and everything it started;
        then, if the shell itself still does not return (it ignores SIGINT and loops), kill the
        shell with everything it started and start a new one with the same name and
        environment (`restarted` is set, the output ends with RESTART_NOTE).

        The session is usable again afterwards. Returns what was printed meanwhile.

        Raises:
            SessionError: the shell exited, or a new one could not be started.
        """
        # A full input queue (a program that reads nothing) cannot take the Ctrl-C: go on.
        with contextlib.suppress(CommandTimeoutError):
            await self._write(b"\x03", min(timeout, 1.0))
        with contextlib.suppress(CommandTimeoutError):
            return self._idle(await self._wait(None, timeout))
        pgid = self._foreground_pgid()
        init = self.sandbox.pid
        if pgid and pgid != self._shell_pgid and init is not None:
            # The job's group, and what its processes started, also in other groups/sessions.
            await asyncio.to_thread(procs.kill_tree, init, groups=[pgid])
        with contextlib.suppress(CommandTimeoutError):
            return self._idle(await self._wait(None, timeout))
        return await self._restart()

    def _idle(self, result: SessionResult) -> SessionResult:
        self._busy = False
        return result

    async def _restart(self) -> SessionResult:
        """Kill the shell and everything it started; start a new shell in its place."""
        self.sandbox._require_running()
        printed, truncated = self._buf.getvalue(), self._buf.truncated
        shell, init = self._shell_pgid, self.sandbox.pid
        assert init is not None
        leaders = [shell] if shell else []
        await asyncio.to_thread(
            procs.kill_tree, init, pids=leaders, groups=leaders, marker=self._mark
        )
        self._detach()
        self._buf = CappedOutput(self._max_output)
        self._scan = bytearray()
        self._eof = False
        self._shell_pgid = None
        await self._start()
        self._busy = False
        return SessionResult(
            output=decode(printed) + RESTART_NOTE,
            exit_code=RESTARTED_EXIT_CODE,
            truncated=truncated,
            restarted=True,
        )

    @property
    def busy(self) -> bool:
        return self._busy

    def _close(self) -> None:
        if self._master is not None and self._shell_pgid and not self._eof:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._shell_pgid, signal.SIGKILL)
        self._detach()

    def _detach(self) -> None:
        """Stop reading the terminal and close our end of it."""
        if self._master is not None:
            with contextlib.suppress(Exception):
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._master)
                loop.remove_writer(self._master)
            os.close(self._master)
            self._master = None
        self._eof = True

    async def close(self) -> None:
        await self.sandbox.close_session(self.name)


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


def _open_pty(sandbox: Sandbox, rows: int, columns: int, echo: bool) -> Terminal:
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
        if sandbox.as_root:
            os.fchown(peer, sandbox.sandbox_uid, sandbox.sandbox_gid)
    except BaseException:
        os.close(peer)
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return Terminal(fd, peer, number)


async def open_terminal(
    sandbox: Sandbox,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    rows: int = 24,
    columns: int = 80,
    echo: bool = True,
) -> Terminal:
    """Start `argv` inside the sandbox as the leader of a new session whose controlling terminal
    is a fresh pty. We keep the peer end open until the caller calls `release_peer()`: a master
    whose slave was never opened reads as EIO, which would look like a process that exited."""
    sandbox._require_running()
    term = _open_pty(sandbox, rows, columns, echo)
    try:
        env_words = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        rid = sandbox._next_id()
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        sandbox._started[rid] = started
        sandbox._send_control(
            f"{{ exec setsid -c env {RESET_SIGNALS} {env_words} "
            f"{' '.join(map(shlex.quote, argv))}; }} "
            f'<>/dev/pts/{term.number} >&0 2>&0 9>&- & echo "P {rid} $!" >&9'
        )
        await asyncio.wait_for(started, 30)
        await _until_controlling(term.master, 30)
    except BaseException:
        term.close()
        raise
    return term


async def _until_controlling(master: int, timeout: float) -> None:
    """Wait until the terminal is the controlling terminal of the new session (setsid -c has
    run, so the process holds the terminal open). Output alone proves nothing: the terminal
    echoes typed input by itself."""
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
