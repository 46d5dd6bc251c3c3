"""Reading the file formats tasks come in: JSON, JSON Lines, Parquet and YAML.

Parquet needs pyarrow and YAML needs PyYAML: each is imported only when a file of its kind is
read, and its absence raises `MissingDependencyError` saying what to install. A file that does
not parse raises `TaskFormatError` naming the file (and, for JSON Lines, the record and line).
Rows come as `Record`s, (index, line or None, row), indexes counting rows, not lines.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from minisandbox.tasks.loaders.errors import MissingDependencyError, TaskFormatError
from minisandbox.tasks.loaders.fields import Record, Where


def optional_import(module: str, missing: str) -> ModuleType:
    """Import `module`, an optional dependency. Imported by name: pyarrow, PyYAML, datasets
    and swebench ship no type stubs, so callers see a module whose attributes are `Any`.

    Raises:
        MissingDependencyError: `module` is not installed; `missing` is the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(missing) from None


def read_json(path: Path) -> Any:
    """The JSON document in `path`.

    Raises:
        TaskFormatError: the file is not valid JSON.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskFormatError(f"{path}: not valid JSON: {exc}", path=str(path)) from None


def read_jsonl(path: Path) -> Iterator[Record]:
    """The rows of a JSON Lines file, read as they are iterated; blank lines are skipped.

    Raises:
        TaskFormatError: a line is not valid JSON (naming its record index and line number).
    """
    index = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                where = Where(str(path), index, lineno)
                raise where.error(f"not valid JSON: {exc}") from None
            yield index, lineno, record
            index += 1


def read_parquet(path: Path) -> Iterable[Record]:
    """The rows of a Parquet file (read at once).

    Raises:
        MissingDependencyError: pyarrow is not installed.
    """
    pq = optional_import("pyarrow.parquet", f"reading {path} needs pyarrow: pip install pyarrow")
    rows: list[Any] = pq.read_table(path).to_pylist()
    return ((i, None, r) for i, r in enumerate(rows))


def yaml_module() -> ModuleType:
    """PyYAML.

    Raises:
        MissingDependencyError: PyYAML is not installed.
    """
    return optional_import("yaml", "reading YAML files needs PyYAML: pip install pyyaml")


def yaml_load(path: Path) -> Any:
    """The YAML document in `path`, read safely (no Python objects).

    Raises:
        MissingDependencyError: PyYAML is not installed.
        TaskFormatError: the file is not valid YAML.
    """
    yaml = yaml_module()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader is ~10x faster
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"{path}: not valid YAML: {exc}", path=str(path)) from None
