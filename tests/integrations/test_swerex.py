"""SWE-ReX's runtime semantics (as its LocalRuntime has them) on real minisandbox sandboxes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "swerex", reason="SWE-ReX is not installed (the `swerex` extra: pip install -e '.[swerex]')"
)

from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from minisandbox.integrations.swerex import (
    MiniSandboxDeployment,
    MiniSandboxDeploymentConfig,
    MiniSandboxRuntime,
)
from minisandbox.tasks.builder import BuildSettings


@pytest.fixture
async def deployment() -> AsyncIterator[MiniSandboxDeployment]:
    d = MiniSandboxDeployment()
    await d.start()
    await d.runtime.create_session(CreateBashSessionRequest())
    yield d
    await d.stop()


@pytest.fixture
def rt(deployment: MiniSandboxDeployment) -> MiniSandboxRuntime:
    return deployment.runtime


async def run(rt: MiniSandboxRuntime, command: str, **kw: object) -> tuple[str, int | None]:
    o = await rt.run_in_session(BashAction(command=command, timeout=10, **kw))  # type: ignore[arg-type]
    return o.output, o.exit_code


async def test_session_state_and_output(rt: MiniSandboxRuntime) -> None:
    assert await run(rt, "echo hi") == ("hi\n", 0)
    assert await run(rt, "cd /tmp && export X=42") == ("", 0)
    assert await run(rt, "pwd; echo $X") == ("/tmp\n42\n", 0)
    assert await run(rt, "printf x") == ("x", 0)
    assert await run(rt, "echo err >&2") == ("err\n", 0)  # one terminal: streams interleaved
    assert await run(rt, "") == ("", 0)


async def test_multiline_heredoc_and_functions(rt: MiniSandboxRuntime) -> None:
    out, code = await run(rt, "cat <<'EOF'\n$HOME\nl2\nEOF\necho done")
    assert (out, code) == ("$HOME\nl2\ndone\n", 0)
    await run(rt, 'f() {\n  echo "f:$1"\n}')
    assert await run(rt, "f a\nf b") == ("f:a\nf:b\n", 0)
    assert await run(rt, "echo a \\\n  b") == ("a b\n", 0)


async def test_check_modes(rt: MiniSandboxRuntime) -> None:
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await run(rt, "(exit 3)")
    with pytest.raises(NonZeroExitCodeError, match=r"^custom: "):
        await run(rt, "false", error_msg="custom")
    assert await run(rt, "(exit 3)", check="silent") == ("", 3)
    assert await run(rt, "(exit 3)", check="ignore") == ("", None)
    assert await run(rt, "true", check="ignore") == ("", None)


async def test_syntax_error_is_caught_before_running(rt: MiniSandboxRuntime) -> None:
    with pytest.raises(BashIncorrectSyntaxError) as e:
        await run(rt, "echo 'unterminated; touch /tmp/ran")
    assert "unexpected EOF" in e.value.extra_info["bash_stderr"]
    assert await run(rt, "test -e /tmp/ran", check="silent") == ("", 1)


async def test_timeout_then_interrupt(rt: MiniSandboxRuntime) -> None:
    began = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(command="sleep 30", timeout=0.5))
    assert time.monotonic() - began < 20  # (well before the command's end, under load too)
    o = await rt.run_in_session(BashInterruptAction())
    assert o.exit_code == 0
    assert await run(rt, "echo back") == ("back\n", 0)
    # A program that ignores Ctrl-C is stopped and killed; bash reports it, as in swerex.
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(command="trap '' INT; sleep 30", timeout=0.5))
    await rt.run_in_session(BashInterruptAction())
    out, code = await run(rt, "echo again")
    assert code == 0 and out.startswith("again\n") and "Killed" in out, out
    assert await run(rt, "echo quiet") == ("quiet\n", 0)


async def test_interrupt_restarts_a_shell_that_ignores_sigint(rt: MiniSandboxRuntime) -> None:
    """Where swerex would fail to interrupt, the shell is restarted (its startup files sourced
    again) and the observation says that its state was lost."""
    await rt.write_file(WriteFileRequest(path="/root/rc", content="export FROM_RC=yes\n"))
    await rt.create_session(CreateBashSessionRequest(session="loop", startup_source=["/root/rc"]))
    assert await run(rt, "cd /tmp; X=1; echo $FROM_RC", session="loop") == ("yes\n", 0)
    # The shell itself loops (no child to stop or kill): neither Ctrl-C nor Ctrl-Z ends it.
    loop = "trap '' INT; while :; do read -r -t 0.1 _; done"
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(command=loop, session="loop", timeout=0.5))
    o = await rt.run_in_session(BashInterruptAction(session="loop", timeout=1))
    assert "restarted" in o.output and "state is lost" in o.output, o.output
    out, code = await run(rt, "echo $FROM_RC ${X:-unset} $PWD", session="loop")
    assert code == 0 and out.startswith("yes unset ") and out != "yes unset /tmp\n", out


async def test_interrupting_a_pager_reports_the_job_as_bash_does(rt: MiniSandboxRuntime) -> None:
    """As in swerex: a pager that ignores Ctrl-C is stopped (Ctrl-Z) and killed; bash says
    "Stopped" in the interrupt's output and "Killed" in the next command's, after its output.
    Under any load: the interrupt waits until bash has reaped the job (run it with the
    machine busy, e.g. `yes > /dev/null` on every core)."""
    for _ in range(3):  # (the second and later rounds: job numbers and reports start afresh)
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(command="echo x | less -+F", timeout=0.5))
        o = await rt.run_in_session(BashInterruptAction())
        assert o.exit_code == 0 and "Stopped" in o.output and "less -+F" in o.output, o.output
        assert "Killed" not in o.output, o.output
        out, code = await run(rt, "echo next")
        assert code == 0 and out.startswith("next\n[1]+"), out
        assert out.count("Killed") == 1 and out.rstrip().endswith("less -+F"), out
        assert await run(rt, "jobs; echo done") == ("done\n", 0)


async def test_interactive_program(rt: MiniSandboxRuntime) -> None:
    o = await rt.run_in_session(
        BashAction(command="python3", is_interactive_command=True, expect=[">>> "], timeout=10)
    )
    assert o.expect_string == ">>> " and "Python 3" in o.output
    o = await rt.run_in_session(
        BashAction(command="print(6*7)", is_interactive_command=True, expect=[">>> "], timeout=10)
    )
    assert (o.output, o.exit_code) == ("42", 0)
    o = await rt.run_in_session(BashAction(command="quit()", is_interactive_quit=True, timeout=10))
    assert o.exit_code == 0
    assert await run(rt, "echo shell") == ("shell\n", 0)


async def test_expect_pattern_and_interrupt_with_expect(rt: MiniSandboxRuntime) -> None:
    o = await rt.run_in_session(
        BashAction(command="echo ready; sleep 30", expect=["rea.y"], check="silent", timeout=10)
    )
    assert (o.output, o.exit_code, o.expect_string) == ("", None, "rea.y")
    # Ctrl-C ends `sleep` at once; a generous wait for the prompt keeps a busy machine from
    # escalating to Ctrl-Z and kill -9 (whose "Killed" report the next output would carry).
    await rt.run_in_session(BashInterruptAction(timeout=10))
    assert await run(rt, "echo ok") == ("ok\n", 0)


async def test_interrupt_sends_ctrl_c_again_as_swerex_does(rt: MiniSandboxRuntime) -> None:
    # A job that survives one SIGINT (as one that got it while still starting would): swerex
    # sends Ctrl-C again (n_retry), so the job ends without the Ctrl-Z and kill -9 whose
    # "Killed" report the next output would carry.
    job = "bash -c 'trap \"trap - INT\" INT; echo armed; while :; do sleep 0.05; done'"
    o = await rt.run_in_session(
        BashAction(command=job, expect=["armed"], check="silent", timeout=10)
    )
    assert o.expect_string == "armed"
    await rt.run_in_session(BashInterruptAction(timeout=2, n_retry=3))
    assert await run(rt, "echo ok") == ("ok\n", 0)


async def test_sessions(rt: MiniSandboxRuntime, tmp_path: Path) -> None:
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true", session="nope"))
    await rt.write_file(
        WriteFileRequest(path="/root/.bashrc", content="PS1='custom> '\nPROMPT_COMMAND=''\nY=7\n")
    )
    r = await rt.create_session(
        CreateBashSessionRequest(session="two", startup_source=["/root/.bashrc", "/missing"])
    )
    assert "/missing" in r.output
    o = await rt.run_in_session(BashAction(command="echo $Y", session="two", timeout=10))
    assert o.output == "7\n"
    assert await run(rt, "echo ${Y:-unset}") == ("unset\n", 0)  # sessions are separate shells
    await rt.close_session(CloseBashSessionRequest(session="two"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest(session="two"))


async def test_execute(rt: MiniSandboxRuntime) -> None:
    r = await rt.execute(Command(command="echo $0; echo e >&2", shell=True))
    assert (r.stdout, r.stderr, r.exit_code) == ("/bin/sh\n", "e\n", 0)
    r = await rt.execute(Command(command=["printf", "%s|", "a b", "c"]))
    assert r.stdout == "a b|c|"
    r = await rt.execute(
        Command(command="echo o; echo e >&2", shell=True, merge_output_streams=True)
    )
    assert (r.stdout, r.stderr) == ("o\ne\n", "")
    # env replaces the environment, as subprocess's does.
    r = await rt.execute(Command(command="echo $FOO:${HOME:-nohome}", shell=True, env={"FOO": "1"}))
    assert r.stdout == "1:nohome\n"
    r = await rt.execute(Command(command=["pwd"], cwd="/tmp"))
    assert r.stdout == "/tmp\n"
    r = await rt.execute(Command(command="exit 4", shell=True))
    assert r.exit_code == 4
    with pytest.raises(NonZeroExitCodeError, match="exit code 4"):
        await rt.execute(Command(command="exit 4", shell=True, check=True))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command="sleep 30", shell=True, timeout=0.5))


async def test_files_and_uploads(rt: MiniSandboxRuntime, tmp_path: Path) -> None:
    await rt.write_file(WriteFileRequest(path="/testbed/a/b/c.txt", content="héllo\r\nworld\n"))
    r = await rt.read_file(ReadFileRequest(path="/testbed/a/b/c.txt"))
    assert r.content == "héllo\nworld\n"  # text mode, as Path.read_text
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/nope"))
    await rt.execute(Command(command="printf '\\377' > /tmp/bin", shell=True))
    with pytest.raises(UnicodeDecodeError):
        await rt.read_file(ReadFileRequest(path="/tmp/bin"))
    r = await rt.read_file(ReadFileRequest(path="/tmp/bin", errors="backslashreplace"))
    assert r.content == "\\xff"

    (tmp_path / "tool" / "bin").mkdir(parents=True)
    (tmp_path / "tool" / "bin" / "hello").write_text("#!/bin/sh\necho hello\n")
    (tmp_path / "single.txt").write_text("one")
    await rt.upload(UploadRequest(source_path=str(tmp_path / "tool"), target_path="/root/tools/t"))
    await rt.upload(UploadRequest(source_path=str(tmp_path / "single.txt"), target_path="/x/s.txt"))
    await rt.upload(UploadRequest(source_path=str(tmp_path / "single.txt"), target_path="/tmp"))
    r2 = await rt.execute(
        Command(
            command="chmod +x /root/tools/t/bin/* && /root/tools/t/bin/hello && "
            "cat /x/s.txt /tmp/single.txt",
            shell=True,
        )
    )
    assert r2.stdout == "hello\noneone"
    with pytest.raises(FileNotFoundError):
        await rt.upload(UploadRequest(source_path=str(tmp_path / "absent"), target_path="/y"))


def test_driven_by_asyncio_run_per_call() -> None:
    """SWE-agent calls every method through its own `asyncio.run()`."""
    d = MiniSandboxDeployment()
    asyncio.run(d.start())
    try:
        asyncio.run(d.runtime.create_session(CreateBashSessionRequest()))
        o = asyncio.run(d.runtime.run_in_session(BashAction(command="cd /root; echo $PWD")))
        assert o.output == "/root\n"
        o = asyncio.run(d.runtime.run_in_session(BashAction(command="pwd; python --version")))
        assert o.output.startswith("/root\nPython 3")  # plain sandboxes have `python`
        assert asyncio.run(d.is_alive()).is_alive
    finally:
        asyncio.run(d.stop())
    assert not asyncio.run(d.is_alive()).is_alive


async def test_lifecycle_and_config() -> None:
    d = MiniSandboxDeployment()
    with pytest.raises(DeploymentNotStartedError):
        _ = d.runtime
    assert not await d.is_alive()
    await d.stop()  # stopping a deployment that never started is fine
    cfg = MiniSandboxDeploymentConfig.model_validate({"type": "minisandbox", "network": True})
    assert isinstance(cfg.get_deployment(), MiniSandboxDeployment)
    with pytest.raises(ValueError):
        MiniSandboxDeploymentConfig.model_validate({"type": "minisandbox", "image_name": "x"})
    with pytest.raises(DeploymentStartupError, match="no task"):
        await MiniSandboxDeployment(task="no-such-task").start()


# ---------------------------------------------------------------- task environments


@pytest.fixture
def task_env(
    built: list, settings: BuildSettings, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Deployments build with the test session's store (the examples are built there)."""
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_CACHE", str(settings.cache))
    monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))
    yield


