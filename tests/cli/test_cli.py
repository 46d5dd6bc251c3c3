"""The `minisandbox` command line, run as a user would run it."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, run_cli


def test_exec_streams_output_and_passes_exit_code() -> None:
    r = run_cli("exec", "--", "bash", "-c", "echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.returncode) == (b"out\n", b"err\n", 7)


def test_exec_reads_stdin_and_honours_timeout() -> None:
    assert run_cli("exec", "--", "tr", "a-z", "A-Z", stdin=b"abc\n").stdout == b"ABC\n"
    began = time.monotonic()
    r = run_cli("exec", "--timeout", "1", "--", "sleep", "30")
    assert r.returncode == 124 and b"timed out" in r.stderr
    assert time.monotonic() - began < 20


def test_exec_with_layer_and_upper(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "testbed").mkdir(parents=True)
    (layer / "testbed" / "hello.txt").write_text("from the layer\n")
    upper = tmp_path / "upper"
    r = run_cli(
        "exec",
        "--layer",
        str(layer),
        "--upper",
        str(upper),
        "--",
        "bash",
        "-c",
        "cat hello.txt && echo changed > /root/note",
    )
    assert r.stdout == b"from the layer\n", r.stderr
    assert (upper / "root" / "note").read_text() == "changed\n"


def test_bad_layer_is_named() -> None:
    r = run_cli("exec", "--layer", "/does/not/exist", "--", "true")
    assert r.returncode == 2 and b"not a directory" in r.stderr


def test_help_explains_commands() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for word in (b"shell", b"exec", b"demo"):
        assert word in r.stdout
    assert b"--layer" in run_cli("exec", "--help").stdout


def test_interactive_shell_on_a_terminal() -> None:
    """Drive `minisandbox shell` through a real pty, as a person at a terminal would."""
    pid, fd = pty.fork()
    if pid == 0:  # child: becomes the CLI
        os.execv(sys.executable, [*CLI, "shell"])
    seen = b""

    def read_until(token: bytes, timeout: float = 30) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while token not in seen:
            assert time.monotonic() < deadline, f"no {token!r} in {seen[-500:]!r}"
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break

    try:
        read_until(b"(sandbox)")
        os.write(fd, b"echo sum=$((40 + 2)); hostname\n")
        read_until(b"sum=42")
        read_until(b"sandbox\r\n")
        os.write(fd, b"sleep 100\n")
        time.sleep(0.5)
        os.write(fd, b"\x03")  # Ctrl-C reaches the sandbox's foreground job, not the CLI
        os.write(fd, b"echo after-interrupt\n")
        read_until(b"after-interrupt\r\n")
        os.write(fd, b"exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.timeout(960)
def test_demo_runs() -> None:
    # It builds (when the store lacks them) and grades the examples: minutes on a busy machine.
    r = run_cli("demo", "--sandboxes", "2", timeout=900)
    assert r.returncode == 0, r.stderr
    assert b"blocked" in r.stdout and b"/tmp 1" in r.stdout


def _env_for(settings) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The store, cache and mirror given as environment variables, as a cluster would."""
    return {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
    }


def test_tasks_build_and_cache_commands(settings, built) -> None:  # type: ignore[no-untyped-def]
    env = _env_for(settings)
    listing = subprocess.run(
        [*CLI, "tasks", "examples", "--json"], capture_output=True, text=True, env=env, check=True
    )
    ids = [json.loads(line)["id"] for line in listing.stdout.splitlines()]
    assert ids == [r.task_id for r in built]
    r = subprocess.run(
        [*CLI, "build", "examples", "--json", "-i", ids[0]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and summary["cached"] == [ids[0]] and summary["total"] == 1
    bad = subprocess.run(
        [*CLI, "build", "examples", "-i", "no-such-task"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert bad.returncode == 2 and "no-such-task" in bad.stderr
    du = subprocess.run([*CLI, "cache", "du"], capture_output=True, text=True, env=env, check=True)
    assert "layers" in du.stdout and str(settings.store) in du.stdout
    verify = subprocess.run(
        [*CLI, "cache", "verify"], capture_output=True, text=True, env=env, check=False
    )
    assert verify.returncode == 0 and "0 problems" in verify.stdout
    ls = subprocess.run([*CLI, "cache", "ls"], capture_output=True, text=True, env=env, check=True)
    assert "env" in ls.stdout and "task" in ls.stdout


def test_shell_in_a_task_environment(settings, built) -> None:  # type: ignore[no-untyped-def]
    env = _env_for(settings)
    script = b"git log --oneline | wc -l; python -c 'import semverkit; print(semverkit.__name__)'\n"
    r = subprocess.run(
        [*CLI, "shell", "--task", "examples__semverkit-1"],
        input=script + b"exit\n",
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    # One commit of history (the base), and the task's package importable from its venv.
    assert b"1\nsemverkit\n" in r.stdout


def test_os_errors_are_one_line_naming_the_path(tmp_path: Path) -> None:
    """A place the CLI cannot write to (here: in /sys, refused to root too) ends it with one
    line naming the path and the setting to change, exit 2, no traceback."""
    target = "/sys/kernel/minisandbox-cannot-write-here"
    r = run_cli("eval", "examples", "-p", "gold", "--report", target)
    err = r.stderr.decode()
    lines = [line for line in err.splitlines() if line.startswith("minisandbox: ")]
    assert r.returncode == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and target in lines[0] and "--report" in lines[0], err
    assert not os.path.exists(target)


def test_eval_refuses_a_run_id_that_is_a_path(tmp_path: Path) -> None:
    r = run_cli("eval", "examples", "-p", "gold", "--run-id", "../escape")
    assert r.returncode == 2 and b"--run-id" in r.stderr and b"'/'" in r.stderr, r.stderr


def test_build_progress_on_stderr_per_instance(settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`build --json` in a store of its own: the instance's phases (building env, building
    task) and result on stderr, stdout JSON alone; again on a terminal (a live display on
    stderr), cached; --quiet shows nothing."""
    env = {
        **_env_for(settings),
        "MINISANDBOX_STORE": str(tmp_path / "store"),
        "MINISANDBOX_CACHE": str(tmp_path / "layers"),
    }
    iid = "examples__datekit-1"
    args = [*CLI, "build", "examples", "-i", iid, "--json"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["built"] == [iid]  # the whole of stdout
    lines = [line for line in r.stderr.splitlines() if iid in line]
    assert lines[:2] == [f"{iid}: building env", f"{iid}: building task"], r.stderr
    assert len(lines) == 3 and lines[2].startswith(f"[1/1] {iid}: built ("), r.stderr

    # stderr a terminal, stdout a pipe.
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1.0)[0]:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal's other end closed: the process is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, seen
    assert json.loads(out)["cached"] == [iid]
    assert f"[1/1] {iid}: cached (".encode() in seen, seen

    quiet = subprocess.run(
        [*args, "--quiet"], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["cached"] == [iid]
    assert iid not in quiet.stderr, quiet.stderr
