"""Write docs/api.md, the API reference, from the public objects' signatures and docstrings.

    .venv/bin/python scripts/api_reference.py          # rewrite docs/api.md
    .venv/bin/python scripts/api_reference.py --check  # exit 1 when it is out of date

tests/test_docs.py runs the check: a docstring changed without the reference fails the suite.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"

# (section, module, names): what a user imports; everything else is internal.
SURFACE: list[tuple[str, str, list[str]]] = [
    ("Runtime", "minisandbox.runtime", ["Runtime", "Backend", "LocalBackend"]),
    ("Purposes", "minisandbox.evaluation.purposes", ["PurposeSpec", "purpose_layers"]),
    ("Sandbox API", "minisandbox.sandbox.api", ["SandboxAPI", "SessionAPI", "SyncSandboxAPI"]),
    ("Sandboxes", "minisandbox.sandbox.sandbox", ["Sandbox"]),
    ("Sandboxes", "minisandbox.sandbox.sync", ["SyncSandbox"]),
    ("Sandboxes", "minisandbox.sandbox.config", ["SandboxConfig", "Limits"]),
    ("Sandboxes", "minisandbox.sandbox.commands", ["ExecResult"]),
    ("Sandboxes", "minisandbox.sandbox.session", ["SessionResult"]),
    ("Tasks", "minisandbox.tasks.loaders", ["load_tasks"]),
    ("Tasks", "minisandbox.tasks.specs", ["Task"]),
    ("Tasks", "minisandbox.tasks.builder", ["Builder", "BuildResult", "TaskLayers"]),
    ("Tasks", "minisandbox.envs.settings", ["BuildSettings"]),
    ("Evaluation", "minisandbox.evaluation.evaluator", ["Evaluator", "EvalResult", "evaluate"]),
    ("Evaluation", "minisandbox.evaluation.evaluator", ["evaluate_many"]),
    ("Evaluation", "minisandbox.evaluation.validation", ["Validation", "read_validation"]),
    ("Cluster (the `ray` extra)", "minisandbox.cluster", ["SandboxPool", "PoolConfig"]),
    ("Cluster (the `ray` extra)", "minisandbox.cluster.remote", ["RemoteSandbox"]),
    ("Integrations", "minisandbox.integrations.tasks", ["TaskSandbox", "task_runtime"]),
]


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, star = [], False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        star = star or p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _annotation(a: Any) -> str:
    return a if isinstance(a, str) else getattr(a, "__name__", repr(a))


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def _attribute_docs(cls: type) -> dict[str, tuple[str, str]]:
    """name → (annotation, docstring) of the class's annotated attributes, in order."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, tuple[str, str]] = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name.startswith("_") or "ClassVar" in ast.unparse(node.annotation):
                continue
            doc = ""
            after = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                doc = inspect.cleandoc(after.value.value)
            elif isinstance(node.value, ast.Call):  # Field(description=...)
                for kw in node.value.keywords:
                    if kw.arg == "description" and isinstance(kw.value, ast.Constant):
                        doc = str(kw.value.value)
            out[name] = (ast.unparse(node.annotation), doc)
    return out


def _own_members(cls: type) -> list[tuple[str, Any]]:
    members = []
    for name, value in cls.__dict__.items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, property):
            members.append((name, value))
        elif inspect.isfunction(value) or inspect.iscoroutinefunction(value):
            members.append((name, value))
    return members


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else "" for line in text.splitlines())


def _class(cls: type) -> list[str]:
    lines = [f"### `{cls.__name__}`", ""]
    init = cls.__dict__.get("__init__")
    if init is not None and inspect.isfunction(init) and not getattr(cls, "_is_protocol", False):
        lines += [f"`{cls.__name__}{_signature(init).split(' -> ')[0]}`", ""]
    if _doc(cls):
        lines += [_doc(cls), ""]
    fields = _attribute_docs(cls)
    if fields:
        lines += ["| field | type | meaning |", "|---|---|---|"]
        for name, (annotation, doc) in fields.items():
            cell = " ".join(doc.split()).replace("|", "\\|")
            lines.append(f"| `{name}` | `{annotation.replace('|', '&#124;')}` | {cell} |")
        lines.append("")
    for name, member in _own_members(cls):
        if name == "__init__":
            continue
        if isinstance(member, property):
            lines += [f"- **`{name}`** (property)"]
            doc = _doc(member.fget) if member.fget else ""
        else:
            lines += [f"- **`{_prefix(member)}{name}{_signature(member)}`**"]
            doc = _doc(member)
        if doc:
            lines += ["", _indent(doc)]
        lines.append("")
    return lines


def _prefix(fn: Any) -> str:
    """How it is called: `async with` (an async context manager), `async` or plain."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and inspect.isasyncgenfunction(wrapped):
        return "async with "
    return "async " if inspect.iscoroutinefunction(fn) else ""


def _function(fn: Any) -> list[str]:
    lines = [f"### `{_prefix(fn)}{fn.__name__}{_signature(fn)}`", ""]
    if _doc(fn):
        lines += [_doc(fn), ""]
    return lines


def render() -> str:
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `scripts/api_reference.py` (the suite checks it is",
        "current). How the pieces fit: [architecture.md](architecture.md).",
        "",
    ]
    section = None
    for title, module_name, names in SURFACE:
        module = importlib.import_module(module_name)
        if title != section:
            out += [f"## {title}", ""]
            section = title
        for name in names:
            obj = getattr(module, name)
            out += [f"<sub>`{obj.__module__}`</sub>", ""]
            out += _class(obj) if inspect.isclass(obj) else _function(obj)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run scripts/api_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
