"""Makes paths of the sandbox read-only where they are, in the sandbox's mount namespace: each is
bound over itself, then remounted read-only (no write, no unlink, no rename over it). Run on the
host by a fresh single-threaded interpreter (setns needs one). argv: sandbox-pid path...
"""

import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
pid, paths = sys.argv[1], sys.argv[2:]


def check(result, what):
    if result != 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")


root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
    check(libc.setns(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY), 0x10000000), "setns user")
check(libc.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), 0x00020000), "setns mnt")
os.fchdir(root)
os.chroot(".")
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
# statvfs flag -> mount flag: a remount in a user namespace must keep the flags it has.
KEEP = {2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}
for path in paths:
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
