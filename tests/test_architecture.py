"""The shape of the code, checked: module and function sizes, typed errors, explained ignores.

The dependency direction between sub-packages and the absence of import cycles are checked by
import-linter (pyproject's contracts, run by scripts/test), the types by mypy.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "minisandbox"
MODULES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)
# Guidance, not a reason to move code: a module holds one idea, most in under 500 lines; the
# check only catches one that has grown into two or three. (The import contracts are the rule.)
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60
# A longer function says why on the line of its `def` or the line above: `# long: <why>`.
_LONG_REASON = re.compile(r"#\s*long:\s*\S")


def _name(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def test_the_checks_see_the_package() -> None:
    assert len(MODULES) > 50 and (SRC / "sandbox" / "sandbox.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines: does it hold two ideas?"


def _long_functions(text: str) -> list[str]:
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            around = " ".join(lines[max(0, first - 2) : node.lineno])
            if length > MAX_FUNCTION_LINES and not _LONG_REASON.search(around):
                out.append(f"{node.name} (line {node.lineno}, {length} lines)")
    return out


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_function_size(path: Path) -> None:
    long = _long_functions(path.read_text())
    assert not long, f"{_name(path)}: split, or say why beside it (`# long: ...`): {long}"


def test_the_function_size_check_can_fail() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n") == [f"f (line 1, {MAX_FUNCTION_LINES + 1} lines)"]
    assert _long_functions(f"# long: a table\ndef f():\n{body}\n") == []


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_errors_are_specific(path: Path) -> None:
    """Raised errors are subclasses of MiniSandboxError, never the base class itself (callers
    tell errors apart by type, not by message text)."""
    bare = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id == "MiniSandboxError"
    ]
    assert not bare, f"{_name(path)}: raise a specific error type, not MiniSandboxError: {bare}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_type_ignores_are_explained(path: Path) -> None:
    lines = path.read_text().splitlines()
    unexplained = [
        i + 1
        for i, line in enumerate(lines)
        if "type: ignore" in line
        and not re.search(r"type: ignore\[[\w, -]+\]\s+#\s*\S", line)
        and not (i > 0 and lines[i - 1].strip().startswith("#"))
    ]
    assert not unexplained, f"{_name(path)}: say why beside each `type: ignore`: {unexplained}"
