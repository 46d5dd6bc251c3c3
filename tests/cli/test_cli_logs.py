"""Where `minisandbox eval` writes its logs: beside the build logs (`BuildSettings.logs`), in
the harness's layout `run_evaluation/<run id>/<model>/<instance id>/`, never in the current
directory; `--report DIR` gets the reports too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from minisandbox.tasks.builder import BuildSettings

CLI = [sys.executable, "-m", "minisandbox.cli"]
IID = "examples__semverkit-1"


def _eval(settings: BuildSettings, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
    }
    return subprocess.run(
        [*CLI, "eval", "examples", "-p", "gold", "-i", IID, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
        check=False,
    )


def test_eval_logs_go_beside_the_build_logs_not_the_cwd(settings, built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    report = tmp_path / "report"
    run_id = f"logs-{tmp_path.name}"  # the store's logs are shared by the tests
    r = _eval(settings, cwd, "--report", str(report), "--run-id", run_id, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["resolved_ids"] == [IID], summary

    assert list(cwd.iterdir()) == []  # no logs/ (nor anything else) in the current directory
    log_dir = settings.logs / "run_evaluation" / run_id
    assert summary["logs"] == str(log_dir)
    out = log_dir / "gold" / IID
    for name in ("run_instance.log", "test_output.txt", "patch.diff", "eval.sh", "report.json"):
        assert (out / name).is_file(), name
    assert "status: resolved" in (out / "run_instance.log").read_text()
    assert json.loads((out / "report.json").read_text())[IID]["resolved"] is True
    # --report still gets the reports, in the same layout, and the run summary.
    assert (report / "gold" / IID / "report.json").read_bytes() == (
        out / "report.json"
    ).read_bytes()
    assert summary["report"] == str(report / f"gold.{run_id}.json")
    assert json.loads((report / f"gold.{run_id}.json").read_text())["resolved_ids"] == [IID]


def test_logs_place_is_beside_the_store(tmp_path: Path) -> None:
    """The documented place: logs/ beside a store named `store` (the default layout under
    ~/.cache/minisandbox), else inside the store."""
    assert BuildSettings(store=tmp_path / "store").logs == tmp_path / "logs"
    assert BuildSettings(store=tmp_path / "layers-store").logs == tmp_path / "layers-store" / "logs"
