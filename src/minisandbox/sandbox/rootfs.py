"""The sandbox's root filesystem as bwrap arguments.

Layout: an overlay at `/` (read-only layers below one writable upper directory), with the host's
system directories bound read-only on top at their own paths, a few generated /etc files, a private
/proc, a minimal /dev, size-capped tmpfs at /tmp and /dev/shm, and no /sys. The host's installed
Python packages (under /usr and in bound interpreter prefixes) are covered (hostpython.py): a
bound tree is mounted as a read-only overlay of itself under its covers layer (covers.py).

bwrap follows symlinks in mount destinations, and every destination here lies inside the overlay,
whose content an earlier sandbox may have written (a kept upper layer, or a layer built from one).
`check_destinations` therefore refuses to start when any component of a destination is a symlink
in any layer: no mount can be redirected.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from minisandbox.errors import SandboxConfigError
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.covers import cover_layer
from minisandbox.sandbox.hostpython import hidden_dirs

IO_DIR = "/run/minisandbox"  # per-sandbox channel directory (FIFOs, command files)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Top-level host paths that are either symlinks into /usr (merged-/usr systems) or real dirs.
_SYSTEM_TOP = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

# Host /etc entries a shell, git, pip and Python need. Secrets (shadow, ssl/private) stay out.
_ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "localtime",
    "timezone",
    "mime.types",
    "os-release",
    "inputrc",
    "gitconfig",
    "pip.conf",
    "xdg/pip",
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "pki/tls/certs",
    "pki/ca-trust",
    "terminfo",
    "python3",
)


_PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = "root:x:0:\nnogroup:x:65534:\n"
# Mount points that every sandbox needs; present in the system layer so bwrap creates nothing.
_MOUNT_POINTS = ("usr", "proc", "dev", "tmp", "run/minisandbox", "root", "etc")
# And the files bwrap mounts over, in /etc: else bwrap creates them in the upper layer (a kept
# upper would hold files the sandbox never wrote).
_FILE_MOUNT_POINTS = ("hosts", "hostname")


_PRIVATE_TMPFS = ("/tmp", "/dev/shm")


@dataclass
class MountPlan:
    args: list[str] = field(default_factory=list)
    data: list[tuple[str, bytes]] = field(default_factory=list)  # (dest, content)
    destinations: list[str] = field(default_factory=list)


# Bumped when build_system_layer makes something different from the same host files.
SYSTEM_LAYER_FORMAT = 2  # 2: modes set whatever the builder's umask


def system_layer_key(owner: tuple[int, int] | None, etc: str = "/etc") -> str:
    """What the system layer is made of: the format, `owner`, and every host entry it copies
    (each /etc entry, recursively, with its type, mode, size, times and inode; and the top-level
    links of a merged-/usr host). Any change to one of them, an edit in place included, gives
    another key. About 700 lstat calls, a few milliseconds."""
    h = hashlib.sha256(f"{SYSTEM_LAYER_FORMAT}\0{owner}\n".encode())

    def add(path: str) -> None:
        try:
            st = os.lstat(path)
        except OSError:
            return
        h.update(
            f"{path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
            f"{st.st_ino}\n".encode()
        )
        if stat.S_ISDIR(st.st_mode):
            try:
                names = sorted(os.listdir(path))
            except OSError:
                return
            for name in names:
                add(os.path.join(path, name))

    for name in _SYSTEM_TOP:  # only what is copied: the links (a real /lib is bound, live)
        path = f"/{name}"
        target = os.readlink(path) if os.path.islink(path) else ""
        h.update(f"{path}\0{os.path.islink(path)}\0{target}\n".encode())
    for entry in _ETC_ENTRIES:
        add(os.path.join(etc, entry))
    return h.hexdigest()


def build_system_layer(path: Path, owner: tuple[int, int] | None) -> Path:
    """The lowest layer of every sandbox, made once per node (startup.system_layer): the host's
    /etc entries that programs need (copies: one overlay layer costs bwrap far less than two
    dozen bind mounts), the /bin -> usr/bin style links of a merged-/usr host, generated passwd
    and group, and the mount points. `owner`: who owns its directories (a root caller's sandbox
    uid), so the sandbox's root can add files to /etc or /run; the copied files stay read-only
    for it. Made beside `path` and renamed there: when another process got there first, its
    layer is used and ours discarded."""
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _fill_system_layer(staging, owner)
        os.rename(staging, path)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not path.is_dir():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _fill_system_layer(staging: Path, owner: tuple[int, int] | None) -> None:
    os.chmod(staging, 0o755)
    for name in _MOUNT_POINTS:
        (staging / name).mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(staging / "root", 0o700)
    os.chmod(staging / "tmp", 0o1777)
    for name in _SYSTEM_TOP:
        host = f"/{name}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), staging / name)
    etc = staging / "etc"
    for entry in _ETC_ENTRIES:
        src, dst = Path("/etc") / entry, etc / entry
        if not os.path.lexists(src):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, dst, symlinks=True)
            elif src.is_symlink():
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copy2(src, dst)
        except OSError:
            continue  # unreadable on this host (e.g. a private key dir): the sandbox does without
    (etc / "passwd").write_text(_PASSWD)
    (etc / "group").write_text(_GROUP)
    for name in _FILE_MOUNT_POINTS:  # empty: bwrap mounts each sandbox's own over them
        (etc / name).touch(mode=0o644)
    os.symlink("/proc/self/mounts", etc / "mtab")
    # Modes as stated, not as the builder's umask left them: every later sandbox of the node
    # uses this layer (the copies keep their /etc modes).
    made = {staging / "etc"}
    for name in (*_MOUNT_POINTS, *(f"etc/{e}" for e in _ETC_ENTRIES)):
        made.update(p for p in (staging / name).parents if p.is_relative_to(staging))
    made.update(staging / name for name in _MOUNT_POINTS)
    for directory in made:  # (what copytree copied keeps its own modes)
        if directory.is_dir() and not directory.is_symlink():
            os.chmod(directory, 0o755)
    os.chmod(staging / "root", 0o700)
    os.chmod(staging / "tmp", 0o1777)
    for name in ("passwd", "group", *_FILE_MOUNT_POINTS):
        os.chmod(etc / name, 0o644)
    if owner is not None:
        for dirpath, _dirnames, _files in os.walk(staging):
            os.chown(dirpath, *owner)


def build_plan(
    config: SandboxConfig,
    system_layer: Path,
    upper: Path,
    work: Path,
    io_dir: Path,
    covers_root: Path | None = None,
) -> MountPlan:
    """The mounts of a sandbox. `covers_root` (the caller's private runtime directory) keeps
    the covers layers of bound host trees (covers.py); None: tmpfs covers."""
    plan = MountPlan()
    a = plan.args
    layers, tmpfs_covers = _covers(config, covers_root)
    # bwrap stacks --overlay-src in order, the last one on top; config.layers is lowest first.
    for layer in (system_layer, *config.layers):
        a += ["--overlay-src", str(layer)]
    a += ["--overlay", str(upper), str(work), "/"]

    def ro(src: str, dest: str | None = None, try_: bool = False) -> None:
        dest = dest or src
        a.extend(["--ro-bind-try" if try_ else "--ro-bind", src, dest])
        plan.destinations.append(dest)

    # The private mounts first: binds below may land inside them (a Python under /tmp).
    a += ["--proc", "/proc", "--dev", "/dev"]
    a += ["--size", str(config.limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    a += ["--size", str(config.limits.shm_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]
    plan.destinations += ["/proc", "/dev", "/tmp", "/dev/shm"]
    _bind_tree(plan, Path("/usr"), layers)
    for name in _SYSTEM_TOP:
        host = f"/{name}"
        if os.path.isdir(host) and not os.path.islink(host):
            ro(host)  # a host without merged /usr
    if config.network:
        ro("/etc/resolv.conf", try_=True)
    hosts = f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n127.0.1.1 {config.hostname}\n"
    plan.data += [
        ("/etc/hosts", hosts.encode()),
        ("/etc/hostname", f"{config.hostname}\n".encode()),
    ]
    plan.destinations += ["/etc/hosts", "/etc/hostname"]
    _bind_host_dirs(plan, config, layers, tmpfs_covers)
    # Read-only inside: nothing in the sandbox can plant, swap or remove a channel file (the
    # host creates them; FIFOs stay writable on a read-only mount).
    a += ["--ro-bind", str(io_dir), IO_DIR]
    plan.destinations.append(IO_DIR)
    return plan


def _covers(config: SandboxConfig, covers_root: Path | None) -> tuple[dict[Path, Path], list[Path]]:
    """How the host's installed Python packages (under /usr and in bound interpreter prefixes:
    a later release of the task's project could be among them, hostpython.py) are covered:
    the covers layer of each bound tree mounted as an overlay of it (covers.py), and the
    directories left to cover with an empty read-only tmpfs each (after every bind)."""
    hidden = hidden_dirs(config.ro_paths)
    if covers_root is None:
        return {}, hidden
    trees = (Path("/usr"), *_ro_paths(config))
    # Where each is, for the kernel: `//usr` or a symlink to /usr binds /usr again on top.
    real = tuple(Path(os.path.realpath(t)) for t in trees)
    layers: dict[Path, Path] = {}
    left = set(hidden)
    for i, mine in _covered_by_tree(real, tuple(hidden)):
        layer = cover_layer(covers_root, real[i], mine)
        if layer is not None:
            layers[trees[i]] = layer
            left -= set(mine)
    return layers, sorted(left)


@functools.lru_cache(maxsize=256)
def _covered_by_tree(
    real: tuple[Path, ...], hidden: tuple[Path, ...]
) -> list[tuple[int, tuple[Path, ...]]]:
    """Which of `hidden` each bound tree (`real`, resolved) covers with a layer of its own:
    (index, directories) for each tree that has any. None of a tree inside another, or
    equal to one (a bind of it could land on its overlay); none of a tree bound inside it.
    (Path arithmetic only: the same for every start of a configuration.)"""
    out = []
    for i, tree in enumerate(real):
        others = real[:i] + real[i + 1 :]
        if any(tree.is_relative_to(t) for t in others):
            continue
        inner = [t for t in others if t.is_relative_to(tree)]
        mine = [h for h in hidden if h.is_relative_to(tree)]
        mine = [h for h in mine if not any(h.is_relative_to(t) for t in inner)]
        if mine:
            out.append((i, tuple(mine)))
    return out


def _ro_paths(config: SandboxConfig) -> list[Path]:
    """config.ro_paths but /usr, bound before them (an interpreter whose prefix is /usr, the
    distribution's, names it)."""
    return [p for p in config.ro_paths if p != Path("/usr")]


def _bind_tree(plan: MountPlan, tree: Path, layers: dict[Path, Path]) -> None:
    """Host directory `tree` read-only at its own path: a bind, or an overlay of it under its
    covers layer."""
    layer = layers.get(tree)
    if layer is None:
        plan.args += ["--ro-bind", str(tree), str(tree)]
    else:  # bwrap stacks --overlay-src in order, the last one on top
        plan.args += ["--overlay-src", str(tree), "--overlay-src", str(layer)]
        plan.args += ["--ro-overlay", str(tree)]
    plan.destinations.append(str(tree))


def _bind_host_dirs(
    plan: MountPlan, config: SandboxConfig, layers: dict[Path, Path], tmpfs_covers: list[Path]
) -> None:
    """`config.ro_paths` read-only at their own paths, then the package directories no covers
    layer took (see _covers) covered by an empty read-only tmpfs each."""
    a = plan.args
    for path in _ro_paths(config):
        # Parents inside the private tmpfs mounts are made by bwrap itself, mode 700 unless told
        # otherwise: a root caller's sandbox uid could not reach the bound directory.
        parent = path.parent
        inside_tmpfs = []
        while parent != parent.parent:
            if any(parent.is_relative_to(m) and parent != Path(m) for m in _PRIVATE_TMPFS):
                inside_tmpfs.append(str(parent))
            parent = parent.parent
        for d in reversed(inside_tmpfs):
            a += ["--perms", "0755", "--dir", d]
        _bind_tree(plan, path, layers)
    # Not in plan.destinations: each lies inside a host directory bound above (the walk never
    # follows a symlink), so no layer's tree is on its path and nothing is precreated for it.
    for hidden in map(str, tmpfs_covers):
        a += ["--perms", "0555", "--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]


def check_destinations(destinations: list[str], trees: list[Path]) -> None:
    """Refuse any mount destination with a symlink on its path in the upper or a lower layer."""
    for dest in destinations:
        parts = Path(dest).parts[1:]
        for i in range(1, len(parts) + 1):
            rel = os.path.join(*parts[:i])
            for tree in trees:
                candidate = tree / rel
                if not os.path.islink(candidate):
                    continue
                raise SandboxConfigError(
                    f"refusing to start: {candidate} is a symlink, and the sandbox mounts "
                    f"{dest} through it (bwrap follows symlinks in mount destinations)"
                )