async def test_task_by_image_name_gold_and_empty_rewards(task_env: None) -> None:
    image = "docker.io/swebench/sweb.eval.x86_64.examples_1776_tablekit-1:latest"
    d = MiniSandboxDeploymentConfig(image=image).get_deployment()
    began = time.monotonic()
    await d.start()
    try:
        rt = d.runtime
        await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"]))
        o = await rt.run_in_session(
            BashAction(command="cd /testbed && git status --porcelain && which python", timeout=30)
        )
        assert o.output.strip().endswith("/bin/python")
        task = d.task_sandbox.task
        assert task is not None and task.id == "examples__tablekit-1"
        empty = await d.evaluate()
        assert empty.reward == 0.0 and empty.empty_patch
        await rt.write_file(WriteFileRequest(path="/tmp/gold.patch", content=task.gold_patch))
        await rt.run_in_session(BashAction(command="git apply /tmp/gold.patch", timeout=30))
        assert (await d.diff()).strip() == task.gold_patch.strip()
        result = await d.evaluate()
        assert result.reward == 1.0, result.reason
    finally:
        await d.stop()
    print(f"\ntask episode (start, two evaluations, stop): {time.monotonic() - began:.2f} s")


DOC_CONFIG = {
    "type": "minisandbox",
    "task": "examples__tablekit-1",
    "dataset": "examples",
    "network": False,
    "limits": {"memory_bytes": 8589934592, "command_timeout": 600},
    "env": {"MY_VAR": "1"},
}


