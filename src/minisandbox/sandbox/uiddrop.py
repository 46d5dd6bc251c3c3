"""The step a root caller's sandbox takes before its control shell: from host root (which its
bwrap needs for the setup) to the sandbox's own uid, with no groups and no capabilities.

util-linux's `setpriv` does it, but costs 1.5 ms a start (an exec of a dynamically linked
program: a fifth of a whole start). This module writes the same step as a static x86-64 program
of 215 bytes of code, made here from the instructions below (no compiled file is shipped); any
other machine uses setpriv. The program, with no libc and no data but its message:

1. empties the capability bounding set (prctl PR_CAPBSET_DROP for capabilities 0-63; EINVAL,
   a number past the kernel's last capability, is not an error): a later exec as the
   namespace's uid 0 gains nothing;
2. setgroups(0, NULL): host root's supplementary group 0 is gone;
3. setresgid(0, 0, 0) and setresuid(0, 0, 0): the namespace's 0 is the sandbox's host uid;
4. capset to empty effective, permitted and inheritable sets (the ambient set follows);
5. execve(argv[1], argv + 1, envp).

Any failed step writes one line to stderr and exits 127: nothing runs with the credentials of
a half-done switch.
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
    ("4889e3", "00 mov rbx, rsp             ; argc, argv..., 0, envp... (kept for step 5)"),
    ("31f6", "03 xor esi, esi              ; capability 0"),
    ("b89d000000", "05 mov eax, 157        ; prctl"),
    ("bf18000000", "0a mov edi, 24         ; PR_CAPBSET_DROP"),
    ("0f05", "0f syscall"),
    ("85c0", "11 test eax, eax"),
    ("7405", "13 je 0x1a"),
    ("83f8ea", "15 cmp eax, -22            ; EINVAL: past the last capability"),
    ("7569", "18 jne fail (0x83)"),
    ("ffc6", "1a inc esi"),
    ("83fe40", "1c cmp esi, 64"),
    ("72e4", "1f jb 0x05"),
    ("b874000000", "21 mov eax, 116        ; setgroups(0, NULL)"),
    ("31ff", "26 xor edi, edi"),
    ("31f6", "28 xor esi, esi"),
    ("0f05", "2a syscall"),
    ("85c0", "2c test eax, eax"),
    ("7553", "2e jne fail"),
    ("b877000000", "30 mov eax, 119        ; setresgid(0, 0, 0)"),
    ("31ff", "35 xor edi, edi"),
    ("31f6", "37 xor esi, esi"),
    ("31d2", "39 xor edx, edx"),
    ("0f05", "3b syscall"),
    ("85c0", "3d test eax, eax"),
    ("7542", "3f jne fail"),
    ("b875000000", "41 mov eax, 117        ; setresuid(0, 0, 0)"),
    ("31ff", "46 xor edi, edi"),
    ("31f6", "48 xor esi, esi"),
    ("31d2", "4a xor edx, edx"),
    ("0f05", "4c syscall"),
    ("85c0", "4e test eax, eax"),
    ("7531", "50 jne fail"),
    ("31c0", "52 xor eax, eax"),
    ("50", "54 push rax                  ; capset data: 2 x {effective, permitted, inheritable}"),
    ("50", "55 push rax"),
    ("50", "56 push rax"),
    ("4889e6", "57 mov rsi, rsp"),
    ("6822050820", "5a push 0x20080522     ; header: _LINUX_CAPABILITY_VERSION_3, pid 0"),
    ("4889e7", "5f mov rdi, rsp"),
    ("b87e000000", "62 mov eax, 126        ; capset"),
    ("0f05", "67 syscall"),
    ("85c0", "69 test eax, eax"),
    ("7516", "6b jne fail"),
    ("488b03", "6d mov rax, [rbx]          ; argc"),
    ("488d54c310", "70 lea rdx, [rbx+rax*8+16] ; envp"),
    ("488d7310", "75 lea rsi, [rbx+16]       ; argv + 1"),
    ("488b3e", "79 mov rdi, [rsi]          ; argv[1]"),
    ("b83b000000", "7c mov eax, 59         ; execve"),
    ("0f05", "81 syscall"),
    ("b801000000", "83 fail: mov eax, 1    ; write(2, message, 48)"),
    ("bf02000000", "88 mov edi, 2"),
    ("488d3513000000", "8d lea rsi, [rip+0x13] ; the message at 0xa7"),
    ("ba30000000", "94 mov edx, 48"),
    ("0f05", "99 syscall"),
    ("b8e7000000", "9b mov eax, 231        ; exit_group(127)"),
    ("bf7f000000", "a0 mov edi, 127"),
    ("0f05", "a5 syscall"),
]
_MESSAGE = b"minisandbox: cannot switch to the sandbox's uid\n"

_BASE = 0x400000  # where the one loadable segment goes (the code is position-independent)
_EHDR_SIZE, _PHDR_SIZE, _PHNUM = 64, 56, 2


def x86_64_code() -> bytes:
    """The program's code and message (the bytes at the ELF file's entry point)."""
    # (0xa7 bytes: `lea rsi, [rip+0x13]` at 0x8d addresses the message right after them.)
    return bytes.fromhex("".join(h for h, _ in _X86_64)) + _MESSAGE


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
