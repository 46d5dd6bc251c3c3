"""Where things are in a store's directory (the layout is described in store.py), and the two
ways anything is written there: an atomic rename of a finished temp file, and, for the
read-modify-write of a layer's metadata, the store's own per-layer flock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from minisandbox.layers.errors import MetaLockHeldError
from minisandbox.layers.ids import check_layer_id, is_layer_id, ref_filename

_MANIFEST_SUFFIX = ".manifest.zst"


class StoreLayout:
    """The paths of a store under `root`; `fsync` makes what is written survive a machine crash,
    not just a process crash."""

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync

    # paths

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / f"{sha}.zst"

    def manifest_path(self, layer_id: str) -> Path:
        return self.root / "layers" / f"{layer_id}{_MANIFEST_SUFFIX}"

    def info_path(self, layer_id: str) -> Path:
        return self.root / "layers" / f"{layer_id}.json"

    def ref_path(self, name: str) -> Path:
        return self.root / "refs" / ref_filename(name)

    def failure_path(self, name: str) -> Path:
        return self.root / "failures" / f"{ref_filename(name)}.json"

    def lock_path(self, layer_id: str) -> Path:
        return self.root / "locks" / check_layer_id(layer_id)

    def tmp_path(self, kind: str) -> Path:
        """A new temp file name: host and pid say whose it is (a crashed writer's, for gc)."""
        host = socket.gethostname().replace(".", "_")[:40] or "host"
        return self.root / "tmp" / f"{host}.{os.getpid()}.{secrets.token_hex(8)}.{kind}"

    # listing

    def layer_ids(self) -> list[str]:
        """Ids of the layers whose manifest is in place (a layer exists iff that is)."""
        return [
            name[: -len(_MANIFEST_SUFFIX)]
            for name in os.listdir(self.root / "layers")
            if name.endswith(_MANIFEST_SUFFIX) and is_layer_id(name[: -len(_MANIFEST_SUFFIX)])
        ]

    def blob_files(self) -> Iterator[tuple[str, Path]]:
        """(sha, path) of every stored blob."""
        blobs = self.root / "blobs"
        for sub in sorted(os.listdir(blobs)):
            subdir = blobs / sub
            if not subdir.is_dir():
                continue
            for name in os.listdir(subdir):
                if name.endswith(".zst") and is_layer_id(name[:-4]):
                    yield name[:-4], subdir / name

    # writing

    def write_atomic(self, path: Path, data: bytes, *, mode: int = 0o444) -> None:
        """Replace `path` with `data` by renaming a finished temp file over it."""
        tmp = self.tmp_path(path.name)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def meta_lock(self, layer_id: str) -> Iterator[None]:
        """Hold the lock on the layer's metadata: an exclusive flock on locks/<id>, on a
        descriptor of this call's own, so that it excludes other threads of this process as
        well as other processes (on a shared filesystem, those of other machines where its
        locks reach them). Blocking; held only for one read-modify-write.

        Raises:
            MetaLockHeldError: this thread already holds it (a second flock would wait forever).
        """
        held = _held_locks()
        if layer_id in held:
            raise MetaLockHeldError(f"layer {layer_id}: its metadata lock is already held here")
        path = self.lock_path(layer_id)
        path.parent.mkdir(exist_ok=True)
        fd = _lock_file(path)
        held.add(layer_id)
        try:
            with contextlib.suppress(OSError):  # another user's lock file: theirs to keep fresh
                now = time.time()
                os.utime(fd, (now, now))  # gc removes only lock files unused for its grace
            yield
        finally:
            held.discard(layer_id)
            os.close(fd)  # drops the flock


_local = threading.local()


def _held_locks() -> set[str]:
    held: set[str] | None = getattr(_local, "held", None)
    if held is None:
        held = _local.held = set()
    return held


def _lock_file(path: Path) -> int:
    """A descriptor holding an exclusive flock on the lock file at `path`, the one the path
    names once locked (gc may remove an unused lock file between an open and its flock: then
    lock the new one)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            # For writing: over NFS an exclusive flock is a POSIX lock, which needs that. 0o666
            # (less the umask): the users sharing a store share its lock files.
            fd = os.open(path, os.O_RDWR | flags, 0o666)
        except PermissionError:  # another user's lock file: read-only locks it too, locally
            fd = os.open(path, os.O_RDONLY | flags)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return fd
        except FileNotFoundError:
            pass  # removed while we waited: take the new one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def remove_lock_file(path: Path) -> bool:
    """Remove an unused lock file: only while holding its flock (a holder keeps it), so that
    two lockers never hold different files of one name."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
