"""Reading the file formats tasks come in: JSON, JSON Lines, Parquet and YAML.

Parquet needs pyarrow and YAML needs PyYAML: each is imported only when a file of its kind is
read, and its absence raises `MissingDependencyError` saying what to install. A file that is
empty, cannot be read, is not UTF-8 text or does not parse raises `TaskFormatError` naming the
file (and, for JSON Lines, the record and line), the problem and the fix.
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


def _error(path: Path, problem: str) -> TaskFormatError:
    return TaskFormatError(f"{path}: {problem}", path=str(path))


def _read_error(path: Path, exc: OSError | UnicodeDecodeError) -> TaskFormatError:
    """The error for a file that cannot be read, or is not UTF-8 text."""
    if isinstance(exc, UnicodeDecodeError):
        return _error(
            path, f"not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8 text"
        )
    return _error(path, f"cannot read it: {exc.strerror or exc}: check that it is a readable file")


def _check_not_empty(path: Path, kind: str) -> None:
    """Refuse an empty file: it is a truncated download or a mistake, not a dataset."""
    try:
        empty = path.stat().st_size == 0
    except OSError as exc:
        raise _read_error(path, exc) from None
    if empty:
        raise _error(path, f"the file is empty: give a {kind} file holding tasks or records")


def _read_text(path: Path, kind: str) -> str:
    """The text of `path`, not blank.

    Raises:
        TaskFormatError: the file cannot be read, is not UTF-8 or holds only whitespace.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _read_error(path, exc) from None
    if not text.strip():
        raise _error(path, f"the file is empty: give a {kind} file holding tasks or records")
    return text


def read_json(path: Path) -> Any:
    """The JSON document in `path`.

    Raises:
        TaskFormatError: the file is empty, unreadable, not UTF-8 or not valid JSON.
    """
    text = _read_text(path, "JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fix = "fix its syntax (a file of one JSON record a line must be named .jsonl)"
        raise _error(path, f"not valid JSON: {exc}: {fix}") from None


def read_jsonl(path: Path) -> Iterator[Record]:
    """The rows of a JSON Lines file, read as they are iterated; blank lines are skipped.

    Raises:
        TaskFormatError: the file is unreadable, not UTF-8 or holds no record, or a line is
            not valid JSON (naming its record index and line number).
    """
    index = 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    where = Where(str(path), index, lineno)
                    raise where.error(
                        f"not valid JSON: {exc}: each line must be one JSON record"
                    ) from None
                yield index, lineno, record
                index += 1
    except (OSError, UnicodeDecodeError) as exc:
        raise _read_error(path, exc) from None
    if index == 0:
        raise _error(path, "the file is empty: give a JSON Lines file holding one record a line")


def read_parquet(path: Path) -> Iterable[Record]:
    """The rows of a Parquet file (read at once).

    Raises:
        MissingDependencyError: pyarrow is not installed.
        TaskFormatError: the file is empty, unreadable or not a Parquet file.
    """
    pq = optional_import("pyarrow.parquet", f"reading {path} needs pyarrow: pip install pyarrow")
    _check_not_empty(path, "Parquet")
    arrow_error: type[Exception] = importlib.import_module("pyarrow").ArrowException
    try:
        rows: list[Any] = pq.read_table(path).to_pylist()
    except (arrow_error, OSError, ValueError) as exc:
        detail = str(exc).replace("\n", " ").strip()
        raise _error(
            path,
            f"not a readable Parquet file ({detail}): download it again (it may be cut short), "
            "or give the records as .json or .jsonl",
        ) from None
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
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _read_error(path, exc) from None
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise _error(path, f"not valid YAML: {detail}: fix its syntax") from None
