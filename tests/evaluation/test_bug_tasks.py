"""SWE-smith-style bug tasks on a real repository (the bundled datekit example): the repository
layer is shared, a task's own layer holds its bug alone, nothing in a sandbox shows the clean
code nor the hidden FAIL_TO_PASS tests, and the reversed bug resolves while an empty patch does
not (the tests come back for evaluation)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.runtime import Runtime
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

CLEAN = "return (isoparse(b).date() - isoparse(a).date()).days"
EXAMPLES = Path(__file__).parents[2] / "src/minisandbox/tasks/examples"


def _escaped(hex_id: str) -> str:
    """A sha1 as printf escapes of its 20 raw bytes (how an index keeps it)."""
    return "".join(f"\\{int(hex_id[i : i + 2], 16):03o}" for i in range(0, 40, 2))


# As SWE-smith's procedural generators write them: plain unified diffs.
BUGS = {
    "swap": (
        "--- a/src/datekit/__init__.py\n+++ b/src/datekit/__init__.py\n"
        "@@ -19,3 +19,3 @@\n"
        " def days_between(a, b):\n"
        '     """Whole days from ISO date `a` to ISO date `b`."""\n'
        f"-    {CLEAN}\n"
        "+    return (isoparse(a).date() - isoparse(b).date()).days\n"
    ),
    "off_by_one": (
        "--- a/src/datekit/__init__.py\n+++ b/src/datekit/__init__.py\n"
        "@@ -19,3 +19,3 @@\n"
        " def days_between(a, b):\n"
        '     """Whole days from ISO date `a` to ISO date `b`."""\n'
        f"-    {CLEAN}\n"
        "+    return (isoparse(b).date() - isoparse(a).date()).days + 1\n"
    ),
}


@pytest.fixture(scope="module")
def bug_tasks(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    (datekit,) = [t for t in load_tasks("examples") if "datekit" in t.id]
    records = [
        {
            "instance_id": f"minisandbox-examples__datekit.ffc2139f.{name}__0000000{i}",
            "repo": datekit.repo,
            "base_commit": datekit.base_commit,
            "patch": bug,
            "FAIL_TO_PASS": ["tests/test_datekit.py::test_days_between"],
            "PASS_TO_PASS": ["tests/test_datekit.py::test_next_billing_date_same_day"],
            "environment": {"python": datekit.env.python, "requirements": datekit.env.requirements},
            # SWE-smith's own command and parser (the default), on the one test file.
            "test_cmd": "pytest --disable-warnings --color=no --tb=no --verbose tests",
        }
        for i, (name, bug) in enumerate(BUGS.items())
    ]
    path = tmp_path_factory.mktemp("smith") / "bugs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_tasks(path)


async def test_a_bug_task_is_a_small_layer_over_a_shared_repository(
    settings: BuildSettings, bug_tasks: list[Task]
) -> None:
    builder = Builder(settings)
    first, second = bug_tasks
    one = await builder.build(first)
    assert one.status in ("built", "cached"), one.error
    two = await builder.build(second)
    assert two.status == "built", two.error
    # The second bug of the same repository builds its own layer only.
    assert [ref.split("/")[0] for ref in two.built_layers] == ["bug"], two.built_layers
    info = builder.store.info(two.task_layer or "")
    assert 0 < info.stored_bytes < 50_000 and info.files < 100, info


async def test_nothing_in_a_bug_tasks_sandbox_shows_the_clean_code(
    settings: BuildSettings, bug_tasks: list[Task]
) -> None:
    builder = Builder(settings)
    task = bug_tasks[0]
    async with Runtime(builder=builder).sandbox(task, require_validated=False) as sb:
        r = await sb.execute("git status --porcelain; git log --format=%s; git diff HEAD")
        assert r.stdout == "Initial commit\n", r.output
        source = await sb.read_file("/testbed/src/datekit/__init__.py")
        assert b"isoparse(a).date() - isoparse(b)" in source  # positive control: the bug
        # Not in any file, nor in any git object the repository still has; nor are the
        # FAIL_TO_PASS tests (hidden as SWE-smith's harness hides them).
        r = await sb.execute(
            f"grep -rlF '{CLEAN}' /testbed /opt/venv; ls tests; "
            "git cat-file --batch-all-objects --batch | grep -caF "
            f"-e '{CLEAN}' -e 'def test_days_between'; "
            "git fsck --connectivity-only >/dev/null && echo fsck-ok"
        )
        assert r.stdout == "0\nfsck-ok\n", r.output
        # Nor any tree that names them: an old tree would give the clean file's blob id, which
        # a fix could be hashed against until one matches.
        r = await sb.execute(
            "git cat-file --batch-all-objects --batch-check | awk '$2 == \"tree\" {print $1}'"
            " | while read t; do git ls-tree -r $t; done | grep -c 'tests/\\|test_datekit'"
        )
        assert r.stdout == "0\n", r.output
        # Nor any file of .git that holds the clean file's blob id, as text or as the raw bytes
        # an index keeps (a shared index of the repository layer would).
        clean = (EXAMPLES / "datekit/repo/src/datekit/__init__.py").read_bytes()
        blob_id = hashlib.sha1(b"blob %d\0" % len(clean) + clean).hexdigest()
        r = await sb.execute(
            "find /testbed/.git -type f -exec grep -lF -e "
            f"{blob_id} -e \"$(printf '{_escaped(blob_id)}')\" {{}} +; echo done"
        )
        assert r.stdout == "done\n", r.output
        # Positive control: the bug's own blob id is in the index, as raw bytes.
        r = await sb.execute("git rev-parse HEAD:src/datekit/__init__.py")
        bug_id = r.stdout.strip()
        r = await sb.execute(f"grep -cF \"$(printf '{_escaped(bug_id)}')\" .git/index")
        assert r.stdout == "1\n", r.output


async def test_the_reversed_bug_resolves_and_an_empty_patch_does_not(
    settings: BuildSettings, bug_tasks: list[Task]
) -> None:
    task = bug_tasks[0]
    assert CLEAN in task.gold_patch and task.gold_patch.startswith("--- a/")
    evaluator = Evaluator(Builder(settings), timeout=120)
    gold = await evaluator.evaluate(task, task.gold_patch)
    empty = await evaluator.evaluate(task, "")
    assert gold.resolved, gold
    assert not empty.resolved and empty.status == "unresolved", empty


async def test_tests_the_agent_writes_in_place_of_the_hidden_ones_do_not_count(
    settings: BuildSettings, bug_tasks: list[Task]
) -> None:
    """The hidden test file comes back as it was, whatever the patch put at its path."""
    cheat = (
        "--- /dev/null\n+++ b/tests/test_datekit.py\n@@ -0,0 +1,4 @@\n"
        "+def test_days_between():\n+    pass\n"
        "+def test_next_billing_date_same_day():\n+    pass\n"
    )
    r = await Evaluator(Builder(settings), timeout=120).evaluate(bug_tasks[0], cheat)
    assert r.patch_applied and not r.resolved, r


def test_reverse_patch_is_its_own_inverse() -> None:
    from minisandbox.tasks.patches import reverse_patch

    gold = Path(__file__).parents[2] / "src/minisandbox/tasks/examples/datekit/gold.patch"
    for patch in [*BUGS.values(), gold.read_text()]:
        back = reverse_patch(patch)
        assert back != patch and reverse_patch(back) == patch


def test_bad_bug_records_fail_alone_naming_the_instance_and_the_cause(
    settings: BuildSettings, bug_tasks: list[Task], tmp_path: Path
) -> None:
    """A patch that does not apply, FAIL_TO_PASS tests that are not there, a SWE-smith profile
    that does not exist: each fails its own task, by name and cause; the good one builds."""
    from conftest import run_cli

    pytest.importorskip("swesmith", reason="the `swesmith` extra (in dev) is not installed")
    good = bug_tasks[0]
    record = {
        "repo": good.repo,
        "base_commit": good.base_commit,
        "patch": good.bug_patch,
        "FAIL_TO_PASS": good.fail_to_pass,
        "PASS_TO_PASS": good.pass_to_pass,
        "environment": good.env.model_dump(),
        "test_cmd": good.test_cmd,
    }
    records = [
        {**record, "instance_id": good.id},
        {
            **record,
            "instance_id": "datekit.ffc2139f.stale__1",
            "patch": BUGS["swap"].replace(
                "isoparse(b).date() - isoparse(a)", "isoparse(b).date() + isoparse(a)"
            ),
        },
        {
            **record,
            "instance_id": "datekit.ffc2139f.lost__2",
            "FAIL_TO_PASS": ["tests/test_gone.py::test_x"],
        },
        {
            **{k: v for k, v in record.items() if k not in ("environment", "base_commit")},
            "instance_id": "nobody__nothing.1234567.func__3",
            "repo": "swesmith/nobody__nothing.1234567",
            "image_name": "swebench/swesmith.x86_64.nobody_1776_nothing.1234567",
        },
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = ["--store", str(settings.store), "--cache", str(settings.cache)]
    r = run_cli(
        "build",
        str(path),
        *env,
        "--git-mirror",
        str(settings.git_mirror),
        "--json",
        "--quiet",
        timeout=600,
    )
    assert r.returncode == 1, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["total"] == 4
    assert set(summary["built"]) | set(summary["cached"]) == {good.id}, summary
    failed = summary["failed"]
    assert "does not apply" in failed["datekit.ffc2139f.stale__1"], failed
    assert "tests/test_gone.py" in failed["datekit.ffc2139f.lost__2"], failed
    unknown = failed["nobody__nothing.1234567.func__3"]
    assert "SWE-smith has no profile 'nobody__nothing.1234567'" in unknown, unknown
    # Evaluating them: the good one is graded, each bad one is an error or not evaluated.
    r = run_cli(
        "eval",
        str(path),
        "--predictions",
        "gold",
        *env,
        "--git-mirror",
        str(settings.git_mirror),
        "--report",
        str(tmp_path / "reports"),
        "--json",
        "--quiet",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["resolved_ids"] == [good.id], summary
    assert sorted(summary["error_ids"]) == ["datekit.ffc2139f.lost__2", "datekit.ffc2139f.stale__1"]
    assert b"skipped (the others go on): " in r.stderr, r.stderr
    assert b"SWE-smith has no profile 'nobody__nothing.1234567'" in r.stderr, r.stderr


async def test_bugs_hiding_the_same_tests_keep_one_copy_of_them(
    settings: BuildSettings, bug_tasks: list[Task]
) -> None:
    """The hidden tests come back from a layer of their own, stored once for identical ones
    (in each bug layer's metadata they took more than the bug layer itself)."""
    from minisandbox.tasks.hidden_tests import LAYER_KEY, restore_patch

    builder = Builder(settings)
    metas = []
    for task in bug_tasks:
        result = await builder.build(task)
        assert result.status in ("built", "cached"), result.error
        metas.append(builder.store.meta(result.task_layer or "") or {})
    assert len({m[LAYER_KEY] for m in metas}) == 1, metas  # both hide tests/test_datekit.py
    assert all("restore_tests" not in m for m in metas)
    patch = restore_patch(builder.store, metas[0])
    assert (
        patch.startswith("diff --git a/tests/test_datekit.py") and "def test_days_between" in patch
    )
    assert builder.evaluation_task(bug_tasks[0]).test_patch == patch


async def test_a_bug_task_whose_hidden_tests_are_gone_is_made_again(
    settings: BuildSettings, bug_tasks: list[Task], tmp_path: Path
) -> None:
    """A gc (or a check that dropped them as broken) may remove the hidden tests' layer: the
    task then counts as not built, and building it makes its bug layer and tests again,
    instead of leaving a task that cannot be graded."""
    from minisandbox.tasks.hidden_tests import LAYER_KEY

    own = BuildSettings(
        store=tmp_path / "store", cache=tmp_path / "layers", git_mirror=settings.git_mirror
    )
    task = bug_tasks[0]
    builder = Builder(own)
    result = await builder.build(task)
    assert result.status == "built", result.error
    tests = (builder.store.meta(result.task_layer or "") or {})[LAYER_KEY]
    builder.store.untag(f"tests/{tests}")
    builder.store.gc(keep={r.id for r in builder.store.list()} - {tests}, grace=0)
    assert not builder.store.exists(tests) and not builder.built_layers(task)
    again = await Builder(own).build(task)
    assert [ref.split("/")[0] for ref in again.built_layers] == ["bug"], again.built_layers
    assert builder.store.exists(tests) and builder.built_layers(task)
    graded = await Evaluator(Builder(own), timeout=120).evaluate(task, task.gold_patch)
    assert graded.resolved, graded
