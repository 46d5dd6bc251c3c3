"""Tests for minisandbox.sandbox.seccomp: static checks, a BPF emulator, and the real kernel."""

from __future__ import annotations

import json
import platform
import struct
import subprocess
import sys
import tempfile
import textwrap

import pytest

from minisandbox.sandbox.seccomp import DENIED_SYSCALLS, UnsupportedArchError, build_filter

EPERM, ENOSYS = 1, 38
ALLOW = 0x7FFF0000
ERRNO = 0x00050000
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Independent copy of the numbers the tests need, so a typo in the module's
# tables is caught rather than mirrored.
# fmt: off
NR = {
    "x86_64": {
        "ioctl": 16, "getpid": 39, "clone": 56, "ptrace": 101, "mount": 165,
        "iopl": 172, "keyctl": 250, "unshare": 272, "io_uring_setup": 425,
        "clone3": 435, "open_tree_attr": 467,
        "open": 2, "creat": 85, "chmod": 90, "fchmod": 91, "mknod": 133, "openat": 257,
        "mknodat": 259, "fchmodat": 268, "openat2": 437, "fchmodat2": 452,
    },
    "aarch64": {
        "ioctl": 29, "getpid": 172, "clone": 220, "ptrace": 117, "mount": 40,
        "keyctl": 219, "unshare": 97, "io_uring_setup": 425, "clone3": 435,
        "open_tree_attr": 467,
        "mknodat": 33, "fchmod": 52, "fchmodat": 53, "openat": 56, "openat2": 437,
        "fchmodat2": 452,
    },
}
# fmt: on
MACHINE = platform.machine()
native_only = pytest.mark.skipif(
    MACHINE not in NR or not sys.platform.startswith("linux"),
    reason="kernel tests need Linux on x86_64 or aarch64",
)


# ---------------------------------------------------------------------------
# Static checks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_program_shape(arch: str) -> None:
    prog = build_filter(arch)
    assert isinstance(prog, bytes)
    assert len(prog) % 8 == 0
    assert 0 < len(prog) < 4096 * 8
    # Last instruction must be a return, or the kernel rejects the program.
    code, _, _, _ = struct.unpack_from("<HBBI", prog, len(prog) - 8)
    assert code == 0x06


def test_default_arch_matches_machine() -> None:
    if MACHINE not in NR:
        with pytest.raises(UnsupportedArchError):
            build_filter()
    else:
        assert build_filter() == build_filter(MACHINE)


@pytest.mark.parametrize("arch", ["i386", "armv7l", "riscv64", "ppc64le"])
def test_unknown_arch_raises(arch: str) -> None:
    with pytest.raises(UnsupportedArchError, match="unsupported architecture"):
        build_filter(arch)
    assert issubclass(UnsupportedArchError, RuntimeError)


