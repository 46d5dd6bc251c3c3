"""swebench eval scripts (a SWE-bench record's `eval_script` column), split into the parts a
task needs: the test command, the preamble's variables and commands, the install commands.

The script is only read, never run here. Lines inside here-documents (the patches the script
applies) are never taken for commands.
"""

from __future__ import annotations

import re
import shlex

from pydantic import BaseModel, ConfigDict


class EvalScriptParts(BaseModel):
    """What a swebench eval script does, split into the parts the builder needs."""

    model_config = ConfigDict(extra="forbid")

    env: dict[str, str] = {}
    setup: list[str] = []  # preamble commands other than exports (e.g. locale-gen)
    install: list[str] = []
    test_cmd: str | None = None


_START_MARK = ": '>>>>> Start Test Output'"
_END_MARK = ": '>>>>> End Test Output'"
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_ASSIGNMENTS = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S+)\s+)*")
_RUNNERS = {"pytest", "py.test", "tox", "nox", "nosetests", "bin/test", "./bin/test"}
_PYTHON = re.compile(r"^(?:\S*/)?python[0-9.]*$")
_EXPORT = re.compile(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def parse_export(line: str) -> tuple[str, str] | None:
    """("NAME", "value") of an `export NAME=value` line (the value unquoted as the shell
    would), or None for any other line or a value the shell could not split."""
    m = _EXPORT.match(line)
    if not m:
        return None
    try:
        words = shlex.split(m.group(2))
    except ValueError:
        return None
    return m.group(1), " ".join(words)


def exports(commands: list[str]) -> dict[str, str]:
    """The variables the `export NAME=value` lines among `commands` set."""
    env = {}
    for cmd in commands:
        parsed = parse_export(cmd)
        if parsed:
            env[parsed[0]] = parsed[1]
    return env


def _is_test_runner(line: str) -> bool:
    assignments = _ASSIGNMENTS.match(line)  # always matches, maybe the empty string
    words = line[assignments.end() if assignments else 0 :].split()
    if not words:
        return False
    first = words[0]
    if first in _RUNNERS or first.endswith("runtests.py"):
        return True
    if _PYTHON.match(first) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return words[2] in ("pytest", "unittest", "tox", "nose", "django")
        return "test" in words[1]
    return False


def _script_lines(script: str) -> list[tuple[str, bool]]:
    """Lines with a flag telling whether they are inside a here-document (patch text)."""
    out = []
    terminator: str | None = None
    for line in script.splitlines():
        if terminator is not None:
            out.append((line, True))
            if line.strip() == terminator:
                terminator = None
            continue
        out.append((line, False))
        m = _HEREDOC.search(line)
        if m:
            terminator = m.group(2)
    return out


def _test_command(texts: list[str]) -> str | None:
    if _START_MARK in texts and _END_MARK in texts[texts.index(_START_MARK) :]:
        start = texts.index(_START_MARK)
        end = texts.index(_END_MARK, start)
        test_lines = [t for t in texts[start + 1 : end] if t]
        return "\n".join(test_lines) or None
    applied = [n for n, t in enumerate(texts) if t.startswith("git apply")]
    after = texts[applied[-1] + 1 :] if applied else texts
    return next((t for t in after if _is_test_runner(t)), None)


def _read_preamble(texts: list[str], parts: EvalScriptParts) -> None:
    safe_dir = next((n for n, t in enumerate(texts) if "safe.directory" in t), None)
    if safe_dir is None:
        return
    cd = next((n for n, t in enumerate(texts[:safe_dir]) if t.startswith("cd ")), None)
    for text in texts[(cd + 1 if cd is not None else 0) : safe_dir]:
        if not text or text.startswith(("#", "source ", "conda activate", "set ", "cd ")):
            continue
        export = parse_export(text)
        if export:
            parts.env[export[0]] = export[1]
        else:
            parts.setup.append(text)


def _install_commands(texts: list[str]) -> list[str] | None:
    """None when the script has no `conda activate` before a `git checkout`."""
    checkout = next((n for n, t in enumerate(texts) if t.startswith("git checkout ")), None)
    if checkout is None:
        return None
    activations = [n for n, t in enumerate(texts[:checkout]) if t.startswith("conda activate")]
    if not activations:
        return None
    return [t for t in texts[activations[-1] + 1 : checkout] if t]


def parse_eval_script(script: str) -> EvalScriptParts:
    """Split a swebench eval script (the `eval_script` column) into env, install and test_cmd.

    - test_cmd: the lines between ": '>>>>> Start Test Output'" and ": '>>>>> End Test Output'"
      (swebench's markers). Without markers: the first line after the last `git apply` that
      starts (after VAR=value assignments) with a test runner: pytest, py.test, tox, nox,
      nosetests, bin/test, a *runtests.py script, `python -m pytest|unittest|tox|nose|django`,
      or `python <path containing "test">`.
    - env / setup: the commands between `cd /testbed` and `git config ...safe.directory`
      (swebench's eval_commands): `export NAME=value` go to env, the rest to setup.
    - install: the commands between the last `conda activate` and the first `git checkout` of
      the test files (swebench reinstalls the repository there).

    Raises nothing: parts the script does not have stay empty (test_cmd None).
    """
    texts = [line.strip() for line, inside in _script_lines(script) if not inside]
    parts = EvalScriptParts(test_cmd=_test_command(texts))
    _read_preamble(texts, parts)
    install = _install_commands(texts)
    if install is not None:
        parts.install = install
    return parts
