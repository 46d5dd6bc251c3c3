"""Pure-Python generator of a classic-BPF seccomp filter for bubblewrap.

:func:`build_filter` returns the raw bytes of a ``struct sock_filter`` array,
which is exactly what ``bwrap --seccomp FD`` expects to read from the fd.
No libseccomp is needed: the program is small and fixed, so we assemble it
ourselves.

Policy (denials return ``EPERM`` unless noted):

* Foreign architectures (e.g. i386 via ``int 0x80``) -> ``ENOSYS``, because
  their syscall numbers differ and would otherwise slip past the filter.
* x86_64 x32 ABI syscalls (``nr >= 0x40000000``) -> ``ENOSYS``, same reason.
* Every syscall in :data:`DENIED_SYSCALLS` that exists on the target arch.
* ``clone3`` -> ``ENOSYS``: its flags live in a user-memory struct BPF cannot
  read, so we force glibc's fallback to ``clone`` whose flags we can inspect.
* ``unshare`` / ``clone`` with any namespace-creating flag.
* ``ioctl`` with ``TIOCSTI`` / ``TIOCLINUX`` (terminal input injection).
* Set-user-id and set-group-id bits (``mode & 06000``): ``chmod``, ``fchmod``,
  ``fchmodat``, ``fchmodat2``, ``mknod``/``mknodat``, and ``creat``/``open``/
  ``openat`` when they create a file (``O_CREAT`` or ``O_TMPFILE``). A sandbox's
  files end up on the host (an upper layer, a kept ``upper=DIR``, a published
  layer), owned by the sandbox's host uid: a set-id file there would let any host
  user who can reach it run as that uid. Setting the bits on directories is
  refused too (BPF cannot tell a directory's chmod from a file's); directories
  still inherit a parent's set-group-id bit, and ``mkdir``'s mode is not checked.
* ``openat2`` -> ``ENOSYS``: its flags and mode live in a user-memory struct, as
  ``clone3``'s do. glibc's ``open``/``openat`` never use it; the programs that
  call it directly fall back to ``openat`` on ``ENOSYS`` (kernels before 5.6).
* Everything else is allowed.
"""

from __future__ import annotations

import functools
import platform
import struct

from minisandbox.errors import MiniSandboxError

__all__ = ["DENIED_SYSCALLS", "FilterAssemblyError", "UnsupportedArchError", "build_filter"]


class UnsupportedArchError(MiniSandboxError):
    """Raised when no syscall table exists for the requested architecture."""


class FilterAssemblyError(MiniSandboxError):
    """The filter cannot be assembled: a conditional jump is farther than BPF's 8-bit offset
    reaches (the policy grew too large for its layout; a bug of this module, not of a caller)."""


# Syscalls denied outright with EPERM.  Grouped by why they are dangerous.
# fmt: off
DENIED_SYSCALLS: tuple[str, ...] = (
    # Inspecting/modifying other processes' memory.
    "ptrace", "process_vm_readv", "process_vm_writev",
    # Kernel keyring: not namespaced, leaks secrets across sandboxes.
    "keyctl", "add_key", "request_key",
    # Large kernel attack surface, rarely needed by sandboxed programs.
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # Filesystem-tree manipulation (old and new mount APIs).
    "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "open_tree_attr",
    # Joining other namespaces.
    "setns",
    # Kernel/module/system-wide administration.
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog",
    "vhangup", "lookup_dcookie", "nfsservctl", "fanotify_init",
    # File-handle syscalls can escape a bind-mounted root.
    "open_by_handle_at", "name_to_handle_at",
    # x86-only legacy/privileged syscalls (absent on aarch64).
    "uselib", "iopl", "ioperm",
)
# fmt: on