def test_filter_errors_are_minisandbox_errors() -> None:
    """Callers catch MiniSandboxError: the filter's own errors are specific subclasses."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.sandbox.seccomp import FilterAssemblyError, _Asm

    assert issubclass(UnsupportedArchError, MiniSandboxError)
    asm = _Asm()
    asm.jump(0x15, 0, "far", 0)  # JEQ with a forward label 300 instructions away
    for _ in range(300):
        asm.ret(0)
    asm.label("far")
    asm.ret(0)
    with pytest.raises(FilterAssemblyError, match="out of range"):
        asm.assemble()


def test_denied_list() -> None:
    assert "ptrace" in DENIED_SYSCALLS and "mount" in DENIED_SYSCALLS
    assert "personality" not in DENIED_SYSCALLS
    assert len(set(DENIED_SYSCALLS)) == len(DENIED_SYSCALLS)


# ---------------------------------------------------------------------------
# Emulated checks: run the program in a tiny classic-BPF interpreter so that
# both arches and cases the kernel test cannot reach (foreign arch) are covered.
# ---------------------------------------------------------------------------


def run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    full = (*args, *([0] * (6 - len(args))))
    data = struct.pack("<IIQ6Q", nr, arch, 0, *full)
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        elif code == 0x05:
            pc += k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_emulated_policy(arch: str) -> None:
    prog, nr, audit = build_filter(arch), NR[arch], AUDIT_ARCH[arch]

    def run(name: str, *args: int) -> int:
        return run_bpf(prog, nr[name], audit, args)

    assert run_bpf(prog, nr["getpid"], 0x40000003, ()) == ERRNO | ENOSYS  # i386
    assert run("getpid") == ALLOW
    for name in ("ptrace", "mount", "keyctl", "io_uring_setup", "open_tree_attr"):
        assert run(name) == ERRNO | EPERM, name
    assert run("clone3") == ERRNO | ENOSYS
    assert run("unshare", 0x10000000) == ERRNO | EPERM
    assert run("unshare", 0x80) == ERRNO | EPERM  # CLONE_NEWTIME
    assert run("unshare", 0x400) == ALLOW
    assert run("clone", 0x11 | 0x40000000) == ERRNO | EPERM
    assert run("clone", 0x01200011) == ALLOW  # glibc fork(): SIGCHLD|CHILD_*TID
    assert run("clone", 0x80) == ALLOW  # 0x80 is part of the exit signal here
    assert run("ioctl", 0, 0x5412) == ERRNO | EPERM
    assert run("ioctl", 0, 0x1_0000_541C) == ERRNO | EPERM  # high bits ignored
    assert run("ioctl", 0, 0x5413) == ALLOW
    if arch == "x86_64":
        assert run("iopl") == ERRNO | EPERM
        assert run_bpf(prog, 0x40000000 | 39, audit) == ERRNO | ENOSYS  # x32


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_emulated_setid_modes(arch: str) -> None:
    """Set-id bits are refused wherever a mode is set or a file created with one."""
    prog, nr, audit = build_filter(arch), NR[arch], AUDIT_ARCH[arch]

    def run(name: str, *args: int) -> int:
        return run_bpf(prog, nr[name], audit, args)

    o_creat, o_tmpfile = 0o100, 0o20000000 | (0o200000 if arch == "x86_64" else 0o40000)
    s_ifreg = 0o100000
    mode_calls = [("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2), ("mknodat", 2)]
    if arch == "x86_64":
        mode_calls += [("chmod", 1), ("creat", 1), ("mknod", 1)]
    for name, i in mode_calls:
        for mode, verdict in ((0o4755, EPERM), (0o2755, EPERM), (0o6000, EPERM), (0o755, 0)):
            args = [0] * 4
            args[i] = mode | (s_ifreg if name.startswith("mknod") else 0)
            assert run(name, *args) == (ERRNO | EPERM if verdict else ALLOW), (name, oct(mode))
        high = [0] * 4
        high[i] = 0x1_0000_0000 | 0o4755  # the kernel reads 16 bits: still set-uid
        assert run(name, *high) == ERRNO | EPERM, name
    opens = [("openat", 2, 3)] + ([("open", 1, 2)] if arch == "x86_64" else [])
    for name, f, m in opens:
        for flags, mode, denied in (
            (o_creat | 0o1, 0o4755, True),
            (o_tmpfile | 0o2, 0o2700, True),
            (o_creat, 0o755, False),
            (0, 0o4755, False),  # no file is created: the mode is ignored
            (0o2, 0xFFFF_FFFF, False),
        ):
            args = [0] * 4
            args[f], args[m] = flags, mode
            assert run(name, *args) == (ERRNO | EPERM if denied else ALLOW), (name, flags, mode)
    assert run("openat2", 0, 0, 0, 24) == ERRNO | ENOSYS


# ---------------------------------------------------------------------------
# Kernel checks: install the filter in a child Python and probe syscalls.
# ---------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import ctypes, json, os, subprocess, sys

    prog_bytes = bytes.fromhex(sys.argv[1])
    nr = json.loads(sys.argv[2])
    install = sys.argv[3] == "1"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog_bytes, len(prog_bytes))
    fprog = SockFprog(len(prog_bytes) // 8, ctypes.addressof(buf))
    if install:
        assert libc.prctl(38, 1, 0, 0, 0) == 0, ctypes.get_errno()
        rc = libc.prctl(22, 2, ctypes.byref(fprog), 0, 0)
        assert rc == 0, os.strerror(ctypes.get_errno())

    def res(rc):
        return [int(rc), ctypes.get_errno() if rc == -1 else 0]

    def sc(name, *args):
        ctypes.set_errno(0)
        return res(libc.syscall(ctypes.c_long(nr[name]), *[ctypes.c_ulong(a) for a in args]))

    out = {}
    # Without the filter these really succeed (tracing ourselves would hang the
    # later exec), so the unfiltered control run skips them.
    if install:
        out["ptrace"] = sc("ptrace", 0, 0, 0, 0)  # PTRACE_TRACEME
        r = sc("clone", 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER|SIGCHLD
        if r[0] == 0:
            os._exit(0)  # only reached if the filter failed: leave at once
        if r[0] > 0:
            os.waitpid(r[0], 0)
        out["clone_newuser"] = r
    out["unshare_user"] = sc("unshare", 0x10000000)
    out["unshare_files"] = sc("unshare", 0x400)
    out["keyctl"] = sc("keyctl", 0, 2**64 - 3, 0)  # KEYCTL_GET_KEYRING_ID, session
    src, dst = ctypes.c_char_p(b"none"), ctypes.c_char_p(b"/")
    fstype = ctypes.c_char_p(b"tmpfs")
    ctypes.set_errno(0)
    out["mount"] = res(libc.syscall(ctypes.c_long(nr["mount"]), src, dst, fstype,
                                    ctypes.c_ulong(0), None))
    params = ctypes.create_string_buffer(256)
    ctypes.set_errno(0)
    out["io_uring_setup"] = res(libc.syscall(ctypes.c_long(nr["io_uring_setup"]),
                                             ctypes.c_ulong(1), params))
    out["clone3"] = sc("clone3", 0, 0)

    # Set-id modes (with positive controls: the same calls without the bits succeed).
    d = sys.argv[4]
    path = os.path.join(d, "f").encode()
    p = ctypes.c_char_p(path)
    def at(name, *args):
        ctypes.set_errno(0)
        return res(libc.syscall(ctypes.c_long(nr[name]), *args))
    AT = ctypes.c_long(-100)
    out["openat_creat_755"] = at("openat", AT, p, ctypes.c_ulong(0o101), ctypes.c_ulong(0o755))
    out["openat_creat_4755"] = at("openat", AT, ctypes.c_char_p(path + b"2"),
                                  ctypes.c_ulong(0o101), ctypes.c_ulong(0o4755))
    out["fchmodat_755"] = at("fchmodat", AT, p, ctypes.c_ulong(0o700))
    out["fchmodat_4755"] = at("fchmodat", AT, p, ctypes.c_ulong(0o4755))
    out["fchmodat_2755"] = at("fchmodat", AT, p, ctypes.c_ulong(0o2755))
    fd = os.open(path, os.O_RDONLY)
    out["fchmod_4755"] = at("fchmod", ctypes.c_long(fd), ctypes.c_ulong(0o4755))
    out["fchmod_644"] = at("fchmod", ctypes.c_long(fd), ctypes.c_ulong(0o644))
    out["mknodat_reg_4755"] = at("mknodat", AT, ctypes.c_char_p(path + b"3"),
                                 ctypes.c_ulong(0o104755), ctypes.c_ulong(0))
    out["mknodat_reg_644"] = at("mknodat", AT, ctypes.c_char_p(path + b"4"),
                                ctypes.c_ulong(0o100644), ctypes.c_ulong(0))
    how = ctypes.create_string_buffer(24)  # struct open_how {flags, mode, resolve}: zeros
    out["openat2"] = at("openat2", AT, p, how, ctypes.c_ulong(24))
    out["setid_files"] = sorted(
        n for n in os.listdir(d) if os.stat(os.path.join(d, n)).st_mode & 0o6000
    )

    master, slave = os.openpty()
    ch = ctypes.c_char(b"x")
    for key, fd, cmd in (("tiocsti", slave, 0x5412), ("tioclinux", slave, 0x541C),
                         ("tiocsti_hi", slave, 0x1_0000_5412)):
        ctypes.set_errno(0)
        out[key] = res(libc.syscall(ctypes.c_long(nr["ioctl"]), ctypes.c_long(fd),
                                    ctypes.c_ulong(cmd), ctypes.byref(ch)))
    winsz = ctypes.create_string_buffer(8)
    ctypes.set_errno(0)
    out["tiocgwinsz"] = res(libc.ioctl(slave, 0x5413, winsz))

    out["getpid"] = os.getpid()
    out["true"] = subprocess.run(["/bin/true"]).returncode
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps(out))
    """
)


