"""A node's pool of unpacked files: each file once per node, whatever the layers that hold it.

Layers unpacked into the node cache hardlink their files from here, so the files that layers
share (a repository's history packs, identical source directories, an environment's packages)
are written once per node and take their space once. A pool file is named by what makes two
copies interchangeable: its content (a blob of the store, or a run of a pack blob: both are
content-addressed), its mode, its mtime and its owner. Same name, same inode.

- A file enters the pool by a hard link of a finished temporary file (`link` fails if another
  process got there first: then theirs is used), so no layer ever sees a half-written file and two
  processes inserting the same content produce one file.
- Pool files are never written after they appear; sandboxes mount layers read-only below their
  overlay, so nothing a sandbox does reaches them.
- A file whose link count is 1 is no longer in any layer: `sweep` removes it.
- A file that has reached the filesystem's link limit is copied instead (the layer gets its own).

Layout of `root`: `ab/<name>` pool files, `tmp/<pid>.<random>` insertions in flight.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from minisandbox.layers.budget import pid_alive

_HEX = frozenset("0123456789abcdef")


def pool_name(content: str, mode: int, mtime: int, owner: tuple[int, int] | None) -> str:
    """The pool name of a file: `content` names its bytes (a blob id, or `<blob>.<offset>.<size>`
    for a run of a pack), then its mode (set-id bits never), mtime and owner."""
    uid, gid = owner if owner is not None else (os.geteuid(), os.getegid())
    mode &= 0o1777
    return f"{content}-{mode:o}-{mtime}-{uid}.{gid}"


class FilePool:
    """Unpacked files of a node, shared by hard links (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def has(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def link_into(self, name: str, dest: str, make: Callable[[int], None]) -> bool:
        """Make `dest` (a new path in a tree the caller is building) a link to the pool file
        `name`, creating that first when absent: `make(fd)` writes its content, owner, mode and
        mtime into a new temporary file, and closes it. Returns True when the pool already had
        it (nothing was written)."""
        final = self.path(name)
        try:
            os.link(final, dest, follow_symlinks=False)
            return True
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.EMLINK:
                raise
            self._copy(final, dest)
            return True
        tmp = self.root / "tmp" / f"{os.getpid()}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            make(fd)  # closes fd
            final.parent.mkdir(exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another process inserted it first
                os.link(tmp, final)
            # Our temporary link keeps the count above 1 until `dest` holds the file, so a
            # concurrent sweep leaves it; a pool file swept before we linked it: ours serves.
            try:
                os.link(final, dest, follow_symlinks=False)
            except FileNotFoundError:
                os.link(tmp, dest, follow_symlinks=False)
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, final)
            except OSError as e:
                if e.errno != errno.EMLINK:
                    raise
                self._copy(final, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return False

    @staticmethod
    def _copy(src: Path, dest: str) -> None:
        st = os.stat(src)
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with open(src, "rb") as f:
                while chunk := f.read(1 << 20):
                    os.write(out, chunk)
            with contextlib.suppress(PermissionError):
                os.fchown(out, st.st_uid, st.st_gid)
            os.fchmod(out, stat.S_IMODE(st.st_mode))
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)

    def sweep(self) -> tuple[int, int]:
        """Remove pool files no layer holds (link count 1) and dead processes' temporaries;
        returns (files, bytes) removed. Safe while others insert: a file is linked into its
        layer right after it enters the pool, under that layer's unpack lock, and a file that
        lost its last layer stays unlinked (an unpack that races with us re-inserts it)."""
        files = freed = 0
        for name in os.listdir(self.root / "tmp"):
            pid = name.split(".", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / "tmp" / name)
        for sub in os.listdir(self.root):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            for name in os.listdir(self.root / sub):
                path = self.root / sub / name
                try:
                    st = os.lstat(path)
                    if st.st_nlink == 1:
                        os.unlink(path)
                        files += 1
                        freed += st.st_blocks * 512
                except FileNotFoundError:
                    continue
        return files, freed

    def usage(self) -> tuple[int, int]:
        """(files, bytes on disk) in the pool."""
        files = total = 0
        for sub in os.listdir(self.root):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            for entry in os.scandir(self.root / sub):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                    files += 1
        return files, total

    def verify(self, read_blob: Callable[[str], bytes]) -> list[str]:
        """Re-hash every pool file against its name; `read_blob(sha)` gives a store blob's
        bytes (for runs of packs). One line per problem."""
        problems = []
        blobs: dict[str, bytes] = {}
        for sub in sorted(os.listdir(self.root)):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            for name in sorted(os.listdir(self.root / sub)):
                path = self.root / sub / name
                content = name.split("-", 1)[0]
                parts = content.split(".")
                try:
                    if len(parts) == 1:  # a whole blob's content: hashed as a stream
                        h = hashlib.sha256()
                        with open(path, "rb") as f:
                            while chunk := f.read(1 << 20):
                                h.update(chunk)
                        ok = h.hexdigest() == content
                    elif len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                        sha, offset, size = parts[0], int(parts[1]), int(parts[2])
                        data = path.read_bytes()  # a run of a pack: small (< 16 KiB)
                        try:
                            if sha not in blobs:
                                blobs = {sha: read_blob(sha)}  # runs of a pack come together
                            ok = blobs[sha][offset : offset + size] == data
                        except Exception as e:  # a missing or corrupt blob: cannot tell
                            problems.append(f"{path}: cannot check against blob {sha} ({e})")
                            continue
                    else:
                        problems.append(f"{path}: not a pool name")
                        continue
                except OSError as e:
                    problems.append(f"{path}: unreadable ({e.strerror})")
                    continue
                if not ok:
                    problems.append(f"{path}: content does not match its name")
        return problems