# Syscall numbers, checked against the kernel uapi headers
# (asm/unistd_64.h for x86_64, asm-generic/unistd.h for aarch64).
# open_tree_attr (467 on both) is newer (Linux 6.15) than some headers but the
# number is reserved uniformly across arches, so it is listed anyway.
# Missing on aarch64 (skipped there): uselib, iopl, ioperm, and the legacy
# open, creat, chmod and mknod (libc uses the *at forms there).
# fmt: off
_X86_64: dict[str, int] = {
    "ioctl": 16, "clone": 56, "ptrace": 101, "syslog": 103, "uselib": 134,
    "vhangup": 153, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172,
    "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
    "nfsservctl": 180, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442,
    "quotactl_fd": 443, "open_tree_attr": 467,
    "open": 2, "creat": 85, "chmod": 90, "fchmod": 91, "mknod": 133, "openat": 257,
    "mknodat": 259, "fchmodat": 268, "openat2": 437, "fchmodat2": 452,
}
_AARCH64: dict[str, int] = {
    "lookup_dcookie": 18, "ioctl": 29, "umount2": 39, "mount": 40, "pivot_root": 41,
    "nfsservctl": 42, "chroot": 51, "vhangup": 58, "quotactl": 60, "acct": 89,
    "unshare": 97, "kexec_load": 104, "init_module": 105, "delete_module": 106,
    "syslog": 116, "ptrace": 117, "reboot": 142, "add_key": 217, "request_key": 218,
    "keyctl": 219, "clone": 220, "swapon": 224, "swapoff": 225,
    "perf_event_open": 241, "fanotify_init": 262, "name_to_handle_at": 264,
    "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270,
    "process_vm_writev": 271, "finit_module": 273, "bpf": 280, "userfaultfd": 282,
    "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
    "mount_setattr": 442, "quotactl_fd": 443, "open_tree_attr": 467,
    "mknodat": 33, "fchmod": 52, "fchmodat": 53, "openat": 56, "openat2": 437,
    "fchmodat2": 452,
}
# fmt: on

# arch name -> (AUDIT_ARCH value, syscall table, whether x32 numbers must be rejected)
_ARCHES: dict[str, tuple[int, dict[str, int], bool]] = {
    "x86_64": (0xC000003E, _X86_64, True),
    "aarch64": (0xC00000B7, _AARCH64, False),
}
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

# Classic BPF opcodes (only the handful we need).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

# seccomp return actions.
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM = 1
_ENOSYS = 38

# struct seccomp_data offsets (little-endian: low 32 bits of args[i] at 16 + 8*i).
_OFF_NR = 0
_OFF_ARCH = 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


_X32_SYSCALL_BIT = 0x40000000

_CLONE_NEWTIME = 0x00000080
# Namespace flags shared by clone(2) and unshare(2).  CLONE_NEWTIME is excluded
# for clone because 0x80 lies in CSIGNAL (the exit signal byte) there.
_CLONE_NS_MASK = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)
_UNSHARE_NS_MASK = _CLONE_NS_MASK | _CLONE_NEWTIME

# Set-user-id | set-group-id. mode_t is truncated to 16 bits by the kernel, so the low
# 32 bits of the argument are all that count.
_SETID_BITS = 0o6000
# open flags that make it create a file: O_CREAT, and __O_TMPFILE (the bit O_TMPFILE adds to
# O_DIRECTORY; the kernel refuses it without O_DIRECTORY). Same values on x86_64 and aarch64.
_CREATE_FLAGS = 0o100 | 0o20000000

# Syscalls taking a mode, -> the index of their mode argument (checked for set-id bits).
_MODE_ARG = {
    "chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2,
    "creat": 1, "mknod": 1, "mknodat": 2,
}  # fmt: skip
# Syscalls that create a file only with a creating flag -> (flags argument, mode argument).
_OPEN_ARGS = {"open": (1, 2), "openat": (2, 3)}

_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C

_BPF_MAXINSNS = 4096

# An instruction before assembly: jump targets may be label names, resolved later
# so we never hand-count offsets.
_Target = int | str
_Insn = tuple[int, _Target, _Target, int]


class _Asm:
    """Tiny two-pass assembler: emit instructions with symbolic jump targets."""

    def __init__(self) -> None:
        self.insns: list[_Insn] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.insns)

    def load(self, offset: int) -> None:
        self.insns.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, k: int, jt: _Target = 0, jf: _Target = 0) -> None:
        self.insns.append((op, jt, jf, k))

    def ret(self, action: int) -> None:
        self.insns.append((_RET_K, 0, 0, action))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self.insns):
            out += struct.pack("<HBBI", code, self._offset(pc, jt), self._offset(pc, jf), k)
        return bytes(out)

    def _offset(self, pc: int, target: _Target) -> int:
        if isinstance(target, int):
            return target
        # Conditional jumps are relative to the next instruction and only u8-wide.
        off = self.labels[target] - pc - 1
        if not 0 <= off <= 255:
            raise FilterAssemblyError(f"BPF jump to {target!r} out of range: {off}")
        return off


