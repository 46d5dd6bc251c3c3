"""The sandbox: one bwrap process tree with its own namespaces, root filesystem and limits.

Inside runs a small control shell (POSIX sh) that starts commands and shell sessions on request.
Commands exchange data with the supervisor through FIFOs and files in a per-sandbox channel
directory; the supervisor creates and opens those only relative to a directory descriptor, without
following symlinks, so nothing the sandbox writes can steer the supervisor to a host path. File
reads, writes and uploads run *inside* the sandbox (cat, tar), so they cannot reach the host.

Two ways of starting bwrap, chosen by the caller's uid:
- unprivileged: the sandbox's uid 0 is the caller (a one-line uid map), with no capabilities;
- root: the sandbox's uid 0 is an unprivileged host uid (`root_mapped_uid`). bwrap still runs
  its setup as root (so root-only paths like pyenv under /root can be bound), then `setpriv`
  drops to the mapped uid with an empty capability bounding set before anything else runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import resource
import secrets
import shlex
import shutil
import signal
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from minisandbox.errors import (
    CommandTimeoutError,
    SandboxConfigError,
    SandboxFileError,
    SandboxLimitError,
    SandboxNotRunningError,
    SandboxStartError,
    SessionError,
)
from minisandbox.sandbox import cleanup, procs, runtime
from minisandbox.sandbox.bwrap import check_userns, explain_bwrap_failure, find_bwrap
from minisandbox.sandbox.cgroups import SandboxCgroup, delegated_parent
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT, CappedOutput, decode
from minisandbox.sandbox.rootfs import (
    DEFAULT_PATH,
    IO_DIR,
    RESET_SIGNALS,
    build_plan,
    build_system_layer,
    check_destinations,
)
from minisandbox.sandbox.seccomp import build_filter
from minisandbox.sandbox.session import ShellSession
from minisandbox.utils import safefs

logger = logging.getLogger(__name__)

# The control shell: runs each line the supervisor sends; replies on fd 9 only.
_CONTROL_SCRIPT = 'exec 9>&1 1>/dev/null; echo R >&9; while IFS= read -r l; do eval "$l"; done'
# What read_file reads at most unless told otherwise: sandbox content is untrusted, and an
# uncapped read of a link to /dev/zero would fill the supervisor's memory.
READ_MAX_BYTES = 64 * 1024 * 1024
# read_file's reader, run inside: `sh -c _READ_SCRIPT sh PATH LIMIT`. The host's own tools by
# absolute PATH (/usr is read-only inside); exit 3: a directory, 4: another non-regular file
# (its kind on stderr).
_READ_DIRECTORY, _READ_NOT_REGULAR = 3, 4
_READ_SCRIPT = """PATH=/usr/bin:/bin
kind=$(stat -L -c %F -- "$1") || exit 2
case $kind in
    "regular file"|"regular empty file") exec head -c "$2" -- "$1" ;;
    directory) exit 3 ;;
    *) printf '%s\n' "$kind" >&2; exit 4 ;;
esac"""
_START_TIMEOUT = 30.0


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


class _RawResult(BaseModel):
    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    duration_s: float


def _q(s: str) -> str:
    return shlex.quote(s)


def _pipe_with(data: bytes) -> int:
    """A readable fd holding `data` (small: it must fit in the pipe buffer)."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


