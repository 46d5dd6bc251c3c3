"""`minisandbox eval` and `build --validate`, run as a user would, on the built example tasks:
real builds, real sandboxes, and the reports checked against swebench's own run report."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minisandbox.errors import TaskNotValidatedError
from minisandbox.evaluation.validation import read_validation, validate
from minisandbox.runtime import Runtime
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.eval_script import START_MARKER
from minisandbox.tasks.loaders import load_tasks

CLI = [sys.executable, "-m", "minisandbox.cli"]
EXAMPLES = [t.id for t in load_tasks("examples")]
GOLD = {t.id: t.gold_patch for t in load_tasks("examples")}


def _env(settings: BuildSettings) -> dict[str, str]:
    return {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
        "COLUMNS": "250",  # rich's tables fit a terminal's width: keep reasons on one line
    }


def _cli(settings: BuildSettings, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        env=_env(settings),
        cwd=cwd,
        timeout=600,
        check=False,
    )


def _last_json(r: subprocess.CompletedProcess) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _swebench_run_report(
    cwd: Path, run_dir: Path, preds: dict[str, dict], ids: list[str], run_id: str
) -> dict:
    """swebench's make_run_report over the report directory we wrote, `run_dir` (it reads
    logs/run_evaluation/<run_id> relative to the working directory, `cwd`, and writes there
    too: `run_dir` is copied there)."""
    from swebench.harness.reporting import make_run_report

    shutil.copytree(run_dir, cwd / "logs" / "run_evaluation" / run_id)
    here = Path.cwd()
    os.chdir(cwd)
    try:
        path = make_run_report(preds, [{"instance_id": i} for i in ids], run_id)
        return json.loads((cwd / path).read_text())
    finally:
        os.chdir(here)


def _check_instance_report(out: Path, iid: str, resolved: bool) -> None:
    report = json.loads((out / "report.json").read_text())
    entry = report[iid]
    assert set(entry) == {
        "patch_is_None",
        "patch_exists",
        "patch_successfully_applied",
        "resolved",
        "tests_status",
        # ours, beside swebench's
        "reward",
        "swebench_resolved",
        "grading",
        "tampering",
    }
    assert entry["resolved"] is resolved and entry["patch_successfully_applied"] is True
    assert entry["grading"] == "guarded" and entry["tampering"] == []
    assert entry["reward"] == (1.0 if resolved else 0.0)
    assert set(entry["tests_status"]) == {
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "FAIL_TO_FAIL",
        "PASS_TO_FAIL",
    }
    for status in entry["tests_status"].values():
        assert set(status) == {"success", "failure"}
    assert START_MARKER in (out / "test_output.txt").read_text()


def test_eval_gold_resolves_every_example(settings, built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The default report directory is laid out as swebench's, so its own run report can read it;
    # it is the run's log directory beside the build logs, not in the current directory.
    r = _cli(settings, "eval", "examples", "--predictions", "gold", "--json", cwd=tmp_path)
    summary = _last_json(r)
    assert summary["total"] == 3 and summary["resolved_ids"] == EXAMPLES, summary
    assert summary["unresolved_ids"] == summary["error_ids"] == summary["empty_patch_ids"] == []
    assert summary["rewards"] == dict.fromkeys(EXAMPLES, 1.0)
    assert summary["grading"] == "guarded" and summary["tampered"] == 0
    assert summary["swebench_resolved"] == 3 and summary["swebench_resolved_ids"] == EXAMPLES
    run_dir = settings.logs / "run_evaluation" / "minisandbox"
    assert summary["logs"] == str(run_dir)
    assert summary["report"] == str(run_dir / "gold.minisandbox.json")
    assert not (tmp_path / "logs").exists()
    for iid in EXAMPLES:
        out = run_dir / "gold" / iid
        _check_instance_report(out, iid, resolved=True)
        assert (out / "patch.diff").read_text() == GOLD[iid]
    ours = json.loads((run_dir / "gold.minisandbox.json").read_text())
    preds = {
        i: {"instance_id": i, "model_name_or_path": "gold", "model_patch": GOLD[i]}
        for i in EXAMPLES
    }
    assert ours == _swebench_run_report(tmp_path, run_dir, preds, EXAMPLES, "minisandbox")
    assert ours["resolved_instances"] == 3 and ours["schema_version"] == 2


def test_eval_empty_resolves_nothing(settings, built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = tmp_path / "reports"
    r = _cli(
        settings, "eval", "examples", "-p", "empty", "--report", str(report), "--json", cwd=tmp_path
    )
    summary = _last_json(r)
    assert summary["resolved_ids"] == [] and summary["error_ids"] == []
    assert summary["unresolved_ids"] == summary["empty_patch_ids"] == EXAMPLES
    assert set(summary["rewards"].values()) == {0.0}
    assert all("FAIL_TO_PASS" in summary["reasons"][i] for i in EXAMPLES)
    run = json.loads((report / "empty.minisandbox.json").read_text())
    # As in swebench: empty patches are counted apart, neither completed nor unresolved.
    assert run["empty_patch_ids"] == sorted(EXAMPLES) and run["completed_instances"] == 0
    for iid in EXAMPLES:
        _check_instance_report(report / "empty" / iid, iid, resolved=False)


def test_eval_predictions_file(settings, built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good, bad, unpredicted = EXAMPLES[1], EXAMPLES[0], EXAMPLES[2]
    broken = "--- a/nothing.py\n+++ b/nothing.py\n@@ -1,1 +1,1 @@\n-not there\n+at all\n"
    preds = [
        {"instance_id": good, "model_name_or_path": "org/agent", "model_patch": GOLD[good]},
        {"instance_id": bad, "model_name_or_path": "org/agent", "model_patch": broken},
    ]
    file = tmp_path / "preds.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in preds))
    run_id = f"preds-{tmp_path.name}"  # the store's logs are shared by the tests
    r = _cli(settings, "eval", "examples", "-p", str(file), "-j", "2", "--run-id", run_id,
             "--json", cwd=tmp_path)  # fmt: skip
    summary = _last_json(r)
    assert summary["total"] == 2, summary  # only predicted tasks are evaluated
    assert summary["resolved_ids"] == [good] and summary["error_ids"] == [bad]
    assert summary["rewards"] == {good: 1.0, bad: 0.0}
    assert "does not apply" in summary["reasons"][bad]
    run_dir = settings.logs / "run_evaluation" / run_id
    _check_instance_report(run_dir / "org__agent" / good, good, resolved=True)
    # Like swebench, an instance whose patch does not apply gets no report.json.
    assert not (run_dir / "org__agent" / bad / "report.json").exists()
    assert (run_dir / "org__agent" / bad / "patch.diff").read_text() == broken
    assert "does not apply" in (run_dir / "org__agent" / bad / "run_instance.log").read_text()
    ours = json.loads((run_dir / f"org__agent.{run_id}.json").read_text())
    assert ours == _swebench_run_report(
        tmp_path, run_dir, {p["instance_id"]: p for p in preds}, [bad, good], run_id
    )
    assert unpredicted not in ours["submitted_ids"]

    # The human summary table (on the failing patch alone: the run grades nothing, and so
    # does not spend seconds importing swebench).
    (tmp_path / "bad.jsonl").write_text(json.dumps(preds[1]) + "\n")
    r = _cli(settings, "eval", "examples", "-p", str(tmp_path / "bad.jsonl"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resolved 0/1, unresolved 0, error 1" in r.stdout and "does not apply" in r.stdout

    # A prediction for an instance the dataset does not have: an error naming it and its line.
    with file.open("a") as f:
        f.write(json.dumps({**preds[0], "instance_id": "no-such-task"}) + "\n")
    r = _cli(settings, "eval", "examples", "-p", str(file), cwd=tmp_path)
    assert r.returncode == 2 and f"{file}:3" in r.stderr and "no-such-task" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"instance_id": "a", "model_name_or_path": "m"}\n', ":1: field 'model_patch'"),
        (
            '{"instance_id": "a", "model_patch": "", "model_name_or_path": "m"}\n{"x"\n',
            ":2: not JSON",
        ),
        ('{"model_patch": "", "model_name_or_path": "m"}\n', ":1: field 'instance_id'"),
        ('[{"instance_id": "a", "model_name_or_path": "m", "model_patch": 3}]', "entry 0"),
    ],
)
def test_eval_rejects_malformed_predictions(tmp_path: Path, content: str, expected: str) -> None:
    file = tmp_path / ("p.json" if content.startswith("[") else "p.jsonl")
    file.write_text(content)
    r = subprocess.run(
        [*CLI, "eval", "examples", "-p", str(file)], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and f"{file}" in r.stderr and expected in r.stderr, r.stderr


def test_eval_rejects_an_unknown_grading(tmp_path: Path) -> None:
    r = subprocess.run(
        [*CLI, "eval", "examples", "-p", "gold", "--grading", "lenient"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "--grading 'lenient'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_build_validate_and_require_validated(settings, built, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    task = load_tasks("examples")[1]
    r = _cli(settings, "build", "examples", "--validate", "--json", "-i", task.id, cwd=tmp_path)
    summary = _last_json(r)
    assert summary["valid"] == [task.id] and summary["invalid"] == {}
    builder = Builder(settings)
    verdict = read_validation(builder, task)
    assert verdict is not None and verdict.valid
    assert verdict.gold.resolved and not verdict.empty.swebench_resolved

    # A task sharing the layer but not its test spec has no verdict of its own...
    changed = task.model_copy(update={"pass_to_pass": task.pass_to_pass[:1]})
    assert builder.built_layers(changed) == builder.built_layers(task)
    assert read_validation(builder, changed) is None
    # ... and one with no gold patch fails validation, with the reason recorded.
    no_gold = task.model_copy(update={"gold_patch": "", "pass_to_pass": []})

    monkeypatch.setenv("MINISANDBOX_REQUIRE_VALIDATED", "1")
    strict = Builder(BuildSettings(**{**settings.model_dump(), "require_validated": True}))
    assert BuildSettings().require_validated  # the environment variable turns it on

    runtime = Runtime(builder=strict)

    async def go() -> None:
        bad = await validate(strict, no_gold)
        assert not bad.valid and "gold patch does not resolve" in bad.reason
        async with runtime.sandbox(task) as sb:  # validated: allowed
            assert (await sb.execute("true")).exit_code == 0
        for refused, why in ((changed, "has no validation"), (no_gold, "failed validation")):
            with pytest.raises(TaskNotValidatedError, match=why) as e:
                async with runtime.sandbox(refused):
                    pass
            assert "minisandbox build" in str(e.value) and "--validate" in str(e.value)
        async with runtime.sandbox(changed, require_validated=False):  # waived
            pass
        async with runtime.sandbox(changed, purpose="evaluation"):  # a grader's: no policy
            pass
        async with strict.sandbox(changed):  # the build's own sandboxes: no policy
            pass
        with pytest.raises(TypeError, match="Runtime"):  # the old per-call switch
            async with strict.sandbox(changed, require_validated=False):
                pass

    asyncio.run(go())


# ------------------------------------------------------------------ a full disk (issue 9, 6b)

IS_ROOT = os.geteuid() == 0
UID = 4242


@pytest.fixture(scope="module")
def uid_runner() -> Iterator[Any]:
    """A venv uid 4242 can run the CLI from (built once for this module, when needed)."""
    from attack_harness import RunnerUnavailable, UidRunner

    runner: list[Any] = []
    failure: list[str] = []

    def get() -> Any:
        if not runner and not failure:
            try:
                runner.append(UidRunner(Path(__file__).resolve().parents[2], UID))
            except RunnerUnavailable as e:
                failure.append(str(e))
        if failure:
            pytest.skip(f"cannot run the CLI as uid {UID}: {failure[0]}")
        return runner[0]

    yield get
    for r in runner:
        r.close()


@contextlib.contextmanager
def _tmpfs(size: str, uid: int) -> Iterator[Path]:
    """A small filesystem of its own (root only), owned by `uid`."""
    path = Path(tempfile.mkdtemp(prefix="msb-enospc-"))
    os.chmod(path, 0o755)
    opts = f"size={size},mode=0755,uid={uid},gid={uid}"
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def _fill(fs: Path, leave: int, uid: int) -> None:
    """Fill `fs` but `leave` bytes."""
    st = os.statvfs(fs)
    filler = fs / "filler"
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    os.chown(filler, uid, uid)


def _copy_tree(src: Path, dst: Path, uid: int) -> None:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    if uid != 0:
        subprocess.run(["chown", "-R", f"{uid}:{uid}", str(dst)], check=True)


def _run_as(
    caller: str, runner: Any, env: dict[str, str], args: list[str], cwd: Path
) -> subprocess.CompletedProcess:
    """The CLI with `args` as `caller`, with a deadline: a hang fails the test."""
    if caller == "root":
        argv, full_env = [*CLI, *args], {**os.environ, **env}
    else:
        argv = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--"]
        argv += [runner.python, "-m", "minisandbox.cli", *args]
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(runner.home)}
        full_env.update(env)
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300, check=False
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr if isinstance(e.stderr, str) else repr(e.stderr)
        raise AssertionError(f"`{' '.join(args)}` did not end within 300 s: {stderr}") from None


def _eval_as(
    caller: str, runner: Any, env: dict[str, str], report: Path, cwd: Path, jobs: int
) -> Any:
    """`eval examples -p gold` as `caller`."""
    args = ["eval", "examples", "-p", "gold", "-j", str(jobs), "--report", str(report)]
    return _run_as(caller, runner, env, args, cwd)


@pytest.fixture(scope="module")
def uid_store(settings, built, uid_runner) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    """A copy of the built store that uid 4242 owns, with the layers uid 4242's own build makes:
    it finds its interpreters itself (root's may be out of its reach, under root's home), so
    its environments can be other layers than root's."""
    runner = uid_runner()
    work = Path(tempfile.mkdtemp(prefix="msb-uid-store-"))
    try:
        os.chmod(work, 0o755)
        os.chown(work, UID, UID)
        _copy_tree(settings.store, work / "store", UID)
        _copy_tree(settings.git_mirror, work / "mirror", UID)
        env = {**_env(settings), "MINISANDBOX_GIT_MIRROR": str(work / "mirror")}
        env.update(MINISANDBOX_STORE=str(work / "store"), MINISANDBOX_CACHE=str(work / "cache"))
        r = _run_as("unprivileged", runner, env, ["build", "examples"], work)
        assert r.returncode == 0, f"uid {UID} could not build the examples: {r.stderr[-3000:]}"
        yield work / "store"
    finally:
        from minisandbox.utils.safefs import discard_tree

        discard_tree(work)


