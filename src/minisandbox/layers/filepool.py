"""A node's pool of unpacked files: each file once per node, whatever the layers that hold it.

Layers unpacked into the node cache hardlink their files from here, so the files that layers
share (a repository's history packs, identical source directories, an environment's packages)
are written once per node and take their space once. A pool file is named by what makes two
copies interchangeable: its content (a blob of the store, or a run of a pack blob: both are
content-addressed), its mode, its mtime and its owner. Same name, same inode.

- A file enters the pool by a hard link of a finished file: it is written where the layer being
  unpacked wants it (a tree only its unpacker sees until it is complete), then linked into the
  pool (`link` fails if another process got there first: then theirs replaces ours). So no pool
  name ever shows a half-written file, two processes inserting the same content produce one
  file, and the writers of a node share no directory but the pool's own.
- Pool files are never written after they appear; sandboxes mount layers read-only below their
  overlay, so nothing a sandbox does reaches them.
- A file whose link count is 1 is no longer in any layer: `sweep` removes it.
- A file that has reached the filesystem's link limit is copied instead (the layer gets its own).

Layout of `root`: `ab/<name>` pool files.
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
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def has(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def link_into(self, name: str, dest: str, make: Callable[[int], None]) -> bool:
        """Make `dest` (a new path in a tree the caller is building) a link to the pool file
        `name`, creating that first when absent: `make(fd)` writes its content, owner, mode and
        mtime into `dest`, new, and closes it (raising, it leaves `dest` half-written and the
        pool without it). Returns True when the pool already had it (nothing was written)."""
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
        # Written in place (`dest` is in a tree only its unpacker sees), then linked into the
        # pool: a pool name never shows a half-written file, and no directory is shared by
        # all the writers of the node.
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        make(fd)  # closes fd
        final.parent.mkdir(exist_ok=True)
        try:
            os.link(dest, final, follow_symlinks=False)
        except FileExistsError:  # another process inserted it first: theirs, so one copy
            spare = f"{dest}.{secrets.token_hex(6)}"
            try:
                os.link(final, spare, follow_symlinks=False)
            except OSError:  # swept since, or at the link limit: ours serves
                return False
            os.replace(spare, dest)
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
        """Remove pool files no layer holds (link count 1); returns (files, bytes) removed.
        Safe while others insert: a file enters the pool already linked from its layer, and a
        file that lost its last layer stays unlinked (an unpack that races with us re-inserts
        it)."""
        files = freed = 0
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
