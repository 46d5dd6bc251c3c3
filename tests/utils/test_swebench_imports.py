"""swebench's grading without the rest of swebench (utils/swebench_imports.py): every process
that grades paid ~5 s importing docker, modal and datasets through swebench's __init__."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import sys
    from minisandbox.evaluation.evaluator import grade, log_parser
    from minisandbox.tasks.loaders import load_tasks
    from minisandbox.utils.swebench_imports import swebench_grading

    light = swebench_grading()
    heavy = [m for m in ("datasets", "docker", "modal", "pandas") if m in sys.modules]
    assert not heavy, f"grading imported {heavy}"
    assert not [m for m in sys.modules if m.split(".")[0] == "swebench"], "left in sys.modules"
    task = load_tasks("examples")[0]
    log = ">>>>> Start Test Output\\n" + "".join(
        f"PASSED {t}\\n" for t in task.fail_to_pass + task.pass_to_pass
    ) + ">>>>> End Test Output\\n"
    ours = grade(task, log, test_exit_code=0)
    assert ours.resolved, ours
    # The whole package imports afterwards, itself, and its functions agree with ours.
    import swebench
    from swebench.harness import grading
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    assert hasattr(swebench, "MAP_REPO_VERSION_TO_SPECS"), "a half package"
    assert grading is not light.grading
    assert grading.get_resolution_status.__code__.co_code == (
        light.grading.get_resolution_status.__code__.co_code
    )
    for repo, fn in light.MAP_REPO_TO_PARSER.items():
        assert MAP_REPO_TO_PARSER[repo].__code__.co_code == fn.__code__.co_code, repo
    # Once swebench is imported, grading uses it as it is.
    swebench_grading.cache_clear()
    assert swebench_grading().grading is grading
    print("OK", len(light.MAP_REPO_TO_PARSER))
    """
)


def test_grading_imports_no_more_of_swebench_than_it_uses() -> None:
    r = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr[-3000:]