def _one_clear_line(r: Any, path: Path) -> str:
    assert r.returncode == 2, f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "exception" not in r.stderr.lower(), r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("minisandbox: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "No space left on device" in lines[0] and str(path) in lines[0], lines[0]
    return lines[0]


@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("caller", ["root", pytest.param("unprivileged", marks=pytest.mark.slow)])
def test_eval_on_a_full_report_disk(settings, built, caller: str, uid_runner) -> None:  # type: ignore[no-untyped-def]
    """The reports' disk fills up after the first instance: one line naming the file and the
    fix, exit 2, the finished instance's report whole on disk, nothing half-written, no
    summary (it would describe a run that did not finish), and the CLI ends."""
    uid = 0 if caller == "root" else UID
    runner = None if caller == "root" else uid_runner()
    env = _env(settings)
    work = Path(tempfile.mkdtemp(prefix="msb-enospc-work-"))
    try:
        os.chmod(work, 0o755)
        if caller != "root":  # the uid's own copy of the built layers
            os.chown(work, uid, uid)  # the store's folder: its build locks live there
            _copy_tree(settings.store, work / "store", uid)
            _copy_tree(settings.cache, work / "cache", uid)
            _copy_tree(settings.git_mirror, work / "mirror", uid)
            env["MINISANDBOX_GIT_MIRROR"] = str(work / "mirror")
            env.update(MINISANDBOX_STORE=str(work / "store"), MINISANDBOX_CACHE=str(work / "cache"))
        with _tmpfs("1m", uid) as fs:
            _fill(fs, 24 << 10, uid)  # room for one instance's report (~20 KiB of pages)
            report = fs / "report"
            r = _eval_as(caller, runner, env, report, work, jobs=1)  # one finishes first
            line = _one_clear_line(r, report)
            assert "--report" in line, line
            reports = sorted(report.glob("gold/*/report.json"))
            assert 1 <= len(reports) < len(EXAMPLES), (reports, r.stderr[-2000:])
            for path in reports:  # complete: everything else is written before report.json
                iid = path.parent.name
                _check_instance_report(path.parent, iid, resolved=True)
                assert (path.parent / "run_instance.log").is_file()
                assert (path.parent / "patch.diff").read_text() == GOLD[iid]
            assert not list(report.glob("**/.*.tmp")), "temporary files left behind"
            assert not list(report.glob("*.json")), "a run summary of an unfinished run"
    finally:
        from minisandbox.utils.safefs import discard_tree

        discard_tree(work)


@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("caller", ["root", pytest.param("unprivileged", marks=pytest.mark.slow)])
def test_eval_on_a_full_store_disk(settings, built, caller: str, uid_runner, request) -> None:  # type: ignore[no-untyped-def]
    """The store and node cache on a disk too small to unpack the layers: evaluations fail
    mid-start, in parallel; one line, exit 2, and the CLI ends (no hang, no tracebacks of the
    tasks left behind)."""
    uid = 0 if caller == "root" else UID
    runner = None if caller == "root" else uid_runner()
    # The caller's own layers are in the store: the unpacking fails, not a build.
    store = settings.store if caller == "root" else request.getfixturevalue("uid_store")
    work = Path(tempfile.mkdtemp(prefix="msb-enospc-work-"))
    try:
        os.chmod(work, 0o755)
        if uid:
            os.chown(work, uid, uid)
        with _tmpfs("40m", uid) as fs:
            _copy_tree(store, fs / "store", uid)  # ~16 MB a caller; the layers need ~90 unpacked
            env = _env(settings)
            env.update(MINISANDBOX_STORE=str(fs / "store"), MINISANDBOX_CACHE=str(fs / "cache"))
            report = work / "report"
            r = _eval_as(caller, runner, env, report, work, jobs=3)
            _one_clear_line(r, fs)
            assert not list(report.glob("*.json")), "a run summary of an unfinished run"
    finally:
        from minisandbox.utils.safefs import discard_tree

        discard_tree(work)


def _progress_lines(stderr: str, iid: str) -> list[str]:
    return [line for line in stderr.splitlines() if iid in line]


def test_eval_progress_on_stderr_per_instance(settings, built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Each instance's phases and verdict go to stderr, with --json too (stdout stays JSON
    alone); --quiet leaves stderr without them."""
    report = tmp_path / "reports"
    r = _cli(settings, "eval", "examples", "-p", "gold", "--report", str(report), "--json",
             "--regrade", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)  # the whole of stdout: nothing else is written there
    assert summary["resolved_ids"] == EXAMPLES, summary
    for iid in EXAMPLES:
        lines = _progress_lines(r.stderr, iid)
        phases = [line.split(": ", 1)[1] for line in lines[:-1]]
        assert phases == ["starting sandbox", "applying the patch", "running tests"], r.stderr
        assert lines[-1].startswith("[") and f"{iid}: resolved (" in lines[-1], r.stderr
    counts = sorted(line.split("]")[0] for line in r.stderr.splitlines() if line.startswith("["))
    assert counts == ["[1/3", "[2/3", "[3/3"], r.stderr

    quiet = _cli(settings, "eval", "examples", "-p", "empty", "-i", EXAMPLES[0], "--report",
                 str(report), "--json", "--quiet", cwd=tmp_path)  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["unresolved_ids"] == [EXAMPLES[0]]
    # (swebench, once imported, logs to stderr at INFO level: not ours to silence here)
    assert EXAMPLES[0] not in quiet.stderr and "running tests" not in quiet.stderr, quiet.stderr