def test_a_config_is_validated_through_ours_never_taken_for_daytona() -> None:
    """SWE-ReX's union takes any unknown `type` (ours before register()) for a Daytona
    deployment, silently; deployment_config() gives ours or an error naming the fix."""
    import json
    import subprocess
    import sys

    from minisandbox.integrations.swerex import deployment_config, register

    unregistered = subprocess.run(
        [sys.executable, "-c", "import json, sys; from pydantic import TypeAdapter; "
         "from swerex.deployment.config import DeploymentConfig as D; "
         "print(type(TypeAdapter(D).validate_python(json.loads(sys.argv[1]))).__name__)",
         json.dumps(DOC_CONFIG)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert unregistered.stdout.strip() == "DaytonaDeploymentConfig"  # the hazard
    cfg = deployment_config(DOC_CONFIG)
    assert isinstance(cfg, MiniSandboxDeploymentConfig) and cfg.limits.command_timeout == 600
    with pytest.raises(ValueError, match="unknown type 'minisandbx'"):
        deployment_config({**DOC_CONFIG, "type": "minisandbx"})
    with pytest.raises(ValueError, match="add `type: minisandbox`"):
        deployment_config({k: v for k, v in DOC_CONFIG.items() if k != "type"})
    with pytest.raises(ValueError):  # (pydantic's: a field we do not have)
        deployment_config({**DOC_CONFIG, "image_name": "x"})
    assert type(deployment_config({"type": "docker", "image": "python:3.12"})).__name__ == (
        "DockerDeploymentConfig"
    )
    from pydantic import TypeAdapter
    from swerex.deployment import config as swerex_config

    register()
    parsed = TypeAdapter(swerex_config.DeploymentConfig).validate_python(DOC_CONFIG)
    assert isinstance(parsed, MiniSandboxDeploymentConfig)
