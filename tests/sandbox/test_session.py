"""Persistent shell sessions with SWE-ReX-like semantics, on real sandboxes."""

from __future__ import annotations

import asyncio
import time

import pytest

from minisandbox import Sandbox
from minisandbox.errors import CommandTimeoutError, InvalidCommandError, SessionError
from minisandbox.sandbox import procs
from minisandbox.sandbox.session import RESTART_NOTE, RESTARTED_EXIT_CODE, ShellSession


async def test_state_persists_between_commands(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    await s.run("cd /tmp && export GREETING='hello world' && counter=41")
    r = await s.run("pwd; echo $GREETING; echo $((counter + 1))")
    assert (r.output, r.exit_code) == ("/tmp\nhello world\n42\n", 0)


async def test_exit_codes_multiline_heredoc_and_no_trailing_newline(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    assert (await s.run("false")).exit_code == 1
    assert (await s.run("(exit 7)")).exit_code == 7
    r = await s.run("for i in 1 2 3; do\n  echo line $i\ndone\necho done")
    assert r.output == "line 1\nline 2\nline 3\ndone\n"
    r = await s.run("cat > /root/f.py <<'EOF'\nprint('a $HOME b')\nEOF\ncat /root/f.py")
    assert r.output == "print('a $HOME b')\n"
    r = await s.run("printf 'no newline'")
    assert r.output == "no newline"
    r = await s.run("echo stdout; echo stderr >&2")
    assert r.output == "stdout\nstderr\n"


async def test_long_commands_arrive_whole(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    payload = "x" * 20000  # longer than a terminal line (4 KiB)
    r = await s.run(f"echo {payload} | wc -c")
    assert r.output.strip() == str(len(payload) + 1)


async def test_command_reading_stdin(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    r = await s.run('read -r name; echo "hi $name"', input="agent\n")
    assert r.output == "hi agent\n"


async def test_interactive_program_with_expected_prompts(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    r = await s.run("python3 -q", expect=[">>> "], timeout=30)
    assert r.exit_code is None and r.match == ">>> "
    r = await s.send("x = 6 * 7\n", expect=[">>> "])
    r = await s.send("print(x)\n", expect=[">>> "])
    assert "42" in r.output
    r = await s.send("quit()\n")
    assert r.exit_code == 0
    assert (await s.run("echo back")).output == "back\n"


async def test_timeout_then_interrupt_recovers(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    await s.run("export KEEP=me")
    began = time.monotonic()
    with pytest.raises(CommandTimeoutError) as info:
        await s.run("echo before; sleep 100", timeout=0.5)
    assert "before" in info.value.output
    with pytest.raises(SessionError, match="interrupt"):
        await s.run("echo busy")
    r = await s.interrupt()
    assert r.exit_code == 130
    assert (await s.run("echo $KEEP")).output == "me\n"
    # A command that ignores Ctrl-C is killed.
    with pytest.raises(CommandTimeoutError):
        await s.run("trap '' INT; sleep 100", timeout=0.5)
    await s.interrupt(timeout=1)
    assert (await s.run("echo $KEEP")).output == "me\n"
    assert time.monotonic() - began < 20


async def test_named_sessions_are_independent(sandbox: Sandbox) -> None:
    a = await sandbox.create_session("a")
    b = await sandbox.create_session("b")
    await a.run("cd /tmp; X=1")
    await b.run("cd /root; X=2")
    ra, rb = await asyncio.gather(a.run("echo $PWD $X"), b.run("echo $PWD $X"))
    assert (ra.output, rb.output) == ("/tmp 1\n", "/root 2\n")
    assert sorted(sandbox.sessions) == ["a", "b"]
    with pytest.raises(SessionError, match="already exists"):
        await sandbox.create_session("a")
    await sandbox.close_session("a")
    with pytest.raises(SessionError, match="no session"):
        sandbox.session("a")
    assert (await sandbox.session("b").run("echo still")).output == "still\n"


async def test_session_that_exits(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    with pytest.raises(SessionError, match="exited"):
        await s.run("exit 3")
    with pytest.raises(SessionError):
        await s.run("true")


async def test_output_cap_and_binary_output(sandbox: Sandbox) -> None:
    s = await sandbox.create_session(max_output=64 * 1024)
    r = await s.run("head -c 3000000 /dev/zero | tr '\\0' y; echo; echo tail-marker")
    assert r.truncated and len(r.output) < 100_000
    assert r.output.endswith("tail-marker\n") and r.exit_code == 0
    r = await s.run("printf 'a\\xffb'")
    assert r.output == "a\\xffb"


async def test_venv_activation_persists(sandbox: Sandbox) -> None:
    s = await sandbox.create_session()
    r = await s.run("python3 -m venv /root/v && source /root/v/bin/activate && which python")
    assert r.output.strip() == "/root/v/bin/python", r.output
    assert (await s.run("echo $VIRTUAL_ENV")).output == "/root/v\n"


async def test_interrupt_restarts_a_shell_that_ignores_sigint(sandbox: Sandbox) -> None:
    s = await sandbox.create_session("loop", env={"FROM_CREATE": "kept"})
    await s.run("cd /tmp; X=1")
    with pytest.raises(CommandTimeoutError):
        await s.run("trap '' INT; while :; do sleep 0.1; done", timeout=0.5)
    r = await s.interrupt(timeout=1)
    assert r.restarted and r.exit_code == RESTARTED_EXIT_CODE
    assert r.output.endswith(RESTART_NOTE)
    assert sandbox.session("loop") is s and not s.busy
    # The same name and environment; the old shell's state is gone.
    r = await s.run("echo $FROM_CREATE ${X:-unset} $PWD")
    assert r.output == f"kept unset {sandbox.config.workdir}\n" and not r.restarted


async def test_input_never_read_does_not_stall_other_sessions(sandbox: Sandbox) -> None:
    """Typing into a program that reads nothing waits for it without blocking the event loop
    (other sessions go on), and gives up at the command's timeout."""
    deaf, other = await sandbox.create_session("deaf"), await sandbox.create_session("other")
    stuck = asyncio.ensure_future(deaf.run("sleep 1000", input="x\n" * 250_000, timeout=60))
    try:
        assert (await other.run("echo alive", timeout=60)).output == "alive\n"
        assert not stuck.done()
    finally:
        stuck.cancel()
    with pytest.raises(CommandTimeoutError, match="input was not read"):
        await (await sandbox.create_session("deaf2")).run(
            "sleep 1000", input="y\n" * 250_000, timeout=1
        )


async def test_sandbox_processes_seen_from_the_host(sandbox: Sandbox) -> None:
    assert sandbox.pid is not None
    r = await sandbox.execute("setsid sleep 1000 >/dev/null 2>&1 </dev/null & echo $!")
    ns_pid = int(r.stdout)
    for _ in range(1000):  # until the child has run setsid (bounded)
        found = {p.ns_pid: p for p in procs.sandbox_processes(sandbox.pid)}
        sleeper = found[ns_pid]
        if sleeper.sid == sleeper.pid:
            break
        await asyncio.sleep(0.01)
    assert found[1].pid == sandbox.pid
    assert sleeper.sid == sleeper.pgid == sleeper.pid
    # The one-shot command's marker is inherited by what it started.
    assert any(procs.environ_has(sleeper.pid, w.encode()) for w in _markers(sleeper.pid))
    assert procs.kill_tree(sandbox.pid, ns_pids=[ns_pid]) == 1
    assert (await sandbox.execute(f"kill -0 {ns_pid}")).exit_code != 0


def _markers(pid: int) -> list[str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        words = f.read().decode().split("\0")
    return [w for w in words if w.startswith(procs.MARKER_VAR + "=")]


async def test_unread_input_does_not_hold_up_other_sandboxes(sandbox: Sandbox) -> None:
    """Typing far more than a pipe or terminal buffer (> 64 KiB) into a program that never
    reads its stdin waits on the event loop: another sandbox on the same loop starts and runs
    commands, and a plain coroutine keeps ticking, while the write is still pending. Closing
    the session ends the write (SessionError from the write itself) and leaves the sandbox
    working."""
    deaf = await sandbox.create_session("deaf")
    payload = ("z" * 1023 + "\n") * 512  # 512 KiB
    # Below pytest's timeout: a write that blocked the loop would fail the asserts below.
    typing = asyncio.ensure_future(deaf.run("sleep 1000", input=payload, timeout=240))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.ensure_future(tick())
    try:
        async with Sandbox() as other:
            for i in range(3):
                before = ticks
                r = await asyncio.wait_for(other.execute(f"echo {i}"), 300)
                assert r.stdout == f"{i}\n"
                assert not typing.done(), typing
            session = await asyncio.wait_for(other.create_session(), 300)
            assert (await session.run("echo other", timeout=300)).output == "other\n"
        for _ in range(3000):  # the loop keeps serving coroutines (bounded, generous)
            if ticks > before + 5:
                break
            await asyncio.sleep(0.01)
        assert ticks > before + 5
        assert not typing.done(), "the input was all taken: the test proves nothing"
    finally:
        ticker.cancel()
    await deaf.close()
    with pytest.raises(SessionError, match="has exited"):  # raised by the pending write
        await asyncio.wait_for(typing, 60)
    assert "deaf" not in sandbox.sessions
    assert (await sandbox.execute("echo fine")).stdout == "fine\n"
    for _ in range(600):  # the deaf program dies with its shell (bounded, generous)
        if not (await sandbox.execute("pgrep -x sleep || true")).stdout:
            break
        await asyncio.sleep(0.1)
    assert not (await sandbox.execute("pgrep -x sleep || true")).stdout


async def test_closing_a_session_kills_its_background_jobs(sandbox: Sandbox) -> None:
    """A killed shell cannot hang up its jobs: close() kills them (they carry its marker)."""
    s = await sandbox.create_session()
    await s.run("sleep 777 & (sleep 778 &) ; echo started")
    # Both jobs are forked by now, but on a busy machine one may not have exec'd sleep yet.
    count = ""
    for _ in range(300):
        count = (await sandbox.execute("pgrep -c -f 'sleep 77[78]'")).stdout
        if count == "2\n":
            break
        await asyncio.sleep(0.1)
    assert count == "2\n"
    await s.close()
    assert not (await sandbox.execute("pgrep -f 'sleep 77[78]' || true")).stdout


async def test_session_lifecycle_is_separate_from_its_commands(sandbox: Sandbox) -> None:
    s = ShellSession(sandbox, "mine", env={"WHO": "me"})
    with pytest.raises(SessionError, match="not started"):
        await s.run("true")
    assert await s.start() is s
    with pytest.raises(SessionError, match="already started"):
        await s.start()
    assert (await s.run("echo $WHO")).output == "me\n"
    assert "mine" not in sandbox.sessions  # made by hand: not the sandbox's to close
    await s.close()
    await s.close()  # idempotent
    assert s.closed
    with pytest.raises(SessionError, match="closed"):
        await s.run("true")
    with pytest.raises(SessionError, match="closed"):
        await s.start()
    # A session of the sandbox's: close() forgets it, and its name can be used again.
    t = await sandbox.create_session("t")
    await t.close()
    assert "t" not in sandbox.sessions
    with pytest.raises(SessionError, match="no session"):
        await sandbox.close_session("t")
    t2 = await sandbox.create_session("t")
    assert t2 is not t and (await t2.run("echo again")).output == "again\n"
    with pytest.raises(InvalidCommandError):
        await t2.run("echo \0")


async def test_sessions_are_closed_when_the_sandbox_stops() -> None:
    sb = await Sandbox().start()
    try:
        s = await sb.create_session("x")
        waiting = asyncio.ensure_future(s.run("sleep 1000", timeout=240))
        await asyncio.sleep(0.5)
    finally:
        await sb.stop()
    assert s.closed and sb.sessions == []
    with pytest.raises(SessionError):
        await asyncio.wait_for(waiting, 60)  # woken by the close, not by its timeout