def _resolve_arch(arch: str | None) -> str:
    name = (arch or platform.machine()).lower()
    name = _ARCH_ALIASES.get(name, name)
    if name not in _ARCHES:
        raise UnsupportedArchError(
            f"seccomp filter: unsupported architecture {name!r} "
            f"(supported: {', '.join(sorted(_ARCHES))})"
        )
    return name


# long: one BPF program, whose jumps and labels read best in one place.
@functools.cache  # the same bytes for every sandbox of a process
def build_filter(arch: str | None = None) -> bytes:
    """Return the seccomp BPF program for ``arch`` (default: this machine).

    The result is a packed ``struct sock_filter[]`` in native (little-endian)
    byte order, ready to be written to the fd given to ``bwrap --seccomp``.

    Raises:
        UnsupportedArchError: no syscall table for ``arch``.
        FilterAssemblyError: the policy no longer fits BPF's limits (a bug here).
    """
    audit_arch, table, reject_x32 = _ARCHES[_resolve_arch(arch)]
    a = _Asm()

    a.load(_OFF_ARCH)
    a.jump(_JEQ_K, audit_arch, jf="enosys")
    a.load(_OFF_NR)
    if reject_x32:
        a.jump(_JGE_K, _X32_SYSCALL_BIT, jt="enosys")

    a.jump(_JEQ_K, table["clone3"], jt="enosys")
    a.jump(_JEQ_K, table["unshare"], jt="unshare")
    a.jump(_JEQ_K, table["clone"], jt="clone")
    a.jump(_JEQ_K, table["ioctl"], jt="ioctl")
    a.jump(_JEQ_K, table["openat2"], jt="enosys")
    for name, (flags_arg, _mode_arg) in _OPEN_ARGS.items():
        if name in table:
            a.jump(_JEQ_K, table[name], jt=f"open{flags_arg}")
    for name, mode_arg in _MODE_ARG.items():
        if name in table:
            a.jump(_JEQ_K, table[name], jt=f"mode{mode_arg}")
    for name in DENIED_SYSCALLS:
        if name in table:
            a.jump(_JEQ_K, table[name], jt="eperm")
    a.ret(_RET_ALLOW)

    # Flags are unsigned long but the kernel only honours the low 32 bits.
    a.label("unshare")
    a.load(_arg_lo(0))
    a.jump(_JSET_K, _UNSHARE_NS_MASK, jt="eperm", jf="allow")

    a.label("clone")
    a.load(_arg_lo(0))
    a.jump(_JSET_K, _CLONE_NS_MASK, jt="eperm", jf="allow")

    # ioctl's cmd is truncated to unsigned int by the kernel, so compare only
    # the low 32 bits; otherwise setting high bits would bypass the check.
    a.label("ioctl")
    a.load(_arg_lo(1))
    a.jump(_JEQ_K, _TIOCSTI, jt="eperm")
    a.jump(_JEQ_K, _TIOCLINUX, jt="eperm", jf="allow")

    # open/openat: the mode matters only when the call creates a file (otherwise it is
    # ignored, and may hold anything).
    for flags_arg, mode_arg in sorted(set(_OPEN_ARGS.values())):
        a.label(f"open{flags_arg}")
        a.load(_arg_lo(flags_arg))
        a.jump(_JSET_K, _CREATE_FLAGS, jt=f"mode{mode_arg}", jf="allow")
    for mode_arg in sorted({*_MODE_ARG.values(), *(m for _f, m in _OPEN_ARGS.values())}):
        a.label(f"mode{mode_arg}")
        a.load(_arg_lo(mode_arg))
        a.jump(_JSET_K, _SETID_BITS, jt="eperm", jf="allow")

    a.label("allow")
    a.ret(_RET_ALLOW)
    a.label("eperm")
    a.ret(_RET_ERRNO | _EPERM)
    a.label("enosys")
    a.ret(_RET_ERRNO | _ENOSYS)

    if len(a.insns) >= _BPF_MAXINSNS:
        raise FilterAssemblyError(f"the filter has {len(a.insns)} instructions, too many for BPF")
    return a.assemble()
