"""The step a root caller's sandbox takes before its control shell: from host root (which its
bwrap needs for the setup) to the sandbox's own uid, with no groups and no capabilities.

util-linux's `setpriv` does it, but costs 1.5 ms a start (an exec of a dynamically linked
program: a fifth of a whole start). This module writes the same step as a static x86-64 program
of 222 bytes of code, made here from the instructions below (no compiled file is shipped); any
other machine uses setpriv. The program, with no libc and no data but its messages:

1. empties the capability bounding set (prctl PR_CAPBSET_DROP for capabilities 0-63; EINVAL,
   a number past the kernel's last capability, is not an error), then reads each back
   (PR_CAPBSET_READ) and fails if one is still there: a later exec as the namespace's uid 0
   gains nothing;
2. setgroups(0, NULL): host root's supplementary group 0 is gone;
3. setresgid(0, 0, 0) and setresuid(0, 0, 0): the namespace's 0 is the sandbox's host uid;
4. capset to empty effective, permitted and inheritable sets (the ambient set follows);
5. execve(argv[1], argv + 1, envp).

Any failed step writes one line to stderr and exits 127: nothing runs with the credentials of
a half-done switch. A failed execve (the switch done) says so and exits 126.
"""

from __future__ import annotations

import os
import platform
import struct
import threading
from pathlib import Path

# The same step with setpriv (machines the program is not written for).
SETPRIV_ARGV = (
    "setpriv",
    "--reuid=0",
    "--regid=0",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
    "--",
)

# Each line: the instruction's bytes, then the instruction (Intel syntax). Offsets in hex.
_X86_64 = [
    ("4889e3", "00 mov rbx, rsp               ; argc, argv..., 0, envp... (kept for the execve)"),
    ("31f6", "03 xor esi, esi               ; capability 0"),
    ("b89d000000", "05 mov eax, 0x9d              ; prctl"),
    ("bf18000000", "0a mov edi, 0x18              ; PR_CAPBSET_DROP"),
    ("0f05", "0f syscall"),
    ("85c0", "11 test eax, eax"),
    ("7409", "13 je 0x1e"),
    ("83f8ea", "15 cmp eax, 0xffffffea        ; EINVAL: past the last capability"),
    ("0f8596000000", "18 jne 0xb4"),
    ("ffc6", "1e inc esi"),
    ("83fe40", "20 cmp esi, 0x40"),
    ("72e0", "23 jb 0x5"),
    ("31f6", "25 xor esi, esi               ; then check each of 0-63 is out of the bounding set"),
    ("b89d000000", "27 mov eax, 0x9d              ; prctl"),
    ("bf17000000", "2c mov edi, 0x17              ; PR_CAPBSET_READ"),
    ("0f05", "31 syscall"),
    ("83f801", "33 cmp eax, 0x1"),
    ("747c", "36 je 0xb4                    ; still in it (an EINVAL that lied): fail"),
    ("ffc6", "38 inc esi"),
    ("83fe40", "3a cmp esi, 0x40"),
    ("72e8", "3d jb 0x27"),
    ("b874000000", "3f mov eax, 0x74              ; setgroups(0, NULL)"),
    ("31ff", "44 xor edi, edi"),
    ("31f6", "46 xor esi, esi"),
    ("0f05", "48 syscall"),
    ("85c0", "4a test eax, eax"),
    ("7566", "4c jne 0xb4"),
    ("b877000000", "4e mov eax, 0x77              ; setresgid(0, 0, 0)"),
    ("31ff", "53 xor edi, edi"),
    ("31f6", "55 xor esi, esi"),
    ("31d2", "57 xor edx, edx"),
    ("0f05", "59 syscall"),
    ("85c0", "5b test eax, eax"),
    ("7555", "5d jne 0xb4"),
    ("b875000000", "5f mov eax, 0x75              ; setresuid(0, 0, 0)"),
    ("31ff", "64 xor edi, edi"),
    ("31f6", "66 xor esi, esi"),
    ("31d2", "68 xor edx, edx"),
    ("0f05", "6a syscall"),
    ("85c0", "6c test eax, eax"),
    ("7544", "6e jne 0xb4"),
    ("31c0", "70 xor eax, eax"),
    ("50", "72 push rax                   ; capset data: 2 x {effective, permitted, inheritable}"),
    ("50", "73 push rax"),
    ("50", "74 push rax"),
    ("4889e6", "75 mov rsi, rsp"),
    ("6822050820", "78 push 0x20080522            ; header: _LINUX_CAPABILITY_VERSION_3, pid 0"),
    ("4889e7", "7d mov rdi, rsp"),
    ("b87e000000", "80 mov eax, 0x7e              ; capset"),
    ("0f05", "85 syscall"),
    ("85c0", "87 test eax, eax"),
    ("7529", "89 jne 0xb4"),
    ("488b03", "8b mov rax, [rbx]             ; argc"),
    ("488d54c310", "8e lea rdx, [rbx+rax*8+0x10]  ; envp"),
    ("488d7310", "93 lea rsi, [rbx+0x10]        ; argv + 1"),
    ("488b3e", "97 mov rdi, [rsi]             ; argv[1]"),
    ("b83b000000", "9a mov eax, 0x3b              ; execve"),
    ("0f05", "9f syscall"),
    ("488d3566000000", "a1 lea rsi, [rip+0x66]        ; it failed: the exec message at 0x10e"),
    ("ba2e000000", "a8 mov edx, 0x2e"),
    ("bf7e000000", "ad mov edi, 0x7e              ; exit status 126"),
    ("eb11", "b2 jmp 0xc5"),
    ("488d3523000000", "b4 lea rsi, [rip+0x23]        ; fail: the switch message at 0xde"),
    ("ba30000000", "bb mov edx, 0x30"),
    ("bf7f000000", "c0 mov edi, 0x7f              ; exit status 127"),
    ("4189fc", "c5 mov r12d, edi"),
    ("b801000000", "c8 mov eax, 0x1               ; write(2, message, length)"),
    ("bf02000000", "cd mov edi, 0x2"),
    ("0f05", "d2 syscall"),
    ("b8e7000000", "d4 mov eax, 0xe7              ; exit_group(status)"),
    ("4489e7", "d9 mov edi, r12d"),
    ("0f05", "dc syscall"),
]
_MESSAGE = b"minisandbox: cannot switch to the sandbox's uid\n"  # at 0xde
_EXEC_MESSAGE = b"minisandbox: cannot execute the control shell\n"  # at 0x10e

