"""Attacks on sessions and command timeouts (issue: the host never acts on what a sandbox
wrote, item 9): a shell that ignores Ctrl-C in itself, and processes that leave their
command's process group and session to outlive its timeout. Registered into attacks.ATTACKS,
run as root and as an unprivileged caller by test_attacks.py like every other attack."""

from __future__ import annotations

import asyncio

from attacks import AttackContext, attack, host_pids_with_arg, marker, sh
from minisandbox import Sandbox, SandboxConfig
from minisandbox.errors import CommandTimeoutError
from minisandbox.sandbox.session import RESTART_NOTE, ShellSession


async def _until(check: object, what: str, seconds: float = 20) -> None:
    """Poll `check()` (bounded by a generous deadline) until it is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)


async def _time_out(session: ShellSession, command: str) -> None:
    try:
        r = await session.run(command, timeout=1)
    except CommandTimeoutError:
        return
    raise AssertionError(f"`{command}` returned instead of hanging (positive control): {r}")


@attack
async def attack_session_shell_ignores_sigint(ctx: AttackContext) -> None:
    """`trap '' INT; while :; do sleep 0.1; done` runs in the session's shell itself: neither
    Ctrl-C nor killing the foreground job (each short `sleep`) brings the prompt back. The
    interrupt must still return, having killed the shell and everything it started (a
    background job, a setsid'd child) and started a new shell, and say that it did."""
    bg, escaped, other, unrelated = marker(), marker(), marker(), marker()
    async with Sandbox(SandboxConfig()) as sb:
        s = await sb.create_session()
        neighbour = await sb.create_session("neighbour")
        await neighbour.run(f"sleep {other} >/dev/null 2>&1 &")
        await sh(sb, f"setsid sleep {unrelated} >/dev/null 2>&1 </dev/null &")
        await s.run(f"cd /tmp; export KEEP=me; sleep {bg} >/dev/null 2>&1 &")
        await s.run(f"setsid sleep {escaped} >/dev/null 2>&1 </dev/null &")
        for m in (bg, escaped, other, unrelated):
            await _until(lambda m=m: host_pids_with_arg(m), f"`sleep {m}` never ran")
        # Positive control: an ordinary interrupt keeps the shell and its state.
        await _time_out(s, "sleep 1000")
        r = await s.interrupt(timeout=2)
        assert not r.restarted and r.exit_code == 130, f"plain interrupt: {r}"
        assert (await s.run("echo $PWD $KEEP")).output == "/tmp me\n", "state lost too early"

        await _time_out(s, "trap '' INT; while :; do sleep 0.1; done")
        r = await s.interrupt(timeout=2)
        assert r.restarted and RESTART_NOTE in r.output, f"restart not reported: {r}"
        assert not s.busy, "the session is still busy after the interrupt"
        after = await s.run("echo alive $PWD ${KEEP:-unset}")
        assert after.exit_code == 0 and after.output.startswith("alive "), f"dead: {after}"
        assert "unset" in after.output, f"the old shell's variables survived: {after}"
        # Ctrl-C works again in the new shell (the old one's `trap` is gone).
        await _time_out(s, "sleep 1000")
        assert not (await s.interrupt(timeout=5)).restarted, "the new shell ignores Ctrl-C"
        for m in (bg, escaped):
            await _until(lambda m=m: not host_pids_with_arg(m), f"`sleep {m}` survived")
        # No collateral: another session's job and an earlier command's daemon live on.
        for m in (other, unrelated):
            assert host_pids_with_arg(m), f"`sleep {m}`, not the session's, was killed"
        assert (await neighbour.run("echo $((6 * 7))")).output == "42\n"


async def _timed_out_command_leaves_nothing(script: str, escaped: str) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        keep = marker()
        await sh(sb, f"setsid sleep {keep} >/dev/null 2>&1 </dev/null &")
        await _until(lambda: host_pids_with_arg(keep), "the earlier command's daemon never ran")
        run = asyncio.ensure_future(sh(sb, script, timeout=8))
        try:
            # Positive control: the escaping process really ran while the command did.
            await _until(lambda: host_pids_with_arg(escaped) or run.done(), "never started")
            assert host_pids_with_arg(escaped), f"`sleep {escaped}` never ran: {await run}"
            try:
                r = await run
            except CommandTimeoutError:
                pass
            else:
                raise AssertionError(f"the command did not time out (positive control): {r}")
        finally:
            run.cancel()
        await _until(
            lambda: not host_pids_with_arg(escaped),
            f"`sleep {escaped}`, started by a command that timed out, outlived its timeout",
        )
        assert host_pids_with_arg(keep), "a finished command's background process was killed"
        assert (await sb.execute("echo ok")).stdout == "ok\n", "the sandbox is unusable"


@attack
async def attack_timeout_setsid_child(ctx: AttackContext) -> None:
    """A command starts a child in a new session, then hangs: its timeout kills both."""
    m = marker()
    await _timed_out_command_leaves_nothing(f"setsid sleep {m} & sleep 1000", m)


@attack
async def attack_timeout_double_fork_setsid(ctx: AttackContext) -> None:
    """Same, with a double fork: the child is reparented to the sandbox's init at once, in its
    own session, so neither parentage, group nor session leads to it, only its marker."""
    m = marker()
    await _timed_out_command_leaves_nothing(f"( setsid sleep {m} & ) ; sleep 1000", m)