class Sandbox:
    """An isolated, disposable Linux environment. Use as `async with Sandbox(...) as sb:`."""

    def __init__(self, config: SandboxConfig | None = None, **kwargs: object) -> None:
        self.config = config if config is not None else SandboxConfig(**kwargs)  # type: ignore[arg-type]
        self.id = secrets.token_hex(6)
        self._proc: asyncio.subprocess.Process | None = None
        self._ns_pid: int | None = None  # host pid of the sandbox's pid 1
        self._dir: Path | None = None
        self._upper: Path | None = None
        self._work: Path | None = None
        self._io_fd: int | None = None
        self._waiters: dict[str, asyncio.Future[int]] = {}
        self._started: dict[str, asyncio.Future[int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stderr = CappedOutput(64 * 1024)
        self._sessions: dict[str, ShellSession] = {}
        self._dead: BaseException | None = None
        self._stopped = False
        self._cgroup: SandboxCgroup | None = None
        self.as_root = os.geteuid() == 0
        self.sandbox_uid, self.sandbox_gid = self.config.sandbox_owner()

    # ---------------------------------------------------------------- lifecycle

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

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> Sandbox:
        if self._proc is not None or self._stopped:
            raise SandboxStartError("a Sandbox object can be started once")
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    def _prepare_dirs(self) -> Path:
        cfg = self.config
        self._dir = runtime.process_dir(cfg.runtime_dir) / self.id
        self._dir.mkdir(mode=0o700)
        io = self._dir / "io"
        io.mkdir(mode=0o700)
        if cfg.upper is not None:
            self._upper = Path(os.path.abspath(cfg.upper))
            self._upper.mkdir(parents=True, exist_ok=True)
            _sweep_dead_work_dirs(self._upper)
            # overlayfs wants its work dir empty and on the upper's filesystem. Named with its
            # owner (pid and start time) so that a later start can tell a dead owner's, and
            # registered (before it exists) for the janitor in case we die without stop().
            self._work = self._upper.parent / _work_dir_name(self._upper, self.id)
            fd = os.open(
                self._dir / cleanup.EXTERNAL_DIRS,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            with os.fdopen(fd, "wb") as f:
                f.write(os.fsencode(self._work) + b"\n")
            self._work.mkdir()
        else:
            self._upper = self._dir / "upper"
            self._work = self._dir / "work"
            self._upper.mkdir()
            self._work.mkdir()
        self._chown(self._upper)
        if cfg.upper is not None:
            # What an earlier sandbox left there, if it was never stopped. A root caller's bwrap
            # makes its last steps (chdir) as host root without capabilities, a stranger to the
            # sandbox's `/`: that needs search permission for others while it runs.
            self._seal_kept_upper(0o711 if self.as_root else 0o700)
        self._chown(io)
        self._io_fd = os.open(io, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return io

    def _seal_kept_upper(self, mode: int) -> None:
        """A kept upper layer stays on the host after the sandbox: make it private to its owner
        (`mode` 0700 once stopped; the directory is the sandbox's `/`, which it may chmod) and
        clear set-id bits in it (seccomp refuses setting them, but a set-id file of a lower
        layer can be copied up), so that no other host user can run anything from it as the
        sandbox's uid. Directories that not even the caller may enter are skipped: 0700 covers
        them."""
        assert self._upper is not None
        # The caller chose this path: following its links is theirs to decide. Below it, the
        # sandbox's tree is walked without following any.
        fd = os.open(self._upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        safefs.strip_setid(os.path.realpath(self._upper))

    def _precreate(self, destinations: list[str], layers: list[Path]) -> None:
        """Create, owned by the sandbox's root, the directories that bwrap would otherwise create
        as its own (root's, for a root caller) while placing mount points: /root, the workdir,
        and every parent of a mount destination that no layer provides."""
        wanted = {"/root", self.config.workdir}
        for dest in destinations:
            parent = os.path.dirname(dest)
            while parent != "/":
                wanted.add(parent)
                parent = os.path.dirname(parent)
        for inside in sorted(wanted):
            rel = inside.lstrip("/")
            if not any(os.path.lexists(tree / rel) for tree in layers):
                self._make_upper_dir(Path(rel), layers)

    def _make_upper_dir(self, rel: Path, layers: list[Path]) -> None:
        """mkdir -p in the upper layer. A parent that a lower layer provides is created with
        that layer's mode and owner: in an overlay the upper copy's attributes win.

        A kept upper layer holds whatever an earlier sandbox wrote there, symlinks included: walk
        it by directory descriptors and never follow a link, or a planted `/testbed -> /etc`
        would make us create (and chown) directories on the host."""
        assert self._upper is not None
        fd = os.open(self._upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for i, name in enumerate(rel.parts, start=1):
                sub = Path(*rel.parts[:i])
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    created = True
                except FileExistsError:
                    created = False
                try:
                    child = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                except OSError as e:
                    raise SandboxConfigError(
                        f"refusing to start: {self._upper / sub} in the upper layer is not a "
                        f"directory (a symlink?): {e.strerror}"
                    ) from None
                os.close(fd)
                fd = child
                if created:
                    lower = next((t / sub for t in reversed(layers) if _is_dir(t / sub)), None)
                    if lower is not None:
                        st = os.stat(lower, follow_symlinks=False)
                        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
                    else:
                        mode = 0o700 if str(sub) == "root" else 0o755
                        owner = (self.sandbox_uid, self.sandbox_gid)
                    os.fchmod(fd, mode)  # whatever our umask is
                    if self.as_root:
                        os.fchown(fd, *owner)
        finally:
            os.close(fd)

    def _chown(self, path: Path) -> None:
        if self.as_root:
            os.chown(path, self.sandbox_uid, self.sandbox_gid, follow_symlinks=False)

    def _env(self) -> dict[str, str]:
        cfg = self.config
        path = DEFAULT_PATH
        env = {
            "HOME": "/root",
            "USER": "root",
            "LOGNAME": "root",
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "HOSTNAME": cfg.hostname,
        }
        if cfg.venv:
            path = f"{cfg.venv}/bin:{path}"
            env["VIRTUAL_ENV"] = cfg.venv
        env["PATH"] = path
        env.update(cfg.env)
        return env

    async def _start(self) -> None:
        cfg = self.config
        _check_total_memory(cfg.limits.total_memory_bytes)
        bwrap = find_bwrap(cfg.bwrap)
        check_userns()
        for tool in ("bash", "setsid", "cat", "tar") + (("setpriv",) if self.as_root else ()):
            if shutil.which(tool, path=DEFAULT_PATH) is None:
                raise SandboxStartError(f"the host has no `{tool}` in /usr/bin or /bin; install it")
        io = self._prepare_dirs()
        assert self._upper is not None and self._work is not None
        owner = (self.sandbox_uid, self.sandbox_gid) if self.as_root else None
        system = _system_layer(self._dir.parent, owner)  # type: ignore[union-attr]
        plan = build_plan(cfg, system, self._upper, self._work, io)
        # The workdir and /root are created in the upper layer: no symlinks on their paths either.
        check_destinations([*plan.destinations, "/root", cfg.workdir], [self._upper, *cfg.layers])
        self._precreate(plan.destinations, [system, *cfg.layers])

        fds: list[int] = []
        try:
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            fds += [info_r, info_w, block_r, block_w]
            seccomp_fd = _pipe_with(build_filter())
            fds.append(seccomp_fd)
            args = [
                str(bwrap),
                "--unshare-user",
                "--userns-block-fd",
                str(block_r),
                "--info-fd",
                str(info_w),
                "--unshare-ipc",
                "--unshare-pid",
                "--unshare-uts",
                "--unshare-cgroup-try",
                "--hostname",
                cfg.hostname,
                "--die-with-parent",
                # Held by every bwrap process but the command: the janitor's sign that no bwrap
                # of ours may still be setting up (see _cleanup).
                "--sync-fd",
                str(runtime.lifeline_fd()),
                "--new-session",
                "--seccomp",
                str(seccomp_fd),
                "--cap-drop",
                "ALL",
            ]
            if not cfg.network:
                args.append("--unshare-net")
            if self.as_root:
                # Just what setpriv needs to switch to the mapped uid and empty the bounding set.
                args += [
                    "--cap-add",
                    "CAP_SETUID",
                    "--cap-add",
                    "CAP_SETGID",
                    "--cap-add",
                    "CAP_SETPCAP",
                ]
            args.append("--clearenv")
            for k, v in self._env().items():
                args += ["--setenv", k, v]
            args += plan.args
            for dest, content in plan.data:
                fd = _pipe_with(content)
                fds.append(fd)
                args += ["--perms", "0644", "--ro-bind-data", str(fd), dest]
            args += ["--chdir", cfg.workdir, "--"]
            if self.as_root:
                args += [
                    "setpriv",
                    "--reuid=0",
                    "--regid=0",
                    "--clear-groups",
                    "--inh-caps=-all",
                    "--bounding-set=-all",
                    "--",
                ]
            args += ["/bin/sh", "-c", _CONTROL_SCRIPT]
            pass_fds = [info_w, block_r, seccomp_fd, *fds[5:]]
            self._proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=[*pass_fds, runtime.lifeline_fd()],
                start_new_session=True,
                umask=0o022,
                # bwrap's own pid 1 stays visible inside: it must not carry our environment.
                env={"PATH": DEFAULT_PATH},
            )
            for fd in pass_fds:
                os.close(fd)
                fds.remove(fd)
            self._tasks.append(asyncio.create_task(self._drain_stderr()))
            info = await asyncio.wait_for(self._read_info(info_r), _START_TIMEOUT)
            self._ns_pid = int(info["child-pid"])
            self._setup_userns(self._ns_pid)
            os.write(block_w, b"1")
            ready = asyncio.get_running_loop().create_future()
            self._started["R"] = ready
            self._tasks.append(asyncio.create_task(self._read_control()))
            await asyncio.wait_for(ready, _START_TIMEOUT)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if cfg.limits.upper_bytes is not None or cfg.limits.upper_inodes is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._watch_upper(cfg.limits.upper_bytes, cfg.limits.upper_inodes)
                )
            )

    async def _read_info(self, fd: int) -> dict[str, object]:
        loop = asyncio.get_running_loop()
        buf = b""
        while True:
            chunk = await loop.run_in_executor(None, os.read, fd, 4096)
            if not chunk:
                await self._fail_start()
            buf += chunk
            with contextlib.suppress(ValueError):
                return json.JSONDecoder().raw_decode(buf.decode())[0]  # type: ignore[no-any-return]

    async def _fail_start(self) -> None:
        assert self._proc is not None
        await self._proc.wait()
        await asyncio.sleep(0)  # let the stderr drain finish
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(t, 1)
        msg = explain_bwrap_failure(decode(self._stderr.getvalue()))
        raise SandboxStartError(f"bwrap failed (exit {self._proc.returncode}): {msg}")

    def _setup_userns(self, pid: int) -> None:
        """Write the uid map bwrap waits for, then the per-sandbox rlimits of its pid 1."""
        uid, gid = self.sandbox_uid, self.sandbox_gid
        if self.as_root:
            # Host root appears as uid 1 only so that bwrap's own setup can run; nothing in the
            # sandbox can become it (no capabilities, no_new_privs).
            uid_map, gid_map = f"0 {uid} 1\n1 0 1\n", f"0 {gid} 1\n1 0 1\n"
        else:
            uid_map, gid_map = f"0 {uid} 1\n", f"0 {gid} 1\n"
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(uid_map)
        if not self.as_root:
            # Required before an unprivileged gid map. A root caller keeps setgroups() so that
            # setpriv can clear the supplementary groups (host root's group 0) inside.
            with open(f"/proc/{pid}/setgroups", "w") as f:
                f.write("deny")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(gid_map)
        lim = self.config.limits
        # Set on pid 1 after its user namespace exists: RLIMIT_NPROC then counts the processes
        # of this sandbox only, not every process of the caller's uid.
        wanted = {
            resource.RLIMIT_NPROC: lim.processes,
            resource.RLIMIT_AS: lim.memory_bytes,
            resource.RLIMIT_NOFILE: lim.open_files,
            # One file may not outgrow the upper layer's cap between two watchdog scans.
            resource.RLIMIT_FSIZE: _min_set(lim.file_size_bytes, lim.upper_bytes),
            resource.RLIMIT_CPU: lim.cpu_seconds,
            resource.RLIMIT_CORE: 0,
        }
        for res, value in wanted.items():
            if value is None:
                continue
            _soft, hard = resource.prlimit(pid, res)
            if hard != resource.RLIM_INFINITY and not self.as_root:
                value = min(value, hard)
            resource.prlimit(pid, res, (value, value))
        parent = delegated_parent()
        # Whole-sandbox limits on top, where the caller may use cgroups (without one, an explicit
        # total_memory_bytes was refused before bwrap started).
        if parent is not None:
            self._cgroup = SandboxCgroup(parent, f"sandbox-{self.id}")
            self._cgroup.create(lim.total_memory_bytes, lim.processes)
            self._cgroup.add(pid)

    async def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(65536):
            self._stderr.write(chunk)

    async def _read_control(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        reader = self._proc.stdout
        try:
            while line := await reader.readline():
                parts = line.decode(errors="replace").split()
                if not parts:
                    continue
                kind = parts[0]
                table = self._waiters if kind == "X" else self._started
                key = "R" if kind == "R" else (parts[1] if len(parts) > 1 else "")
                fut = table.pop(key, None)
                if fut is not None and not fut.done():
                    value = parts[2] if len(parts) > 2 else "0"
                    fut.set_result(int(value) if value.lstrip("-").isdigit() else 0)
        finally:
            reason = self._dead or SandboxNotRunningError(
                f"sandbox {self.id} exited" + self._stderr_tail()
            )
            if self._dead is None and not self._stopped:
                self._dead = reason
            for fut in [*self._waiters.values(), *self._started.values()]:
                if not fut.done():
                    fut.set_exception(reason)
            self._waiters.clear()
            self._started.clear()

    def _stderr_tail(self) -> str:
        text = decode(self._stderr.getvalue()).strip()
        return f": {text[-2000:]}" if text else ""

    async def _watch_upper(self, max_bytes: int | None, max_inodes: int | None) -> None:
        """Stop the sandbox once its writable layer (and channel dir) holds more than
        `max_bytes` bytes of blocks or more than `max_inodes` files and directories.

        Scans run off the event loop, at most `_SCAN_MAX_PAUSE` apart whatever a scan costs (a
        scan stops early at a cap, so its cost is bounded by the caps too). Between two scans a
        single file cannot outgrow the byte cap: RLIMIT_FSIZE is at most `max_bytes`."""
        assert self._upper is not None and self._dir is not None
        roots = [self._upper, self._dir / "io"]
        loop = asyncio.get_running_loop()
        while self.running:
            began = time.monotonic()
            try:
                scan = await loop.run_in_executor(
                    _scan_pool(), _disk_usage, roots, max_bytes, max_inodes
                )
            except OSError as e:  # e.g. out of descriptors: try again at the next poll
                logger.warning("cannot measure the upper layer of sandbox %s: %s", self.id, e)
            else:
                if scan.breach is not None:
                    self._dead = SandboxLimitError(
                        _breach_message(self.id, scan, max_bytes, max_inodes)
                    )
                    await self._kill()
                    return
            took = time.monotonic() - began
            # Scans cost CPU: at most a third of a thread's time, but never more than
            # _SCAN_MAX_PAUSE apart.
            await asyncio.sleep(min(_SCAN_MAX_PAUSE, max(_SCAN_MIN_PAUSE, 2 * took)))

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
        """Kill everything in the sandbox and remove its temporary directories. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for session in list(self._sessions.values()):
            session._close()
        self._sessions.clear()
        await self._kill()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                await self._proc.wait()
        current = asyncio.current_task()
        for t in self._tasks:
            if t is not current:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._io_fd is not None:
            os.close(self._io_fd)
            self._io_fd = None
        if self._upper is not None and self.config.upper is not None:
            try:
                self._seal_kept_upper(0o700)  # everything in the sandbox is dead by now
            except OSError as e:
                logger.warning("could not make the kept upper layer %s private: %s", self._upper, e)
        if self._work is not None and self.config.upper is not None:
            runtime.remove_tree(self._work)
        if self._dir is not None:
            runtime.remove_tree(self._dir)

    def _require_running(self) -> None:
        if self._dead is not None:
            raise (
                self._dead
                if isinstance(self._dead, SandboxLimitError)
                else (SandboxNotRunningError(str(self._dead)))
            )
        if not self.running:
            raise SandboxNotRunningError(
                f"sandbox {self.id} is not running" + (" (stopped)" if self._stopped else "")
            )

    # ---------------------------------------------------------------- channel files

    def _next_id(self) -> str:
        # Random, not sequential: a process left in the sandbox should not guess the next reply.
        return secrets.token_hex(6)

    def _mkfifo(self, name: str) -> int:
        """Create a FIFO in the channel dir and open its read end (non-blocking)."""
        assert self._io_fd is not None
        os.mkfifo(name, 0o600, dir_fd=self._io_fd)
        if self.as_root:
            os.chown(
                name, self.sandbox_uid, self.sandbox_gid, dir_fd=self._io_fd, follow_symlinks=False
            )
        fd = os.open(
            name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._io_fd
        )
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise SandboxFileError(f"channel file {name} of sandbox {self.id} was replaced")
        return fd

    def _open_channel_file(self, name: str) -> int:
        """Create a new regular file in the channel dir for writing (never an existing one)."""
        assert self._io_fd is not None
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=self._io_fd,
        )
        if self.as_root:
            os.fchown(fd, self.sandbox_uid, self.sandbox_gid)
        return fd

    def _write_channel_file(self, name: str, data: bytes) -> None:
        fd = self._open_channel_file(name)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def _unlink_channel(self, *names: str) -> None:
        if self._io_fd is None:
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._io_fd)

    def _send_control(self, line: str) -> None:
        self._require_running()
        assert self._proc is not None and self._proc.stdin is not None
        if "\n" in line:  # the control shell reads lines: hand it a multi-line one as a file
            name = f"ctl-{self._next_id()}"
            self._write_channel_file(name, line.encode())
            line = f". {IO_DIR}/{name}; rm -f {IO_DIR}/{name}"
        self._proc.stdin.write(line.encode() + b"\n")

    # ---------------------------------------------------------------- commands

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
        `on_output(fd, chunk)` sees the output as it arrives (fd 1 or 2), e.g. to stream it."""
        raw = await self._execute_raw(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            merge_stderr=merge_stderr,
            max_output=max_output,
            on_output=on_output,
        )
        return ExecResult(
            exit_code=raw.exit_code,
            stdout=decode(raw.stdout),
            stderr=decode(raw.stderr),
            truncated=raw.truncated,
            duration_s=raw.duration_s,
        )

    async def _execute_raw(
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
    ) -> _RawResult:
        self._require_running()
        timeout = self.config.limits.command_timeout if timeout is None else timeout
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("empty command")
        for part in (*argv, cwd or "", *(env or {}).keys(), *(env or {}).values()):
            if "\0" in part:
                raise ValueError("commands, paths and variables cannot contain NUL bytes")
        rid = self._next_id()
        names = [f"{rid}.o"] + ([] if merge_stderr else [f"{rid}.e"])
        stdin_path = "/dev/null"
        if stdin is not None:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            self._write_channel_file(f"{rid}.i", data)
            names.append(f"{rid}.i")
            stdin_path = f"{IO_DIR}/{rid}.i"
        out = CappedOutput(max_output, on_output and functools.partial(on_output, 1))
        err = CappedOutput(max_output, on_output and functools.partial(on_output, 2))
        fds: list[int] = []
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        try:
            fds.append(self._mkfifo(f"{rid}.o"))
            if not merge_stderr:
                fds.append(self._mkfifo(f"{rid}.e"))
            sinks = {fds[0]: out, **({fds[1]: err} if not merge_stderr else {})}
            for fd, sink in sinks.items():
                loop.add_reader(fd, _drain_into, fd, sink)
            env_words = " ".join(_q(f"{k}={v}") for k, v in (env or {}).items())
            # Inherited by everything the command starts: what its timeout must find. Before the
            # caller's variables, so that it sits near the start of every environ.
            mark = secrets.token_hex(8)
            redirect_err = "2>&1" if merge_stderr else f"2>{_q(f'{IO_DIR}/{rid}.e')}"
            started: asyncio.Future[int] = loop.create_future()
            done: asyncio.Future[int] = loop.create_future()
            self._started[rid], self._waiters[rid] = started, done
            self._send_control(
                "{ { cd -- "
                + _q(cwd or self.config.workdir)
                + f" || exit 126; exec 9>&-; exec env {RESET_SIGNALS} {procs.marker_word(mark)} "
                + f"{env_words} setsid "
                + " ".join(_q(a) for a in argv)
                + "; } <"
                + _q(stdin_path)
                + " >"
                + _q(f"{IO_DIR}/{rid}.o")
                + " "
                + redirect_err
                + f' & p=$!; echo "P {rid} $p" >&9; wait $p; echo "X {rid} $?" >&9; }} &'
            )
            try:
                exit_code = await asyncio.wait_for(asyncio.shield(done), timeout)
            except asyncio.TimeoutError:
                await self._kill_command(started, mark)
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(done, 5)
                for fd, sink in sinks.items():
                    _drain_into(fd, sink)
                raise CommandTimeoutError(
                    f"command timed out after {timeout} s: {_short(argv)}",
                    output=decode(out.getvalue() + err.getvalue()),
                ) from None
            for fd, sink in sinks.items():
                _drain_into(fd, sink)
        finally:
            self._started.pop(rid, None)
            self._waiters.pop(rid, None)
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)
            self._unlink_channel(*names)
        return _RawResult(
            exit_code=exit_code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            truncated=out.truncated or err.truncated,
            duration_s=time.monotonic() - began,
        )

    async def _kill_command(self, started: asyncio.Future[int], mark: str) -> None:
        """SIGKILL everything a timed-out command started: its process group and session, its
        descendants, and what left both but still carries its marker (see procs.kill_tree for
        the one gap). Done from the host, which sees the processes that escaped the command's
        session; the control shell's `kill`/`pkill` is the fallback if the host cannot look."""
        with contextlib.suppress(BaseException):  # the start is reported at once, if at all
            await asyncio.wait_for(asyncio.shield(started), 5)
        ok = started.done() and not started.cancelled() and started.exception() is None
        pid = started.result() if ok else None
        assert self._ns_pid is not None
        try:
            await asyncio.to_thread(
                procs.kill_tree, self._ns_pid, ns_pids=[pid] if pid else [], marker=mark
            )
        except OSError:
            if pid and self.running:
                self._send_control(
                    f"kill -KILL -- -{pid} 2>/dev/null; pkill -KILL -s {pid} 2>/dev/null"
                )

    # ---------------------------------------------------------------- files

    def _inside(self, path: str) -> str:
        if "\0" in path:
            raise SandboxFileError(f"path {path!r} contains a NUL byte")
        return os.path.normpath(os.path.join(self.config.workdir, path))

    async def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        """Bytes of a regular file inside the sandbox (read by a process inside: host files are
        out of reach, whatever symlinks or `..` the path holds).

        Raises:
            SandboxFileError: the file is missing or unreadable, is not a regular file once
                symlinks are resolved inside (a directory, a FIFO, a device such as a link to
                /dev/zero), or holds more than `max_bytes` bytes (never silently truncated).
        """
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise SandboxFileError(f"read_file: max_bytes must be a byte count, not {max_bytes!r}")
        target = self._inside(path)
        # Inside: one stat (following links, without opening: a FIFO would block) says what it
        # is; only a regular file is read, and by `head -c`, which stops one byte past the cap
        # even if the file grows or is swapped for something endless after the stat. The cap on
        # what we collect bounds our memory whatever runs inside.
        r = await self._execute_raw(
            ["/bin/sh", "-c", _READ_SCRIPT, "sh", target, str(max_bytes + 1)],
            max_output=max(max_bytes + 1, 64 * 1024),
        )
        if r.exit_code == 0 and not r.truncated and len(r.stdout) <= max_bytes:
            return r.stdout
        why = decode(r.stderr).strip()
        if r.exit_code == 0:
            why = (
                f"it holds more than {max_bytes} bytes (the cap of read_file; pass a larger "
                "max_bytes to read it)"
            )
        elif r.exit_code == _READ_DIRECTORY:
            why = "Is a directory"
        elif r.exit_code == _READ_NOT_REGULAR:
            kind = why.splitlines()[0][:80] if why else "special file"
            why = f"it is a {kind}, not a regular file (after resolving symlinks inside)"
        raise SandboxFileError(f"cannot read {target} in the sandbox: {why}")

    async def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str:
        """`read_file` decoded (same checks and cap)."""
        return (await self.read_file(path, max_bytes=max_bytes)).decode(encoding, errors)

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """Create or replace a file inside the sandbox, creating its parent directories."""
        target = self._inside(path)
        payload = data.encode() if isinstance(data, str) else data
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        if mode is not None and not 0 <= mode <= 0o1777:
            raise SandboxFileError(
                f"cannot write {target} with mode {mode:#o}: set-user-id and set-group-id bits "
                "are refused in a sandbox (and modes go up to 0o1777)"
            )
        if mode is not None:
            script += f' && chmod {mode:o} -- "$1"'
        r = await self._execute_raw(["/bin/sh", "-c", script, "sh", target], stdin=payload)
        if r.exit_code != 0:
            raise SandboxFileError(
                f"cannot write {target} in the sandbox: {decode(r.stderr).strip()}"
            )

    async def upload(self, source: str | os.PathLike[str], target: str) -> None:
        """Copy a host file or directory into the sandbox at `target` (a directory's contents
        land in `target`). Symlinks in the source are copied as symlinks, never followed.
        Set-user-id and set-group-id bits are dropped: a sandbox cannot set them."""
        src = Path(source)
        if not src.exists() and not src.is_symlink():
            raise SandboxFileError(f"upload source {src} does not exist")
        dest = self._inside(target)
        self._require_running()
        rid = self._next_id()
        name = f"{rid}.tar"
        fd = self._open_channel_file(name)
        try:
            with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
                if src.is_dir() and not src.is_symlink():
                    for child in sorted(src.iterdir()):
                        tar.add(child, arcname=child.name, filter=_without_setid)
                    extract_to = dest
                else:
                    tar.add(src, arcname=os.path.basename(dest), filter=_without_setid)
                    extract_to = os.path.dirname(dest)
            r = await self._execute_raw(
                [
                    "/bin/sh",
                    "-c",
                    'mkdir -p -- "$1" && tar -x --no-same-owner -C "$1" -f "$2"',
                    "sh",
                    extract_to,
                    f"{IO_DIR}/{name}",
                ]
            )
        finally:
            self._unlink_channel(name)
        if r.exit_code != 0:
            raise SandboxFileError(f"cannot upload {src} to {dest}: {decode(r.stderr).strip()}")

    # ---------------------------------------------------------------- sessions

    async def create_session(self, name: str = "default", **kwargs: Any) -> ShellSession:
        """Start a persistent interactive bash (its own pty) and return its ShellSession."""
        if name in self._sessions:
            raise SessionError(f"session {name!r} already exists in sandbox {self.id}")
        self._require_running()
        session = ShellSession(self, name, **kwargs)
        self._sessions[name] = session
        try:
            await session._start()
        except BaseException:
            self._sessions.pop(name, None)
            session._close()
            raise
        return session

    def session(self, name: str = "default") -> ShellSession:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionError(f"no session {name!r} in sandbox {self.id}") from None

    @property
    def sessions(self) -> list[str]:
        return list(self._sessions)

    async def close_session(self, name: str) -> None:
        session = self._sessions.pop(name, None)
        if session is None:
            raise SessionError(f"no session {name!r} in sandbox {self.id}")
        session._close()


def _is_dir(path: Path) -> bool:
    """A real directory (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


_system_layers: dict[tuple[Path, tuple[int, int] | None], Path] = {}
_system_lock = threading.Lock()


def _system_layer(process_dir: Path, owner: tuple[int, int] | None) -> Path:
    with _system_lock:
        key = (process_dir, owner)
        if key not in _system_layers:
            name = "system" if owner is None else f"system-{owner[0]}"
            _system_layers[key] = build_system_layer(process_dir / name, owner)
        return _system_layers[key]


def _without_setid(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mode &= ~(stat.S_ISUID | stat.S_ISGID)
    return info


def _drain_into(fd: int, sink: CappedOutput) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            return
        if not chunk:
            return
        sink.write(chunk)


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) < 200 else text[:200] + "..."


# The upper-layer watchdog: pauses between scans, and how deep it follows directories (one
# descriptor per level is held while scanning; deeper nesting stops the sandbox, as it would
# otherwise hide what lies below from the count).
_SCAN_MIN_PAUSE = 0.25
_SCAN_MAX_PAUSE = 1.0
_SCAN_MAX_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@functools.cache
def _scan_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads of their own for upper-layer scans: a slow scan must not hold up the default
    executor, which sandbox starts use."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="minisandbox-upper-scan")


@dataclasses.dataclass
class _Usage:
    bytes: int = 0
    inodes: int = 0
    breach: str | None = None  # "bytes", "inodes" or "depth": the scan stopped there


class _StopScan(Exception):
    pass


def _disk_usage(
    roots: Sequence[Path], max_bytes: int | None = None, max_inodes: int | None = None
) -> _Usage:
    """Bytes allocated (blocks) and inodes under `roots`, stopping as soon as either passes its
    cap. Walks by directory descriptors and never follows a symlink; a file with several hard
    links counts once. A directory that its owner made unreadable (mode 000, the sandbox's
    own right) is opened after lending its owner rwx for that instant; a vanished one counts
    as nothing.

    Raises:
        OSError: a directory could not be opened for another reason (e.g. out of descriptors).
    """
    usage = _Usage()
    linked: set[tuple[int, int]] = set()

    def count(st: os.stat_result) -> None:
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in linked:
                return
            linked.add(key)
        usage.inodes += 1
        usage.bytes += st.st_blocks * 512
        if max_inodes is not None and usage.inodes > max_inodes:
            usage.breach = "inodes"
        elif max_bytes is not None and usage.bytes > max_bytes:
            usage.breach = "bytes"
        if usage.breach:
            raise _StopScan

    def visit(fd: int, depth: int) -> None:
        subdirs = []
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                count(st)
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
        for name in subdirs:
            child = _open_scan_dir(fd, name)
            if child < 0:
                continue
            try:
                if depth >= _SCAN_MAX_DEPTH:
                    usage.breach = "depth"
                    raise _StopScan
                visit(child, depth + 1)
            finally:
                os.close(child)

    for root in roots:
        try:
            fd = os.open(root, _DIR_FLAGS)
        except FileNotFoundError:
            continue
        try:
            visit(fd, 1)
        except _StopScan:
            return usage
        finally:
            os.close(fd)
    return usage


def _open_scan_dir(parent: int, name: str) -> int:
    """A descriptor of the directory `name` in `parent`, or -1 if it is gone or was replaced
    by something else (the next scan sees what it became)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError):
        return -1
    except OSError as e:
        if e.errno == errno.ELOOP:
            return -1
        if e.errno != errno.EACCES:
            raise
    # Unreadable to us, its owner (a root caller is never refused): opened with its mode
    # given back at once.
    return safefs.open_dir_as_owner(parent, name, restore=True)


def _breach_message(
    sandbox_id: str, usage: _Usage, max_bytes: int | None, max_inodes: int | None
) -> str:
    if usage.breach == "inodes":
        return (
            f"sandbox {sandbox_id} created more than {max_inodes} files and directories in its "
            f"upper layer (Limits.upper_inodes={max_inodes}); it was stopped. Raise "
            "Limits.upper_inodes to allow more"
        )
    if usage.breach == "depth":
        return (
            f"sandbox {sandbox_id} nested directories more than {_SCAN_MAX_DEPTH} deep in its "
            "upper layer, deeper than its size watchdog measures; it was stopped"
        )
    return (
        f"sandbox {sandbox_id} wrote more than {max_bytes} bytes to its upper layer "
        f"(Limits.upper_bytes={max_bytes}); it was stopped. Raise Limits.upper_bytes to allow more"
    )


def _min_set(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _check_total_memory(total_memory_bytes: int | None) -> None:
    """Refuse a whole-sandbox memory cap that nothing would enforce.

    Raises:
        SandboxConfigError: `total_memory_bytes` is set and no delegated cgroup v2 is usable.
    """
    if total_memory_bytes is not None and delegated_parent() is None:
        raise SandboxConfigError(
            f"Limits.total_memory_bytes={total_memory_bytes} cannot be enforced: it needs a "
            f"delegated cgroup v2 with the memory and pids controllers, and uid {os.geteuid()} "
            "has none here. Unset it (the per-process Limits.memory_bytes still applies), or "
            "delegate a cgroup v2 directory and name it in MINISANDBOX_CGROUP"
        )


def _proc_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot): with the pid, it names one
    process; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return data[data.rfind(b")") + 2 :].split()[19].decode()
    except (OSError, IndexError):
        return None


def _work_dir_name(upper: Path, sandbox_id: str) -> str:
    """The overlay work directory of a kept `upper`, beside it: `.<upper>.work-p<pid>-<start
    time>-<sandbox id>`, so that a later start can tell whether its owner still runs."""
    return f".{upper.name}.work-p{os.getpid()}-{_proc_start(os.getpid())}-{sandbox_id}"


def _sweep_dead_work_dirs(upper: Path) -> None:
    """Remove the work directories beside `upper` whose owner process is gone (killed before
    its janitor could remove them, or the janitor was killed too). Only our own directories,
    named as `_work_dir_name` names them; a live owner's (same pid and start time) is kept."""
    prefix = f".{upper.name}.work-p"
    try:
        names = [n for n in os.listdir(upper.parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid, _, rest = name[len(prefix) :].partition("-")
        start, _, _sandbox = rest.partition("-")
        if not pid.isdigit() or not start.isdigit():
            continue
        if _proc_start(int(pid)) == start:
            continue  # its owner still runs
        path = upper.parent / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            with contextlib.suppress(OSError):
                safefs.remove_tree(path)
