"""The sandbox's root filesystem as bwrap arguments.

Layout: an overlay at `/` (read-only layers below one writable upper directory), with the host's
system directories bound read-only on top at their own paths, a few generated /etc files, a private
/proc, a minimal /dev, size-capped tmpfs at /tmp and /dev/shm, and no /sys.

bwrap follows symlinks in mount destinations, and every destination here lies inside the overlay,
whose content an earlier sandbox may have written (a kept upper layer, or a layer built from one).
`check_destinations` therefore refuses to start when any component of a destination is a symlink
in any layer: no mount can be redirected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .config import SandboxConfig
from .errors import SandboxConfigError

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


@dataclass
class MountPlan:
    args: list[str] = field(default_factory=list)
    data: list[tuple[str, bytes]] = field(default_factory=list)  # (dest, content)
    destinations: list[str] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)


def _etc_files(config: SandboxConfig) -> list[tuple[str, bytes]]:
    passwd = (
        "root:x:0:0:root:/root:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    group = "root:x:0:\nnogroup:x:65534:\n"
    hosts = f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n127.0.1.1 {config.hostname}\n"
    return [
        ("/etc/passwd", passwd.encode()),
        ("/etc/group", group.encode()),
        ("/etc/hosts", hosts.encode()),
        ("/etc/hostname", f"{config.hostname}\n".encode()),
    ]


def build_plan(config: SandboxConfig, upper: Path, work: Path, io_dir: Path) -> MountPlan:
    plan = MountPlan()
    a = plan.args
    # bwrap stacks --overlay-src in order, the last one on top; config.layers is lowest first.
    for layer in config.layers:
        a += ["--overlay-src", str(layer)]
    if not config.layers:
        a += ["--overlay-src", str(_empty_dir(io_dir.parent))]
    a += ["--overlay", str(upper), str(work), "/"]

    def ro(src: str, dest: str | None = None, try_: bool = False) -> None:
        dest = dest or src
        a.extend(["--ro-bind-try" if try_ else "--ro-bind", src, dest])
        plan.destinations.append(dest)

    ro("/usr")
    for name in _SYSTEM_TOP:
        host = f"/{name}"
        if os.path.islink(host):
            target = os.readlink(host)
            a += ["--symlink", target, host]
            plan.symlinks[host] = target
        elif os.path.isdir(host):
            ro(host)
    for entry in _ETC_ENTRIES:
        if os.path.lexists(f"/etc/{entry}"):
            ro(f"/etc/{entry}", try_=True)
    if config.network:
        ro("/etc/resolv.conf", try_=True)
    for dest, content in _etc_files(config):
        plan.data.append((dest, content))
        plan.destinations.append(dest)
    for path in config.ro_paths:
        ro(str(path))
    a += ["--proc", "/proc", "--dev", "/dev"]
    a += ["--size", str(config.limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    a += ["--size", str(config.limits.shm_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]
    a += ["--bind", str(io_dir), IO_DIR]
    a += ["--symlink", "/proc/self/mounts", "/etc/mtab"]
    plan.symlinks["/etc/mtab"] = "/proc/self/mounts"
    plan.destinations += ["/proc", "/dev", "/tmp", IO_DIR, "/etc/mtab"]
    return plan


def _empty_dir(parent: Path) -> Path:
    path = parent / "empty"
    path.mkdir(exist_ok=True)
    return path


def check_destinations(plan: MountPlan, trees: list[Path]) -> None:
    """Refuse any mount destination with a symlink on its path in the upper or a lower layer."""
    for dest in plan.destinations:
        parts = Path(dest).parts[1:]
        for i in range(1, len(parts) + 1):
            rel = os.path.join(*parts[:i])
            inside = "/" + rel
            for tree in trees:
                candidate = tree / rel
                if not os.path.islink(candidate):
                    continue
                if plan.symlinks.get(inside) == os.readlink(candidate):
                    continue  # the same symlink bwrap itself creates, e.g. /bin -> usr/bin
                raise SandboxConfigError(
                    f"refusing to start: {candidate} is a symlink, and the sandbox mounts "
                    f"{dest} through it (bwrap follows symlinks in mount destinations)"
                )
