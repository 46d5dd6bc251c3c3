"""The program a root caller's sandbox drops its credentials with (sandbox/uiddrop.py), run for
real: each of its steps seen in /proc/self/status of what it executes; a refused step ends it
before it executes anything. (The attack suite's `keep_host_credentials` checks the same inside
sandboxes, for both callers.)"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.sandbox import uiddrop

pytestmark = pytest.mark.skipif(not uiddrop.supported(), reason="the program is x86-64 Linux")
IS_ROOT = os.geteuid() == 0
OTHER_UID = 4242  # an unprivileged uid (root runs only)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can reach and write (pytest's tmp_path is private), in the
    session's temp directory (removed however the run ends)."""
    path = Path(tempfile.mkdtemp())
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def helper(shared_dir: Path) -> Path:
    path = uiddrop.drop_helper(shared_dir)  # (mode 0111, as the sandbox has it)
    assert path is not None
    return path


def status(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def test_code_addresses_its_messages() -> None:
    """Each `lea rsi, [rip+N]` lands on its message and the `mov edx, N` after it writes all
    of it (the offsets of the instruction list are checked too)."""
    code = uiddrop.x86_64_code()
    switch = b"minisandbox: cannot switch to the sandbox's uid\n"
    execute = b"minisandbox: cannot execute the control shell\n"
    for at, message in ((0xB4, switch), (0xA1, execute)):
        assert code[at : at + 3] == bytes.fromhex("488d35")
        target = at + 7 + int.from_bytes(code[at + 3 : at + 7], "little")
        assert code[target : target + len(message)] == message
        assert code[at + 7] == 0xBA and int.from_bytes(code[at + 8 : at + 12], "little") == len(
            message
        )
    offset = 0
    for hexed, text in uiddrop._X86_64:
        assert int(text.split()[0], 16) == offset, text
        offset += len(bytes.fromhex(hexed))


def test_elf_shape() -> None:
    elf = uiddrop.x86_64_elf()
    assert elf[:4] == b"\x7fELF" and elf[4:6] == b"\x02\x01"  # 64-bit, little-endian
    e_type, e_machine, _v, entry, phoff = struct.unpack_from("<HHIQQ", elf, 16)
    assert (e_type, e_machine, phoff) == (2, 0x3E, 64)
    p_type, p_flags, p_off, vaddr, _pa, filesz, memsz, _al = struct.unpack_from(
        "<IIQQQQQQ", elf, 64
    )
    assert (p_type, p_flags, p_off, filesz, memsz) == (1, 5, 0, len(elf), len(elf))  # R+X only
    assert vaddr <= entry < vaddr + filesz
    assert elf[entry - vaddr :] == uiddrop.x86_64_code()
    gnu_stack, stack_flags = struct.unpack_from("<II", elf, 64 + 56)
    assert (gnu_stack, stack_flags) == (0x6474E551, 6)  # the stack is not executable


def test_written_once_per_directory_execute_only(tmp_path: Path) -> None:
    first = uiddrop.drop_helper(tmp_path)
    assert first is not None and uiddrop.drop_helper(tmp_path) == first
    st = os.lstat(first)
    assert oct(st.st_mode & 0o7777) == oct(0o111)
    assert st.st_uid == os.geteuid()
    assert sorted(os.listdir(tmp_path)) == [uiddrop.HELPER_NAME]  # no staging file left


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="root (setpriv)")
def test_drops_groups_and_capabilities(helper: Path) -> None:
    """Run by root holding supplementary groups and every capability: what it executes has no
    groups and no capabilities at all, bounding set included."""
    r = subprocess.run(
        ["setpriv", "--groups=4,6", "--", str(helper), "/bin/cat", "/proc/self/status"],
        capture_output=True,
        text=True,
        check=True,
    )
    control = subprocess.run(
        ["setpriv", "--groups=4,6", "--", "/bin/cat", "/proc/self/status"],
        capture_output=True,
        text=True,
        check=True,
    )
    before = status(control.stdout)
    assert before["Groups"].split() == ["4", "6"] and int(before["CapBnd"], 16) != 0
    after = status(r.stdout)
    assert after["Groups"] == ""
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(after[cap], 16) == 0, f"{cap}: {after[cap]}"
    assert after["Uid"].split() == ["0"] * 4 and after["Gid"].split() == ["0"] * 4


def test_refused_step_executes_nothing(helper: Path, shared_dir: Path) -> None:
    """Without the capabilities to drop, it says so and ends (127) before its command."""
    marker = shared_dir / "ran"
    argv = [str(helper), "/usr/bin/touch", str(marker)]
    if IS_ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv to become an unprivileged uid")
        argv = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *argv]
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 127, r
    assert r.stderr == "minisandbox: cannot switch to the sandbox's uid\n"
    assert not marker.exists()
    control = subprocess.run(argv[: argv.index(str(helper))] + argv[-2:], capture_output=True)
    assert control.returncode == 0 and marker.exists(), "touch does not run (positive control)"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare (util-linux)")
def test_refused_setgroups_executes_nothing(helper: Path, shared_dir: Path) -> None:
    """In a user namespace of our own whose setgroups is denied (unshare -r), the bounding set
    can be emptied but the groups cannot be cleared: it ends (127) before its command."""
    marker = shared_dir / "ran"
    unshare = ["unshare", "-r", "--"]
    r = subprocess.run([*unshare, str(helper), "/usr/bin/touch", str(marker)], capture_output=True)
    assert r.returncode == 127 and b"cannot switch" in r.stderr, r
    assert not marker.exists()
    control = subprocess.run([*unshare, "/usr/bin/touch", str(marker)], capture_output=True)
    assert control.returncode == 0 and marker.exists(), f"positive control: {control}"


@pytest.mark.skipif(not IS_ROOT, reason="the switch succeeds for root only")
def test_failed_exec_says_so(helper: Path) -> None:
    r = subprocess.run([str(helper), "/nonexistent/control-shell"], capture_output=True)
    assert (r.returncode, r.stderr) == (126, b"minisandbox: cannot execute the control shell\n")


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="root (setpriv)")
async def test_setpriv_where_the_program_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine the program is not written for, a root caller's sandbox drops with setpriv:
    the same credentials (the attack suite's check), and the channel directory stays 300."""
    from attacks import check_credentials  # (the attack suite's imports: root runs only)

    monkeypatch.setattr(uiddrop, "supported", lambda: False)
    sb = Sandbox(SandboxConfig())
    held = os.getgroups()
    os.setgroups([0, 6])
    try:
        await sb.start()
    finally:
        os.setgroups(held)
    try:
        assert sb.upper_dir is not None
        io = sb.upper_dir.parent / "io"
        assert stat.S_IMODE(os.stat(io).st_mode) == 0o300
        assert not os.path.lexists(io / uiddrop.HELPER_NAME)
        await check_credentials(sb)
    finally:
        await sb.stop()
