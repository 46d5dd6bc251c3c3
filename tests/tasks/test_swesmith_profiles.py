"""SWE-smith records without an environment get their recipe from SWE-smith's own repository
profiles (the real `swesmith` package)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minisandbox.tasks.loaders import TaskFormatError, load_tasks

BUG = "--- a/boltons/strutils.py\n+++ b/boltons/strutils.py\n@@ -1 +1 @@\n-a\n+b\n"
PROFILE_COMMIT = "3bfcfdd04395b6cc74a5c0cdc72c8f64cc4ac01f"  # SWE-smith's boltons profile


def published(iid: str, repo: str, **extra: object) -> dict:
    """A record with the fields SWE-smith's dataset publishes, and nothing of ours."""
    return {
        "instance_id": iid,
        "repo": repo,
        "patch": BUG,
        "FAIL_TO_PASS": ["tests/test_strutils.py::test_a"],
        "PASS_TO_PASS": ["tests/test_strutils.py::test_b"],
        "image_name": "swebench/swesmith.x86_64.mahmoud_1776_boltons.3bfcfdd0",
        "problem_statement": "strutils misbehaves",
        **extra,
    }


def write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "smith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_record_without_environment_gets_its_swesmith_profile(tmp_path: Path) -> None:
    pytest.importorskip("swesmith", reason="the `swesmith` extra (in dev) is not installed")
    iid = "mahmoud__boltons.3bfcfdd0.func_pm_remove_assign__abcd1234"
    # A base_commit that is not the named commit is the SWE-smith mirror's: ignored.
    record = published(iid, "swesmith/mahmoud__boltons.3bfcfdd0", base_commit="d1c5" * 10)
    (task,) = load_tasks(write(tmp_path, [record]))
    assert task.repo == "mahmoud/boltons"
    assert task.base_commit == PROFILE_COMMIT
    assert task.env.python == "3.10" and task.env.requirements == []
    assert task.install == ["python -m pip install -e .", "python -m pip install pytest"]
    assert task.install_as_of == "commit"
    assert task.test_cmd == "pytest --disable-warnings --color=no --tb=no --verbose"
    assert task.log_parser == "swesmith"
    assert task.bug_patch == BUG and "+a\n" in task.gold_patch


def test_an_unknown_profile_names_the_record_and_the_cause(tmp_path: Path) -> None:
    pytest.importorskip("swesmith", reason="the `swesmith` extra (in dev) is not installed")
    record = published("nobody__nothing.1234567.func_x__1", "swesmith/nobody__nothing.1234567")
    with pytest.raises(TaskFormatError) as err:
        load_tasks(write(tmp_path, [record]))
    assert "'nobody__nothing.1234567.func_x__1'" in str(err.value)
    assert "SWE-smith has no profile 'nobody__nothing.1234567'" in str(err.value)
    assert err.value.field == "repo"


def test_profiles_this_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    pytest.importorskip("swesmith", reason="the `swesmith` extra (in dev) is not installed")
    cases = {
        # Its test command is made per instance (`pytest -k <tests>`): taken as it is, it
        # would end in `-k` and run nothing.
        "python__mypy.e93f06ce": "makes each instance's test command itself",
        "jqlang__jq.b9e19de7": "not a Python one",
    }
    for name, cause in cases.items():
        record = published(f"{name}.func_x__1", f"swesmith/{name}")
        with pytest.raises(TaskFormatError, match=cause) as err:
            load_tasks(write(tmp_path, [record]))
        assert err.value.instance_id == f"{name}.func_x__1"


def test_without_swesmith_the_message_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisandbox.tasks.loaders import MissingDependencyError
    from minisandbox.tasks.loaders.swesmith_profiles import _registry

    monkeypatch.setitem(sys.modules, "swesmith.profiles", None)  # as if not installed
    _registry.cache_clear()
    try:
        record = published("mahmoud__boltons.3bfcfdd0.x__1", "swesmith/mahmoud__boltons.3bfcfdd0")
        fix = r"`swesmith` extra.*pip install -e '\.\[swesmith\]'"
        with pytest.raises(MissingDependencyError, match=fix):
            load_tasks(write(tmp_path, [record]))
    finally:
        _registry.cache_clear()


def test_test_ids_that_name_no_file_hide_no_file() -> None:
    from minisandbox.tasks.specs import files_of_tests

    ids = ["tests/test_a.py::test_x", "test_y (tornado.test.web_test.WebTest)"]
    assert files_of_tests(ids) == {"tests/test_a.py"}


def test_importing_swesmith_leaves_our_logging_alone() -> None:
    """swesmith sets up root logging as it imports (every INFO line of ours then reached
    stderr, `--quiet` or not). In a process of its own: pytest's own logging setup would
    hide it (logging.basicConfig does nothing once the root logger has handlers)."""
    pytest.importorskip("swesmith", reason="the `swesmith` extra (in dev) is not installed")
    code = (
        "import logging\n"
        "from minisandbox.tasks.loaders.swesmith_profiles import _registry\n"
        "_registry()\n"
        "root = logging.getLogger()\n"
        "print(len(root.handlers), root.level)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.stdout == "0 30\n", (r.stdout, r.stderr[-2000:])
