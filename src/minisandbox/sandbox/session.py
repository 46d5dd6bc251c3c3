"""Persistent interactive bash sessions inside a sandbox, each on its own pseudo-terminal.

The pty is allocated in the sandbox's own devpts instance (see terminal.py), so the session's
bash has a real controlling terminal: job control, Ctrl-C, and programs that want a tty (a
Python REPL) behave as they do for a person.

A session's lifecycle (`start`, `close`) is separate from its operations (`run`, `send`,
`interrupt`), as in SWE-ReX. Sandbox.create_session makes and starts one; the sandbox closes its
sessions when it stops. A session uses only the public side of its sandbox (a SessionHost) and
of its control channel; it never imports the sandbox module, which imports this one.

Each command is written to a file in the sandbox's channel directory and sourced, so multi-line
commands and heredocs need no escaping and arrive in one piece (a tty line is at most 4 KiB).
The end of a command is its prompt: PS1 carries a random marker and `$?`.

Typing into the terminal never blocks the event loop: when the terminal's input queue is full
(a program that does not read its stdin), the write waits for the master to become writable,
while every other sandbox and session on the loop goes on, up to the command's timeout.

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
import struct
import termios
from collections.abc import Callable, Sequence
from typing import Protocol

from pydantic import BaseModel

from minisandbox.errors import CommandTimeoutError, InvalidCommandError, SessionError
from minisandbox.sandbox import procs
from minisandbox.sandbox.channel import ChannelDir
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT, CappedOutput, decode
from minisandbox.sandbox.terminal import TerminalHost, open_terminal, until_writable

# The shell function that puts the prompt marker back; a caller whose startup files replace
# PROMPT_COMMAND restores it by this name.
PROMPT_HOOK = "__msb_prompt"
# A write to a full terminal is retried at least this often, should a wakeup be missed.
_WRITE_RECHECK = 0.05
# How long a new shell may take to show its first prompt.
_START_TIMEOUT = 30.0


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


class SessionHost(TerminalHost, Protocol):
    """What a session needs of its sandbox: a Sandbox is one. (Sessions depend on this, not on
    the Sandbox class: the sandbox module imports this one, never the other way round.)"""

    @property
    def id(self) -> str: ...

    @property
    def config(self) -> SandboxConfig: ...  # for the default command timeout

    def require_running(self) -> None: ...  # raises unless the sandbox runs


class ShellSession:
    """One persistent bash in `sandbox`. Not for concurrent use: one command at a time.

    `env` is added to the shell's environment, `max_output` caps what one command returns,
    `columns` and `rows` size its terminal. `on_close(session)` is called once by `close()`
    (Sandbox.create_session uses it to forget the session)."""

    def __init__(
        self,
        sandbox: SessionHost,
        name: str,
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
        on_close: Callable[[ShellSession], None] | None = None,
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
        self._on_close = on_close
        self._nonce = secrets.token_hex(8)
        self._marker = re.compile(rb"__MSB" + self._nonce.encode() + rb"_(\d+)__")
        self._master: int | None = None
        self._buf = CappedOutput(max_output)
        self._scan = bytearray()  # the recent bytes that a marker or an expect pattern may span
        self._data = asyncio.Event()
        self._eof = False
        self._busy = False
        self._started = False
        self._closed = False
        self._shell_pgid: int | None = None  # host pid of the shell: its group and session
        self._mark = ""  # marks (in the environment) everything the current shell starts
        self._seq = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def busy(self) -> bool:
        """A command (or a program stopped at an `expect` pattern) holds the shell."""
        return self._busy

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> ShellSession:
        """Start the shell and wait for its first prompt (once).

        Raises:
            SessionError: the session was started or closed before, or its shell did not start.
            CommandTimeoutError: the shell did not show its prompt in time.
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
        """
        if self._closed or self._started:
            state = "closed" if self._closed else "already started"
            raise SessionError(f"session {self.name!r} is {state}")
        self.sandbox.require_running()
        self._started = True
        await self._launch()
        return self

    async def close(self) -> None:
        """Kill the shell and everything it started (its jobs too, which a killed shell cannot
        hang up), and let go of its terminal. Idempotent; a command waiting in `run` or `send`
        fails with SessionError."""
        if self._closed:
            return
        self._closed = True
        shell, init, running = self._shell_pgid, self.sandbox.pid, not self._eof
        self._shutdown()  # waiters fail now, not with what the killing below prints
        if init is not None and self._mark:
            # Jobs in no foreground group, or left behind (setsid): all carry the marker.
            leaders = [shell] if shell and running else []
            with contextlib.suppress(OSError):
                await asyncio.to_thread(
                    procs.kill_tree, init, pids=leaders, groups=leaders, marker=self._mark
                )
        if self._on_close is not None:
            self._on_close(self)

    async def _launch(self) -> None:
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
            await self._write(init.encode(), _START_TIMEOUT)
            await self._wait(None, _START_TIMEOUT, discard=True)
        finally:
            term.release_peer()
        self._shell_pgid = self._foreground_pgid()

    def _shell_env(self) -> dict[str, str]:
        # The marker first: it then sits near the start of every environ the shell passes on.
        env = {procs.MARKER_VAR: self._mark}
        env.update((k, v) for k, v in self._env.items() if k != procs.MARKER_VAR)
        return env

    def _shutdown(self) -> None:
        """Kill the shell's process group (if it still runs) and let go of the terminal."""
        if self._master is not None and self._shell_pgid and not self._eof:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._shell_pgid, signal.SIGKILL)
        self._detach()

    def _detach(self) -> None:
        """Stop reading the terminal and close our end of it; wake whoever waits for output."""
        if self._master is not None:
            with contextlib.suppress(Exception):
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._master)
                loop.remove_writer(self._master)
            os.close(self._master)
            self._master = None
        self._eof = True
        self._data.set()

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

    def _live_master(self) -> int:
        if self._master is None or self._eof:
            raise SessionError(f"session {self.name!r} has exited")
        return self._master

    async def _write(self, data: bytes, timeout: float) -> None:
        """Type `data` into the terminal. When its input queue is full, wait (on the event
        loop, never blocking it) for the program to read, at most `timeout` seconds.

        Raises:
            SessionError: the shell has exited, or the session was closed.
            CommandTimeoutError: the program did not read its input in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        view = memoryview(data)
        while view:
            master = self._live_master()
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
            # Bounded: should a wakeup be missed, the write is simply tried again.
            wait = min(remaining, _WRITE_RECHECK)
            await until_writable(master, wait, lambda: self._master)

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

    def _match(self, patterns: list[re.Pattern[bytes]], discard: bool) -> SessionResult | None:
        """The result, if the output so far ends a command: its prompt, or an `expect` match."""
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
        return None

    async def _wait(
        self, expect: Sequence[str] | None, timeout: float, discard: bool = False
    ) -> SessionResult:
        """Wait for the prompt or an `expect` pattern.

        Raises:
            SessionError: the shell exited, or the session was closed.
            CommandTimeoutError: neither came within `timeout` seconds.
        """
        patterns = [re.compile(p.encode()) for p in expect or ()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            result = self._match(patterns, discard)
            if result is not None:
                return result
            if self._eof:
                self._shutdown()
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

    def _check_usable(self) -> None:
        self.sandbox.require_running()
        if self._closed:
            raise SessionError(f"session {self.name!r} is closed")
        if not self._started:
            raise SessionError(f"session {self.name!r} was not started")

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
        into the terminal once the command has started, for commands that read stdin.

        Raises:
            SessionError: the session is busy (interrupt it), closed, not started, or its
                shell exited.
            CommandTimeoutError: no prompt or `expect` match within `timeout` (default
                `Limits.command_timeout`), or the terminal did not take the input in time.
            InvalidCommandError: (a ValueError) the command holds a NUL byte.
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
        """
        self._check_usable()
        if self._busy:
            raise SessionError(
                f"session {self.name!r} is still running a command; interrupt() it first"
            )
        if "\0" in command:
            raise InvalidCommandError("commands cannot contain NUL bytes")
        timeout = self.sandbox.config.limits.command_timeout if timeout is None else timeout
        self._seq += 1
        name = f"s{self.sandbox.id}-{self.name}-{self._seq}.sh".replace("/", "_")
        files = self.sandbox.channel.files
        files.write(name, command.encode())
        try:
            self._busy = True
            loop = asyncio.get_running_loop()
            began = loop.time()
            line = f". {shlex.quote(ChannelDir.inside(name))}\n"
            await self._write(line.encode() + (input or "").encode(), timeout)
            return await self._finish(expect, max(0.0, timeout - (loop.time() - began)))
        finally:
            files.unlink(name)

    async def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        """Type `text` into the session's terminal (e.g. a line for a REPL), then wait for a
        pattern in `expect`, or for the shell's prompt when `expect` is empty.

        Raises:
            SessionError: the session is closed, not started, or its shell exited.
            CommandTimeoutError: as `run`.
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
        """
        self._check_usable()
        timeout = self.sandbox.config.limits.command_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        began = loop.time()
        self._busy = True
        await self._write(text.encode(), timeout)
        return await self._finish(expect, max(0.0, timeout - (loop.time() - began)))

    async def _finish(self, expect: Sequence[str] | None, timeout: float) -> SessionResult:
        self._busy = True
        return self._finished(await self._wait(expect, timeout))

    def _finished(self, result: SessionResult) -> SessionResult:
        # Still inside an interactive program when we stopped at an expect pattern.
        self._busy = result.exit_code is None
        return result

    def job_in_foreground(self) -> bool:
        """Whether a program other than the shell holds the session's terminal (a command or
        an interactive program is running): False once the shell has its terminal back."""
        pgid = self._foreground_pgid()
        return pgid is not None and pgid != self._shell_pgid

    def _foreground_pgid(self) -> int | None:
        if self._master is None:
            return None
        try:
            (pgid,) = struct.unpack("i", fcntl.ioctl(self._master, termios.TIOCGPGRP, b"\0" * 4))
        except OSError:
            return None
        return int(pgid)

    async def interrupt(self, timeout: float = 2.0) -> SessionResult:
        """Stop what the session is running, each step given `timeout` seconds to bring the
        prompt back: Ctrl-C; then SIGKILL to the foreground job and everything it started;
        then, if the shell itself still does not return (it ignores SIGINT and loops), kill the
        shell with everything it started and start a new one with the same name and
        environment (`restarted` is set, the output ends with RESTART_NOTE).

        The session is usable again afterwards. Returns what was printed meanwhile.

        Raises:
            SessionError: the shell exited or the session was closed, or a new shell could
                not be started.
            SandboxNotRunningError: the sandbox is not running (when a restart is needed).
        """
        # A full input queue (a program that reads nothing) cannot take the Ctrl-C: go on.
        with contextlib.suppress(CommandTimeoutError):
            await self._write(b"\x03", min(timeout, 1.0))
        with contextlib.suppress(CommandTimeoutError):
            return self._finished(await self._wait(None, timeout))
        pgid = self._foreground_pgid()
        init = self.sandbox.pid
        if pgid and pgid != self._shell_pgid and init is not None:
            # The job's group, and what its processes started, also in other groups/sessions.
            await asyncio.to_thread(procs.kill_tree, init, groups=[pgid])
        with contextlib.suppress(CommandTimeoutError):
            return self._finished(await self._wait(None, timeout))
        return await self._restart()

    async def _restart(self) -> SessionResult:
        """Kill the shell and everything it started; start a new shell in its place."""
        self.sandbox.require_running()
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
        await self._launch()
        self._busy = False
        return SessionResult(
            output=decode(printed) + RESTART_NOTE,
            exit_code=RESTARTED_EXIT_CODE,
            truncated=truncated,
            restarted=True,
        )
