"""The sandbox: one bwrap process tree with its own namespaces, root filesystem and limits.

Inside runs a small control shell (POSIX sh, helpers/control.sh) that starts commands and shell
sessions on request (the protocol: channel.py). Commands exchange data with the supervisor
through FIFOs and files in a per-sandbox channel directory; the supervisor creates and opens
those only relative to a directory descriptor, without following symlinks, so nothing the
sandbox writes can steer the supervisor to a host path. File reads, writes and uploads run
*inside* the sandbox (cat, tar; files.py), so they cannot reach the host.

Two ways of starting bwrap, chosen by the caller's uid:
- unprivileged: the sandbox's uid 0 is the caller (a one-line uid map), with no capabilities;
- root: the sandbox's uid 0 is an unprivileged host uid (`root_mapped_uid`). bwrap still runs
  its setup as root (so root-only paths like pyenv under /root can be bound), then a tiny static
  program (uiddrop.py; setpriv on machines it is not written for) drops to the mapped uid with
  no groups and an empty capability bounding set before anything else runs.

The parts: startup.py (checks, bwrap's command line, uid maps and rlimits), dirs.py (runtime
directory, upper layer), channel.py (control protocol, channel directory), commands.py
(one-shot commands), files.py (files), watchdog.py (upper-layer caps), memory.py (the memory
cap), session.py (a shell), sessions.py (the named shells of a sandbox).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from minisandbox.errors import (
    SandboxLimitError,
    SandboxLoopError,
    SandboxNotRunningError,
    SandboxStartError,
)
from minisandbox.sandbox import dirs, egress, memory, runtime, startup, uiddrop, watchdog
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.sandbox.bwrap import explain_bwrap_failure
from minisandbox.sandbox.cgroups import SandboxCgroup, delegated_parent
from minisandbox.sandbox.channel import CONTROL_SHELL, ChannelDir, ControlChannel, ControlFifos
from minisandbox.sandbox.commands import CommandExecutor, ExecResult
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.files import READ_MAX_BYTES, FileOperations
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT, CappedOutput, decode
from minisandbox.sandbox.rootfs import DEFAULT_PATH, MountPlan, build_plan, check_destinations
from minisandbox.sandbox.seccomp import build_filter
from minisandbox.sandbox.session import SessionHost, ShellSession
from minisandbox.sandbox.sessions import SessionOperations
from minisandbox.utils import safefs
from minisandbox.utils.aio import cancel_and_wait, running_loop, settle

__all__ = ["READ_MAX_BYTES", "ExecResult", "Sandbox"]

logger = logging.getLogger(__name__)

# The longest control reply line read (asyncio's default stream limit, as before).
_CONTROL_LINE_LIMIT = 2**16


_REMOVERS: concurrent.futures.ThreadPoolExecutor | None = None


def _removers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that remove stopped sandboxes' directories, apart from the loop's default
    executor (which a burst of stops would otherwise fill): one per core, 2 to 4 (removal is
    system calls between GIL hand-offs: more threads only contend)."""
    global _REMOVERS
    if _REMOVERS is None:
        workers = min(4, max(2, os.cpu_count() or 2))
        _REMOVERS = concurrent.futures.ThreadPoolExecutor(workers, "minisandbox-rm")
    return _REMOVERS


