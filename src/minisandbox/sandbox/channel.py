"""The control channel between the host and a sandbox's control shell.

The control shell (helpers/control.sh, the command bwrap runs) evaluates each line the host
writes to its stdin, and answers on its stdout, one reply a line:

    R               the shell is ready (once, first)
    P <id> <pid>    job <id> started, as process <pid> (a pid inside the sandbox)
    X <id> <code>   job <id> exited with status <code>

Job ids are random, not sequential: a process left in the sandbox should not guess the next
one. A reply that names a job but does not parse (a status that is not a number) fails that
job's waiter with ControlProtocolError; it is never read as a success. A line that names no
waiting job is logged and dropped. When the channel closes (the shell exited, or the host
stopped reading), every waiter left fails with the reason its owner gives.

Nothing else in the sandbox may read the requests or write replies: the control lines travel
through two FIFOs of the channel directory that the shell opens as it starts, before any other
process of the sandbox exists, and whose names the host removes once it is ready; the shell is
a copy of the host's bash that the sandbox may execute but not read, which makes it (and its
forks) not dumpable, so no process in the sandbox can open its descriptors or memory through
/proc (`control_shell`). bwrap's own processes get /dev/null instead.

Data other than control lines goes through the channel directory (IO_DIR inside): FIFOs for
output, files for input. It is read-only inside, and cannot be listed there (mode 0300), so the
sandbox cannot plant, swap or remove anything in it, nor find another command's FIFO; even so,
the host creates and opens them only relative to a descriptor of that directory, never
following a symlink and never opening an existing file for writing.

Every control line is built here, `env_words` being the one quoting of environment variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shlex
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from minisandbox.errors import (
    ControlProtocolError,
    InvalidCommandError,
    SandboxFileError,
    SandboxNotRunningError,
)
from minisandbox.sandbox import procs
from minisandbox.sandbox.rootfs import IO_DIR
from minisandbox.utils.aio import cancel_and_wait

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?[0-9]+")
_EXPORTABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Variables bash keeps for itself (read-only, reset or acted on when assigned): env(1) sets them.
_BASH_OWN = frozenset(
    {
        "_",
        "DIRSTACK",
        "EPOCHREALTIME",
        "EPOCHSECONDS",
        "EUID",
        "FUNCNAME",
        "GROUPS",
        "HISTCMD",
        "IFS",
        "LINENO",
        "OLDPWD",
        "OPTARG",
        "OPTERR",
        "OPTIND",
        "POSIXLY_CORRECT",
        "PIPESTATUS",
        "PPID",
        "PS4",
        "PWD",
        "RANDOM",
        "SECONDS",
        "SHELLOPTS",
        "SHLVL",
        "SRANDOM",
        "TMOUT",
        "UID",
    }
)
_READY = "R"
# The control FIFOs in the channel directory, while the shell starts.
CONTROL_IN = "control.in"
CONTROL_OUT = "control.out"
# The control shell's executable in the channel directory (see `control_shell`).
CONTROL_SHELL = "control-sh"


def new_id() -> str:
    """A fresh job or file id: random, so that nothing inside can guess the next one."""
    return secrets.token_hex(6)


def quote(word: str) -> str:
    """`word` as one word for the control shell (bash), on one line: a newline is spelled
    `$'\\n'` (no variable of the shell's, which a command's environment could replace)."""
    return shlex.quote(word).replace("\n", "'$'\\n''")


def env_words(env: Mapping[str, str]) -> str:
    """`NAME=value` operands for env(1), each quoted as one word for the control shell.

    Raises:
        InvalidCommandError: a name is empty or holds `=` or a NUL byte, or a value holds a
            NUL byte.
    """
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise InvalidCommandError(
                f"environment variable {name!r}: a name must be non-empty without '=' or NUL "
                "bytes, and a value cannot contain NUL bytes"
            )
    return " ".join(quote(f"{name}={value}") for name, value in env.items())


def env_setup(env: Mapping[str, str]) -> tuple[str, str]:
    """How a command gets `env`: an `export ...;` for the control shell's subshell (no exec)
    and env(1) words to put before the command for the names bash would not pass through
    (not a plain name, or one bash sets, refuses or acts on: BASH*, UID, SHELLOPTS, IFS, ...).
    Either may be empty.

    Raises:
        InvalidCommandError: as env_words.
    """
    env_words(env)  # the checks
    plain = {
        k: v
        for k, v in env.items()
        if _EXPORTABLE.match(k) and k not in _BASH_OWN and not k.startswith("BASH")
    }
    rest = {k: v for k, v in env.items() if k not in plain}
    exports = f"export {env_words(plain)}; " if plain else ""
    return exports, (f"/usr/bin/env {env_words(rest)} " if rest else "")


class ChannelDir:
    """The host's side of a sandbox's channel directory (IO_DIR inside).

    Every operation is relative to a descriptor of the directory and refuses symlinks: the
    sandbox can write to the directory too. `owner` (uid, gid), when given, becomes the owner
    of what is created (a root caller's sandbox runs as another uid)."""

    def __init__(self, path: Path, owner: tuple[int, int] | None = None) -> None:
        self.path = path
        self._owner = owner
        # O_PATH: the directory is not readable (not listable inside); *at calls still work.
        self._fd: int | None = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    @staticmethod
    def inside(name: str) -> str:
        """The path of channel file `name` as the sandbox sees it."""
        return f"{IO_DIR}/{name}"

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _dir_fd(self) -> int:
        if self._fd is None:
            raise SandboxNotRunningError(f"the channel directory {self.path} is closed")
        return self._fd

    def mkfifo(self, name: str) -> int:
        """Create FIFO `name` and open its read end (non-blocking), which also holds a write
        end (O_RDWR): the FIFO never shows end-of-file, so a poller is not woken at every turn
        of the event loop from the moment the command's last writer closes it until its exit
        status comes (that busy wait took a core from the sandbox). The end of the output is
        the exit status; what is left in the FIFO then is read until it is empty.

        Raises:
            SandboxFileError: something else took its place before it was opened.
            SandboxNotRunningError: the directory is closed (the sandbox stopped).
        """
        fd = self._dir_fd()
        os.mkfifo(name, 0o600, dir_fd=fd)
        if self._owner is not None:
            os.chown(name, *self._owner, dir_fd=fd, follow_symlinks=False)
        rfd = os.open(name, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        if not stat.S_ISFIFO(os.fstat(rfd).st_mode):
            os.close(rfd)
            raise SandboxFileError(f"channel file {name} in {self.path} was replaced")
        return rfd

    def control_fifos(self) -> ControlFifos:
        """Create the control shell's request and reply FIFOs (CONTROL_IN, CONTROL_OUT) and
        open the host's ends, with a spare end of each so that neither open nor read waits
        for the shell (`ControlFifos.seal` drops them once it has opened its own).

        Raises:
            SandboxNotRunningError: the directory is closed.
        """
        fd = self._dir_fd()
        opened: list[int] = []
        try:
            for name in (CONTROL_IN, CONTROL_OUT):
                os.mkfifo(name, 0o600, dir_fd=fd)
                if self._owner is not None:
                    os.chown(name, *self._owner, dir_fd=fd, follow_symlinks=False)
            flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
            for name, mode in (
                (CONTROL_IN, os.O_RDONLY),  # spare reader: lets the write end open now
                (CONTROL_IN, os.O_WRONLY),
                (CONTROL_OUT, os.O_RDONLY),
                (CONTROL_OUT, os.O_WRONLY),  # spare writer: no end of file before the shell
            ):
                opened.append(os.open(name, mode | flags, dir_fd=fd))
        except BaseException:
            for f in opened:
                os.close(f)
            raise
        spare_in, request, reply, spare_out = opened
        return ControlFifos(self, request, reply, [spare_in, spare_out])

    def create(self, name: str) -> int:
        """Create the new regular file `name` for writing (never an existing one): its fd.

        Raises:
            FileExistsError: `name` exists (the sandbox may have made it).
            SandboxNotRunningError: the directory is closed (the sandbox stopped).
        """
        dir_fd = self._dir_fd()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        if self._owner is not None:
            os.fchown(fd, *self._owner)
        return fd

    def write(self, name: str, data: bytes) -> None:
        """Create the new file `name` holding `data`.

        Raises:
            FileExistsError: `name` exists (the sandbox may have made it).
            SandboxNotRunningError: the directory is closed (the sandbox stopped).
        """
        with os.fdopen(self.create(name), "wb") as f:
            f.write(data)

    def unlink(self, *names: str) -> None:
        """Remove channel files; those already gone, or a closed directory, are no error."""
        if self._fd is None:
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclasses.dataclass
class ControlFifos:
    """The host's ends of the control FIFOs: `request` (written), `reply` (read)."""

    files: ChannelDir
    request: int
    reply: int
    spares: list[int]
    taken: bool = False

    def seal(self) -> None:
        """Once the shell has opened its ends (it replied): drop the spare ends, so that the
        reply FIFO ends when the shell does, and remove the names, so that no later process
        in the sandbox can open either FIFO. Idempotent."""
        for fd in self.spares:
            os.close(fd)
        self.spares = []
        self.files.unlink(CONTROL_IN, CONTROL_OUT)

    async def streams(self, limit: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The reply and request ends as streams (they take over the descriptors)."""
        loop = asyncio.get_running_loop()
        self.taken = True
        reader = asyncio.StreamReader(limit=limit)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(self.reply, "rb", 0)
        )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(self.request, "wb", 0)
        )
        return reader, asyncio.StreamWriter(transport, protocol, None, loop)

    def close(self) -> None:
        """Close what `streams` did not take over (a start that failed first)."""
        for fd in [*self.spares, *(() if self.taken else (self.request, self.reply))]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.spares = []


@dataclasses.dataclass(frozen=True)
class Job:
    """Something the control shell was asked to start, and the replies it will send."""

    id: str
    started: asyncio.Future[int]  # its pid inside the sandbox (the P reply)
    exited: asyncio.Future[int] | None  # its exit status (the X reply); None: not reported


class ControlChannel:
    """The host's end of a control shell: sends control lines, reads the replies.

    `reader` is the shell's stdout, `writer` its stdin, `files` the sandbox's channel
    directory. `on_close()` is called once when the replies end, and returns the exception
    that the waiters left get (by default SandboxNotRunningError).

    Usage: `start()` (begins reading), `await ready()`, then `start_command`,
    `start_on_terminal`, `kill_group`, `send`; `forget(job)` once a job's replies are of no
    more interest; `await close()` at the end."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        files: ChannelDir,
        *,
        on_close: Callable[[], BaseException] | None = None,
    ) -> None:
        self.files = files
        self._reader = reader
        self._writer = writer
        self._on_close = on_close
        self._started: dict[str, asyncio.Future[int]] = {}
        self._exited: dict[str, asyncio.Future[int]] = {}
        self._ready: asyncio.Future[int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed: BaseException | None = None
        self._dropped_overlong = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Begin reading replies (once), in a task of the running loop."""
        if self._task is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._started[_READY] = self._ready
            self._task = asyncio.create_task(self._read())

    async def ready(self) -> None:
        """Wait for the shell's first reply (bound it with a timeout).

        Raises:
            SandboxNotRunningError: (or `on_close`'s exception) the channel closed first.
        """
        if self._ready is None:
            raise SandboxNotRunningError("the control channel was not started")
        await self._ready

    @property
    def closed(self) -> bool:
        """No more replies will come (the shell exited, or `close()` was called)."""
        return self._closed is not None

    async def close(self) -> None:
        """Stop reading replies; the waiters left fail. Idempotent."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait([task])
        if self._closed is None:  # never started
            self._fail_waiters()

    # ---------------------------------------------------------------- requests

    def send(self, line: str) -> None:
        """Have the control shell evaluate `line`, one line built with `quote`.

        Raises:
            SandboxNotRunningError: the channel is closed.
        """
        if self._closed is not None:
            raise SandboxNotRunningError(f"the control channel is closed: {self._closed}")
        if "\n" in line:  # a bug here, not the caller's: every word goes through quote()
            raise InvalidCommandError(f"a control line must be one line: {line[:200]!r}")
        self._writer.write(line.encode() + b"\n")

    def _expect(self, exits: bool) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(new_id(), loop.create_future(), loop.create_future() if exits else None)
        self._started[job.id] = job.started
        if job.exited is not None:
            self._exited[job.id] = job.exited
        return job

    def _submit(self, job: Job, line: str) -> Job:
        try:
            self.send(line)
        except BaseException:
            self.forget(job)
            raise
        return job

    def start_command(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        mark: str,
        stdin: str,
        stdout: str,
        stderr: str | None,
    ) -> Job:
        """Start `argv` in the background, in a process group of its own, from `cwd`, with
        `env` added to the shell's environment and the marker `mark` (procs.MARKER_VAR) first
        in it. Its streams are the paths inside `stdin`, `stdout` and `stderr` (None: into
        stdout). The job reports its pid and its exit status; an unusable `cwd` is status 126.

        Raises:
            InvalidCommandError: a variable's name or value cannot be passed (see env_words).
            SandboxNotRunningError: the channel is closed.
        """
        exports, via_env = env_setup({procs.MARKER_VAR: mark, **env})
        job = self._expect(exits=True)
        err = "2>&1" if stderr is None else f"2>{quote(stderr)}"
        command = " ".join(quote(a) for a in argv)
        # A waiter in the background starts the command with job control on (set -m): in a
        # process group of its own, SIGINT and SIGQUIT at their defaults (a background job
        # without job control ignores them). So `kill 0` or Ctrl-C in the command reaches
        # neither the waiter nor the control shell, and the only exec is the command's own.
        # Job control goes off again before `wait`, which then waits for the end, not a stop.
        # The job's fd 9 is closed: only the shell answers on it.
        line = (
            f"{{ set -m; {{ trap - INT QUIT; cd -- {quote(cwd)} || exit 126; exec 9>&-; "
            f"{exports}exec {via_env}{command}; }} "
            f"<{quote(stdin)} >{quote(stdout)} {err} & "
            f'p=$!; set +m; echo "P {job.id} $p" >&9; wait $p; echo "X {job.id} $?" >&9; '
            "} 2>/dev/null &"
        )
        return self._submit(job, line)

    def start_on_terminal(
        self, argv: Sequence[str], *, env: Mapping[str, str], terminal: str
    ) -> Job:
        """Start `argv` as the leader of a new session whose controlling terminal is
        `terminal` (a path inside, such as /dev/pts/3), with `env` added. Reports its pid
        only (`exited` is None): the end of such a process shows on its terminal.

        Raises:
            InvalidCommandError: a variable's name or value cannot be passed (see env_words).
            SandboxNotRunningError: the channel is closed.
        """
        exports, via_env = env_setup(env)
        job = self._expect(exits=False)
        command = " ".join(quote(a) for a in argv)
        line = (
            f"{{ trap - INT QUIT; {exports}exec /usr/bin/setsid -c {via_env}{command}; }} "
            f'<>{quote(terminal)} >&0 2>&0 9>&- & echo "P {job.id} $!" >&9'
        )
        return self._submit(job, line)

    def kill_group(self, pid: int) -> None:
        """SIGKILL the process group of `pid` (a pid inside) and its session if it leads one,
        from inside.

        Raises:
            SandboxNotRunningError: the channel is closed.
        """
        # pkill by its full path, without the channel's FIFOs: PATH may lead into the sandbox.
        self.send(
            f"kill -KILL -- -{int(pid)} 2>/dev/null; "
            f"/usr/bin/pkill -KILL -s {int(pid)} </dev/null 2>/dev/null 9>&-"
        )

    def forget(self, job: Job) -> None:
        """Drop the waiters of `job`: replies still to come for it are ignored."""
        for table, fut in ((self._started, job.started), (self._exited, job.exited)):
            if fut is None:
                continue
            if table.get(job.id) is fut:
                del table[job.id]
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: an error nobody awaited is not logged

    # ---------------------------------------------------------------- replies

    async def _read(self) -> None:
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # longer than the reader's limit: not one of ours
                    if not self._dropped_overlong:  # once: the sandbox can write many
                        logger.warning("dropped an overlong line on a control channel")
                    self._dropped_overlong = True
                    continue
                if not line:
                    return
                self._dispatch(line)
        finally:
            self._fail_waiters()

    def _dispatch(self, raw: bytes) -> None:
        parts = raw.decode(errors="replace").split()
        if not parts:
            return
        if parts == [_READY]:
            self._resolve(self._started, _READY, None, raw)
            return
        kind, rest = parts[0], parts[1:]
        if kind not in ("P", "X") or not rest:
            logger.warning("dropped a control reply that names no job: %r", raw[:200])
            return
        table = self._exited if kind == "X" else self._started
        self._resolve(table, rest[0], rest[1:], raw)

    def _resolve(
        self, table: dict[str, asyncio.Future[int]], key: str, values: list[str] | None, raw: bytes
    ) -> None:
        fut = table.pop(key, None)
        if fut is None or fut.done():
            if fut is None:
                logger.debug("dropped a control reply for no waiting job: %r", raw[:200])
            return
        if values is None:
            fut.set_result(0)
        elif len(values) == 1 and _NUMBER.fullmatch(values[0]):
            fut.set_result(int(values[0]))
        else:
            fut.set_exception(
                ControlProtocolError(f"malformed control reply {raw[:200]!r}: expected one number")
            )

    def _fail_waiters(self) -> None:
        reason: BaseException | None = None
        if self._on_close is not None:
            with contextlib.suppress(Exception):
                reason = self._on_close()
        if reason is None:
            reason = SandboxNotRunningError("the control channel closed")
        self._closed = reason
        for fut in [*self._exited.values(), *self._started.values()]:
            if not fut.done():
                fut.set_exception(reason)
        self._exited.clear()
        self._started.clear()
