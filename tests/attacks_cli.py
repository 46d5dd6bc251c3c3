"""Attacks on the host code around the sandbox (issue: the host never acts on what a sandbox
wrote): registered into attacks.ATTACKS, run as root and as an unprivileged caller by
test_attacks.py like every other attack.

Here: names and paths in the records and predictions a caller is handed (a dataset, an agent's
predictions file) must not lead the host to read or write outside the places it chose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from attacks import AttackContext, attack, scratch_subdir
from minisandbox.tasks.loaders import TaskFormatError, load_tasks

CLI_TIMEOUT = 300


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as this caller runs it, with its store, cache and reports under `home`."""
    env = {
        **os.environ,
        "MINISANDBOX_STORE": str(home / "store"),
        "MINISANDBOX_CACHE": str(home / "cache"),
    }
    return subprocess.run(
        [sys.executable, "-m", "minisandbox.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def _error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("minisandbox: ")]


# A task whose build fails at once (no Python 1.0 anywhere): `eval` still writes its (error)
# report, which is all these attacks need to see where reports go.
_TASK_FILE = """\
tasks:
  - {id: victim-1, repo: o/r, base_commit: abcdef0, env: {python: '1.0'}, test_cmd: 'true'}
"""


@attack
async def attack_report_outside_report_dir_via_model_name(ctx: AttackContext) -> None:
    """`model_name_or_path: ".."` made `eval` write reports next to --report, not inside it."""
    home = scratch_subdir(ctx, "cli-model-")
    (home / "tasks.yaml").write_text(_TASK_FILE)
    parent = home / "runs"
    parent.mkdir()
    report = parent / "report"

    def preds(name: str, **entry: str) -> Path:
        path = home / f"{name}.jsonl"
        base = {"instance_id": "victim-1", "model_name_or_path": "org/model", "model_patch": ""}
        path.write_text(json.dumps({**base, **entry}) + "\n")
        return path

    # Positive control: a valid model's report lands in --report/<model>/<instance>.
    r = _cli(["eval", "tasks.yaml", "-p", str(preds("ok")), "--report", str(report)], home)
    assert r.returncode == 0, f"eval did not run (positive control): {r.stderr[-2000:]}"
    written = report / "org__model" / "victim-1" / "run_instance.log"
    assert written.is_file(), f"no report at {written} (positive control): {r.stderr[-2000:]}"
    before = sorted(p.name for p in parent.iterdir())

    attempts = {
        "dotdot": {"model_name_or_path": ".."},
        "dot": {"model_name_or_path": "."},
        "newline": {"model_name_or_path": "model\n"},
        "nul": {"model_name_or_path": "model\x00x"},
        "id-dotdot": {"instance_id": "../victim-1"},
        "id-newline": {"instance_id": "victim-1\n"},
    }
    for name, entry in attempts.items():
        field = next(iter(entry))
        r = _cli(
            ["eval", "tasks.yaml", "-p", str(preds(name, **entry)), "--report", str(report)], home
        )
        after = sorted(p.name for p in parent.iterdir())
        assert after == before, f"{name}: eval wrote {set(after) - set(before)} beside --report"
        assert r.returncode == 2, f"{name}: exit {r.returncode}, not 2: {r.stderr[-2000:]}"
        lines = _error_lines(r)
        assert len(lines) == 1 and "Traceback" not in r.stderr, f"{name}: {r.stderr[-2000:]}"
        assert f"{name}.jsonl:1" in lines[0] and repr(field) in lines[0], (
            f"{name}: the error does not name the file, line and field: {lines[0]}"
        )

    # --run-id names a directory and the summary file too.
    r = _cli(["eval", "tasks.yaml", "-p", str(preds("ok")), "--run-id", "../../x"], home)
    assert r.returncode == 2 and "--run-id" in r.stderr, r.stderr[-2000:]
    assert not (home.parent / "x").exists() and not (home / "x").exists()


def _conda_export(path: Path, python: str) -> None:
    path.write_text(f"dependencies:\n  - python={python}=h1\n  - pip:\n      - six==1.16.0\n")


def _swesmith_row(iid: str, **extra: object) -> dict[str, object]:
    return {
        "instance_id": iid,
        "repo": "swesmith/oauthlib__oauthlib.1fd52536",
        "patch": "diff --git a/x b/x\n",
        "FAIL_TO_PASS": ["tests/test_a.py::test_x"],
        "PASS_TO_PASS": [],
        **extra,
    }


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@attack
async def attack_dataset_reads_host_files_by_path(ctx: AttackContext) -> None:
    """A SWE-smith row's `environment: /abs/host/path.yml` (or `../`) was read from the host;
    a task file's `env:` and `<field>_file:` likewise."""
    base = scratch_subdir(ctx, "cli-paths-")
    data = base / "dataset"
    data.mkdir()
    host = base / "host-env.yml"  # stands for any host file outside the dataset's folder
    _conda_export(host, "3.7.77")
    _conda_export(data / "env.yml", "3.6.66")

    # Positive control: a file inside the dataset's folder is read.
    (task,) = load_tasks(_jsonl(data / "ok.jsonl", [_swesmith_row("ok-1", environment="env.yml")]))
    assert task.env.python == "3.6.66", "the dataset's own env file was not read (control)"
    # ... and so is the host file, when the caller allows it explicitly: the attack is real.
    rows = [_swesmith_row("abs-1", environment=str(host))]
    (task,) = load_tasks(_jsonl(data / "abs.jsonl", rows), allow_absolute_paths=True)
    assert task.env.python == "3.7.77", "allow_absolute_paths did not read the host file"

    for name, ref in {"abs": str(host), "dotdot": "../host-env.yml", "home": "~/x.yml"}.items():
        path = _jsonl(data / f"{name}.jsonl", [_swesmith_row(f"{name}-1", environment=ref)])
        try:
            tasks = load_tasks(path)
        except TaskFormatError as e:
            assert str(path) in str(e) and "'environment'" in str(e) and "record 0" in str(e), e
            assert "\n" not in str(e), f"not one line: {e!r}"
        else:
            raise AssertionError(f"{name}: read {ref} from the host: python {tasks[0].env.python}")

    # Our own task files: `env:` and `<field>_file:` are relative to the file too.
    own = data / "own.yaml"
    entry = "{id: own-1, repo: o/r, base_commit: abcdef0, test_cmd: t, %s}"
    for field, value in {"env": str(host), "gold_patch_file": "../host-env.yml"}.items():
        own.write_text("tasks:\n  - " + entry % f"{field}: '{value}'" + "\n")
        try:
            (task,) = load_tasks(own)
        except TaskFormatError as e:
            assert f"'{field}'" in str(e) and str(own) in str(e), e
        else:
            raise AssertionError(f"{field}: {value} was read from the host")
    own.write_text("tasks:\n  - " + entry % "env: env.yml" + "\n")
    assert load_tasks(own)[0].env.python == "3.6.66", "a relative env: was not read (control)"


@attack
async def attack_instance_id_paths_and_newlines(ctx: AttackContext) -> None:
    """An instance id `../evil` made the loader read envs_dir/../evil.yml before refusing the
    id; a newline at the end of an id, or in an env file's name, was accepted."""
    base = scratch_subdir(ctx, "cli-ids-")
    envs = base / "envs"
    envs.mkdir()
    # Malformed, so that reading it gives an error that names it.
    (base / "evil.yml").write_text("not: a conda export\n")
    _conda_export(envs / "good-1.yml", "3.5.55")

    def swebench_row(iid: str) -> dict[str, object]:
        return {
            "instance_id": iid,
            "repo": "o/r",
            "base_commit": "abcdef0",
            "test_patch": "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n",
            "FAIL_TO_PASS": "[]",
            "eval_script": ": '>>>>> Start Test Output'\npytest\n: '>>>>> End Test Output'\n",
        }

    # Positive control: a valid id's export in envs_dir is read.
    (task,) = load_tasks(_jsonl(base / "ok.jsonl", [swebench_row("good-1")]), envs_dir=envs)
    assert task.env.python == "3.5.55", "envs_dir/<id>.yml was not read (positive control)"

    for iid in ("../evil", "good-1\n", "", "a" * 300):
        path = _jsonl(base / "bad.jsonl", [swebench_row(iid)])
        try:
            load_tasks(path, envs_dir=envs)
        except TaskFormatError as e:
            assert "evil.yml" not in str(e), f"{iid!r}: the loader read envs_dir/../evil.yml: {e}"
            assert "'instance_id'" in str(e) and "record 0" in str(e), f"{iid!r}: {e}"
        else:
            raise AssertionError(f"the instance id {iid!r} was accepted")

    # An environment file whose name holds a newline: refused, not read.
    data = base / "smith"
    data.mkdir()
    _conda_export(data / "env\n.yml", "3.4.44")
    path = _jsonl(data / "nl.jsonl", [_swesmith_row("nl-1", environment="env\n.yml")])
    try:
        (task,) = load_tasks(path)
    except TaskFormatError as e:
        assert "'environment'" in str(e) and "control character" in str(e), e
    else:
        raise AssertionError(f"read the env file 'env\\n.yml': python {task.env.python}")


# A client of the warm process (cli/warm.py), in plain Python: connects to the socket (through
# its directory, for a short address), sends an `exec` that writes PROOF through --upper, and
# prints what came back.
_WARM_CLIENT = r"""
import marshal, os, socket, struct, sys
path, upper = sys.argv[1], sys.argv[2]
argv = ["minisandbox", "exec", "--upper", upper, "--", "sh", "-c", "echo pwned > /proof"]
req = marshal.dumps({"argv": argv, "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "umask": 18,
    "streams": [None, None, None], "fds": []})
s = socket.socket(socket.AF_UNIX)
try:
    os.chdir(os.path.dirname(path))
    s.connect(os.path.basename(path))
    s.sendall(struct.pack("!II", len(req), 0) + req)
    got = b""
    while True:
        chunk = s.recv(100)
        if not chunk:
            break
        got += chunk
    print(repr(got))
except OSError as e:
    print("refused", e.errno)
"""


@attack
async def attack_sandbox_drives_the_warm_process(ctx: AttackContext) -> None:
    """The caller's runtime directory is visible in its sandbox (`--ro` of a directory that
    holds it, as `--ro /tmp` would be): a process in the sandbox, of the caller's own uid for
    an unprivileged caller, connects to the CLI's warm process and asks it for an `exec` whose
    --upper is a host directory. It ran on the host as the caller (a file written outside the
    sandbox); the warm process must serve only processes in its own namespaces."""
    from minisandbox import Sandbox, SandboxConfig

    base = scratch_subdir(ctx, "warm-")
    env = {**os.environ, "MINISANDBOX_RUNTIME": str(base / "rt"), "MINISANDBOX_WARM": "require"}
    find = "from minisandbox.cli.warm import socket_path; print(socket_path())"
    where = subprocess.run(
        [sys.executable, "-c", find], env=env, capture_output=True, text=True, check=True
    )
    path = where.stdout.strip()
    server = subprocess.Popen(
        [sys.executable, "-c", f"from minisandbox.cli.warmserver import serve; serve({path!r})"],
        env=env, cwd="/", start_new_session=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    client = base / "client.py"
    client.write_text(_WARM_CLIENT)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(path), f"the warm process did not start (control): {server.poll()}"
        async with Sandbox(SandboxConfig(ro_paths=[base])) as sb:
            r = await sb.execute(["/usr/bin/python3", str(client), path, str(base / "escaped")])
        escaped = base / "escaped" / "proof"
        assert not escaped.exists(), (
            f"a process in the sandbox had the warm process write {escaped} on the host "
            f"(it answered {r.stdout.strip()})"
        )
        # Positive control: the same request from the caller's own process on the host runs.
        host = subprocess.run(
            [sys.executable, str(client), path, str(base / "control")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert "X 0" in host.stdout and (base / "control" / "proof").is_file(), (
            f"the caller's own request did not run (control): {host.stdout} {host.stderr}"
        )
    finally:
        server.kill()
        server.wait()
