"""A task's eval script, and what it installs from the index.

The script is the dataset's own when it has one (SWE-bench's: reset the test files, apply the
test patch, run the tests between two markers, reset); else one of the same shape is made from
the task's test command, test files and test patch. Evaluation runs it; the builder reads the
requirements it installs, to fetch them at build time (evaluation is offline).
"""

from __future__ import annotations

import re
import shlex

from packaging.requirements import InvalidRequirement, Requirement

from minisandbox.errors import EvalScriptError
from minisandbox.tasks.specs import Task, files_in_patch

START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
_HEREDOC = "EOF_114329324912"  # swebench's delimiter, so generated scripts read like theirs


def make_eval_script(task: Task) -> str:
    """The task's eval script: the dataset's own when it has one, else one of the same shape
    (reset the test files, apply the test patch, run the tests between the markers, reset)."""
    if task.eval_script:
        return task.eval_script
    if _HEREDOC in task.test_patch:
        raise EvalScriptError(f"task {task.id}: its test patch contains {_HEREDOC}")
    files = " ".join(shlex.quote(f) for f in task.test_files)
    # A bug task's history is one commit, HEAD (tasks.builder): its base commit is not there.
    commit = "HEAD" if task.bug_patch else task.base_commit
    lines = ["#!/bin/bash", "set -uxo pipefail", "cd /testbed"]
    # A bug task's test files from its tests' ids: reset those HEAD has (one unknown path would
    # make `git checkout` reset none).
    reset = (
        f"git ls-tree -z --name-only HEAD -- {files} | xargs -0 -r git checkout HEAD --"
        if task.bug_patch
        else f"git checkout {commit} {files}"
    )
    if files:
        lines.append(reset)
    if task.test_patch:
        if task.bug_patch:  # its hidden tests come back as they were, whatever took their place
            restored = " ".join(shlex.quote(f) for f in files_in_patch(task.test_patch))
            lines.append(f"rm -rf -- {restored}")
        lines += [f"git apply -v - <<'{_HEREDOC}'", task.test_patch.rstrip("\n"), _HEREDOC]
    lines += [f": '{START_MARKER}'", task.test_cmd, f": '{END_MARKER}'"]
    if files:
        lines.append(reset)
    return "\n".join(lines) + "\n"


_PIP_INSTALL = re.compile(r"^(?:python[\d.]*\s+-m\s+)?pip3?\s+install\s+(?P<args>.+)$")
_HEREDOC_START = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_PIP_FLAGS = {"-q", "--quiet", "-v", "--verbose", "-U", "--upgrade", "--pre"}
_SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>&1"}


def eval_pip_requirements(script: str) -> list[str]:
    """The requirements an eval script installs from the index besides the package itself
    (astropy 3.1's runs `pip install 'pytest<7.2'` before its tests). The official harness
    fetches them while evaluating; evaluation here is offline, so the task's build downloads
    them into the wheelhouse (envs.layout.WHEELHOUSE), where evaluation's pip looks. (They are
    the harness's steps, not the fix: nothing of the hidden patches, whose heredoc bodies are
    skipped.)

    The script is data, so only plain requirements are taken: a line with any option other
    than -q/-v/-U/--pre (an index URL, a requirements file) is left out whole, and so is a
    word that is not a requirement `packaging` reads without a URL, or holds `$` (pip expands
    variables in requirement files)."""
    out: list[str] = []
    heredoc: str | None = None
    for raw in script.splitlines():
        line = raw.strip()
        if heredoc is not None:
            if line == heredoc:
                heredoc = None
            continue
        if (m := _HEREDOC_START.search(line)) is not None:
            heredoc = m.group(1)
        m = _PIP_INSTALL.match(line)
        if m is None:
            continue
        try:
            words = shlex.split(m.group("args"), comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word in _SHELL_OPERATORS:
                words = words[:i]
                break
        if any(w.startswith("-") and w not in _PIP_FLAGS for w in words):
            continue  # an index, a file, an editable install: not a plain requirement
        reqs = [w for w in words if not w.startswith("-")]
        if all(_plain_requirement(w) for w in reqs):
            out += [r for r in reqs if r not in out]
    return out


def _plain_requirement(word: str) -> bool:
    if "$" in word or any(c.isspace() for c in word) or word in (".", "..") or "/" in word:
        return False
    try:
        return Requirement(word).url is None
    except InvalidRequirement:
        return False
