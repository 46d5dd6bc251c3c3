"""Mounts in a sandbox's mount namespace, run on the host by a fresh single-threaded interpreter
(setns needs one). argv: MODE sandbox-pid ARGS...

- `read-only PATH...`: each path bound over itself, then remounted read-only (no write, no
  unlink, no rename over it);
- `bind-over SOURCE TARGET`: SOURCE bound read-only over TARGET, a file bwrap bound and then
  unlinked (nothing can be mounted on an unlinked file), so that mount is detached first.
"""

import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
mode, pid, args = sys.argv[1], sys.argv[2], sys.argv[3:]
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MNT_DETACH = 1, 32, 4096, 16384, 2
# statvfs flag -> mount flag: a remount in a user namespace must keep the flags it has.
KEEP = {2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}


def check(result, what):
    if result != 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")


if mode not in ("read-only", "bind-over") or (mode == "bind-over" and len(args) != 2):
    sys.exit(f"usage: read-only PID PATH... | bind-over PID SOURCE TARGET (not {sys.argv[1:]})")
root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
    check(libc.setns(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY), 0x10000000), "setns user")
check(libc.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), 0x00020000), "setns mnt")
os.fchdir(root)
os.chroot(".")
if mode == "bind-over":
    source, target = args
    check(libc.umount2(target.encode(), MNT_DETACH), "umount")
    check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind")
    check(libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "ro")
    sys.exit(0)
for path in args:
    # Nothing of the patch has run yet: these are the environment's own files, no link of
    # the sandbox's on their way (refused all the same).
    if os.path.islink(path):
        sys.exit(f"{path}: a symbolic link")
    check(libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
    have = os.statvfs(path).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    for st, ms in KEEP.items():
        if have & st:
            flags |= ms
    check(libc.mount(None, path.encode(), None, flags, None), f"read-only {path}")
