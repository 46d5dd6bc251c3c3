"""One-shot commands in a sandbox: started by the control shell, their output through FIFOs.

A command's stdout and stderr are FIFOs in the channel directory, read by the host as they fill
(non-blocking, on the event loop) into capped buffers: an agent that prints gigabytes costs the
host at most `max_output` bytes per stream. Its stdin, when given, is a file there.

A command that outlives its timeout is killed with everything it started: its process group
and session, its descendants, and what left both but still carries its marker variable (found
from the host, see procs.kill_tree).
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel

from minisandbox.errors import CommandTimeoutError, InvalidCommandError
from minisandbox.sandbox import procs
from minisandbox.sandbox.channel import ChannelDir, ControlChannel, Job, new_id
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT, CappedOutput, decode
from minisandbox.utils.aio import settle

# How long a timed-out command's replies are waited for around its kill: its start is reported
# at once and its status as soon as the kill lands; neither may stretch the timeout much.
_KILL_SETTLE = 1.0


class ExecResult(BaseModel):
    """The outcome of a one-shot command."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class RawResult(BaseModel):
    """ExecResult's bytes, before decoding."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    duration_s: float

    def decoded(self) -> ExecResult:
        return ExecResult(
            exit_code=self.exit_code,
            stdout=decode(self.stdout),
            stderr=decode(self.stderr),
            truncated=self.truncated,
            duration_s=self.duration_s,
        )


def command_argv(
    command: str | Sequence[str], cwd: str | None, env: Mapping[str, str] | None
) -> list[str]:
    """The argv of `command` (a string runs under `bash -c`), checked for what cannot be sent.

    Raises:
        InvalidCommandError: the command is empty, or it, `cwd` or `env` holds a NUL byte.
    """
    argv = ["/bin/bash", "-c", command] if isinstance(command, str) else list(command)
    if not argv:
        raise InvalidCommandError("empty command")
    for part in (*argv, cwd or "", *(env or {}).keys(), *(env or {}).values()):
        if "\0" in part:
            raise InvalidCommandError("commands, paths and variables cannot contain NUL bytes")
    return argv


class CommandExecutor:
    """Runs one-shot commands over a started sandbox's control channel.

    `init_pid` is the host pid of the sandbox's pid 1 (where a timed-out command's processes
    are looked for); `workdir` and `default_timeout` apply when a call gives none."""

    def __init__(
        self, channel: ControlChannel, *, init_pid: int, workdir: str, default_timeout: float
    ) -> None:
        self.channel = channel
        self.files: ChannelDir = channel.files
        self._init_pid = init_pid
        self._workdir = workdir
        self._default_timeout = default_timeout

    async def run(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        merge_stderr: bool = False,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> RawResult:
        """Run `command` to completion (see Sandbox.execute).

        Raises:
            InvalidCommandError: the command, `cwd` or `env` cannot be sent.
            CommandTimeoutError: it ran past `timeout`; it was killed with what it started.
            SandboxNotRunningError: the sandbox stopped or died meanwhile.
            ControlProtocolError: the control shell's reply about it was malformed.
        """
        timeout = self._default_timeout if timeout is None else timeout
        argv = command_argv(command, cwd, env)
        rid = new_id()
        out = CappedOutput(max_output, on_output and functools.partial(on_output, 1))
        err = CappedOutput(max_output, on_output and functools.partial(on_output, 2))
        sinks: dict[int, CappedOutput] = {}  # FIFO read ends, being drained into their sink
        job: Job | None = None
        began = time.monotonic()
        try:
            stdin_path = self._stdin_file(rid, stdin)
            outputs = {f"{rid}.o": out, **({} if merge_stderr else {f"{rid}.e": err})}
            self._open_outputs(outputs, sinks)
            # Inherited by everything the command starts: what its timeout must find.
            mark = secrets.token_hex(8)
            job = self.channel.start_command(
                argv,
                cwd=cwd or self._workdir,
                env=env or {},
                mark=mark,
                stdin=stdin_path,
                stdout=ChannelDir.inside(f"{rid}.o"),
                stderr=None if merge_stderr else ChannelDir.inside(f"{rid}.e"),
            )
            exit_code = await self._wait(job, mark, timeout, sinks, argv, out, err)
        finally:
            self._release(rid, job, sinks)
        return RawResult(
            exit_code=exit_code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            truncated=out.truncated or err.truncated,
            duration_s=time.monotonic() - began,
        )

    def _stdin_file(self, rid: str, stdin: bytes | str | None) -> str:
        """The path inside of the command's stdin: a new channel file holding `stdin`."""
        if stdin is None:
            return "/dev/null"
        self.files.write(f"{rid}.i", stdin.encode() if isinstance(stdin, str) else stdin)
        return ChannelDir.inside(f"{rid}.i")

    def _open_outputs(
        self, wanted: dict[str, CappedOutput], sinks: dict[int, CappedOutput]
    ) -> None:
        """Create the FIFOs named in `wanted` and drain each into its sink as it fills; their
        read ends go to `sinks` as they are opened (for `_release`, whatever happens)."""
        loop = asyncio.get_running_loop()
        for name, sink in wanted.items():
            fd = self.files.mkfifo(name)
            sinks[fd] = sink
            loop.add_reader(fd, _drain_into, fd, sink)

    def _release(self, rid: str, job: Job | None, sinks: dict[int, CappedOutput]) -> None:
        if job is not None:
            self.channel.forget(job)
        loop = asyncio.get_running_loop()
        for fd in sinks:
            loop.remove_reader(fd)
            os.close(fd)
        self.files.unlink(f"{rid}.o", f"{rid}.e", f"{rid}.i")  # those made; others are no error

    async def _wait(
        self,
        job: Job,
        mark: str,
        timeout: float,
        sinks: dict[int, CappedOutput],
        argv: Sequence[str],
        out: CappedOutput,
        err: CappedOutput,
    ) -> int:
        """The job's exit status, once its output is drained; kill it at `timeout`."""
        assert job.exited is not None
        try:
            exit_code = await asyncio.wait_for(asyncio.shield(job.exited), timeout)
        except asyncio.CancelledError:
            # Our caller gave up on it (an episode's deadline, say): it does not run on.
            await self._kill(job.started, mark)
            raise
        except asyncio.TimeoutError:
            started = job.started.done()
            await self._kill(job.started, mark)
            if started:  # its status comes once the kill lands; a request never taken, never
                await settle([job.exited], _KILL_SETTLE)
            for fd, sink in sinks.items():
                _drain_into(fd, sink)
            raise CommandTimeoutError(
                f"command timed out after {timeout} s: {_short(argv)}",
                output=decode(out.getvalue() + err.getvalue()),
            ) from None
        for fd, sink in sinks.items():
            _drain_into(fd, sink)
        return exit_code

    async def _kill(self, started: asyncio.Future[int], mark: str) -> None:
        """SIGKILL everything a timed-out command started: its process group and session, its
        descendants, and what left both but still carries its marker (see procs.kill_tree for
        the one gap). Done from the host, which sees the processes that escaped the command's
        session; the control shell's `kill`/`pkill` is the fallback if the host cannot look."""
        # The start is reported at once, if at all: a request nobody took (a stopped control
        # shell) must not stretch the command past its timeout; the marker finds what ran.
        await settle([started], _KILL_SETTLE)
        ok = started.done() and not started.cancelled() and started.exception() is None
        pid = started.result() if ok else None
        try:
            await asyncio.to_thread(
                procs.kill_tree, self._init_pid, ns_pids=[pid] if pid else [], marker=mark
            )
        except OSError:
            if pid and not self.channel.closed:
                self.channel.kill_group(pid)


def _drain_into(fd: int, sink: CappedOutput) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # BlockingIOError included: nothing more for now
            return
        if not chunk:
            return
        sink.write(chunk)


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) < 200 else text[:200] + "..."
