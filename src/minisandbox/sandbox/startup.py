"""Starting a sandbox's bwrap: checks first, the command line, then the user namespace's maps
and the limits of its pid 1.

bwrap is started with --userns-block-fd: it waits, in its new user namespace, until the host has
written the namespace's uid and gid maps and set the rlimits of its pid 1 (`setup_userns`), so
that nothing of the sandbox runs before they hold. RLIMIT_NPROC is set after the namespace
exists: it then counts the processes of this sandbox only, not every process of the caller's uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import stat
import threading
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TypeVar

from minisandbox.errors import SandboxStartError
from minisandbox.sandbox import runtime, uiddrop
from minisandbox.sandbox.bwrap import check_userns, find_bwrap
from minisandbox.sandbox.channel import CONTROL_IN, CONTROL_OUT, CONTROL_SHELL
from minisandbox.sandbox.config import Limits, SandboxConfig
from minisandbox.sandbox.egress import proxy_env
from minisandbox.sandbox.rootfs import (
    DEFAULT_PATH,
    IO_DIR,
    MountPlan,
    build_system_layer,
    system_layer_key,
)
from minisandbox.sandbox.scripts import helper

T = TypeVar("T")

# Where the host tools sandboxes rely on are looked up (the file helpers' PATH, helpers/fail.sh:
# /usr is read-only inside, so nothing in the sandbox can replace them).
HOST_TOOLS_PATH = "/usr/bin:/bin"
# How long bwrap may take to set a sandbox up (its info, then the control shell's first reply).
START_TIMEOUT = 30.0


def preflight(config: SandboxConfig, as_root: bool) -> Path:
    """Everything a start needs from the host, checked before anything is created: the bwrap
    to run.

    Raises:
        BwrapNotFoundError: no usable bwrap.
        UserNamespacesUnavailableError: the kernel refuses unprivileged user namespaces.
        SandboxStartError: a host tool the sandbox relies on is missing.
    """
    bwrap = find_bwrap(config.bwrap)
    check_userns()
    needs_setpriv = as_root and not uiddrop.supported()
    for tool in ("bash", "setsid", "cat", "tar") + (("setpriv",) if needs_setpriv else ()):
        if tool in _found_tools:  # once per process: a tool removed later fails the start anyway
            continue
        if shutil.which(tool, path=HOST_TOOLS_PATH) is None:
            raise SandboxStartError(f"the host has no `{tool}` in /usr/bin or /bin; install it")
        _found_tools.add(tool)
    return bwrap


_found_tools: set[str] = set()


_system_layers: dict[tuple[Path, tuple[int, int] | None], Path] = {}
_system_lock = threading.Lock()


def system_layer(root: Path, owner: tuple[int, int] | None) -> Path:
    """The lowest layer of every sandbox (rootfs.build_system_layer), made once per node and
    kept in the caller's private runtime directory `root` (mode 700, checked), under a name
    that is the key of the host files it copies: a CLI process finds it made (a copy of some
    700 /etc entries costs 0.2 s), and a change to those files names a new one. Looked up
    once per process."""
    with _system_lock:
        key = (root, owner)
        if key not in _system_layers:
            path = root / f"node-system-{system_layer_key(owner)[:32]}"
            if not _usable_layer(path, owner):
                build_system_layer(path, owner)
            _system_layers[key] = path
        return _system_layers[key]


def forget_system_layers() -> None:
    """Look the system layer up again at the next start (a long-lived process that forks
    workers refreshes it between them)."""
    with _system_lock:
        _system_layers.clear()


def _usable_layer(path: Path, owner: tuple[int, int] | None) -> bool:
    """A directory made as build_system_layer makes it: owned by us, or by `owner` (a root
    caller's sandbox uid). Nobody else can have put it there: `root` is private."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    uid = os.geteuid() if owner is None else owner[0]
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


_control_shells: dict[Path, Path] = {}


def control_shell(process_dir: Path) -> Path:
    """The control shell's executable, made once per process: a copy of the host's bash (the
    one bound inside: with job control, bash starts each command in a process group of its own
    with the default SIGINT and SIGQUIT, no exec of setsid or env in between; see
    channel.start_command) that nobody may read, only execute. A process that executes a file
    it cannot read is not dumpable (nor are its forks, until they execute something else): no
    other process of the sandbox's uid may open its /proc descriptors or memory, so nothing in
    the sandbox can read the host's requests or forge the replies. (A root caller's shell too:
    its exec by the sandbox's uid, which may not read the file, is what keeps it so.)"""
    with _system_lock:
        if process_dir not in _control_shells:
            path = process_dir / "control-sh"
            staging = process_dir / "control-sh.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            bash = shutil.which("bash", path=HOST_TOOLS_PATH)
            if bash is None:
                raise SandboxStartError("the host has no `bash` in /usr/bin or /bin; install it")
            shutil.copyfile(os.path.realpath(bash), staging)
            os.chmod(staging, 0o111)
            os.rename(staging, path)
            _control_shells[process_dir] = path
        return _control_shells[process_dir]


def sandbox_env(config: SandboxConfig) -> dict[str, str]:
    """The environment of everything in the sandbox: a root-like login, then `config.env`."""
    path = DEFAULT_PATH
    env = {
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "HOSTNAME": config.hostname,
    }
    if config.venv:
        path = f"{config.venv}/bin:{path}"
        env["VIRTUAL_ENV"] = config.venv
    env["PATH"] = path
    env.update(config.env)
    if config.egress is not None:  # last: nothing else leads out of its namespace
        env.update(proxy_env(config.egress))
    return env


def pipe_with(data: bytes) -> int:
    """A readable fd holding `data` (small: it must fit in the pipe buffer)."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


def bwrap_argv(
    bwrap: Path,
    config: SandboxConfig,
    plan: MountPlan,
    *,
    as_root: bool,
    info_fd: int,
    block_fd: int,
    seccomp_fd: int,
    data_fds: Sequence[int],
) -> list[str]:
    """bwrap's command line: namespaces, privileges, environment, mounts (`plan`, whose data
    files are read from `data_fds`, in order), then the control shell."""
    args = [str(bwrap), *_namespace_args(config, info_fd, block_fd, seccomp_fd)]
    if as_root:
        # Just what the drop (uiddrop) needs to switch to the mapped uid and empty the
        # bounding set.
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    args.append("--clearenv")
    for k, v in sandbox_env(config).items():
        args += ["--setenv", k, v]
    args += plan.args
    for (dest, _content), fd in zip(plan.data, data_fds, strict=True):
        args += ["--perms", "0644", "--ro-bind-data", str(fd), dest]
    args += ["--chdir", config.workdir, "--"]
    if as_root:
        args += [f"{IO_DIR}/{uiddrop.HELPER_NAME}"] if uiddrop.supported() else uiddrop.SETPRIV_ARGV
    shell = f"{IO_DIR}/{CONTROL_SHELL}"
    fifos = [f"{IO_DIR}/{CONTROL_IN}", f"{IO_DIR}/{CONTROL_OUT}"]
    # -p: no $BASH_ENV file and no functions from the environment (config.env sets it).
    return [*args, shell, "-p", "-c", helper("control.sh"), CONTROL_SHELL, *fifos]


def _namespace_args(
    config: SandboxConfig, info_fd: int, block_fd: int, seccomp_fd: int
) -> list[str]:
    args = [
        "--unshare-user",
        "--userns-block-fd",
        str(block_fd),
        "--info-fd",
        str(info_fd),
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        config.hostname,
        "--die-with-parent",
        # Held by every bwrap process but the command: the janitor's sign that no bwrap
        # of ours may still be setting up (see cleanup).
        "--sync-fd",
        str(runtime.lifeline_fd()),
        "--new-session",
        "--seccomp",
        str(seccomp_fd),
        "--cap-drop",
        "ALL",
    ]
    if not config.network:
        args.append("--unshare-net")
    return args


async def read_child_pid(fd: int) -> int | None:
    """The host pid of the sandbox's pid 1, from bwrap's --info-fd JSON; None when bwrap
    closed it without writing one (it failed)."""
    buf = b""
    while True:
        chunk = await _read_when_ready(fd)
        if not chunk:
            return None
        buf += chunk
        with contextlib.suppress(ValueError):
            info = json.JSONDecoder().raw_decode(buf.decode())[0]
            pid = info.get("child-pid") if isinstance(info, dict) else None
            if not isinstance(pid, int) or pid <= 0:
                raise SandboxStartError(f"bwrap reported no child pid: {buf[:200]!r}")
            return pid


async def _read_when_ready(fd: int) -> bytes:
    """os.read of `fd` once it is readable, waited for on the event loop (not in a thread:
    a thread hop per start costs more than the read)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return os.read(fd, 4096)


