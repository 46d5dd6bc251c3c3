"""The SWE-ReX runtime of a minisandbox deployment (integrations.swerex): SWE-ReX's requests on
one sandbox, with its semantics (swerex's LocalRuntime: request and response models, exceptions,
`check` modes, interactive commands and `expect` patterns). Sessions are our ShellSessions (a
bash on a real pty inside the sandbox).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import shlex
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

try:
    from swerex.exceptions import (
        BashIncorrectSyntaxError,
        CommandTimeoutError,
        NoExitCodeError,
        NonZeroExitCodeError,
        SessionDoesNotExistError,
        SessionExistsError,
    )
    from swerex.runtime.abstract import (
        AbstractRuntime,
        Action,
        BashAction,
        BashInterruptAction,
        BashObservation,
        CloseBashSessionResponse,
        CloseResponse,
        CloseSessionRequest,
        CloseSessionResponse,
        Command,
        CommandResponse,
        CreateBashSessionRequest,
        CreateBashSessionResponse,
        CreateSessionRequest,
        CreateSessionResponse,
        IsAliveResponse,
        Observation,
        ReadFileRequest,
        ReadFileResponse,
        UploadRequest,
        UploadResponse,
        WriteFileRequest,
        WriteFileResponse,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"minisandbox.integrations.swerex needs SWE-ReX ({e}): "
        "install the `swerex` extra (in a checkout of swe-minisandbox: pip install -e '.[swerex]')"
    ) from e

from minisandbox import errors
from minisandbox.sandbox.api import SandboxAPI, SessionAPI
from minisandbox.sandbox.session import PROMPT_HOOK, SessionResult, ShellSession
from minisandbox.sandbox.sync import home_loop, on_loop

T = TypeVar("T")

__all__ = ["PS1", "MiniSandboxRuntime"]

# What the expect_string of an observation says when a command ended at the shell's prompt:
# swerex reports the PS1 it matched, and callers may compare against that value.
PS1 = "SHELLPS1PREFIX"
# "No timeout" for swerex; asyncio needs a finite deadline.
_FOREVER = 10.0**7
_ANSI = re.compile(r"\x1b[@-_][0-?]*[ -/]*[@-~]")


def default_logger() -> logging.Logger:
    return logging.getLogger("minisandbox.swerex")


def _seconds(timeout: float | None) -> float:
    return _FOREVER if timeout is None else float(timeout)


def _clean(text: str, match: str | None = None) -> str:
    """Output as swerex reports it: no escape sequences and, like pexpect's `before`, without
    the text that matched an expect pattern."""
    if match:
        text = text.removesuffix(match)
    return _ANSI.sub("", text).replace("\r\n", "\n")


# ---------------------------------------------------------------- runtime


class _Session:
    def __init__(self, shell: SessionAPI) -> None:
        self.shell = shell
        self.lock = asyncio.Lock()
        # The request's startup files, sourced again when an interrupt restarts the shell.
        self.startup: tuple[str, float] | None = None
        # bash's report of a job the last interrupt killed, for the next command's output.
        self.report = ""


class MiniSandboxRuntime(AbstractRuntime):
    """swerex's AbstractRuntime over a running minisandbox Sandbox."""

    def __init__(self, sandbox: SandboxAPI, *, logger: logging.Logger | None = None) -> None:
        self.sandbox = sandbox
        self.logger = logger or default_logger()
        self._sessions: dict[str, _Session] = {}

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the loop the sandbox belongs to (the caller's, when it started the
        sandbox on its own loop; else the process's sandbox loop)."""
        return await on_loop(coro, home_loop(self.sandbox))

    @property
    def sessions(self) -> dict[str, SessionAPI]:
        return {name: s.shell for name, s in self._sessions.items()}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self.sandbox.running:
            return IsAliveResponse(is_alive=True)
        return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} is not running")

    # ------------------------------------------------------------ sessions

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        return await self._on_loop(self._create_session(request))

    async def _create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        shell = await self.sandbox.create_session(request.session)
        self._sessions[request.session] = _Session(shell)
        output = ""
        if request.startup_source:
            # Sourced as swerex does (a missing file is reported, not fatal); the files may
            # replace PROMPT_COMMAND, which our prompt detection relies on.
            command = "; ".join(f"source {shlex.quote(p)}" for p in request.startup_source)
            command += f"; PROMPT_COMMAND={PROMPT_HOOK}"
            # A slow .bashrc gets at least a few seconds: the sandbox may start cold.
            timeout = max(request.startup_timeout, 5.0)
            self._sessions[request.session].startup = (command, timeout)
            try:
                r = await shell.run(command, timeout=timeout)
            except errors.CommandTimeoutError as e:
                raise CommandTimeoutError(
                    f"timeout after {timeout} seconds while sourcing {request.startup_source}"
                ) from e
            output = _clean(r.output)
        return CreateBashSessionResponse(output=output)

    def _session(self, name: str) -> _Session:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionDoesNotExistError(f"session {name!r} does not exist") from None

    async def run_in_session(self, action: Action) -> Observation:
        return await self._on_loop(self._run_in_session(action))

    async def _run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        session = self._session(action.session)
        async with session.lock:
            if isinstance(action, BashInterruptAction):
                return await self._interrupt(session, action)
            if action.is_interactive_command or action.is_interactive_quit:
                return await self._run_interactive(session.shell, action)
            r = await self._run_normal(session, action)
        if action.check == "raise" and r.exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {r.exit_code}. "
                f"Here is the output:\n{r.output!r}"
            )
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return r

    @staticmethod
    def _expect_string(expect: list[str], matched: str | None) -> str:
        if matched is None:
            return PS1
        return next((p for p in expect if re.search(p, matched)), matched)

    async def _send_or_run(
        self,
        shell: SessionAPI,
        command: str,
        expect: list[str],
        timeout: float | None,
    ) -> Any:
        """A command for the shell, or a line typed into the program the shell is running (a
        REPL left open by an earlier `expect` match), as swerex's pexpect session does."""
        try:
            if shell.busy:
                return await shell.send(command + "\n", expect=expect, timeout=_seconds(timeout))
            return await shell.run(command, expect=expect, timeout=_seconds(timeout))
        except errors.CommandTimeoutError as e:
            raise CommandTimeoutError(
                f"timeout after {timeout} seconds while running command {command!r}"
            ) from e

    async def _run_normal(self, session: _Session, action: BashAction) -> BashObservation:
        shell = session.shell
        if not shell.busy:
            await self._check_syntax(action.command)
        r = await self._send_or_run(shell, action.command, action.expect, action.timeout)
        output = _clean(r.output, r.match)
        if session.report and r.match is None:
            # Where swerex's session shows it: after the command's output, before the prompt.
            output, session.report = output + session.report, ""
        expect_string = self._expect_string(action.expect, r.match)
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None, expect_string=expect_string)
        if r.exit_code is None and action.check == "raise":
            raise NoExitCodeError(
                f"no exit code for {action.command!r}: it stopped at {expect_string!r}"
            )
        return BashObservation(output=output, exit_code=r.exit_code, expect_string=expect_string)

    async def _run_interactive(self, shell: SessionAPI, action: BashAction) -> BashObservation:
        r = await self._send_or_run(shell, action.command, action.expect, action.timeout)
        output = _clean(r.output, r.match).strip()
        if action.is_interactive_command:
            output = output.removeprefix(action.command).strip()
        return BashObservation(
            output=output, exit_code=0, expect_string=self._expect_string(action.expect, r.match)
        )

    async def _interrupt(self, session: _Session, action: BashInterruptAction) -> BashObservation:
        """swerex's interrupt. Where swerex would give up ("Failed to interrupt session": a shell
        that ignores Ctrl-C in itself), ours kills and restarts the shell instead, and the
        observation's output ends with the notice that the shell's state was lost."""
        shell = session.shell
        # swerex sends Ctrl-C up to n_retry times, `timeout` apart: a Ctrl-C that lands while
        # bash is still starting the job (the child has not yet reset SIGINT) is lost, and the
        # next one ends it. A floor of 1 s in all keeps a busy machine from escalating.
        tries = max(action.n_retry, 1)
        timeout = max(action.timeout, 1.0 / tries)
        try:
            if action.expect:
                # Ctrl-C to a program that keeps running (a REPL): wait for its prompt, once
                # (a second Ctrl-C to a REPL slow to redraw would print a second prompt).
                r = await shell.send("\x03", expect=action.expect, timeout=timeout * tries)
            else:
                r, session.report = await _stop_foreground_job(shell, tries, timeout)
            if r.restarted and session.startup is not None:
                # A fresh shell, as create_session left it: the startup files again.
                command, startup_timeout = session.startup
                await shell.run(command, timeout=startup_timeout)
        except (errors.CommandTimeoutError, errors.SessionError) as e:
            raise CommandTimeoutError(f"Failed to interrupt session: {e}") from e
        return BashObservation(
            output=_clean(r.output, r.match).strip(),
            exit_code=0,
            expect_string=self._expect_string(action.expect, r.match),
        )

    async def _check_syntax(self, command: str) -> None:
        """`bash -n`, inside the sandbox: the agent's text is never run on the host."""
        r = await self.sandbox.execute(["/bin/bash", "-n"], stdin=command + "\n", timeout=30)
        if r.exit_code == 0:
            return
        msg = (
            f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
            f"---- Stderr ----\n{r.stderr}\n---- Stdout ----\n{r.stdout}"
        )
        raise BashIncorrectSyntaxError(
            msg, extra_info={"bash_stdout": r.stdout, "bash_stderr": r.stderr}
        )

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        return await self._on_loop(self._close_session(request.session))

    async def _close_session(self, name: str) -> CloseBashSessionResponse:
        if name not in self._sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        del self._sessions[name]
        if self.sandbox.running:
            await self.sandbox.close_session(name)
        return CloseBashSessionResponse()

    # ------------------------------------------------------------ commands and files

    async def execute(self, command: Command) -> CommandResponse:
        return await self._on_loop(self._execute(command))

    async def _execute(self, command: Command) -> CommandResponse:
        cmd = command.command
        if command.shell:
            # subprocess.run(shell=True): the string (or the list's first item) goes to sh -c.
            argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else ["/bin/sh", "-c", *cmd]
        else:
            argv = [cmd] if isinstance(cmd, str) else list(cmd)
        if command.env is not None:
            # subprocess's env= replaces the environment, it does not extend it.
            argv = ["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), *argv]
        try:
            r = await self.sandbox.execute(
                argv,
                cwd=command.cwd,
                timeout=_seconds(command.timeout),
                merge_stderr=command.merge_output_streams,
            )
        except errors.CommandTimeoutError as e:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command"
            ) from e
        response = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {r.exit_code}. "
                f"Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}"
            )
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        return await self._on_loop(self._read_file(request))

    async def _read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await self.sandbox.read_file(request.path)
        except errors.SandboxFileError as e:
            # Path.read_text's exceptions: callers catch FileNotFoundError (SWE-agent does).
            # OSError(errno, ...) is FileNotFoundError, IsADirectoryError, PermissionError.
            if e.errno in (errno.ENOENT, errno.EISDIR, errno.EACCES):
                raise OSError(e.errno, os.strerror(e.errno), request.path) from None
            raise
        content = data.decode(request.encoding or "utf-8", request.errors or "strict")
        # Text mode reads translate newlines; so does Path.read_text.
        return ReadFileResponse(content=content.replace("\r\n", "\n").replace("\r", "\n"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await self._on_loop(self.sandbox.write_file(request.path, request.content))
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        return await self._on_loop(self._upload(request))

    async def _upload(self, request: UploadRequest) -> UploadResponse:
        source, target = Path(request.source_path), request.target_path
        if not source.exists():
            raise FileNotFoundError(2, "No such file or directory", str(source))
        if not source.is_dir():
            # shutil.copy: a file copied onto a directory lands inside it.
            r = await self.sandbox.execute(["test", "-d", target])
            if r.exit_code == 0:
                target = os.path.join(target, source.name)
        await self.sandbox.upload(source, target)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        return await self._on_loop(self._close())

    async def _close(self) -> CloseResponse:
        for name in list(self._sessions):
            await self._close_session(name)
        return CloseResponse()


# ---------------------------------------------------------------- deployment


async def _send_ctrl_c(shell: SessionAPI, tries: int, timeout: float) -> SessionResult:
    """Ctrl-C until the prompt is back, at most `tries` times, each waited for `timeout`
    seconds. Sent again only while a job still holds the terminal: once the shell has it back
    (the job ended meanwhile), a Ctrl-C would print a second prompt, and every later command
    would read the one before's; the prompt on its way is waited for instead.

    Raises:
        CommandTimeoutError: no prompt after the last one.
        SessionError: as ShellSession.send.
    """
    for attempt in range(tries):
        last = attempt == tries - 1
        again = attempt == 0 or not isinstance(shell, ShellSession) or shell.job_in_foreground()
        try:
            return await shell.send("\x03" if again else "", timeout=timeout)
        except errors.CommandTimeoutError:
            if last:
                raise
    raise AssertionError("unreachable")


async def _stop_foreground_job(
    shell: SessionAPI, tries: int, timeout: float
) -> tuple[SessionResult, str]:
    """swerex's interrupt of a plain command: Ctrl-C (`tries` times); if the prompt does not
    come back (a pager, a program that ignores SIGINT), Ctrl-Z and `kill -9` of that job, so
    that bash reports it "Stopped", then "Killed". Where even Ctrl-Z brings no prompt,
    ShellSession.interrupt kills the job, or restarts the shell.

    Returns what was printed and, apart, bash's "Killed" report: swerex's session sees that
    report in the next command's output (bash prints it at the prompt after the job was
    reaped, which with pexpect is almost always the next one), so the caller hands it on.
    Waiting here until the job is gone makes that independent of the machine's load.

    Raises:
        CommandTimeoutError, SessionError: as ShellSession.interrupt.
    """
    try:
        return await _send_ctrl_c(shell, tries, timeout), ""
    except errors.CommandTimeoutError:
        pass
    timeout = max(timeout * tries, 1.0)  # the steps after Ctrl-C: as long as all of them
    try:
        stopped = await shell.send("\x1a", timeout=timeout)
    except errors.CommandTimeoutError:
        return await shell.interrupt(timeout=timeout), ""
    if "Stopped" not in stopped.output:  # it ended by itself meanwhile: no job to kill (%%
        return stopped, ""  # would then be the agent's last background job)
    killed = await shell.send(_KILL_STOPPED_JOB, timeout=max(timeout, _KILL_WAIT + 5.0))
    report = "".join(line for line in killed.output.splitlines(keepends=True) if "Killed" in line)
    rest = "".join(line for line in killed.output.splitlines(keepends=True) if "Killed" not in line)
    return SessionResult(output=stopped.output + rest, exit_code=0), report


# Seconds the interrupt waits for a SIGKILLed job to be gone.
_KILL_WAIT = 20.0
# `kill -9` of the stopped job, then a wait (bounded) until bash no longer lists it running or
# stopped: bash has reaped it and prints its "Killed" report before the next prompt, this
# command's, whatever the machine's load ($(jobs) in a subshell sees the shell's job table).
_KILL_STOPPED_JOB = (
    "kill -9 %%; for _ in {1.."
    + str(int(_KILL_WAIT * 100))
    + '}; do [ -n "$(jobs -r %% 2>/dev/null)$(jobs -s %% 2>/dev/null)" ] || break; '
    "sleep 0.01; done\n"
)
