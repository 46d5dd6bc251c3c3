"""`minisandbox shell` with piped input, and `minisandbox exec` in a task's environment or over
an environment layer, run as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from conftest import CLI, run_cli
from minisandbox.tasks.builder import BuildSettings

# ---------------------------------------------------------------- shell, input piped in


def test_piped_shell_runs_the_script_and_exits_with_its_status() -> None:
    r = run_cli("shell", stdin=b"echo hi; exit 3\n", timeout=30)
    assert (r.stdout, r.returncode) == (b"hi\n", 3), r.stderr
    assert b"\x1b[" not in r.stdout + r.stderr  # no prompt, no bracketed paste


def test_piped_shell_runs_every_line_and_exits_0() -> None:
    r = run_cli("shell", stdin=b"echo a\necho b\n", timeout=30)
    assert (r.stdout, r.returncode) == (b"a\nb\n", 0), r.stderr


def test_piped_shell_is_not_interactive_and_keeps_stderr_apart() -> None:
    r = run_cli("shell", stdin=b"echo err >&2; pwd; case $- in *i*) echo interactive;; esac\n")
    assert (r.stdout, r.stderr, r.returncode) == (b"/testbed\n", b"err\n", 0)


def test_empty_piped_input_exits_at_once() -> None:
    r = run_cli("shell", stdin=b"", timeout=30)
    assert (r.stdout, r.returncode) == (b"", 0), r.stderr


# ---------------------------------------------------------------- exec in a task's environment


def _env_for(settings: BuildSettings) -> dict[str, str]:
    return {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
    }


def _cli(env: dict[str, str], *args: str, stdin: bytes | None = None) -> CompletedProcess[bytes]:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, env=env, timeout=300, check=False
    )


TASK = ["--tasks", "examples", "--task", "examples__semverkit-1"]


def test_exec_in_a_task_environment(settings: BuildSettings, built: list) -> None:
    env = _env_for(settings)
    r = _cli(env, "exec", *TASK, "--", "python", "-c", "import semverkit; print('ok')")
    assert (r.stdout, r.returncode) == (b"ok\n", 0), r.stderr
    r = _cli(env, "exec", *TASK, "--", "sh", "-c", "pwd; git log --oneline | wc -l; exit 5")
    assert (r.stdout, r.returncode) == (b"/testbed\n1\n", 5), r.stderr
    r = _cli(env, "exec", *TASK, "--", "tr", "a-z", "A-Z", stdin=b"abc\n")
    assert (r.stdout, r.returncode) == (b"ABC\n", 0), r.stderr


def test_piped_shell_in_a_task_environment(settings: BuildSettings, built: list) -> None:
    script = b"python -c 'import semverkit; print(semverkit.__name__)'; exit 4\n"
    r = _cli(_env_for(settings), "shell", *TASK, stdin=script)
    assert (r.stdout, r.returncode) == (b"semverkit\n", 4), r.stderr


def test_exec_of_an_unknown_task_is_one_line() -> None:
    r = run_cli("exec", "--tasks", "examples", "--task", "no-such-task", "--", "true")
    err = r.stderr.decode()
    assert r.returncode == 2 and "no-such-task" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "option", [["--ro", "/"], ["--network"], ["--workdir", "/tmp"], ["--layer", "/"]]
)
def test_plain_sandbox_options_with_a_task_are_refused(option: list[str]) -> None:
    # They shaped nothing with --task (the agent's sandbox): a --ro dir was silently absent.
    r = run_cli("exec", "--task", "examples__semverkit-1", *option, "--", "true")
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"{option[0]} cannot be combined with --task" in err, err


# ---------------------------------------------------------------- exec over an environment layer


def test_exec_over_a_venv_layer_has_the_venv_on_path(layer_dir: Path) -> None:
    """A layer holding a venv at /opt/venv, made here from the interpreter running the tests
    (its bin/python links to the host's install): its commands are found, its python runs."""
    venv = layer_dir / "opt" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    hello = venv / "bin" / "hello"
    hello.write_text("#!/opt/venv/bin/python\nimport sys\nprint('hello from', sys.prefix)\n")
    hello.chmod(0o755)
    script = "import sys; print(sys.prefix)"
    r = run_cli("exec", "--layer", str(layer_dir), "-w", "/", "--", "python", "-c", script)
    assert (r.stdout, r.returncode) == (b"/opt/venv\n", 0), r.stderr
    r = run_cli("exec", "--layer", str(layer_dir), "-w", "/", "--", "hello")
    assert (r.stdout, r.returncode) == (b"hello from /opt/venv\n", 0), r.stderr


def test_exec_over_a_built_environment_layer_runs_pytest(
    settings: BuildSettings, built: list, layer_dir: Path
) -> None:
    layers = sorted(settings.cache.glob("**/opt/venv/bin/pytest"))
    assert layers, "no environment layer with pytest in the node cache"
    env_layer = layers[0].parents[3]
    r = run_cli("exec", "--layer", str(env_layer), "-w", "/", "--", "pytest", "--version")
    assert r.returncode == 0 and b"pytest" in r.stdout + r.stderr, r.stderr


def test_a_missing_layer_is_one_line(tmp_path: Path) -> None:
    for option in ("--layer", "--ro"):
        r = run_cli("exec", option, str(tmp_path / "nope"), "--", "true")
        err = r.stderr.decode()
        assert r.returncode == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"minisandbox: {option} ") and "not a directory" in err, err


def test_exec_task_says_what_it_builds_on_stderr(settings: BuildSettings, tmp_path: Path) -> None:
    """On a cold store the task's layers are built first (long): its phases go to stderr, one
    line each, and stdout holds only the command's output; with --quiet, nothing is said."""
    args = ["exec", *TASK, "--", "echo", "ok"]
    for quiet in (False, True):
        env = _env_for(settings)  # a cold store each time: both runs build
        cold = tmp_path / ("quiet" if quiet else "loud")
        env.update(MINISANDBOX_STORE=str(cold / "store"), MINISANDBOX_CACHE=str(cold / "cache"))
        r = _cli(env, *([*args[:5], "--quiet", *args[5:]] if quiet else args))
        assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr.decode()[-2000:]
        lines = r.stderr.decode().splitlines()
        said = [f"examples__semverkit-1: {p}" in lines for p in ("building env", "building task")]
        assert said == [not quiet, not quiet], r.stderr.decode()[-2000:]