def write_id_maps(pid: int, owner: tuple[int, int], as_root: bool) -> None:
    """Write the uid and gid maps that bwrap waits for: the sandbox's uid 0 is `owner`."""
    uid, gid = owner
    if as_root:
        # Host root appears as uid 1 only so that bwrap's own setup can run; nothing in the
        # sandbox can become it (no capabilities, no_new_privs).
        uid_map, gid_map = f"0 {uid} 1\n1 0 1\n", f"0 {gid} 1\n1 0 1\n"
    else:
        uid_map, gid_map = f"0 {uid} 1\n", f"0 {gid} 1\n"
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    if not as_root:
        # Required before an unprivileged gid map. A root caller keeps setgroups() so that
        # the drop (uiddrop) can clear the supplementary groups (host root's group 0) inside.
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def apply_rlimits(pid: int, limits: Limits, as_root: bool) -> None:
    """Set the per-process limits on the sandbox's pid 1 (after its user namespace exists);
    an unprivileged caller cannot go above its own hard limits."""
    wanted = {
        resource.RLIMIT_NPROC: limits.processes,
        resource.RLIMIT_AS: limits.memory_bytes,
        resource.RLIMIT_NOFILE: limits.open_files,
        # One file may not outgrow the upper layer's cap between two watchdog scans.
        resource.RLIMIT_FSIZE: _min_set(limits.file_size_bytes, limits.upper_bytes),
        resource.RLIMIT_CPU: limits.cpu_seconds,
        resource.RLIMIT_CORE: 0,
    }
    for res, value in wanted.items():
        if value is None:
            continue
        _soft, hard = resource.prlimit(pid, res)
        if hard != resource.RLIM_INFINITY and not as_root:
            value = min(value, hard)
        resource.prlimit(pid, res, (value, value))


def _min_set(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


async def within(step: Awaitable[T], what: str) -> T:
    """`step`, bounded by START_TIMEOUT.

    Raises:
        SandboxStartError: it took longer.
    """
    try:
        return await asyncio.wait_for(step, START_TIMEOUT)
    except asyncio.TimeoutError:
        raise SandboxStartError(f"bwrap did not {what} within {START_TIMEOUT} s") from None
