"""Load tasks from SWE-bench / SWE-smith datasets, Hugging Face, our own task files, or the
bundled examples.

`load_tasks` is the entry point; docs/task-format.md describes every source and rule. One
module per source or conversion:

- `files`: a file source, dispatched by suffix; `formats`: reading JSON, JSONL, Parquet, YAML;
- `rows`: SWE-bench / SWE-smith rows (.parquet, .jsonl, .json list, Hugging Face datasets);
- `swebench_records`, `swesmith_records`: one record of each kind as a task;
- `conda_exports`: conda environment exports (the `envs/` directory) as an `EnvRecipe`;
- `swebench_specs`: swebench's MAP_REPO_VERSION_TO_SPECS as recipes and commands;
- `eval_script_parts`: a swebench eval script split into test command, variables and install;
- `overrides`: recipe overrides (data/recipe_overrides.yaml);
- `task_files`: our own task files (YAML, or JSON with a `tasks` list);
- `fields`, `selection`, `errors`: naming records in errors, the `instance_ids` kept, errors.

Invariants for every source: the same input gives the same tasks (their layer keys depend on
them); errors are `TaskFormatError` naming the file, record and field; ids are checked before
any path is built from them; paths records name stay inside the dataset's folder unless the
caller allows otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from minisandbox.tasks.loaders.conda_exports import (
    CONDA_TO_PYPI,
    conda_env_to_recipe,
    conda_only_packages,
)
from minisandbox.tasks.loaders.errors import (
    MissingDependencyError,
    TaskFileNotFoundError,
    TaskFormatError,
    TaskNotFoundError,
    VersionSpecError,
)
from minisandbox.tasks.loaders.eval_script_parts import EvalScriptParts, parse_eval_script
from minisandbox.tasks.loaders.files import FILE_SUFFIXES, load_file
from minisandbox.tasks.loaders.overrides import (
    RecipeOverride,
    apply_recipe_overrides,
    load_recipe_overrides,
    recipe_overrides,
    version_matches,
)
from minisandbox.tasks.loaders.rows import is_hf_name, load_hf
from minisandbox.tasks.loaders.selection import check_found, check_unique, wanted_ids
from minisandbox.tasks.loaders.swesmith_records import SWESMITH_INSTALL, SWESMITH_TEST_CMD
from minisandbox.tasks.specs import Task

__all__ = [
    "CONDA_TO_PYPI",
    "SWESMITH_INSTALL",
    "SWESMITH_TEST_CMD",
    "EvalScriptParts",
    "MissingDependencyError",
    "RecipeOverride",
    "TaskFileNotFoundError",
    "TaskFormatError",
    "TaskNotFoundError",
    "VersionSpecError",
    "apply_recipe_overrides",
    "conda_env_to_recipe",
    "conda_only_packages",
    "load_recipe_overrides",
    "load_tasks",
    "parse_eval_script",
    "recipe_overrides",
    "version_matches",
]


def load_tasks(
    source: str | Path,
    *,
    envs_dir: Path | None = None,
    instance_ids: Sequence[str] | None = None,
    allow_absolute_paths: bool = False,
    rejected: list[TaskFormatError] | None = None,
) -> list[Task]:
    """Load tasks from `source`:

    - "examples": the built-in example tasks;
    - a file: SWE-bench/SWE-smith records (.parquet, .json list, .jsonl) or our task file
      (.yaml/.yml, or .json with a top-level `tasks:` list);
    - otherwise, a name with a "/" is a Hugging Face dataset ("owner/name" or "owner/name:split").

    `envs_dir` holds per-instance conda exports (`<instance_id>.yml`) for SWE-bench records.
    `instance_ids` keeps only those tasks, in the source's order; missing ones raise.

    Paths that records name (a SWE-smith `environment` file, a task file's `env` and
    `<field>_file`) stay inside the data file's folder or `envs_dir`: an absolute path, `~` or a
    `..` is refused (a dataset must not make us read host files) unless `allow_absolute_paths`.
    Instance ids are checked before any path is built from them.

    With a `rejected` list, a malformed record with a valid id (an unknown SWE-smith profile, a
    missing field) goes there, naming its id and the cause, and the other records load.

    Raises:
        TaskFormatError: a malformed record or file, naming the file, record and field; also
            a directory, or a source that is neither a file, "examples" nor a dataset name.
        TaskFileNotFoundError: (a TaskFormatError) a file source with a known suffix that
            does not exist.
        TaskNotFoundError: an id of `instance_ids` is not in the source; `.missing` lists them.
        MissingDependencyError: the source needs pyarrow, PyYAML or `datasets`.
    """
    wanted = wanted_ids(instance_ids)
    if isinstance(source, str) and source == "examples":
        # (the bundled records, read only when asked for: tasks.examples)
        from minisandbox.tasks.examples import load_examples

        tasks = [t for t in load_examples() if wanted is None or t.id in wanted]
        check_found(wanted, [t.id for t in tasks], "examples")
        return tasks

    path = Path(source).expanduser()
    envs = Path(envs_dir).expanduser() if envs_dir is not None else None
    if path.is_dir():
        raise TaskFormatError(_directory_problem(path), path=str(path))
    if path.exists():
        tasks = load_file(path, envs, wanted, allow_absolute_paths, rejected)
    elif path.suffix.lower() in FILE_SUFFIXES:
        raise TaskFileNotFoundError(f"{path}: no such task file", path=str(path))
    elif isinstance(source, str) and is_hf_name(source):
        tasks = load_hf(source, envs, wanted, allow_absolute_paths, rejected)
    else:
        raise TaskFileNotFoundError(_unknown_source(str(source)), path=str(source))
    found = [t.id for t in tasks] + [e.instance_id for e in rejected or [] if e.instance_id]
    check_found(wanted, found, str(source))
    check_unique(tasks, str(source))
    return tasks


def _unknown_source(source: str) -> str:
    """What to say of a source that is no file, no directory and no dataset name."""
    if source.rstrip("/").removeprefix("./") == "examples":
        return f"{source}: no such file or directory: the bundled examples are `examples`"
    return (
        f"{source}: no such file or directory, and not a Hugging Face dataset name "
        f"(owner/name[:split]): give 'examples', a file ({', '.join(FILE_SUFFIXES)}) or a "
        "dataset name like 'princeton-nlp/SWE-bench_Verified'"
    )


def _directory_problem(path: Path) -> str:
    """What to say when a task source is a directory: the task files in it, if any."""
    try:
        found = sorted(
            p.name for p in path.iterdir() if p.suffix.lower() in FILE_SUFFIXES and p.is_file()
        )
    except OSError:
        found = []
    if found:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        return f"{path}: is a directory, not a task file: give one of its task files ({shown})"
    if path.name == "examples":
        return f"{path}: is a directory, not a task file: the bundled examples are `examples`"
    return (
        f"{path}: is a directory without task files: give a task file "
        f"({', '.join(FILE_SUFFIXES)}), 'examples' or a Hugging Face dataset name"
    )
