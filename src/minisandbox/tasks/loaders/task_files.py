"""Our own task files: YAML (.yaml/.yml), or JSON with the same shape, holding a mapping with
one key, `tasks`, a list of tasks whose fields are `Task`'s (docs/task-format.md).

Any of the long text fields may instead be given as `<field>_file:` a path, and `env` as the
path of a conda export; both are relative to the task file. Invariants: such paths stay inside
the task file's folder (no absolute path, `~` or `..`) unless the caller allows it, an id is
checked before any path is built, and each task's `source` is the task file's path unless the
entry sets one. A directory is not a task file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minisandbox.tasks.loaders.conda_exports import conda_env_to_recipe
from minisandbox.tasks.loaders.errors import TaskFormatError
from minisandbox.tasks.loaders.fields import Where, record_path, validate_task
from minisandbox.tasks.specs import Task

# Task fields that our task files may give as `<field>_file: path` instead of inline.
TEXT_FIELDS = ("gold_patch", "test_patch", "bug_patch", "eval_script", "problem_statement")


def own_tasks(
    data: dict[str, Any], path: Path, wanted: set[str] | None, allow_abs: bool = False
) -> list[Task]:
    """The wanted tasks of a task file's content `data` (read from `path`), in order.

    Raises:
        TaskFormatError: `data` has keys other than `tasks`, `tasks` is not a list, or an
            entry is malformed (naming the file, the entry, its id and the field).
        MissingDependencyError: PyYAML is not installed (an `env` conda export is read).
    """
    name = str(path)
    extra = set(data) - {"tasks"}
    if extra:
        raise TaskFormatError(
            f"{path}: unknown top-level key(s) {', '.join(sorted(extra))}; only 'tasks' is allowed",
            path=name,
        )
    entries = data["tasks"]
    if not isinstance(entries, list):
        raise TaskFormatError(f"{path}: field 'tasks': expected a list", path=name, field="tasks")
    tasks = []
    for index, entry in enumerate(entries):
        where = Where(name, index)
        if not where.take(entry, "id", wanted):
            continue
        tasks.append(_entry_task(dict(entry), path, where, allow_abs))
    return tasks


def _entry_task(entry: dict[str, Any], path: Path, where: Where, allow_abs: bool) -> Task:
    """One entry (a copy, changed here) with its files read, as a task."""
    for field in TEXT_FIELDS:
        ref = entry.pop(f"{field}_file", None)
        if ref is None:
            continue
        if field in entry:
            raise where.error(f"give either {field} or {field}_file, not both", field)
        entry[field] = _read_relative(path, ref, where, f"{field}_file", allow_abs)
    env = entry.get("env")
    if isinstance(env, str):  # a conda export next to the task file
        entry["env"] = conda_env_to_recipe(_resolve_relative(path, env, where, "env", allow_abs))
    entry.setdefault("source", str(path))
    return validate_task(entry, where)


def _resolve_relative(
    task_file: Path, ref: Any, where: Where, field: str, allow_abs: bool = False
) -> Path:
    if not isinstance(ref, str) or not ref:
        raise where.error("expected a file path", field)
    target = record_path(ref, where, field, allow_abs)
    if not target.is_absolute():
        target = task_file.parent / target
    if not target.is_file():
        raise where.error(f"no such file: {target}", field)
    return target


def _read_relative(
    task_file: Path, ref: Any, where: Where, field: str, allow_abs: bool = False
) -> str:
    target = _resolve_relative(task_file, ref, where, field, allow_abs)
    try:
        return target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise where.error(f"cannot read {target}: {exc}", field) from None