class Sandbox(FileOperations, SessionOperations):
    """An isolated, disposable Linux environment. Use as `async with Sandbox(...) as sb:`.

    `Sandbox(config)` or `Sandbox(**fields of SandboxConfig)`."""

    def __init__(self, config: SandboxConfig | None = None, **kwargs: object) -> None:
        self.config = config if config is not None else SandboxConfig.model_validate(kwargs)
        self.id = secrets.token_hex(6)
        self._proc: asyncio.subprocess.Process | None = None
        self._ns_pid: int | None = None  # host pid of the sandbox's pid 1
        self._dir: Path | None = None
        self._upper: Path | None = None
        self._work: Path | None = None
        self._files: ChannelDir | None = None
        self._fifos: ControlFifos | None = None
        self._egress: egress.EgressProxy | None = None
        self._channel: ControlChannel | None = None
        self._runner: CommandExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stderr = CappedOutput(64 * 1024)
        self._sessions: dict[str, ShellSession] = {}
        self._dead: BaseException | None = None
        self._stopped = False
        self._cgroup: SandboxCgroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.as_root = os.geteuid() == 0
        self.sandbox_uid, self.sandbox_gid = self.config.sandbox_owner()

    # ---------------------------------------------------------------- state

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self._dead is None

    @property
    def upper_dir(self) -> Path | None:
        """The host directory holding everything this sandbox wrote."""
        return self._upper

    @property
    def pid(self) -> int | None:
        """Host pid of the sandbox's init process (pid 1 inside)."""
        return self._ns_pid

    @property
    def egress_refused(self) -> list[str]:
        """What the sandbox's egress proxy refused so far ("host:port (why)"), if it has one."""
        return list(self._egress.refused) if self._egress is not None else []

    @property
    def owner(self) -> tuple[int, int] | None:
        """The host (uid, gid) to give what the host creates for the sandbox's root; None
        when that is the caller already (an unprivileged caller)."""
        return (self.sandbox_uid, self.sandbox_gid) if self.as_root else None

    @property
    def channel(self) -> ControlChannel:
        """The control channel of the running sandbox (used by sessions and terminals).

        Raises:
            SandboxNotRunningError: the sandbox is not running (see `require_running`).
            SandboxLimitError: it was stopped for exceeding a limit.
        """
        self.require_running()
        assert self._channel is not None
        return self._channel

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that started it (None before): every call must come from it."""
        return self._loop

    def require_running(self) -> None:
        """Return if the sandbox runs, else raise why not.

        Raises:
            SandboxLimitError: it was stopped for exceeding a limit.
            SandboxNotRunningError: it was never started, was stopped, or died.
            SandboxLoopError: called from an event loop other than the one that started it.
        """
        if self._loop is not None and running_loop() not in (None, self._loop):
            raise SandboxLoopError(
                f"sandbox {self.id} was started on another event loop: call it from that loop "
                "(from another thread: asyncio.run_coroutine_threadsafe(..., sandbox.loop))"
            )
        if self._dead is not None:
            if isinstance(self._dead, SandboxLimitError):
                raise self._dead
            raise SandboxNotRunningError(str(self._dead))
        if not self.running:
            raise SandboxNotRunningError(
                f"sandbox {self.id} is not running" + (" (stopped)" if self._stopped else "")
            )

    # ---------------------------------------------------------------- start

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> Sandbox:
        """Start the sandbox (once); a failed start leaves nothing behind.

        Raises:
            SandboxStartError: already started, or bwrap could not set the sandbox up.
            SandboxConfigError: the configuration is unsafe (a symlink on a mount path).
            BwrapNotFoundError: no usable bwrap.
            UserNamespacesUnavailableError: the kernel refuses unprivileged user namespaces.
        """
        if self._proc is not None or self._stopped:
            raise SandboxStartError("a Sandbox object can be started once")
        self._loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        cfg = self.config
        bwrap = startup.preflight(cfg, self.as_root)
        io = self._prepare_dirs()
        assert self._dir is not None and self._upper is not None and self._work is not None
        system = startup.system_layer(self._dir.parent.parent, self.owner)
        plan = build_plan(cfg, system, self._upper, self._work, io, self._dir.parent.parent)
        # The workdir and /root are created in the upper layer: no symlinks on their paths either.
        check_destinations([*plan.destinations, "/root", cfg.workdir], [self._upper, *cfg.layers])
        dirs.precreate(
            self._upper, plan.destinations, [system, *cfg.layers], cfg.workdir, self.owner
        )
        await self._launch(bwrap, plan)
        if cfg.egress is not None:  # before anything of the sandbox but its control shell runs
            assert self._ns_pid is not None
            listener = await asyncio.to_thread(egress.open_listener, self._ns_pid)
            self._egress = egress.EgressProxy(cfg.egress, listener, self.id)
            await self._egress.start()
        lim = cfg.limits
        cap = self._memory_cap()
        if cap and self._cgroup is None:
            self._tasks.append(asyncio.create_task(self._watch_memory(cap)))
        if lim.upper_bytes is not None or lim.upper_inodes is not None:
            self._tasks.append(
                asyncio.create_task(self._watch_upper(lim.upper_bytes, lim.upper_inodes))
            )

    def _prepare_dirs(self) -> Path:
        """The runtime directory, the upper layer and work directory (attributes set as each
        is made, so that stop() removes what a failed start left), the channel directory."""
        cfg = self.config
        self._dir = runtime.process_dir(cfg.runtime_dir) / self.id
        helper = uiddrop.drop_helper(self._dir.parent) if self.as_root else None
        io = dirs.make_runtime_dir(self._dir, searchable=helper is not None)
        if cfg.upper is not None:
            upper = Path(os.path.abspath(cfg.upper))
            self._work = dirs.kept_work_dir(upper, self._dir, self.id)
            self._upper = upper  # once it is ours to seal at stop
        else:
            self._upper = self._dir / "upper"
            self._work = self._dir / "work"
            self._upper.mkdir()
            self._work.mkdir()
        dirs.chown(self._upper, self.owner)
        if cfg.upper is not None:
            # What an earlier sandbox left there, if it was never stopped. A root caller's bwrap
            # makes its last steps (chdir) as host root without capabilities, a stranger to the
            # sandbox's `/`: that needs search permission for others while it runs.
            dirs.seal_kept_upper(self._upper, 0o711 if self.as_root else 0o700)
        dirs.chown(io, self.owner)
        self._files = ChannelDir(io, self.owner)
        programs = {CONTROL_SHELL: startup.control_shell(self._dir.parent)}
        if helper is not None:
            programs[uiddrop.HELPER_NAME] = helper
        for name, program in programs.items():
            try:
                os.link(program, io / name)
            except OSError:  # another filesystem (a runtime dir of its own): a copy of it
                shutil.copy2(program, io / name)
        return io

    async def _launch(self, bwrap: Path, plan: MountPlan) -> None:
        """Start bwrap, let it go once its user namespace is set up, and wait for the control
        shell's first reply."""
        fds: list[int] = []
        try:
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            fds += [info_r, info_w, block_r, block_w]
            passed = [info_w, block_r, startup.pipe_with(build_filter())]
            fds.append(passed[-1])
            for _dest, content in plan.data:
                passed.append(startup.pipe_with(content))
                fds.append(passed[-1])
            args = startup.bwrap_argv(
                bwrap,
                self.config,
                plan,
                as_root=self.as_root,
                info_fd=info_w,
                block_fd=block_r,
                seccomp_fd=passed[2],
                data_fds=passed[3:],
            )
            assert self._files is not None
            self._fifos = self._files.control_fifos()
            await self._spawn(args, passed)
            for fd in passed:
                os.close(fd)
                fds.remove(fd)
            child = await startup.within(startup.read_child_pid(info_r), "report its pid 1")
            if child is None:
                await self._fail_start()
            self._ns_pid = child
            self._setup_userns(child)
            os.write(block_w, b"1")
            await self._open_channel()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def _spawn(self, args: list[str], pass_fds: list[int]) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *args,
            # The control lines go through FIFOs only the control shell holds (channel.py):
            # bwrap's own processes, pid 1 inside included, must hold no end of them.
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=[*pass_fds, runtime.lifeline_fd()],
            start_new_session=True,
            umask=0o022,
            # bwrap's own pid 1 stays visible inside: it must not carry our environment.
            env={"PATH": DEFAULT_PATH},
        )
        self._tasks.append(asyncio.create_task(self._drain_stderr()))

    async def _fail_start(self) -> NoReturn:
        """bwrap exited during setup: raise what its stderr says.

        Raises:
            SandboxStartError: always.
        """
        assert self._proc is not None
        await self._proc.wait()
        await asyncio.sleep(0)  # let the stderr drain finish
        await settle(self._tasks, 1)
        msg = explain_bwrap_failure(decode(self._stderr.getvalue()))
        raise SandboxStartError(f"bwrap failed (exit {self._proc.returncode}): {msg}")

    def _setup_userns(self, pid: int) -> None:
        """Write the uid map bwrap waits for, then the per-sandbox limits of its pid 1."""
        startup.write_id_maps(pid, (self.sandbox_uid, self.sandbox_gid), self.as_root)
        lim = self.config.limits
        startup.apply_rlimits(pid, lim, self.as_root)
        memory.point_oom_killer_at(pid)
        parent = delegated_parent()
        # Whole-sandbox limits on top, where the caller may use cgroups (without one, its memory
        # is watched from the host: see _watch_memory).
        if parent is not None:
            self._cgroup = SandboxCgroup(parent, f"sandbox-{self.id}")
            self._cgroup.create(self._memory_cap() or None, lim.processes)
            self._cgroup.add(pid)

    def _memory_cap(self) -> int:
        """The whole-sandbox memory cap in bytes (0: none): total_memory_bytes, else the
        default share of the host's memory (memory.py)."""
        total = self.config.limits.total_memory_bytes
        return memory.default_share() if total is None else total

    async def _watch_memory(self, cap: int) -> None:
        assert self._ns_pid is not None
        breach = await memory.watch_memory(
            self._ns_pid, cap, sandbox_id=self.id, running=lambda: self.running
        )
        await self._stop_on(breach)

    async def _stop_on(self, breach: str | None) -> None:
        """A watchdog's verdict: past a limit (`breach` says which), the sandbox dies of it."""
        if breach is not None:
            self._dead = SandboxLimitError(breach)
            await self._kill()

    async def _open_channel(self) -> None:
        assert self._proc is not None and self._files is not None and self._ns_pid is not None
        assert self._fifos is not None
        reader, writer = await self._fifos.streams(limit=_CONTROL_LINE_LIMIT)
        channel = ControlChannel(reader, writer, self._files, on_close=self._channel_closed)
        self._channel = channel
        channel.start()
        if not await startup.within(self._ready_or_exit(channel), "start its control shell"):
            await self._fail_start()
        self._fifos.seal()
        self._runner = CommandExecutor(
            channel,
            init_pid=self._ns_pid,
            workdir=self.config.workdir,
            default_timeout=self.config.limits.command_timeout,
        )

    async def _ready_or_exit(self, channel: ControlChannel) -> bool:
        """True once the control shell replies; False if bwrap exits first (its command could
        not run). The host holds a spare end of the reply FIFO until then, so the channel
        alone would never see the end.

        Raises:
            SandboxNotRunningError: the channel closed first.
        """
        assert self._proc is not None
        ready = asyncio.ensure_future(channel.ready())
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            await asyncio.wait((ready, exited), return_when=asyncio.FIRST_COMPLETED)
            replied = ready.done()
        finally:
            await cancel_and_wait([t for t in (ready, exited) if not t.done()])
        if replied:
            ready.result()
        return replied

    def _channel_closed(self) -> BaseException:
        """The control shell is gone: why, for whatever still waits on it."""
        reason = self._dead or SandboxNotRunningError(
            f"sandbox {self.id} exited" + self._stderr_tail()
        )
        if self._dead is None and not self._stopped:
            self._dead = reason
        return reason

    async def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(65536):
            self._stderr.write(chunk)

    def _stderr_tail(self) -> str:
        text = decode(self._stderr.getvalue()).strip()
        return f": {text[-2000:]}" if text else ""

    async def _watch_upper(self, max_bytes: int | None, max_inodes: int | None) -> None:
        """Stop the sandbox once its writable layer outgrows its caps. (The channel dir holds
        only what the host writes: the sandbox sees it read-only.)"""
        assert self._upper is not None and self._dir is not None
        breach = await watchdog.watch_upper(
            [self._upper],
            max_bytes,
            max_inodes,
            sandbox_id=self.id,
            running=lambda: self.running,
        )
        await self._stop_on(breach)

    # ---------------------------------------------------------------- stop

    async def _kill(self) -> None:
        if self._ns_pid is not None:
            # Killing pid 1 of the sandbox's pid namespace kills every process in it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self._ns_pid, signal.SIGKILL)
        if self._proc is not None and self._proc.returncode is None:
            # The outer bwrap reaps pid 1 and exits by itself; killing it first would leave pid 1
            # a zombie for whoever adopts it.
            try:
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), 2)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()

    async def stop(self) -> None:
        """Kill everything in the sandbox and remove its temporary directories. Idempotent.

        Its sessions are closed; a kept upper layer is made private to its owner (a failure
        to do so is logged, not raised)."""
        if self._stopped:
            return
        self._stopped = True
        await self._close_sessions()
        await self._kill()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                await self._proc.wait()
        if self._channel is not None:
            await self._channel.close()
        if self._egress is not None:
            await self._egress.close()
        current = asyncio.current_task()
        await cancel_and_wait(t for t in self._tasks if t is not current)
        if self._fifos is not None:
            self._fifos.close()
        if self._files is not None:
            self._files.close()
        # Removing a large upper layer takes seconds: in a thread, so that other sandboxes'
        # commands and stops go on meanwhile (many stops at once run side by side).
        try:
            await asyncio.get_running_loop().run_in_executor(_removers(), self._remove_dirs)
        except RuntimeError:  # an executor shut down (interpreter exit): here, then
            self._remove_dirs()

    def _remove_dirs(self) -> None:
        """Remove the sandbox's directories (its processes are gone). Blocking: run in a
        thread."""
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._upper is not None and self.config.upper is not None:
            try:
                dirs.seal_kept_upper(self._upper, 0o700)  # everything in the sandbox is dead
            except OSError as e:
                logger.warning("could not make the kept upper layer %s private: %s", self._upper, e)
        if self._work is not None and self.config.upper is not None:
            safefs.discard_tree(self._work)
        if self._dir is not None:
            safefs.discard_tree(self._dir)

    # ---------------------------------------------------------------- commands

    def _commands(self) -> CommandExecutor:
        self.require_running()
        assert self._runner is not None
        return self._runner

    async def execute(
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
    ) -> ExecResult:
        """Run one command to completion, like subprocess.run.

        A string runs under `bash -c`; a sequence is executed directly. On timeout the command's
        whole process group is killed and CommandTimeoutError carries the output so far.
        `on_output(fd, chunk)` sees the output as it arrives (fd 1 or 2), e.g. to stream it.
        Each stream keeps at most `max_output` bytes (its head and tail; `truncated` says so).

        Raises:
            CommandTimeoutError: the command ran past `timeout` (default
                `Limits.command_timeout`); it was killed with everything it started.
            InvalidCommandError: (a ValueError) the command is empty, or it, `cwd` or `env`
                holds a NUL byte, or a variable's name is empty or holds `=`.
            SandboxNotRunningError: the sandbox is not running, or died meanwhile.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
            ControlProtocolError: the control shell's reply about the command was malformed.
        """
        raw = await self._commands().run(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            merge_stderr=merge_stderr,
            max_output=max_output,
            on_output=on_output,
        )
        return raw.decoded()


if TYPE_CHECKING:
    _host: SessionHost = cast(Sandbox, None)  # a Sandbox is what its sessions need
    _api: SandboxAPI = cast(Sandbox, None)  # and the declared API (sandbox/api.py)
