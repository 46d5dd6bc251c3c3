"""Sandbox lifecycle, commands, layers and files, on real bwrap sandboxes."""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import pickle
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import give_to_sandbox
from minisandbox import Limits, Sandbox, SandboxConfig, SyncSandbox
from minisandbox.errors import (
    BwrapNotFoundError,
    CommandTimeoutError,
    ControlProtocolError,
    InvalidCommandError,
    MiniSandboxError,
    SandboxConfigError,
    SandboxFileError,
    SandboxLoopError,
    SandboxNotRunningError,
    SandboxStartError,
)
from minisandbox.sandbox import startup, sync
from minisandbox.sandbox.channel import ChannelDir, ControlChannel, Job, env_words


async def test_execute_separates_streams_and_passes_exit_code(sandbox: Sandbox) -> None:
    r = await sandbox.execute("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    merged = await sandbox.execute("echo out; echo err >&2", merge_stderr=True)
    assert merged.stdout == "out\nerr\n" and merged.stderr == ""


async def test_execute_argv_cwd_env_stdin(sandbox: Sandbox) -> None:
    r = await sandbox.execute(["printf", "%s|", "a b", "$HOME", "'q'"])
    assert r.stdout == "a b|$HOME|'q'|"
    r = await sandbox.execute("pwd; echo $FOO", cwd="/tmp", env={"FOO": "bar baz"})
    assert r.stdout == "/tmp\nbar baz\n"
    r = await sandbox.execute(["tr", "a-z", "A-Z"], stdin="hello\n")
    assert r.stdout == "HELLO\n"
    missing = await sandbox.execute("true", cwd="/does/not/exist")
    assert missing.exit_code != 0


async def test_environment_is_clean_and_root_like(sandbox: Sandbox) -> None:
    os.environ["MSB_TEST_HOST_ONLY"] = "leak"
    try:
        async with Sandbox() as sb:
            r = await sb.execute("env; id -u; echo $HOME; hostname")
    finally:
        del os.environ["MSB_TEST_HOST_ONLY"]
    assert "MSB_TEST_HOST_ONLY" not in r.stdout
    for expected in ("PATH=/usr/local/sbin:", "HOME=/root", "LANG=C.UTF-8"):
        assert expected in r.stdout
    assert r.stdout.splitlines()[-3:] == ["0", "/root", "sandbox"]


async def test_venv_goes_on_path(layer_dir: Path) -> None:
    venv_bin = layer_dir / "opt" / "env" / "bin"
    venv_bin.mkdir(parents=True)
    tool = venv_bin / "hello-tool"
    tool.write_text("#!/bin/sh\necho from-venv\n")
    tool.chmod(0o755)
    async with Sandbox(layers=[layer_dir], venv="/opt/env") as sb:
        r = await sb.execute("hello-tool; echo $VIRTUAL_ENV")
    assert r.stdout == "from-venv\n/opt/env\n"


async def test_timeout_kills_the_process_group(sandbox: Sandbox) -> None:
    began = time.monotonic()
    with pytest.raises(CommandTimeoutError) as info:
        await sandbox.execute("echo started; sleep 100 & sleep 100", timeout=0.5)
    assert time.monotonic() - began < 10
    assert "started" in info.value.output
    ps = await sandbox.execute("ps -eo args")
    assert "sleep 100" not in ps.stdout
    assert (await sandbox.execute("echo alive")).stdout == "alive\n"


async def test_a_cancelled_command_is_killed_and_the_cancellation_goes_on(
    sandbox: Sandbox,
) -> None:
    """A caller that gives up on a command (an episode's deadline) leaves nothing running."""
    up = asyncio.Event()
    task = asyncio.ensure_future(
        sandbox.execute("echo up; sleep 100 & sleep 100", on_output=lambda _fd, data: up.set())
    )
    await up.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancellation does not wait for the kill: on a busy machine the group may take a
    # moment to go (exited but not yet reaped counts as gone).
    live: list[str] = []
    for _ in range(300):
        ps = await sandbox.execute("ps -eo stat=,args=")
        live = [
            line
            for line in ps.stdout.splitlines()
            if "sleep 100" in line and "Z" not in line.split()[0]
        ]
        if not live:
            break
        await asyncio.sleep(0.1)
    assert not live
    assert (await sandbox.execute("echo alive")).stdout == "alive\n"


async def test_a_call_from_another_event_loop_fails_at_once(sandbox: Sandbox) -> None:
    """The sandbox's control channel is read by the loop that started it: a call from another
    loop (here the process's sandbox loop, in its thread) would wait for a reply it never
    sees. It is refused at once instead; the same call from the sandbox's loop works, and so
    does the SWE-ReX runtime's, which sends it there (sync.home_loop)."""
    other = sync.background_loop()
    assert other is not asyncio.get_running_loop()
    assert sandbox.loop is asyncio.get_running_loop()
    call = asyncio.run_coroutine_threadsafe(sandbox.execute(["echo", "hi"]), other)
    with pytest.raises(SandboxLoopError, match="another event loop"):
        await asyncio.wait_for(asyncio.wrap_future(call), 60)
    assert (await sandbox.execute(["echo", "hi"])).stdout == "hi\n"  # (positive control)
    assert sync.home_loop(sandbox) is asyncio.get_running_loop()
    r = await sync.on_loop(sandbox.execute(["echo", "hi"]), sync.home_loop(sandbox))
    assert r.stdout == "hi\n"


async def test_output_is_capped_and_non_utf8_is_kept(sandbox: Sandbox) -> None:
    r = await sandbox.execute("head -c 5000000 /dev/zero | tr '\\0' x", max_output=100_000)
    assert r.truncated and len(r.stdout) < 200_000 and "omitted" in r.stdout
    raw = await sandbox.execute("printf 'ok\\xff\\xfe'")
    assert raw.stdout == "ok\\xff\\xfe"


async def test_concurrent_commands(sandbox: Sandbox) -> None:
    results = await asyncio.gather(*(sandbox.execute(f"sleep 0.2; echo {i}") for i in range(12)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


async def test_layers_overlay_in_order_and_writes_stay_in_upper(tmp_path: Path) -> None:
    base = Path(tmp_path / "low")
    top = Path(tmp_path / "top")
    for d, text in ((base, "low"), (top, "top")):
        (d / "testbed").mkdir(parents=True)
        (d / "testbed" / "shared.txt").write_text(text)
    (base / "testbed" / "only-low.txt").write_text("only low")
    os.chmod(tmp_path, 0o755)
    give_to_sandbox(base)
    give_to_sandbox(top)
    upper = tmp_path / "kept-upper"
    async with Sandbox(layers=[base, top], upper=upper) as sb:
        r = await sb.execute("cat shared.txt only-low.txt; echo new > shared.txt; echo x > new.txt")
        assert r.stdout == "toponly low", r.stderr
    assert (top / "testbed" / "shared.txt").read_text() == "top"
    assert (base / "testbed" / "shared.txt").read_text() == "low"
    assert (upper / "testbed" / "shared.txt").read_text() == "new\n"
    assert (upper / "testbed" / "new.txt").read_text() == "x\n"
    assert not any(p.name.startswith(".kept-upper.work") for p in tmp_path.iterdir())
    # A kept upper layer carries the changes into the next sandbox.
    async with Sandbox(layers=[base, top], upper=upper) as sb:
        assert (await sb.execute("cat shared.txt new.txt")).stdout == "new\nx\n"
        # The sandbox may open its `/` (the upper) to everyone; stop() makes it private again.
        assert (await sb.execute("chmod 755 / && stat -c %a /")).stdout == "755\n"
    assert oct(upper.stat().st_mode & 0o7777) == oct(0o700)


async def test_kept_upper_loses_set_id_bits_of_copied_up_files(layer_dir: Path) -> None:
    """Seccomp refuses set-id modes, but a lower layer's set-id file keeps its bit when it is
    copied up: a kept upper is swept at stop (and at the next start)."""
    lower = layer_dir / "lower"
    (lower / "opt").mkdir(parents=True)
    (lower / "opt" / "tool").write_text("#!/bin/sh\n")
    give_to_sandbox(lower)
    os.chmod(lower / "opt" / "tool", 0o4755)
    upper = layer_dir / "upper"
    async with Sandbox(layers=[lower], upper=upper) as sb:
        r = await sb.execute("touch /opt/tool && stat -c %a /opt/tool")
        assert r.stdout == "4755\n", r.output
        assert (upper / "opt" / "tool").stat().st_mode & 0o7777 == 0o4755  # copied up as is
    assert (upper / "opt" / "tool").stat().st_mode & 0o7777 == 0o755


async def test_ro_paths_are_visible_and_read_only(layer_dir: Path) -> None:
    # Nested under /tmp: its parents lie in the sandbox's own /tmp and must be traversable.
    shown = layer_dir / "nested" / "deeper"
    shown.mkdir(parents=True)
    (shown / "data.txt").write_text("host data")
    async with Sandbox(ro_paths=[shown]) as sb:
        r = await sb.execute(f"cat {shown}/data.txt; echo x > {shown}/data.txt")
    assert r.stdout == "host data" and r.exit_code != 0, r.stderr
    assert (shown / "data.txt").read_text() == "host data"


async def test_host_python_runs_inside_via_ro_paths() -> None:
    import sys

    async with Sandbox(ro_paths=[Path(sys.base_prefix)]) as sb:
        exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        r = await sb.execute([exe, "-c", "import sys; print(sys.version_info[:2])"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == str(sys.version_info[:2])


async def test_symlink_on_a_mount_destination_is_refused(layer_dir: Path) -> None:
    # A layer (say, built from an earlier agent's upper dir) that redirects /run or /etc.
    (layer_dir / "run").symlink_to("/root")
    with pytest.raises(SandboxConfigError, match="symlink"):
        async with Sandbox(layers=[layer_dir]):
            pass
    (layer_dir / "run").unlink()
    (layer_dir / "etc").mkdir()
    (layer_dir / "etc" / "hosts").symlink_to("/etc/shadow")
    with pytest.raises(SandboxConfigError, match="symlink"):
        async with Sandbox(layers=[layer_dir]):
            pass


async def test_stops_remove_their_directories_side_by_side_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Removing a sandbox's directories (seconds for a large upper layer) runs in a thread:
    two sandboxes stopping at once remove theirs at the same time, and the event loop goes on
    meanwhile. (Each removal waits at a barrier for the other: removals done one after the
    other on the loop would never meet there.)"""
    import threading

    import minisandbox.sandbox.sandbox as sandbox_module

    real = sandbox_module.safefs.discard_tree
    meet = threading.Barrier(2, timeout=60)
    threads: list[int] = []

    def discard_tree(path: Path) -> None:
        threads.append(threading.get_ident())
        meet.wait()  # raises BrokenBarrierError if the other removal never comes
        real(path)

    monkeypatch.setattr(sandbox_module.safefs, "discard_tree", discard_tree)
    boxes = [Sandbox(SandboxConfig()) for _ in range(2)]
    for sb in boxes:
        await sb.start()
        assert (await sb.execute(["true"])).exit_code == 0  # positive control
    await asyncio.gather(*(sb.stop() for sb in boxes))
    assert len(threads) == 2 and threading.get_ident() not in threads, threads
    assert not any(sb.running for sb in boxes)


async def test_stop_is_idempotent_and_safe_before_start() -> None:
    sb = Sandbox()
    await sb.stop()
    await sb.stop()
    with pytest.raises(SandboxStartError):
        await sb.start()
    sb2 = Sandbox()
    await sb2.start()
    runtime_dir = sb2._dir
    assert runtime_dir is not None and runtime_dir.exists()
    await sb2.stop()
    await sb2.stop()
    assert not runtime_dir.exists()
    with pytest.raises(SandboxNotRunningError):
        await sb2.execute("true")


async def test_a_control_shell_that_cannot_run_fails_the_start_with_bwraps_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bwrap exits when its command cannot run; the start says why at once (it waited out its
    30 s timeout before: the host's spare FIFO end hid the end of the channel)."""
    real = startup.bwrap_argv

    def missing_shell(*args: Any, **kwargs: Any) -> list[str]:
        argv = real(*args, **kwargs)
        at = argv.index("-c") - 1  # the control shell's path
        argv[at] = "/run/minisandbox/no-such-shell"
        return argv

    monkeypatch.setattr(startup, "bwrap_argv", missing_shell)
    sb = Sandbox()
    with pytest.raises(SandboxStartError, match="no-such-shell"):
        await sb.start()
    assert not sb.running
    monkeypatch.undo()
    async with Sandbox() as ok:  # positive control
        assert (await ok.execute(["true"])).exit_code == 0


async def test_sandbox_that_exits_reports_it(sandbox: Sandbox) -> None:
    # Killing everything it may signal kills the control shell too: the sandbox ends.
    with pytest.raises(SandboxNotRunningError):
        await sandbox.execute("kill -9 -1; sleep 5", timeout=20)
    with pytest.raises(SandboxNotRunningError):
        await sandbox.execute("true")


async def test_files_roundtrip(sandbox: Sandbox, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 1000
    await sandbox.write_file("/root/sub/dir/blob.bin", blob)
    assert await sandbox.read_file("/root/sub/dir/blob.bin") == blob
    await sandbox.write_file("relative.txt", "in workdir", mode=0o600)
    r = await sandbox.execute("stat -c %a /testbed/relative.txt; cat /testbed/relative.txt")
    assert r.stdout == "600\nin workdir"
    with pytest.raises(SandboxFileError, match="No such file"):
        await sandbox.read_file("/nope")
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "link").symlink_to("pkg/mod.py")
    await sandbox.upload(src, "/root/up")
    r = await sandbox.execute("cat /root/up/pkg/mod.py /root/up/link; readlink /root/up/link")
    assert r.stdout == "X = 1\nX = 1\npkg/mod.py\n"
    await sandbox.upload(src / "pkg" / "mod.py", "/root/single.py")
    assert await sandbox.read_file("/root/single.py") == b"X = 1\n"


async def test_limits_tmp_size_and_processes() -> None:
    async with Sandbox(limits=Limits(tmp_bytes=8 * 1024 * 1024, processes=32)) as sb:
        full = await sb.execute("head -c 20000000 /dev/zero > /tmp/fill")
        assert full.exit_code != 0 and "No space left" in full.stderr
        forks = await sb.execute("for i in $(seq 60); do sleep 5 & done; wait", timeout=30)
        assert forks.exit_code != 0 or "retry" in forks.stderr or "fork" in forks.stderr


async def test_read_file_refuses_what_is_not_a_small_regular_file(sandbox: Sandbox) -> None:
    script = (
        "ln -s /dev/zero /tmp/zero && mkfifo /tmp/fifo && mkdir /tmp/dir && "
        "head -c 3000 /dev/zero > /tmp/3k && ln -s /tmp/3k /tmp/link && : > /tmp/empty"
    )
    assert (await sandbox.execute(script)).exit_code == 0
    with pytest.raises(SandboxFileError, match=r"/tmp/zero.*character special file"):
        await sandbox.read_file("/tmp/zero")
    with pytest.raises(SandboxFileError, match=r"/tmp/fifo.*fifo, not a regular file"):
        await sandbox.read_text("/tmp/fifo")
    with pytest.raises(SandboxFileError, match="Is a directory"):
        await sandbox.read_file("/tmp/dir")
    with pytest.raises(SandboxFileError, match="No such file"):
        await sandbox.read_file("/tmp/missing")
    assert await sandbox.read_file("/tmp/link", max_bytes=3000) == bytes(3000)
    assert await sandbox.read_file("/tmp/empty", max_bytes=0) == b""
    with pytest.raises(SandboxFileError, match=r"/tmp/3k.*more than 2999 bytes.*max_bytes"):
        await sandbox.read_file("/tmp/3k", max_bytes=2999)
    with pytest.raises(SandboxFileError, match="max_bytes"):
        await sandbox.read_file("/tmp/3k", max_bytes=None)  # type: ignore[arg-type]
    assert (await sandbox.read_text("/proc/self/status")).startswith("Name:")
    assert sandbox.running


async def test_no_set_id_bits_through_file_calls(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(SandboxFileError, match="set-user-id"):
        await sandbox.write_file("/tmp/f", "x", mode=0o4755)
    await sandbox.write_file("/tmp/f", "x", mode=0o1755)
    assert (await sandbox.execute("stat -c %a /tmp/f")).stdout == "1755\n"
    # Uploading a host file or tree with set-id bits: they are dropped, the rest is kept.
    (tmp_path / "tree" / "shared").mkdir(parents=True)
    (tmp_path / "tree" / "tool").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "tree" / "tool", 0o4755)
    os.chmod(tmp_path / "tree" / "shared", 0o2775)
    await sandbox.upload(tmp_path / "tree", "/root/tree")
    await sandbox.upload(tmp_path / "tree" / "tool", "/root/one")
    r = await sandbox.execute("stat -c %a /root/tree/tool /root/tree/shared /root/one")
    assert r.stdout.split() == ["755", "775", "755"], r.output


def test_sync_facade() -> None:
    with SyncSandbox() as sb:
        assert sb.running and sb.pid is not None and sb.id
        assert sb.execute("echo hi").stdout == "hi\n"
        seen: list[tuple[int, bytes]] = []
        r = sb.execute(
            "cat; echo err >&2", stdin="in", on_output=lambda fd, b: seen.append((fd, b))
        )
        assert (r.stdout, r.stderr) == ("in", "err\n")
        assert b"".join(b for fd, b in seen if fd == 1) == b"in"
        session = sb.create_session(env={"WHO": "sync"})
        session.run("cd /tmp")
        assert session.run("pwd").output == "/tmp\n"
        assert sb.session().run("echo $WHO").output == "sync\n" and not session.busy
        assert sb.sessions == ["default"]
        sb.close_session("default")
        assert sb.sessions == []
        sb.write_file("/root/f", b"data")
        assert sb.read_file("/root/f") == b"data"
        assert sb.read_text("/root/f") == "data"
        with pytest.raises(SandboxFileError, match="more than"):
            sb.read_file("/root/f", max_bytes=2)
    assert not sb.running


def _parameters(cls: type) -> dict[str, list[tuple[str, object, object]]]:
    """Each public method's parameters (name, kind, default) and each property, by name."""
    out: dict[str, list[tuple[str, object, object]]] = {}
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out[name] = [("property", None, None)]
        elif callable(member):
            sig = inspect.signature(member)
            out[name] = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
    return out


def test_the_sync_api_is_the_async_api_made_blocking() -> None:
    """mypy checks each backend against its protocol; this checks the two protocols agree,
    parameter by parameter (names, kinds, defaults)."""
    from minisandbox.sandbox import api

    assert _parameters(api.SyncSandboxAPI) == _parameters(api.SandboxAPI)
    assert _parameters(api.SyncSessionAPI) == _parameters(api.SessionAPI)
    assert {"execute", "read_text", "session", "create_session", "stop"} <= set(
        _parameters(api.SandboxAPI)
    )
    assert isinstance(Sandbox(), api.SandboxAPI)


def test_bad_configuration_is_named() -> None:
    with pytest.raises(ValueError, match="not a directory"):
        SandboxConfig(layers=["/does/not/exist"])
    with pytest.raises(ValueError, match="absolute"):
        SandboxConfig(workdir="relative")


async def test_missing_bwrap_is_named(tmp_path: Path) -> None:
    with pytest.raises(BwrapNotFoundError, match="not executable"):
        async with Sandbox(bwrap=tmp_path / "bwrap"):
            pass


def test_user_namespaces_switched_off_is_named() -> None:
    """In a user namespace of our own whose user.max_user_namespaces is 0, starting a sandbox
    must fail at once and name the setting, not hang or print a bare bwrap error."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    code = (
        "import asyncio\n"
        "from minisandbox import Sandbox\n"
        "from minisandbox.errors import UserNamespacesUnavailableError\n"
        "try:\n"
        "    asyncio.run(Sandbox().start())\n"
        "except UserNamespacesUnavailableError as e:\n"
        "    print('NAMED:', e)\n"
    )
    r = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "sh",
            "-c",
            'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
            "sh",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if r.returncode != 0 and "unshare" in r.stderr and "NAMED" not in r.stdout:
        pytest.skip(f"cannot make a user namespace here: {r.stderr.strip()}")
    assert "NAMED:" in r.stdout, r.stdout + r.stderr
    assert "max_user_namespaces" in r.stdout


async def test_cgroup_limits_where_delegated() -> None:
    from minisandbox.sandbox.cgroups import delegated_parent

    if delegated_parent() is None:
        pytest.skip("no delegated cgroup v2 with memory and pids controllers here (rlimits only)")
    limits = Limits(processes=40, total_memory_bytes=256 * 1024 * 1024)
    async with Sandbox(limits=limits) as sb:
        assert sb._cgroup is not None
        assert (sb._cgroup.path / "pids.max").read_text().strip() == "40"
        assert str(sb.pid) in (sb._cgroup.path / "cgroup.procs").read_text().split()
        hog = await sb.execute(["python3", "-c", "b = bytearray(600 * 1024 * 1024); print('no')"])
        assert hog.exit_code != 0 and "no" not in hog.stdout
        path = sb._cgroup.path
    assert not path.exists()


# --------------------------------------------- caps that hold, crashes that leave nothing


def test_disk_usage_counts_blocks_and_inodes_and_stops_at_a_cap(tmp_path: Path) -> None:
    from minisandbox.sandbox.watchdog import disk_usage as _disk_usage

    (tmp_path / "d" / "e").mkdir(parents=True)
    for i in range(50):
        (tmp_path / "d" / f"empty{i}").touch()
    (tmp_path / "d" / "e" / "data").write_bytes(b"x" * (1 << 20))
    os.link(tmp_path / "d" / "e" / "data", tmp_path / "d" / "hardlink")  # counted once
    os.symlink("/usr", tmp_path / "d" / "link")  # counted, never followed
    usage = _disk_usage([tmp_path])
    assert usage.inodes == 2 + 50 + 1 + 1  # d, e, the empty files, data, link
    assert 1 << 20 <= usage.bytes < 2 << 20 and usage.breach is None
    assert _disk_usage([tmp_path], max_inodes=10).breach == "inodes"
    assert _disk_usage([tmp_path], max_bytes=1 << 19).breach == "bytes"
    assert _disk_usage([tmp_path / "missing"]).inodes == 0


async def test_upper_caps_bound_one_file_and_name_the_limit() -> None:
    """RLIMIT_FSIZE is at most upper_bytes; crossing a cap names it and the fix."""
    limits = Limits(upper_bytes=8 * 1024 * 1024, file_size_bytes=1 << 30)
    async with Sandbox(limits=limits) as sb:
        r = await sb.execute("ulimit -f")
        assert int(r.stdout) * 1024 == 8 * 1024 * 1024
    from minisandbox.errors import SandboxLimitError

    async with Sandbox(limits=Limits(upper_inodes=500)) as sb:
        with pytest.raises(SandboxLimitError, match=r"Limits\.upper_inodes"):
            await sb.execute(
                "mkdir /root/f && for i in $(seq 700); do : > /root/f/$i; done; sleep 60",
                timeout=60,
            )


async def test_whole_sandbox_memory_has_a_default_cap_and_the_oom_killer_prefers_it() -> None:
    from minisandbox.sandbox import memory

    assert Limits().total_memory_bytes is None  # a share of the host's memory
    assert 0 < memory.default_share() < memory.host_memory()
    async with Sandbox() as sb:
        r = await sb.execute("cat /proc/self/oom_score_adj")
        assert r.stdout == f"{memory.OOM_SCORE_ADJ}\n", r.output
    with pytest.raises(ValueError):
        Limits(total_memory_bytes=-1)


async def test_kept_upper_work_dir_names_its_owner_and_dead_owners_are_swept(
    tmp_path: Path,
) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    # A dead owner's: a pid above the kernel's maximum names no process.
    dead = tmp_path / ".upper.work-p999999999-123-abcdef"
    (dead / "work").mkdir(parents=True)
    foreign = tmp_path / ".upper.work-0123456789ab"  # an old-style name: owner unknown, kept
    foreign.mkdir()
    async with Sandbox(upper=upper) as sb:
        assert not dead.exists()
        mine = [p.name for p in tmp_path.iterdir() if p.name.startswith(".upper.work-p")]
        assert len(mine) == 1 and mine[0].startswith(f".upper.work-p{os.getpid()}-")
        assert sb._dir is not None
        registered = (sb._dir / "external-dirs").read_text().split()
        assert registered == [str(tmp_path / mine[0])]
    assert foreign.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".upper.work-p")]


# --------------------------------------------- the control channel, errors, helper files


async def _channel_over_socket(tmp_path: Path) -> tuple[ControlChannel, socket.socket]:
    """A ControlChannel whose control shell is the test: it reads what the host sends and
    writes the replies on the other end of a socket pair."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    channel = ControlChannel(reader, writer, ChannelDir(tmp_path))
    channel.start()
    theirs.sendall(b"R\n")
    await asyncio.wait_for(channel.ready(), 30)
    return channel, theirs


def _command(channel: ControlChannel) -> Job:
    return channel.start_command(
        ["true"], cwd="/", env={}, mark="m", stdin="/dev/null", stdout="/dev/null", stderr=None
    )


async def test_malformed_control_reply_fails_its_waiter_not_a_success(tmp_path: Path) -> None:
    channel, shell = await _channel_over_socket(tmp_path)
    try:
        job = _command(channel)
        assert job.exited is not None
        sent = await asyncio.wait_for(asyncio.to_thread(shell.recv, 65536), 30)
        assert f'echo "X {job.id} $?" >&9'.encode() in sent  # the line the shell would run
        # A status that is not a number (a Unicode digit included): an error, never exit 0.
        shell.sendall(f"P {job.id} 42\nX {job.id} ²\n".encode())
        assert await asyncio.wait_for(job.started, 30) == 42
        with pytest.raises(ControlProtocolError, match="malformed control reply"):
            await asyncio.wait_for(job.exited, 30)
        channel.forget(job)
        # Lines that name no waiting job are dropped; the channel keeps working.
        other, extra = _command(channel), _command(channel)
        assert other.exited is not None and extra.exited is not None
        shell.sendall(f"garbage\nX\nX nobody 1\nX {other.id} -3\nX {extra.id} 1 2\n".encode())
        assert await asyncio.wait_for(other.exited, 30) == -3
        with pytest.raises(ControlProtocolError):
            await asyncio.wait_for(extra.exited, 30)
        # The end of the channel fails whatever still waits.
        last = _command(channel)
        assert last.exited is not None
        shell.close()
        with pytest.raises(SandboxNotRunningError):
            await asyncio.wait_for(last.exited, 30)
        assert channel.closed
        with pytest.raises(SandboxNotRunningError):
            _command(channel)
    finally:
        shell.close()
        await channel.close()


def test_env_words_is_the_one_quoting_and_refuses_bad_names() -> None:
    value = "a b 'c' \"d\" $(touch /x) `e` \\f\ng"
    words = env_words({"A": value, "-S": "x"})
    assert "\n" not in words  # the control shell reads a line at a time
    # As the control shell (bash) reads them.
    split = 'eval "set -- $1"; printf "%s\\0" "$@"'
    out = subprocess.run(["bash", "-c", split, "sh", words], capture_output=True, check=True)
    assert out.stdout.decode().split("\0")[:-1] == [f"A={value}", "-S=x"]
    for bad in ({"": "x"}, {"A=B": "x"}, {"A": "x\0"}):
        with pytest.raises(InvalidCommandError):
            env_words(bad)
    assert issubclass(InvalidCommandError, ValueError)


async def test_variables_reach_commands_and_sessions_alike(sandbox: Sandbox) -> None:
    value = "a b 'c' \"d\" $(echo injected) `echo x` \\e"
    env = {"ODD": value, "PLAIN": "p"}
    r = await sandbox.execute(["printenv", "ODD", "PLAIN"], env=env)
    assert r.stdout == f"{value}\np\n", r.output
    session = await sandbox.create_session("odd", env=env)
    assert (await session.run('printf "%s|%s" "$ODD" "$PLAIN"')).output == f"{value}|p"
    for bad in ({"A=B": "x"}, {"": "x"}):
        with pytest.raises(InvalidCommandError):
            await sandbox.execute("true", env=bad)
        with pytest.raises(InvalidCommandError):
            await sandbox.create_session("bad", env=bad)
    assert sandbox.sessions == ["odd"]
    with pytest.raises(ValueError, match="empty command"):  # InvalidCommandError is one
        await sandbox.execute([])


async def test_names_bash_keeps_for_itself_reach_commands_as_given(sandbox: Sandbox) -> None:
    """Plain names are exported by the control shell's subshell, the rest (names bash sets,
    refuses or acts on; names no shell can export) go through env(1): every one arrives."""
    env = {"UID": "5", "SHELLOPTS": "x", "BASH_ENV": "/nowhere", "IFS": ":", "A-B": "1", "_": "u"}
    env |= {"BASH_FUNC_true%%": "() { echo planted; }", "PLAIN": "p"}
    r = await sandbox.execute(["env"], env=env)
    got = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert {k: got.get(k) for k in env} == env, r.output
    session = await sandbox.create_session("names", env=env)
    assert (await session.run("printenv UID A-B PLAIN")).output.split() == ["5", "1", "p"]


async def test_no_variable_changes_what_the_control_shell_sends_or_how_long_it_waits() -> None:
    """Newlines are spelled with no variable of the shell's (a command's `N` once rewrote
    them), the loop's variable is no common name (`l` once carried the control line into
    every command), TMOUT does not end the shell's wait for requests, and a command's PATH
    does not decide where env(1) is found."""
    async with Sandbox(SandboxConfig(env={"TMOUT": "1", "l": "mine"})) as sb:
        r = await sb.execute(["sh", "-c", "echo a\necho b"], env={"N": "x"})
        assert r.stdout == "a\nb\n", r.output
        await asyncio.sleep(2.5)  # past TMOUT: the control shell still reads
        r = await sb.execute(["printenv", "l", "TMOUT"])
        assert r.stdout == "mine\n1\n", r.output
        r = await sb.execute(["/bin/echo", "hi"], env={"PATH": "/nowhere", "UID": "5"})
        assert (r.exit_code, r.stdout) == (0, "hi\n"), r.output


async def test_bash_settings_in_the_sandboxes_environment_do_not_reach_its_control_shell(
    tmp_path: Path,
) -> None:
    """config.env is the control shell's environment too: bash -p reads no $BASH_ENV file and
    takes no functions from it (either would run code in the shell that answers the host)."""
    planted = "/tmp/planted-by-env"
    env = {"BASH_ENV": "/etc/hostname", "BASH_FUNC_echo%%": f"() {{ touch {planted}; }}"}
    async with Sandbox(SandboxConfig(env=env)) as sb:
        r = await sb.execute(["sh", "-c", f"test -e {planted} && echo planted; echo ok"])
        assert r.stdout == "ok\n" and r.exit_code == 0, r.output


async def test_a_command_is_a_process_group_of_its_own_with_default_signals(
    sandbox: Sandbox,
) -> None:
    """`kill 0` and a Ctrl-C sent to its own group reach the command and what it started, not
    the waiter that reports its exit (the command would never be reported) nor the control
    shell; SIGINT and SIGQUIT are at their defaults (a test suite that interrupts itself
    must see KeyboardInterrupt); a command that stops itself is reported when it ends."""
    r = await sandbox.execute(["sh", "-c", "sleep 30 & kill 0; sleep 30"], timeout=60)
    assert r.exit_code == 128 + signal.SIGTERM, r.output
    code = "import os, signal, time\nos.killpg(0, signal.SIGINT)\ntime.sleep(30)"
    r = await sandbox.execute(["python3", "-c", code], timeout=60)
    assert r.exit_code == 128 + signal.SIGINT and "KeyboardInterrupt" in r.stderr, r.output
    r = await sandbox.execute(
        ["sh", "-c", "ps -o pid=,pgid= -p $$; grep -E '^SigIgn' /proc/$$/status"], timeout=60
    )
    pid, pgid, _sig, ignored = r.stdout.split()
    assert pid == pgid and int(ignored, 16) & 0b110 == 0, r.output  # bits of SIGINT, SIGQUIT
    r = await sandbox.execute(
        ["sh", "-c", "(sleep 1; kill -CONT $$) & kill -STOP $$; echo resumed; exit 3"],
        timeout=60,
    )
    assert (r.exit_code, r.stdout) == (3, "resumed\n"), r.output
    assert (await sandbox.execute(["true"])).exit_code == 0  # the control shell lives on


async def test_file_errors_name_their_errno(sandbox: Sandbox) -> None:
    script = (
        "mkdir -p /tmp/d && echo x > /tmp/locked && chmod 000 /tmp/locked && "
        "echo x > /tmp/file && ln -s loop1 /tmp/loop2 && ln -s loop2 /tmp/loop1"
    )
    assert (await sandbox.execute(script)).exit_code == 0
    expected_reads = {
        "/tmp/missing": errno.ENOENT,
        "/tmp/d": errno.EISDIR,
        "/tmp/locked": errno.EACCES,
        "/tmp/file/below": errno.ENOTDIR,
        "/tmp/loop1": errno.ELOOP,
    }
    for path, code in expected_reads.items():
        with pytest.raises(SandboxFileError) as info:
            await sandbox.read_file(path)
        assert info.value.errno == code, (path, info.value)
        assert path in str(info.value) and not str(info.value).startswith("[Errno")
    with pytest.raises(SandboxFileError) as info:
        await sandbox.read_file("/tmp/file", max_bytes=1)
    assert info.value.errno == errno.EFBIG
    with pytest.raises(SandboxFileError) as info:
        await sandbox.read_file("/tmp/a\0b")
    assert info.value.errno == errno.EINVAL
    expected_writes = {
        "/tmp/d": errno.EISDIR,
        "/tmp/file/below": errno.EEXIST,  # mkdir -p: a parent that is a file
        "/usr/minisandbox-test": errno.EROFS,
    }
    for path, code in expected_writes.items():
        with pytest.raises(SandboxFileError) as info:
            await sandbox.write_file(path, "x")
        assert info.value.errno == code, (path, info.value)
    with pytest.raises(SandboxFileError) as info:
        await sandbox.upload("/does/not/exist", "/tmp/x")
    assert info.value.errno == errno.ENOENT
    copy = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), copy.errno, str(copy)) == (SandboxFileError, errno.ENOENT, str(info.value))
    # The errors of a cause that is unknown keep errno None.
    assert SandboxFileError("why").errno is None


def test_helper_programs_are_package_files() -> None:
    from importlib import resources

    from minisandbox.sandbox import scripts

    folder = resources.files("minisandbox.sandbox") / "helpers"
    names = {p.name for p in folder.iterdir()}
    assert {"control.sh", "fail.sh", "read_file.sh", "write_file.sh", "extract_tar.sh"} <= names
    assert scripts.helper("read_file.sh") is scripts.helper("read_file.sh")  # read once
    assert scripts.file_helper("read_file.sh").startswith(scripts.helper("fail.sh"))


def test_every_error_raised_in_the_sandbox_package_is_specific() -> None:
    """A `raise Name(...)` in minisandbox.sandbox names a subclass of MiniSandboxError, never
    MiniSandboxError itself nor a builtin (the scanner's private stop signal excepted)."""
    import importlib
    import json
    import pkgutil
    import subprocess
    import sys

    import minisandbox.sandbox as package

    # The raises are found by a fresh interpreter (one for all modules): in this one, CPython
    # 3.11's AST constructor can fail with "recursion depth mismatch" after some earlier tests.
    scan = (
        "import ast, json, sys\n"
        "print(json.dumps({p: [[n.lineno, n.exc.func.id if isinstance(n.exc.func, ast.Name) "
        "else ast.unparse(n.exc.func)] for n in ast.walk(ast.parse(open(p).read())) "
        "if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)] for p in sys.argv[1:]}))"
    )
    modules = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        assert module.__file__ is not None
        modules.append((info.name, module))
    out = subprocess.run(
        [sys.executable, "-c", scan, *(m.__file__ for _, m in modules)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    raises = json.loads(out.stdout)
    allowed_private = {"_StopScan", "_Refused"}  # caught where they are raised
    wrong = []
    for name_of_module, module in modules:
        for lineno, name in raises[module.__file__]:
            if name in allowed_private:
                continue
            cls = getattr(module, name, None)
            ok = (
                isinstance(cls, type)
                and issubclass(cls, MiniSandboxError)
                and cls is not MiniSandboxError
            )
            if not ok:
                wrong.append(f"{name_of_module}.py:{lineno} raises {name}")
    assert not wrong, wrong
