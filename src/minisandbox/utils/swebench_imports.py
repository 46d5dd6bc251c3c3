"""swebench's Python log parsers, grading and constants, without its package's imports.

`import swebench.harness.grading` runs `swebench/__init__.py` and `swebench/harness/__init__.py`
first, which import the whole harness: docker, modal, datasets (pyarrow, pandas), ~5 s of every
process that grades (each `minisandbox eval`, each Ray worker). The modules evaluation uses
import only `swebench.harness.constants` and a `TestSpec` name for their annotations, so they
are loaded here under empty parent packages, then taken out of `sys.modules` again: code that
imports swebench afterwards gets the real, whole package. Should swebench's layout change so
that this fails, the whole package is imported as before (slower, same functions).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

_LOCK = threading.Lock()
_PARENTS = ("swebench", "swebench.harness", "swebench.harness.test_spec")
_PARSERS = "swebench.harness.log_parsers"


@functools.cache
def swebench_grading() -> SimpleNamespace:
    """`grading`, `constants` and `python_parsers` (swebench's modules) and
    `MAP_REPO_TO_PARSER` (its Python repositories' parsers).

    Raises:
        ImportError: swebench is not installed, or does not import.
    """
    with _LOCK:
        if "swebench" not in sys.modules:
            try:
                return _light()
            except Exception:  # any layout we do not know: the slow way
                pass
        return _whole()


def repo_parser(repo: str) -> Callable[..., Any] | None:
    """swebench's log parser for `repo`: from the Python repositories' table, else (another
    language's repository) from the whole package's; None when it has none.

    Raises:
        ImportError: swebench is not installed, or does not import.
    """
    fn = swebench_grading().MAP_REPO_TO_PARSER.get(repo)
    if fn is None:
        with contextlib.suppress(ImportError):
            fn = getattr(importlib.import_module(_PARSERS), "MAP_REPO_TO_PARSER", {}).get(repo)
    return fn


def _whole() -> SimpleNamespace:
    grading = importlib.import_module("swebench.harness.grading")
    parsers = importlib.import_module(_PARSERS)
    python_parsers = importlib.import_module(f"{_PARSERS}.python")
    table = getattr(parsers, "MAP_REPO_TO_PARSER", None)  # (4.x; 5.x: the Python ones')
    return SimpleNamespace(
        grading=grading,
        constants=importlib.import_module("swebench.harness.constants"),
        python_parsers=python_parsers,
        MAP_REPO_TO_PARSER=table or dict(python_parsers.MAP_REPO_TO_PARSER_PY),
    )


def _package(name: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    return module


def _light() -> SimpleNamespace:
    spec = importlib.util.find_spec("swebench")  # finds it without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("swebench is not installed")
    root = next(iter(spec.submodule_search_locations))
    before = set(sys.modules)
    try:
        for name in (*_PARENTS, _PARSERS):
            sub = name.removeprefix("swebench").replace(".", "/")
            sys.modules[name] = _package(name, root + sub)
        stub = types.ModuleType("swebench.harness.test_spec.test_spec")
        setattr(stub, "TestSpec", type("TestSpec", (), {}))  # noqa: B010  (annotations only)
        sys.modules[stub.__name__] = stub
        constants = importlib.import_module("swebench.harness.constants")
        python_parsers = importlib.import_module(f"{_PARSERS}.python")
        table = dict(python_parsers.MAP_REPO_TO_PARSER_PY)
        # What grading imports from the parsers package: 4.x its repository table, 5.x its
        # registry by name (here the Python parsers').
        stubbed = sys.modules[_PARSERS]
        setattr(stubbed, "MAP_REPO_TO_PARSER", table)  # noqa: B010
        registry = {n: f for n, f in vars(python_parsers).items() if n.startswith("parse_log_")}
        setattr(stubbed, "PARSER_REGISTRY", registry)  # noqa: B010
        grading = importlib.import_module("swebench.harness.grading")
    finally:
        for name in set(sys.modules) - before:
            if name == "swebench" or name.startswith("swebench."):
                del sys.modules[name]
    return SimpleNamespace(
        grading=grading,
        constants=constants,
        python_parsers=python_parsers,
        MAP_REPO_TO_PARSER=table,
    )
