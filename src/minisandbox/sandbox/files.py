"""Files inside a sandbox: read, written and unpacked by processes inside, never by the host.

Reads, writes and uploads run in the sandbox (sh, stat, head, cat, tar from helpers/), so
whatever symlinks or `..` a path holds, it resolves inside the sandbox and cannot reach a host
file. A read is bounded: sandbox content is untrusted, and an uncapped read of a link to
/dev/zero would fill the host's memory; only regular files are read, and never more than the
cap plus one byte. An upload is a tar archive written to the channel directory by the host (new
file, no symlinks followed) and unpacked inside; set-id bits are dropped from it.

A failure is a SandboxFileError whose `errno` names its cause where it is known (the helpers'
exit statuses, see CAUSES).
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from pathlib import Path

from minisandbox.errors import SandboxFileError
from minisandbox.sandbox.channel import ChannelDir, new_id
from minisandbox.sandbox.commands import CommandExecutor, RawResult
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.output import decode
from minisandbox.sandbox.scripts import file_helper

# What read_file reads at most unless told otherwise.
READ_MAX_BYTES = 64 * 1024 * 1024
# read_file.sh's own statuses: a directory; another file that is not a regular one.
_READ_DIRECTORY, _READ_NOT_REGULAR = 3, 4
# The statuses of helpers/fail.sh's `fail`, by the cause it read in a tool's message.
CAUSES = {
    65: errno.ENOENT,
    66: errno.EACCES,
    67: errno.EISDIR,
    68: errno.ENOTDIR,
    69: errno.ELOOP,
    70: errno.EROFS,
    71: errno.ENOSPC,
    72: errno.ENAMETOOLONG,
    73: errno.EEXIST,
}


class FileOperations:
    """The file half of Sandbox's API (a mixin): what it needs of the sandbox is its config
    and `_commands()`, the runner of a running sandbox."""

    config: SandboxConfig

    def _commands(self) -> CommandExecutor:
        """The command runner, once the sandbox is checked to be running.

        Raises:
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
        """
        raise NotImplementedError

    def _inside(self, path: str) -> str:
        return inside(self.config.workdir, path)

    async def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        """Bytes of a regular file inside the sandbox (read by a process inside: host files are
        out of reach, whatever symlinks or `..` the path holds). A relative path is relative
        to the workdir.

        Raises:
            SandboxFileError: the file is missing or unreadable, is not a regular file once
                symlinks are resolved inside (a directory, a FIFO, a device such as a link to
                /dev/zero), or holds more than `max_bytes` bytes (never silently truncated).
                Its `errno` names the cause where known: ENOENT, EACCES, EISDIR, ENOTDIR,
                ELOOP, EFBIG (over the cap), EINVAL (a bad `max_bytes` or a NUL in the path).
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
            CommandTimeoutError: the read ran past `Limits.command_timeout`.
        """
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise SandboxFileError(
                f"read_file: max_bytes must be a byte count, not {max_bytes!r}", errno.EINVAL
            )
        target = self._inside(path)
        return await _read(self._commands(), target, max_bytes)

    async def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str:
        """`read_file` decoded (same checks and cap).

        Raises:
            SandboxFileError, SandboxNotRunningError, SandboxLimitError, CommandTimeoutError:
                as read_file.
        """
        return (await self.read_file(path, max_bytes=max_bytes)).decode(encoding, errors)

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """Create or replace a file inside the sandbox, creating its parent directories (a
        process inside writes it). `mode` is set when given (at most 0o1777).

        Raises:
            SandboxFileError: the file cannot be written; its `errno` names the cause where
                known (EACCES, EISDIR, ENOTDIR, EEXIST (a parent is a file), EROFS, ENOSPC,
                EINVAL: a set-id `mode` or a NUL in the path).
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
            CommandTimeoutError: the write ran past `Limits.command_timeout`.
        """
        target = self._inside(path)
        payload = data.encode() if isinstance(data, str) else data
        _check_mode(target, mode)
        await _write(self._commands(), target, payload, mode)

    async def upload(self, source: str | os.PathLike[str], target: str) -> None:
        """Copy a host file or directory into the sandbox at `target` (a directory's contents
        land in `target`). Symlinks in the source are copied as symlinks, never followed.
        Set-user-id and set-group-id bits are dropped: a sandbox cannot set them.

        Raises:
            SandboxFileError: the source does not exist (ENOENT), or unpacking it inside
                failed (its `errno` names the cause where known).
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
            CommandTimeoutError: unpacking ran past `Limits.command_timeout`.
            OSError: a host file of the source cannot be read.
        """
        src = Path(source)
        if not src.exists() and not src.is_symlink():
            raise SandboxFileError(f"upload source {src} does not exist", errno.ENOENT)
        dest = self._inside(target)
        await _upload(self._commands(), src, dest)


def inside(workdir: str, path: str) -> str:
    """`path` (relative to `workdir`) as an absolute, normalised path inside the sandbox.

    Raises:
        SandboxFileError: (EINVAL) the path holds a NUL byte.
    """
    if "\0" in path:
        raise SandboxFileError(f"path {path!r} contains a NUL byte", errno.EINVAL)
    return os.path.normpath(os.path.join(workdir, path))


def _failure(r: RawResult) -> tuple[str, int | None]:
    """What the helper said went wrong, and its errno when known."""
    return decode(r.stderr).strip(), CAUSES.get(r.exit_code)


async def _read(runner: CommandExecutor, target: str, max_bytes: int) -> bytes:
    # The cap on what we collect bounds our memory whatever runs inside.
    r = await runner.run(
        ["/bin/sh", "-c", file_helper("read_file.sh"), "sh", target, str(max_bytes + 1)],
        max_output=max(max_bytes + 1, 64 * 1024),
    )
    if r.exit_code == 0 and not r.truncated and len(r.stdout) <= max_bytes:
        return r.stdout
    why, code = _failure(r)
    if r.exit_code == 0:
        why = (
            f"it holds more than {max_bytes} bytes (the cap of read_file; pass a larger "
            "max_bytes to read it)"
        )
        code = errno.EFBIG
    elif r.exit_code == _READ_DIRECTORY:
        why, code = "Is a directory", errno.EISDIR
    elif r.exit_code == _READ_NOT_REGULAR:
        kind = why.splitlines()[0][:80] if why else "special file"
        why = f"it is a {kind}, not a regular file (after resolving symlinks inside)"
    raise SandboxFileError(f"cannot read {target} in the sandbox: {why}", code)


def _check_mode(target: str, mode: int | None) -> None:
    """Refuse a file mode that a sandbox cannot set.

    Raises:
        SandboxFileError: (EINVAL) `mode` has set-id bits or is out of range.
    """
    if mode is not None and not 0 <= mode <= 0o1777:
        raise SandboxFileError(
            f"cannot write {target} with mode {mode:#o}: set-user-id and set-group-id bits "
            "are refused in a sandbox (and modes go up to 0o1777)",
            errno.EINVAL,
        )


async def _write(runner: CommandExecutor, target: str, data: bytes, mode: int | None) -> None:
    argv = ["/bin/sh", "-c", file_helper("write_file.sh"), "sh", target]
    if mode is not None:
        argv.append(f"{mode:o}")
    r = await runner.run(argv, stdin=data)
    if r.exit_code != 0:
        why, code = _failure(r)
        raise SandboxFileError(f"cannot write {target} in the sandbox: {why}", code)


async def _upload(runner: CommandExecutor, source: Path, dest: str) -> None:
    name = f"{new_id()}.tar"
    files = runner.files
    fd = files.create(name)
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
            if source.is_dir() and not source.is_symlink():
                for child in sorted(source.iterdir()):
                    tar.add(child, arcname=child.name, filter=_without_setid)
                extract_to = dest
            else:
                tar.add(source, arcname=os.path.basename(dest), filter=_without_setid)
                extract_to = os.path.dirname(dest)
        argv = ["/bin/sh", "-c", file_helper("extract_tar.sh"), "sh", extract_to]
        r = await runner.run([*argv, ChannelDir.inside(name)])
    finally:
        files.unlink(name)
    if r.exit_code != 0:
        why, code = _failure(r)
        raise SandboxFileError(f"cannot upload {source} to {dest}: {why}", code)


def _without_setid(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mode &= ~(stat.S_ISUID | stat.S_ISGID)
    return info
