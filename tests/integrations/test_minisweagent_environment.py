"""mini-swe-agent's own environment tests, their behaviours ported to MiniSandboxEnvironment.

mini-swe-agent 2.4.6 tests its environments in tests/environments/test_local.py, test_docker.py,
extra/test_bubblewrap.py and test_init.py (not shipped in its sdist). Their modules build their
environment class directly, on host paths (a host temp directory as `cwd`, the host's pid of a
child process, files read back on the host), so they cannot take ours as a parameter: each test
here is one of theirs, named alike, with the host paths read as the sandbox's (its /tmp, its
processes, its files read through the sandbox's API). Where a behaviour is host-independent the
result must equal LocalEnvironment's on the same command, field for field.

Every environment is a plain sandbox (`plain: true`: the host's system, an empty /testbed),
which is what LocalEnvironment's tests run on; the task tests are in test_minisweagent.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
mswea = pytest.importorskip(
    "minisweagent", reason="mini-swe-agent is not installed (extra: minisweagent)"
)
if int(mswea.__version__.split(".")[0]) < 2:
    pytest.skip("the 2.x environment protocol (1.x is installed)", allow_module_level=True)

from minisweagent.environments import get_environment, get_environment_class  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402

from minisandbox.integrations.minisweagent import (  # noqa: E402
    MiniSandboxEnvironment,
    MiniSandboxEnvironmentConfig,
)
from minisandbox.sandbox.sync import run_sync  # noqa: E402

ENV_CLASS = "minisandbox.integrations.minisweagent.MiniSandboxEnvironment"


@pytest.fixture
def make_env() -> Iterator[Any]:
    """A factory of plain-sandbox environments, all cleaned up after the test."""
    made: list[MiniSandboxEnvironment] = []

    def make(**kwargs: Any) -> MiniSandboxEnvironment:
        env = MiniSandboxEnvironment(plain=True, **kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        env.cleanup()


def run(env: MiniSandboxEnvironment, command: str, **kwargs: Any) -> dict[str, Any]:
    return env.execute({"command": command}, **kwargs)


# ------------------------------------------------------------- tests/environments/test_local.py


def test_environment_config_defaults() -> None:
    """(and test_docker's) Defaults as docker's: a working directory, no env, 30 s."""
    config = MiniSandboxEnvironmentConfig()
    assert config.cwd == "/testbed"
    assert config.env == {}
    assert config.forward_env == []
    assert config.timeout == 30
    assert config.interpreter == ["bash", "-c"]


def test_environment_basic_execution(make_env: Any) -> None:
    result = run(make_env(), "echo 'hello world'")
    assert result == {"output": "hello world\n", "returncode": 0, "exception_info": ""}


def test_environment_set_env_variables(make_env: Any) -> None:
    env = make_env(env={"TEST_VAR": "test_value", "ANOTHER_VAR": "another_value"})
    assert run(env, "echo $TEST_VAR")["output"] == "test_value\n"
    assert run(env, "echo $TEST_VAR $ANOTHER_VAR")["output"] == "test_value another_value\n"


def test_environment_existing_env_variables(make_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local inherits the host's variables; a sandbox only those forwarded (docker's
    `forward_env`), merged with `env`."""
    monkeypatch.setenv("EXISTING_VAR", "existing_value")
    env = make_env(env={"NEW_VAR": "new_value"}, forward_env=["EXISTING_VAR"])
    assert run(env, "echo $EXISTING_VAR $NEW_VAR")["output"] == "existing_value new_value\n"
    isolated = make_env(env={"NEW_VAR": "new_value"})
    assert run(isolated, 'echo "[$EXISTING_VAR]"')["output"] == "[]\n"


def test_environment_env_variable_override(make_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """(and test_docker's env_override_forward) `env` wins over a forwarded host variable."""
    monkeypatch.setenv("CONFLICT_VAR", "original_value")
    env = make_env(env={"CONFLICT_VAR": "override_value"}, forward_env=["CONFLICT_VAR"])
    assert run(env, "echo $CONFLICT_VAR")["output"] == "override_value\n"


def test_environment_custom_cwd(make_env: Any) -> None:
    env = make_env(cwd="/tmp")
    assert run(env, "pwd") == {"output": "/tmp\n", "returncode": 0, "exception_info": ""}


def test_environment_cwd_parameter_override(make_env: Any) -> None:
    env = make_env(cwd="/tmp")
    run(env, "mkdir -p /tmp/other")
    assert run(env, "pwd", cwd="/tmp/other")["output"] == "/tmp/other\n"
    assert run(env, "pwd")["output"] == "/tmp\n"  # only that call


def test_environment_default_cwd(make_env: Any) -> None:
    """Local's default is the process's directory; ours (as docker's) the configured one."""
    assert run(make_env(), "pwd")["output"] == "/testbed\n"


def test_environment_command_failure(make_env: Any) -> None:
    assert run(make_env(), "exit 1") == {"output": "", "returncode": 1, "exception_info": ""}


def test_environment_nonexistent_command(make_env: Any) -> None:
    result = run(make_env(), "nonexistent_command_12345")
    assert result["returncode"] == 127
    assert "nonexistent_command_12345" in result["output"]
    assert "command not found" in result["output"]


def test_environment_stderr_capture(make_env: Any) -> None:
    result = run(make_env(), "echo 'error message' >&2")
    assert result == {"output": "error message\n", "returncode": 0, "exception_info": ""}


def test_environment_timeout(make_env: Any) -> None:
    """A timeout is returned, not raised, as every upstream environment reports it."""
    result = run(make_env(timeout=1), "sleep 2")
    assert result["returncode"] == -1
    assert "timed out" in result["exception_info"]
    assert result["extra"]["exception_type"] == "TimeoutExpired"


def test_environment_timeout_kills_child_process(make_env: Any) -> None:
    """A process the command's shell started dies with it (its pid is the sandbox's)."""
    env = make_env(timeout=1)
    child = "bash -c 'echo $$ > /tmp/child.pid; while :; do sleep 1; done' & wait"
    assert run(env, child)["returncode"] == -1
    check = (
        "pid=$(cat /tmp/child.pid); for _ in $(seq 50); do "
        "kill -0 $pid 2>/dev/null || { echo gone; exit 0; }; sleep 0.1; done; echo alive"
    )
    assert run(env, check, timeout=30)["output"] == "gone\n"


def test_environment_custom_timeout(make_env: Any) -> None:
    config = MiniSandboxEnvironmentConfig(timeout=5)
    env = make_env(timeout=config.timeout)
    assert env.config.timeout == 5
    assert run(env, "sleep 2 && echo slept")["output"] == "slept\n"  # 2 s is within 5


@pytest.mark.parametrize(
    ("command", "expected_returncode"), [("echo 'test'", 0), ("exit 1", 1), ("exit 42", 42)]
)
def test_environment_return_codes(make_env: Any, command: str, expected_returncode: int) -> None:
    """(and test_docker's command_failure, exit 42)"""
    assert run(make_env(), command)["returncode"] == expected_returncode


def test_environment_multiline_output(make_env: Any) -> None:
    result = run(make_env(), "echo -e 'line1\\nline2\\nline3'")
    assert result["returncode"] == 0
    assert result["output"].strip().split("\n") == ["line1", "line2", "line3"]


def test_environment_file_operations(make_env: Any) -> None:
    """Files persist across commands; read back through the sandbox (theirs: on the host)."""
    env = make_env(cwd="/tmp")
    assert run(env, "echo 'test content' > test.txt")["returncode"] == 0
    assert run(env, "cat test.txt")["output"] == "test content\n"
    data = run_sync(env.task_sandbox.sandbox.read_file("/tmp/test.txt"))
    assert data == b"test content\n"


def test_environment_shell_features(make_env: Any) -> None:
    env = make_env()
    assert run(env, "echo 'hello world' | grep 'world'")["output"] == "hello world\n"
    assert run(env, "echo $(echo 'nested')")["output"] == "nested\n"


# ------------------------------------------------------------ tests/environments/test_docker.py


def test_environment_forward_env_variables(make_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOST_VAR", "host_value")
    monkeypatch.setenv("ANOTHER_HOST_VAR", "another_host_value")
    env = make_env(forward_env=["HOST_VAR", "ANOTHER_HOST_VAR"])
    assert run(env, "echo $HOST_VAR")["output"] == "host_value\n"
    assert run(env, "echo $HOST_VAR $ANOTHER_HOST_VAR")["output"] == (
        "host_value another_host_value\n"
    )


def test_environment_forward_nonexistent_env_variables(
    make_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NONEXISTENT_VAR", raising=False)
    env = make_env(forward_env=["NONEXISTENT_VAR"])
    assert run(env, 'echo "[$NONEXISTENT_VAR]"')["output"] == "[]\n"


def test_environment_combined_env_and_forward(
    make_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_VAR", "from_host")
    env = make_env(env={"SET_VAR": "from_config"}, forward_env=["HOST_VAR"])
    assert run(env, "echo $SET_VAR $HOST_VAR")["output"] == "from_config from_host\n"


def test_environment_custom_interpreter(make_env: Any) -> None:
    """Docker's `interpreter`: the command is its last argument."""
    env = make_env(interpreter=["python3", "-c"])
    assert run(env, "print(6 * 7)")["output"] == "42\n"


def test_environment_ends_with_cleanup(make_env: Any) -> None:
    """(docker's custom_container_timeout: the container is gone once it ends) After cleanup
    the sandbox is gone; a new command starts a fresh one, without the old one's files."""
    env = make_env()
    run(env, "echo x > /testbed/f")
    sandbox = env.task_sandbox.sandbox
    env.cleanup()
    assert not env.task_sandbox.running and not sandbox.running
    assert run(env, "ls -A /testbed")["output"] == ""


# --------------------------------------------------- tests/environments/extra/test_bubblewrap.py


def test_environment_working_directory_creation(make_env: Any) -> None:
    """The working directory exists, writable, when the environment is made."""
    env = make_env()
    assert run(env, "test -d /testbed && test -w /testbed && echo ok")["output"] == "ok\n"


def test_environment_sandbox_settings(make_env: Any) -> None:
    """(bubblewrap's custom wrapper_args) Sandbox settings pass through: no network by
    default, the host's network when asked."""
    for network in (False, True):
        env = make_env(sandbox={"network": True} if network else {})
        assert run(env, "true")["returncode"] == 0  # (a plain sandbox starts on first use)
        assert env.task_sandbox.sandbox.config.network is network


def test_environment_get_template_vars(make_env: Any) -> None:
    template_vars = make_env(env={"TEST_VAR": "test_value"}).get_template_vars()
    assert template_vars["env"]["TEST_VAR"] == "test_value"
    assert template_vars["timeout"] == 30
    assert template_vars["cwd"] == "/testbed"
    assert "system" in template_vars and "machine" in template_vars


def test_environment_serialize(make_env: Any) -> None:
    import json

    info = make_env(timeout=7).serialize()["info"]["config"]
    assert info["environment_type"] == ENV_CLASS
    assert info["environment"]["timeout"] == 7 and info["environment"]["plain"] is True
    json.dumps(info)


# ---------------------------------------------------------- tests/environments/test_init.py


def test_get_environment_class_full_path() -> None:
    assert get_environment_class(ENV_CLASS) is MiniSandboxEnvironment
    env = get_environment({"environment_class": ENV_CLASS, "plain": True, "timeout": 3})
    try:
        assert isinstance(env, MiniSandboxEnvironment) and env.config.timeout == 3
    finally:
        env.cleanup()


# ------------------------------------- the result format, field for field, as LocalEnvironment's


def test_timeout_result_equals_local_environment(make_env: Any) -> None:
    """The timeout result (its output so far, the message, `extra`) is LocalEnvironment's."""
    command = "echo started; sleep 5"
    ours = run(make_env(timeout=1), command)
    theirs = LocalEnvironment(timeout=1).execute({"command": command})
    assert ours == theirs
    assert ours["exception_info"] == (
        "An error occurred while executing the command: "
        "Command 'echo started; sleep 5' timed out after 1 seconds"
    )
    assert ours["output"] == "started\n"


def test_timeout_argument_overrides_config(make_env: Any) -> None:
    ours = run(make_env(timeout=30), "sleep 5", timeout=1)
    assert ours == LocalEnvironment(timeout=30).execute({"command": "sleep 5"}, timeout=1)


def test_output_decoded_as_local_environment(make_env: Any) -> None:
    """Undecodable bytes replaced, \\r\\n and \\r read as newlines (subprocess's text mode)."""
    command = "printf 'a\\r\\nb\\rc\\377\\n'; echo err >&2; exit 4"
    ours = run(make_env(), command)
    assert ours == LocalEnvironment().execute({"command": command})
    assert ours == {"output": "a\nb\nc\ufffd\nerr\n", "returncode": 4, "exception_info": ""}


def test_submission_raises_submitted(make_env: Any) -> None:
    env = make_env()
    with pytest.raises(Submitted) as e:
        run(env, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch")
    (message,) = e.value.messages
    assert message == {
        "role": "exit",
        "content": "the patch\n",
        "extra": {"exit_status": "Submitted", "submission": "the patch\n"},
    }
    assert env.submission == "the patch\n"


def test_marker_not_first_or_failed_is_no_submission(make_env: Any) -> None:
    env = make_env()
    for command in (
        "echo x; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false",
    ):
        ours = run(env, command)
        assert ours == LocalEnvironment().execute({"command": command})
    assert env.submission is None