_BASE = 0x400000  # where the one loadable segment goes (the code is position-independent)
_EHDR_SIZE, _PHDR_SIZE, _PHNUM = 64, 56, 2


def x86_64_code() -> bytes:
    """The program's code and message (the bytes at the ELF file's entry point)."""
    return bytes.fromhex("".join(h for h, _ in _X86_64)) + _MESSAGE + _EXEC_MESSAGE


def x86_64_elf() -> bytes:
    """A static ELF64 executable of x86_64_code: one read+execute segment, a non-executable
    stack, no sections."""
    body = x86_64_code()
    entry_off = _EHDR_SIZE + _PHNUM * _PHDR_SIZE
    size = entry_off + len(body)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, version 1
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        2,  # ET_EXEC
        0x3E,  # EM_X86_64
        1,
        _BASE + entry_off,
        _EHDR_SIZE,  # program headers right after
        0,  # no section headers
        0,
        _EHDR_SIZE,
        _PHDR_SIZE,
        _PHNUM,
        0,
        0,
        0,
    )
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, _BASE, _BASE, size, size, 0x1000)  # PT_LOAD, R+X
    stack = struct.pack("<IIQQQQQQ", 0x6474E551, 6, 0, 0, 0, 0, 0, 16)  # PT_GNU_STACK, R+W
    return ehdr + load + stack + body


_helpers: dict[Path, Path | None] = {}
_lock = threading.Lock()

HELPER_NAME = "drop-uid"


def supported() -> bool:
    """Whether this machine runs the program (else setpriv is used)."""
    return platform.machine() == "x86_64" and platform.system() == "Linux"


def drop_helper(process_dir: Path) -> Path | None:
    """The program, written once per process into `process_dir` (private to the caller), mode
    0111: only executed. None on a machine it is not written for."""
    if not supported():
        return None
    with _lock:
        if process_dir not in _helpers:
            path = process_dir / HELPER_NAME
            staging = process_dir / f"{HELPER_NAME}.tmp"
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
            try:
                os.write(fd, x86_64_elf())
                os.fchmod(fd, 0o111)
            finally:
                os.close(fd)
            os.rename(staging, path)
            _helpers[process_dir] = path
        return _helpers[process_dir]
