"""A task source that is a file: which loader reads it, by its suffix (and, for .json, by its
content).

- .parquet, .jsonl: SWE-bench / SWE-smith rows (rows);
- .json: a list of rows, or our task file when it is a mapping with a `tasks` key;
- .yaml, .yml: our task file (task_files).

Invariant: rows and task files name paths relative to the file's own folder.
"""

from __future__ import annotations

from pathlib import Path

from minisandbox.tasks.loaders.errors import TaskFormatError
from minisandbox.tasks.loaders.formats import read_json, read_jsonl, read_parquet, yaml_load
from minisandbox.tasks.loaders.rows import records_to_tasks
from minisandbox.tasks.loaders.task_files import own_tasks
from minisandbox.tasks.specs import Task

FILE_SUFFIXES = (".parquet", ".json", ".jsonl", ".yaml", ".yml")


def load_file(
    path: Path,
    envs_dir: Path | None,
    wanted: set[str] | None,
    allow_abs: bool,
    rejected: list[TaskFormatError] | None = None,
) -> list[Task]:
    """The wanted tasks of the file at `path`, in order (malformed records into `rejected`,
    when given: rows.records_to_tasks).

    Raises:
        TaskFormatError: the file does not parse, has an unknown suffix or shape, or holds a
            malformed record or task.
        MissingDependencyError: reading it needs pyarrow or PyYAML, which is not installed.
    """
    suffix = path.suffix.lower()
    name = str(path)
    if suffix == ".parquet":
        records = read_parquet(path)
        return records_to_tasks(records, name, path.parent, envs_dir, wanted, allow_abs, rejected)
    if suffix == ".jsonl":
        rows = read_jsonl(path)
        return records_to_tasks(rows, name, path.parent, envs_dir, wanted, allow_abs, rejected)
    if suffix == ".json":
        data = read_json(path)
        if isinstance(data, dict) and "tasks" in data:
            return own_tasks(data, path, wanted, allow_abs)
        if isinstance(data, list):
            rows = ((i, None, r) for i, r in enumerate(data))
            return records_to_tasks(rows, name, path.parent, envs_dir, wanted, allow_abs, rejected)
        raise TaskFormatError(
            f"{path}: expected a list of SWE-bench/SWE-smith records or a mapping with a "
            "'tasks' list",
            path=name,
        )
    if suffix in (".yaml", ".yml"):
        data = yaml_load(path)
        if not isinstance(data, dict) or "tasks" not in data:
            raise TaskFormatError(f"{path}: expected a mapping with a 'tasks' list", path=name)
        return own_tasks(data, path, wanted, allow_abs)
    raise TaskFormatError(
        f"{path}: unknown task file type {suffix or '(none)'}; expected one of "
        + ", ".join(FILE_SUFFIXES),
        path=name,
    )
