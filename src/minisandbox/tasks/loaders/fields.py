"""Reading a record's fields, and naming the record in errors.

Every loader reports malformed input the same way, as a `TaskFormatError` whose message names
the file (or dataset), the record's index, its line in a JSONL file, its id and the field:

    data.jsonl: record 1 (line 2, id 'psf__requests-2317'): field 'base_commit': missing

Invariants: an id is checked (`Where.check_id`) before any path is built from it, and a path a
record names (`record_path`) never holds a control character and stays inside the dataset's
folder (no absolute path, `~` or `..`) unless the caller allows paths outside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeAlias

from pydantic import ValidationError

from minisandbox.tasks.loaders.errors import TaskFormatError
from minisandbox.tasks.specs import Task, path_name_problem, task_id_problem

Record: TypeAlias = tuple[int, int | None, Any]  # (index, line number or None, record)


class Where:
    """Names a record in error messages: file, index (and line), instance id."""

    def __init__(self, path: str, index: int | None = None, line: int | None = None) -> None:
        self.path = path
        self.index = index
        self.line = line
        self.instance_id: str | None = None

    def describe(self) -> str:
        """ "<file>", or "<file>: record <index> (line <line>, id '<id>')"."""
        if self.index is None:
            return self.path
        extra = [f"line {self.line}"] if self.line is not None else []
        if self.instance_id:
            extra.append(f"id {self.instance_id!r}")
        return f"{self.path}: record {self.index}" + (f" ({', '.join(extra)})" if extra else "")

    def error(self, message: str, field: str | None = None) -> TaskFormatError:
        """The error to raise for `message` about this record (and `field`, when given)."""
        where = self.describe()
        text = f"{where}: field {field!r}: {message}" if field else f"{where}: {message}"
        return TaskFormatError(
            text, path=self.path, index=self.index, instance_id=self.instance_id, field=field
        )

    def check_id(self, value: Any, field: str) -> None:
        """Refuse an id that cannot name a directory, before anything builds a path from it.

        Raises:
            TaskFormatError: `value` is a string that is not usable as a task id.
        """
        if not isinstance(value, str):
            return  # the record's own checks name a missing or non-string id
        problem = task_id_problem(value)
        if problem is not None:
            self.instance_id = None  # do not repeat a newline or a control character
            raise self.error(f"{value!r} {problem}: not usable as a task id", field)

    def take(self, record: Any, id_field: str, wanted: set[str] | None) -> bool:
        """Check that `record` is a mapping with a valid id in `id_field` (this place then names
        it) and say whether it is `wanted` (None: all are); a non-string id is never wanted.

        Raises:
            TaskFormatError: not a mapping, or a wanted record whose id is not a valid id.
        """
        if not isinstance(record, dict):
            raise self.error(f"expected a mapping, got {type(record).__name__}")
        value = record.get(id_field)
        self.instance_id = value if isinstance(value, str) else None
        if wanted is not None and self.instance_id not in wanted:
            return False
        self.check_id(value, id_field)
        return True

    def from_validation(self, exc: ValidationError, prefix: str = "") -> TaskFormatError:
        """The error to raise for pydantic's `exc`: every problem, each naming its field
        (`prefix` + the field's dotted location)."""
        problems = []
        first_field = None
        for err in exc.errors():
            field = prefix + ".".join(str(p) for p in err["loc"])
            first_field = first_field or field
            message = err["msg"]
            if err["type"] == "value_error" and "error" in err.get("ctx", {}):
                # our validator's text, without pydantic's prefix
                message = str(err["ctx"]["error"])
            elif err["type"] == "missing":
                message = "missing"
            elif err["type"] == "extra_forbidden":
                message = "unknown field"
            problems.append(f"field {field!r}: {message}")
        text = f"{self.describe()}: " + "; ".join(problems)
        return TaskFormatError(
            text, path=self.path, index=self.index, instance_id=self.instance_id, field=first_field
        )


def validate_task(data: dict[str, Any], where: Where) -> Task:
    """The task `data` describes.

    Raises:
        TaskFormatError: `data` is not a valid task; the message names each bad field.
    """
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        raise where.from_validation(exc) from None


def required(record: dict[str, Any], field: str, where: Where) -> Any:
    """`record[field]`, which must be given and not empty.

    Raises:
        TaskFormatError: the field is missing, None or "".
    """
    value = record.get(field)
    if value is None or value == "":
        raise where.error("missing", field)
    return value


def text(record: dict[str, Any], field: str, where: Where, default: str = "") -> str:
    """`record[field]` as a string; `default` when it is missing or None.

    Raises:
        TaskFormatError: the field holds something other than a string.
    """
    value = record.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise where.error(f"expected a string, got {type(value).__name__}", field)
    return value


def string_list(record: dict[str, Any], field: str, where: Where) -> list[str]:
    """`record[field]` as a list of strings; [] when missing. SWE-bench files hold test lists
    JSON-encoded in a string; Hugging Face datasets as real lists.

    Raises:
        TaskFormatError: the field is neither a list of strings nor a JSON-encoded one.
    """
    value = record.get(field)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise where.error(f"not a JSON list: {exc}", field) from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise where.error("expected a list of strings", field)
    return list(value)


def version_text(value: Any) -> str | None:
    """A dataset's version column as a string ("2.4"); None when missing or empty."""
    if value is None or value == "":
        return None
    return str(value)


def as_list(value: Any) -> list[str]:
    """A command or a list of commands as a list; a blank string gives []."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value]


def record_path(ref: str, where: Where, field: str, allow_abs: bool) -> Path:
    """A path a record names, checked before use: no control characters ever; absolute, `~` or
    `..` only when the caller allows paths outside the dataset's folders.

    Raises:
        TaskFormatError: `ref` has a control character, or reaches outside without `allow_abs`.
    """
    for part in ref.split("/"):
        problem = path_name_problem(part)
        if problem is not None and "control character" in problem:
            raise where.error(f"{ref!r} {problem}", field)
    given = Path(ref)
    outside = given.is_absolute() or ref.startswith("~") or ".." in given.parts
    if outside and not allow_abs:
        raise where.error(
            f"{ref!r} reaches outside the dataset's folder: give a path relative to it, or "
            "allow absolute paths (allow_absolute_paths=True, --allow-absolute-paths)",
            field,
        )
    return given.expanduser()