def probe(install: bool = True) -> dict[str, list[int] | int]:
    with tempfile.TemporaryDirectory() as scratch:
        return _probe(install, scratch)


def _probe(install: bool, scratch: str) -> dict[str, list[int] | int]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            build_filter().hex(),
            json.dumps(NR[MACHINE]),
            "1" if install else "0",
            scratch,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filtered() -> dict[str, list[int] | int]:
    return probe(install=True)


EPERM_KEYS = [
    "ptrace",
    "unshare_user",
    "keyctl",
    "mount",
    "io_uring_setup",
    "clone_newuser",
    "tiocsti",
    "tioclinux",
    "tiocsti_hi",
    "openat_creat_4755",
    "fchmodat_4755",
    "fchmodat_2755",
    "fchmod_4755",
    "mknodat_reg_4755",
]


@native_only
@pytest.mark.parametrize("key", EPERM_KEYS)
def test_kernel_denies_with_eperm(filtered: dict, key: str) -> None:
    assert filtered[key] == [-1, EPERM]


@native_only
def test_kernel_clone3_enosys(filtered: dict) -> None:
    assert filtered["clone3"] == [-1, ENOSYS]


@native_only
def test_kernel_setid_modes(filtered: dict) -> None:
    assert filtered["openat2"] == [-1, ENOSYS]
    for key in ("fchmodat_755", "fchmod_644", "mknodat_reg_644"):
        assert filtered[key] == [0, 0], key
    assert filtered["openat_creat_755"][0] >= 0
    assert filtered["setid_files"] == []


@native_only
def test_kernel_allows_normal_operation(filtered: dict) -> None:
    assert filtered["unshare_files"] == [0, 0]
    assert filtered["tiocgwinsz"] == [0, 0]
    assert filtered["getpid"] > 0
    assert filtered["true"] == 0
    assert filtered["fork"] == 7


@native_only
def test_kernel_control_without_filter() -> None:
    # Proves the EPERMs above come from our filter, not from the environment.
    base = probe(install=False)
    assert base["clone3"] != [-1, ENOSYS]
    changed = [k for k in EPERM_KEYS if k in base and base[k] != [-1, EPERM]]
    assert changed, f"every probe already fails with EPERM unfiltered: {base}"
    assert base["unshare_files"] == [0, 0] and base["fork"] == 7
    # The set-id modes really take without the filter (here owner and file are ours).
    assert base["openat_creat_4755"][0] >= 0 and base["fchmodat_2755"] == [0, 0]
    assert base["mknodat_reg_4755"] == [0, 0] and base["openat2"][0] >= 0
    assert base["setid_files"], base
