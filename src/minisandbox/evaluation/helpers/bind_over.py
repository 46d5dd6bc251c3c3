"""Binds a file of the sandbox read-only over another, in the sandbox's mount namespace. Run on
the host by a fresh single-threaded interpreter (setns needs one). The target is a file bwrap
bound and then unlinked (nothing can be mounted on an unlinked file), so that mount is detached
first. argv: sandbox-pid source target.
"""

import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
pid, source, target = sys.argv[1:4]


def check(result, what):
    if result != 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")


root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
if os.geteuid() != 0:  # the sandbox's user namespace is ours: its capabilities are ours
    check(libc.setns(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY), 0x10000000), "setns user")
check(libc.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), 0x00020000), "setns mnt")
os.fchdir(root)
os.chroot(".")
MS_RDONLY, MS_REMOUNT, MS_BIND, MNT_DETACH = 1, 32, 4096, 2
check(libc.umount2(target.encode(), MNT_DETACH), "umount")
check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind")
check(libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "ro")
