"""Load tasks from SWE-bench / SWE-smith datasets, Hugging Face, or our own task files.

`load_tasks` is the entry point; docs/task-format.md describes every source and rule.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shlex
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.relax import normalise
from minisandbox.errors import MiniSandboxError
from minisandbox.tasks.specs import (
    Task,
    files_in_patch,
    path_name_problem,
    task_id_problem,
)

log = logging.getLogger(__name__)

__all__ = [
    "CONDA_TO_PYPI",
    "EvalScriptParts",
    "MissingDependencyError",
    "RecipeOverride",
    "TaskFormatError",
    "TaskNotFoundError",
    "apply_recipe_overrides",
    "conda_env_to_recipe",
    "conda_only_packages",
    "load_recipe_overrides",
    "load_tasks",
    "parse_eval_script",
    "recipe_overrides",
    "version_matches",
]


class TaskFormatError(MiniSandboxError, ValueError):
    """A task source is malformed. The message names the file, the record and the field."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        index: int | None = None,
        instance_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.index = index
        self.instance_id = instance_id
        self.field = field


class TaskFileNotFoundError(TaskFormatError, FileNotFoundError):
    """A task file that does not exist."""


class TaskNotFoundError(MiniSandboxError, LookupError):
    """Some requested instance ids are not in the source."""


class MissingDependencyError(MiniSandboxError, ImportError):
    """An optional package is needed for this source; the message says what to install."""


# Conda package names whose PyPI distribution is named differently. Conda splits and
# metapackages ("matplotlib-base", "numpy-base") map to the distribution that holds their code;
# duplicate pins that result are merged.
CONDA_TO_PYPI: dict[str, str] = {
    "antlr-python-runtime": "antlr4-python3-runtime",
    "brotli-python": "brotli",
    "iris": "scitools-iris",
    "matplotlib-base": "matplotlib",
    "msgpack-python": "msgpack",
    "nbconvert-core": "nbconvert",
    "numpy-base": "numpy",
    "pyarrow-core": "pyarrow",
    "pyqt": "pyqt5",
    "pytables": "tables",
    "python-eccodes": "eccodes",
    "python-fastjsonschema": "fastjsonschema",
    "python-tzdata": "tzdata",
    "python-xxhash": "xxhash",
    "pytorch": "torch",
    "seaborn-base": "seaborn",
}

# swebench's log parsers by repository, for records without a `log_parser` column.
# Short names: the swebench function is `parse_log_<name>`.
_LOG_PARSER_BY_REPO = {
    "astropy/astropy": "astropy",
    "django/django": "django",
    "matplotlib/matplotlib": "matplotlib",
    "mwaskom/seaborn": "seaborn",
    "pallets/flask": "flask",
    "psf/requests": "requests",
    "pydata/xarray": "xarray",
    "pylint-dev/pylint": "pylint",
    "pytest-dev/pytest": "pytest",
    "scikit-learn/scikit-learn": "scikit",
    "sphinx-doc/sphinx": "sphinx",
    "sympy/sympy": "sympy",
}

# SWE-smith's default Python test command; records may carry their own `test_cmd`.
SWESMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
SWESMITH_INSTALL = "python -m pip install -e ."

_FILE_SUFFIXES = (".parquet", ".json", ".jsonl", ".yaml", ".yml")
# Task fields that our task files may give as `<field>_file: path` instead of inline.
_TEXT_FIELDS = ("gold_patch", "test_patch", "bug_patch", "eval_script", "problem_statement")
# A permissive PEP 440 version: conda versions outside it ("2024b", "9e") cannot be pip pins.
_PEP440 = re.compile(
    r"^(\d+!)?\d+(\.\d+)*((a|b|rc)\d*)?(\.?post\d*)?(\.?dev\d*)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?$",
    re.IGNORECASE,
)
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_SWESMITH_REPO = re.compile(r"(?P<owner>[A-Za-z0-9-]+)__(?P<name>.+)\.(?P<commit>[0-9a-f]{7,40})")
# Files in a test patch that are data, not test modules to pass to a runner (swebench's list).
_NON_TEST_SUFFIXES = (
    ".json",
    ".png",
    ".csv",
    ".txt",
    ".md",
    ".jpg",
    ".jpeg",
    ".pkl",
    ".yml",
    ".yaml",
    ".toml",
)


# --------------------------------------------------------------------------- entry point


def load_tasks(
    source: str | Path,
    *,
    envs_dir: Path | None = None,
    instance_ids: Sequence[str] | None = None,
    allow_absolute_paths: bool = False,
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

    Raises:
        TaskFormatError: a malformed record or file, naming the file, record and field.
        TaskNotFoundError: an id of `instance_ids` is not in the source.
    """
    wanted = _wanted(instance_ids)
    if isinstance(source, str) and source == "examples":
        from minisandbox.tasks.examples import (
            load_examples,  # written separately; imported only when asked for
        )

        tasks = [t for t in load_examples() if wanted is None or t.id in wanted]
        _check_found(wanted, [t.id for t in tasks], "examples")
        return tasks

    path = Path(source).expanduser()
    envs = Path(envs_dir).expanduser() if envs_dir is not None else None
    if path.is_dir():
        raise TaskFormatError(f"{path}: is a directory, not a task file", path=str(path))
    if path.exists():
        tasks = _load_file(path, envs, wanted, allow_absolute_paths)
    elif path.suffix.lower() in _FILE_SUFFIXES:
        raise TaskFileNotFoundError(f"{path}: no such task file", path=str(path))
    elif "/" in str(source):
        tasks = _load_hf(str(source), envs, wanted, allow_absolute_paths)
    else:
        raise TaskFormatError(
            f"unknown task source {str(source)!r}: expected 'examples', a file "
            f"({', '.join(_FILE_SUFFIXES)}) or a Hugging Face dataset name like "
            "'princeton-nlp/SWE-bench_Verified'"
        )
    _check_found(wanted, [t.id for t in tasks], str(source))
    _check_unique(tasks, str(source))
    return tasks


def _wanted(instance_ids: Sequence[str] | None) -> set[str] | None:
    if instance_ids is None:
        return None
    if isinstance(instance_ids, str):  # a lone id would otherwise be split into characters
        return {instance_ids}
    return set(instance_ids)


def _check_found(wanted: set[str] | None, found: Iterable[str], source: str) -> None:
    if wanted is None:
        return
    missing = sorted(wanted - set(found))
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        raise TaskNotFoundError(f"{source}: no task with id {shown}")


def _check_unique(tasks: list[Task], source: str) -> None:
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        if task.id in seen:
            raise TaskFormatError(
                f"{source}: task {index} (id {task.id!r}): field 'id': duplicate task id",
                path=source,
                index=index,
                instance_id=task.id,
                field="id",
            )
        seen.add(task.id)


# --------------------------------------------------------------------------- error context


class _Where:
    """Names a record in error messages: file, index (and line), instance id."""

    def __init__(self, path: str, index: int | None = None, line: int | None = None) -> None:
        self.path = path
        self.index = index
        self.line = line
        self.instance_id: str | None = None

    def describe(self) -> str:
        if self.index is None:
            return self.path
        extra = [f"line {self.line}"] if self.line is not None else []
        if self.instance_id:
            extra.append(f"id {self.instance_id!r}")
        return f"{self.path}: record {self.index}" + (f" ({', '.join(extra)})" if extra else "")

    def error(self, message: str, field: str | None = None) -> TaskFormatError:
        where = self.describe()
        text = f"{where}: field {field!r}: {message}" if field else f"{where}: {message}"
        return TaskFormatError(
            text, path=self.path, index=self.index, instance_id=self.instance_id, field=field
        )

    def check_id(self, value: Any, field: str) -> None:
        """Refuse an id that cannot name a directory, before anything builds a path from it."""
        if not isinstance(value, str):
            return  # the record's own checks name a missing or non-string id
        problem = task_id_problem(value)
        if problem is not None:
            self.instance_id = None  # do not repeat a newline or a control character
            raise self.error(f"{value!r} {problem}: not usable as a task id", field)

    def from_validation(self, exc: ValidationError, prefix: str = "") -> TaskFormatError:
        problems = []
        first_field = None
        for err in exc.errors():
            field = prefix + ".".join(str(p) for p in err["loc"])
            first_field = first_field or field
            message = err["msg"]
            if err["type"] == "value_error" and "error" in err.get("ctx", {}):
                message = str(
                    err["ctx"]["error"]
                )  # our validator's text, without pydantic's prefix
            elif err["type"] == "missing":
                message = "missing"
            elif err["type"] == "extra_forbidden":
                message = "unknown field"
            problems.append(f"field {field!r}: {message}")
        text = f"{self.describe()}: " + "; ".join(problems)
        return TaskFormatError(
            text, path=self.path, index=self.index, instance_id=self.instance_id, field=first_field
        )


def _validate_task(data: dict[str, Any], where: _Where) -> Task:
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        raise where.from_validation(exc) from None


# --------------------------------------------------------------------------- files


def _load_file(
    path: Path, envs_dir: Path | None, wanted: set[str] | None, allow_abs: bool
) -> list[Task]:
    suffix = path.suffix.lower()
    name = str(path)
    if suffix == ".parquet":
        records = _read_parquet(path)
        return _records_to_tasks(records, name, path.parent, envs_dir, wanted, allow_abs)
    if suffix == ".jsonl":
        records = _read_jsonl(path)
        return _records_to_tasks(records, name, path.parent, envs_dir, wanted, allow_abs)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TaskFormatError(f"{path}: not valid JSON: {exc}", path=name) from None
        if isinstance(data, dict) and "tasks" in data:
            return _own_tasks(data, path, envs_dir, wanted, allow_abs)
        if isinstance(data, list):
            records = ((i, None, r) for i, r in enumerate(data))
            return _records_to_tasks(records, name, path.parent, envs_dir, wanted, allow_abs)
        raise TaskFormatError(
            f"{path}: expected a list of SWE-bench/SWE-smith records or a mapping with a "
            "'tasks' list",
            path=name,
        )
    if suffix in (".yaml", ".yml"):
        data = _yaml_load(path)
        if not isinstance(data, dict) or "tasks" not in data:
            raise TaskFormatError(f"{path}: expected a mapping with a 'tasks' list", path=name)
        return _own_tasks(data, path, envs_dir, wanted, allow_abs)
    raise TaskFormatError(
        f"{path}: unknown task file type {suffix or '(none)'}; expected one of "
        + ", ".join(_FILE_SUFFIXES),
        path=name,
    )


Record = tuple[int, int | None, Any]  # (index, line number or None, record)


def _read_parquet(path: Path) -> Iterable[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependencyError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    rows = pq.read_table(path).to_pylist()
    return ((i, None, r) for i, r in enumerate(rows))


def _read_jsonl(path: Path) -> Iterable[Record]:
    index = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                where = _Where(str(path), index, lineno)
                raise where.error(f"not valid JSON: {exc}") from None
            yield index, lineno, record
            index += 1


def _yaml_module() -> Any:
    try:
        import yaml
    except ImportError:
        raise MissingDependencyError(
            "reading YAML files needs PyYAML: pip install pyyaml"
        ) from None
    return yaml


def _yaml_load(path: Path) -> Any:
    yaml = _yaml_module()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader is ~10x faster
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"{path}: not valid YAML: {exc}", path=str(path)) from None


# --------------------------------------------------------------------------- Hugging Face


def _load_hf(
    name: str, envs_dir: Path | None, wanted: set[str] | None, allow_abs: bool
) -> list[Task]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise MissingDependencyError(
            f"{name!r} is not a file, so it is taken for a Hugging Face dataset name; loading one "
            "needs the `datasets` package (pip install datasets). Or download the dataset and "
            "pass its local .parquet/.json/.jsonl file."
        ) from None
    dataset_name, _, split = name.partition(":")
    loaded = datasets.load_dataset(dataset_name, split=split or None)
    if not split:
        splits = list(loaded.keys())
        if "test" in splits:
            split = "test"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise TaskFormatError(
                f"{dataset_name}: has splits {', '.join(splits)}; choose one as "
                f"'{dataset_name}:<split>'"
            )
        loaded = loaded[split]
    source = f"hf:{dataset_name}:{split}"
    records = ((i, None, dict(r)) for i, r in enumerate(loaded))
    return _records_to_tasks(records, source, None, envs_dir, wanted, allow_abs)


# --------------------------------------------------------------------------- dataset records


def _records_to_tasks(
    records: Iterable[Record],
    source: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    wanted: set[str] | None,
    allow_abs: bool = False,
) -> list[Task]:
    tasks = []
    for index, line, record in records:
        where = _Where(source, index, line)
        if not isinstance(record, dict):
            raise where.error(f"expected a mapping, got {type(record).__name__}")
        iid = record.get("instance_id")
        where.instance_id = iid if isinstance(iid, str) else None
        if wanted is not None and iid not in wanted:
            continue
        where.check_id(iid, "instance_id")  # before envs_dir/<id>.yml is looked at
        kind = _record_kind(record, where)
        if kind == "swesmith":
            tasks.append(_swesmith_task(record, where, source, base_dir, envs_dir, allow_abs))
        else:
            tasks.append(_swebench_task(record, where, source, envs_dir))
    return tasks


def _record_kind(record: dict[str, Any], where: _Where) -> str:
    """SWE-smith records have an image or environment and no test patch; SWE-bench records
    have a base commit / test patch."""
    if ("image_name" in record or "environment" in record) and "test_patch" not in record:
        return "swesmith"
    if {"base_commit", "test_patch", "environment_setup_commit"} & record.keys():
        return "swebench"
    raise where.error(
        "neither a SWE-bench record (instance_id, repo, base_commit, test_patch, FAIL_TO_PASS, "
        "...) nor a SWE-smith record (instance_id, repo, patch, FAIL_TO_PASS, image_name or "
        "environment)"
    )


def _required(record: dict[str, Any], field: str, where: _Where) -> Any:
    value = record.get(field)
    if value is None or value == "":
        raise where.error("missing", field)
    return value


def _text(record: dict[str, Any], field: str, where: _Where, default: str = "") -> str:
    value = record.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise where.error(f"expected a string, got {type(value).__name__}", field)
    return value


def _string_list(record: dict[str, Any], field: str, where: _Where) -> list[str]:
    """SWE-bench files hold test lists JSON-encoded in a string; HF datasets as real lists."""
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


def _version_text(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def _log_parser(record: dict[str, Any], repo: str, where: _Where) -> str:
    name = _text(record, "log_parser", where)
    if name:
        return name.removeprefix("parse_log_")
    return _LOG_PARSER_BY_REPO.get(repo, "pytest")


def _swebench_task(
    record: dict[str, Any], where: _Where, source: str, envs_dir: Path | None
) -> Task:
    iid = _text(record, "instance_id", where) or _required(record, "instance_id", where)
    repo = _text(record, "repo", where) or _required(record, "repo", where)
    _required(record, "base_commit", where)
    test_patch = _text(record, "test_patch", where) or _required(record, "test_patch", where)
    fail_to_pass = _string_list(record, "FAIL_TO_PASS", where)
    if "FAIL_TO_PASS" not in record:
        raise where.error("missing", "FAIL_TO_PASS")
    version = _version_text(record.get("version"))
    eval_script = _text(record, "eval_script", where) or None
    spec = _swebench_spec(repo, version)

    env_file = envs_dir / f"{iid}.yml" if envs_dir is not None else None
    if env_file is not None and env_file.is_file():
        recipe = conda_env_to_recipe(env_file)
    elif spec is not None:
        recipe = _recipe_from_spec(spec, where)
    else:
        looked = f" (no {env_file})" if env_file is not None else ""
        raise where.error(
            f"no environment recipe for {iid}{looked}: pass envs_dir= a directory with the "
            f"instance's conda export {iid}.yml, or install swebench 4.x "
            "(pip install 'swebench>=4.1,<5') for its MAP_REPO_VERSION_TO_SPECS table",
            "env",
        )

    parts = parse_eval_script(eval_script) if eval_script else None
    pre_install: list[str] = []
    install: list[str] = []
    skipped = list(recipe.skipped)
    env_vars = dict(recipe.env)
    if spec is not None:
        pre_install = _sandboxable(_as_list(spec.get("pre_install")), skipped, "pre_install")
        install = _as_list(spec.get("install"))
        if parts is None:  # the eval script's exports are the same commands, already parsed
            setup = _sandboxable(_as_list(spec.get("eval_commands")), skipped, "eval_commands")
            env_vars.update(_exports(setup))
    if parts is not None:
        env_vars.update(parts.env)
        skipped.extend(f"eval_script setup: {cmd}" for cmd in parts.setup)
        if spec is None:  # the eval script reinstalls the repository: the same install commands
            install = parts.install

    if parts is not None and parts.test_cmd:
        test_cmd = parts.test_cmd
    elif spec is not None and spec.get("test_cmd"):
        test_cmd = _spec_test_cmd(spec, repo, test_patch)
    else:
        raise where.error(
            "cannot tell how to run the tests: the record has no eval_script with a test "
            "command, and swebench 4.x (pip install 'swebench>=4.1,<5') is not installed",
            "test_cmd",
        )

    recipe = recipe.model_copy(update={"env": env_vars, "skipped": skipped})
    recipe, services = apply_recipe_overrides(repo, version, recipe, recipe_overrides())
    data = {
        "id": iid,
        "repo": repo,
        "base_commit": record.get("base_commit"),
        "env": recipe,
        "pre_install": pre_install,
        "install": install,
        "test_cmd": test_cmd,
        "log_parser": _log_parser(record, repo, where),
        "eval_type": _text(record, "eval_type", where) or "pass_and_fail",
        "gold_patch": _text(record, "patch", where),
        "test_patch": test_patch,
        "fail_to_pass": fail_to_pass,
        "pass_to_pass": _string_list(record, "PASS_TO_PASS", where),
        "eval_script": eval_script,
        "problem_statement": _text(record, "problem_statement", where),
        "hints_text": _text(record, "hints_text", where),
        "version": version,
        "image": _text(record, "image", where) or None,
        "environment_setup_commit": _text(record, "environment_setup_commit", where) or None,
        "source": source,
        "services": services,
    }
    return _validate_task(data, where)


def _swesmith_task(
    record: dict[str, Any],
    where: _Where,
    source: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    allow_abs: bool = False,
) -> Task:
    iid = _text(record, "instance_id", where) or _required(record, "instance_id", where)
    raw_repo = _text(record, "repo", where) or _required(record, "repo", where)
    bug_patch = _text(record, "patch", where) or _required(record, "patch", where)
    if "FAIL_TO_PASS" not in record:
        raise where.error("missing", "FAIL_TO_PASS")
    repo, commit, env_name = _split_swesmith_repo(raw_repo)
    base_commit = _text(record, "base_commit", where) or commit
    if not base_commit:
        raise where.error(
            "missing: give base_commit, or a SWE-smith repo name 'owner__name.<commit>'",
            "base_commit",
        )
    if env_name is not None and path_name_problem(env_name) is not None:
        raise where.error(f"{raw_repo!r} {path_name_problem(env_name)}", "repo")
    recipe = _swesmith_recipe(record, where, env_name, iid, base_dir, envs_dir, allow_abs)
    install = record.get("install", [SWESMITH_INSTALL])
    data = {
        "id": iid,
        "repo": repo,
        "base_commit": base_commit,
        "env": recipe,
        "pre_install": _as_list(record.get("pre_install")),
        "install": _as_list(install),
        "test_cmd": _text(record, "test_cmd", where) or SWESMITH_TEST_CMD,
        "test_files": _string_list(record, "test_files", where),
        "log_parser": _text(record, "log_parser", where).removeprefix("parse_log_") or "pytest",
        "bug_patch": bug_patch,
        "fail_to_pass": _string_list(record, "FAIL_TO_PASS", where),
        "pass_to_pass": _string_list(record, "PASS_TO_PASS", where),
        "problem_statement": _text(record, "problem_statement", where),
        "image": _text(record, "image_name", where) or None,
        "source": source,
    }
    return _validate_task(data, where)


def _split_swesmith_repo(repo: str) -> tuple[str, str | None, str | None]:
    """Split a SWE-smith repo name: "swesmith/owner__name.abc1234" or "owner__name.abc1234"
    gives ("owner/name", "abc1234", "owner__name.abc1234"); "owner/name" passes through."""
    tail = repo.rsplit("/", 1)[-1]
    m = _SWESMITH_REPO.fullmatch(tail)
    if m:
        return f"{m['owner']}/{m['name']}", m["commit"], tail
    return repo, None, None


def _swesmith_recipe(
    record: dict[str, Any],
    where: _Where,
    env_name: str | None,
    iid: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    allow_abs: bool = False,
) -> EnvRecipe:
    """`environment` is a recipe mapping, or names a conda export (a path relative to the data
    file, or `<name>.yml` in envs_dir); without it, envs_dir/<owner__name.commit>.yml. An
    absolute path or one with `..` is refused unless `allow_abs`."""
    environment = record.get("environment")
    if isinstance(environment, dict):
        try:
            return EnvRecipe.model_validate(environment)
        except ValidationError as exc:
            raise where.from_validation(exc, prefix="environment.") from None
    candidates: list[Path] = []
    if isinstance(environment, str) and environment:
        given = _record_path(environment, where, "environment", allow_abs)
        for folder in (base_dir, envs_dir):
            if folder is not None and not given.is_absolute():
                candidates += [folder / given, folder / f"{environment}.yml"]
        if given.is_absolute():  # allowed explicitly
            candidates.append(given)
    elif environment is not None:
        raise where.error("expected a mapping or a file name", "environment")
    elif envs_dir is not None:
        candidates += [envs_dir / f"{name}.yml" for name in (env_name, iid) if name]
    for candidate in candidates:
        if candidate.is_file():
            return conda_env_to_recipe(candidate)
    looked = ", ".join(str(c) for c in candidates) or "nothing (no envs_dir)"
    raise where.error(
        "no environment recipe: give `environment` (a mapping with python/requirements, or a "
        f"conda export file) or put <owner__name.commit>.yml in envs_dir; looked at {looked}",
        "environment",
    )


# --------------------------------------------------------------------------- our task files


def _own_tasks(
    data: dict[str, Any],
    path: Path,
    envs_dir: Path | None,
    wanted: set[str] | None,
    allow_abs: bool = False,
) -> list[Task]:
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
        where = _Where(name, index)
        if not isinstance(entry, dict):
            raise where.error(f"expected a mapping, got {type(entry).__name__}")
        entry = dict(entry)
        where.instance_id = entry.get("id") if isinstance(entry.get("id"), str) else None
        if wanted is not None and entry.get("id") not in wanted:
            continue
        where.check_id(entry.get("id"), "id")
        for field in _TEXT_FIELDS:
            ref = entry.pop(f"{field}_file", None)
            if ref is None:
                continue
            if field in entry:
                raise where.error(f"give either {field} or {field}_file, not both", field)
            entry[field] = _read_relative(path, ref, where, f"{field}_file", allow_abs)
        env = entry.get("env")
        if isinstance(env, str):  # a conda export next to the task file
            entry["env"] = conda_env_to_recipe(
                _resolve_relative(path, env, where, "env", allow_abs)
            )
        entry.setdefault("source", name)
        tasks.append(_validate_task(entry, where))
    return tasks


def _record_path(ref: str, where: _Where, field: str, allow_abs: bool) -> Path:
    """A path a record names, checked before use: no control characters ever; absolute, `~` or
    `..` only when the caller allows paths outside the dataset's folders."""
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


def _resolve_relative(
    task_file: Path, ref: Any, where: _Where, field: str, allow_abs: bool = False
) -> Path:
    if not isinstance(ref, str) or not ref:
        raise where.error("expected a file path", field)
    target = _record_path(ref, where, field, allow_abs)
    if not target.is_absolute():
        target = task_file.parent / target
    if not target.is_file():
        raise where.error(f"no such file: {target}", field)
    return target


def _read_relative(
    task_file: Path, ref: Any, where: _Where, field: str, allow_abs: bool = False
) -> str:
    target = _resolve_relative(task_file, ref, where, field, allow_abs)
    try:
        return target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise where.error(f"cannot read {target}: {exc}", field) from None


# --------------------------------------------------------------------------- conda exports


@functools.cache
def conda_only_packages() -> frozenset[str]:
    """Conda package names that are not pip-installable (data/conda_only_packages.txt)."""
    text = (resources.files("minisandbox") / "data" / "conda_only_packages.txt").read_text(
        encoding="utf-8"
    )
    names = (line.split("#", 1)[0].strip().lower() for line in text.splitlines())
    return frozenset(name for name in names if name)


def _requirement_name(line: str) -> str | None:
    m = _REQ_NAME.match(line)
    return normalise(m.group(1)) if m else None


def conda_env_to_recipe(path: str | Path) -> EnvRecipe:
    """Turn a conda environment export (`conda env export`) into a pip recipe.

    - the Python version comes from the `python=X.Y.Z` dependency;
    - `name=version=build` becomes `name==version`, after renaming by CONDA_TO_PYPI; names in
      data/conda_only_packages.txt and versions pip cannot read are dropped into `skipped`;
    - the `pip:` sub-list is kept as is and wins over a conda pin of the same package;
      entries starting with "-" become pip options;
    - the export's `variables:` become `env`.
    """
    path = Path(path)
    where = _Where(str(path))
    data = _yaml_load(path)
    if not isinstance(data, dict) or not isinstance(data.get("dependencies"), list):
        raise where.error("expected a conda export with a 'dependencies' list", "dependencies")
    skip = conda_only_packages()
    python: str | None = None
    pins: dict[str, str] = {}  # normalised name -> requirement, in file order
    versions: dict[str, str] = {}
    skipped: list[str] = []
    pip_lines: list[str] = []
    for dep in data["dependencies"]:
        if isinstance(dep, dict) and set(dep) == {"pip"}:
            pip_lines += [str(x) for x in dep["pip"] or []]
            continue
        if not isinstance(dep, str):
            raise where.error(f"unexpected entry {dep!r}", "dependencies")
        spec = dep.split("::", 1)[-1].strip()  # drop a "channel::" prefix
        name, _, rest = spec.partition("=")
        name = name.strip().lower()
        version = rest.split("=", 1)[0].strip()
        if name == "python":
            python = version
            continue
        if name in skip:
            skipped.append(f"{dep}: conda-only")
            continue
        if version and not _PEP440.match(version.replace("*", "0")):
            skipped.append(f"{dep}: version is not a pip version")
            continue
        pypi = CONDA_TO_PYPI.get(name, name)
        key = normalise(pypi)
        if key in pins:  # a split or alias of a package already pinned ("matplotlib-base")
            if versions[key] != version:
                skipped.append(f"{dep}: conflicts with {pins[key]}")
            continue
        pins[key] = f"{pypi}=={version}" if version else pypi
        versions[key] = version
    if not python:
        raise where.error("no python=X.Y.Z dependency", "dependencies")
    python = python.rstrip(".*")

    options = [line for line in pip_lines if line.startswith("-")]
    pip_reqs = [line for line in pip_lines if not line.startswith("-")]
    for line in pip_reqs:
        key = _requirement_name(line)
        if key in pins:
            skipped.append(f"conda {pins.pop(key)}: overridden by pip {line}")
    variables = data.get("variables") or {}
    if not isinstance(variables, dict):
        raise where.error("expected a mapping", "variables")
    try:
        return EnvRecipe(
            python=python,
            requirements=[*pins.values(), *pip_reqs],
            pip_options=options,
            env={str(k): str(v) for k, v in variables.items()},
            skipped=skipped,
            relax_pins=True,
        )
    except ValidationError as exc:
        raise where.from_validation(exc) from None


# --------------------------------------------------------------------------- recipe overrides


class RecipeOverride(BaseModel):
    """One entry of data/recipe_overrides.yaml (docs/recipes.md)."""

    model_config = ConfigDict(extra="forbid")

    repo: str
    version: str | None = None  # "2.0", or comparisons joined by commas: ">=1.0,<2.9"
    services: list[str] = []
    pins: dict[str, str] = {}
    drop: list[str] = []
    env: dict[str, str] = {}
    note: str = ""

    def matches(self, repo: str, version: str | None) -> bool:
        if repo != self.repo:
            return False
        if self.version is None:
            return True
        return version is not None and version_matches(version, self.version)


_VERSION_CLAUSE = re.compile(r"^\s*(==|!=|<=|>=|<|>)?\s*(\d+(?:\.\d+)*)\s*$")


def _version_tuple(version: str) -> tuple[int, ...] | None:
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", version)
    if not m:
        return None
    parts = [int(p) for p in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:  # 2.0 == 2
        parts.pop()
    return tuple(parts)


def version_matches(version: str, spec: str) -> bool:
    """Whether a dataset version ("2.3") satisfies `spec`: "2.3", or clauses like ">=1.0,<2.9"
    that must all hold. Versions compare numerically, part by part."""
    have = _version_tuple(version)
    if have is None:
        return False
    for clause in spec.split(","):
        m = _VERSION_CLAUSE.match(clause)
        if not m:
            raise ValueError(f"{spec!r}: {clause!r} is not a version comparison like '<2.9'")
        op, want = m.group(1) or "==", _version_tuple(m.group(2))
        assert want is not None
        ok = {
            "==": have == want,
            "!=": have != want,
            "<": have < want,
            "<=": have <= want,
            ">": have > want,
            ">=": have >= want,
        }[op]
        if not ok:
            return False
    return True


def load_recipe_overrides(path: str | Path) -> tuple[RecipeOverride, ...]:
    """Read and check an overrides file (a mapping with an `overrides` list)."""
    path = Path(path)
    return _parse_overrides(_yaml_load(path), str(path))


@functools.cache
def recipe_overrides() -> tuple[RecipeOverride, ...]:
    """The bundled overrides (data/recipe_overrides.yaml)."""
    text = (resources.files("minisandbox") / "data" / "recipe_overrides.yaml").read_text(
        encoding="utf-8"
    )
    yaml = _yaml_module()
    return _parse_overrides(yaml.safe_load(text), "data/recipe_overrides.yaml")


def _parse_overrides(data: Any, name: str) -> tuple[RecipeOverride, ...]:
    if not isinstance(data, dict) or set(data) != {"overrides"}:
        raise TaskFormatError(f"{name}: expected a mapping with only an 'overrides' list")
    entries = data["overrides"] or []
    if not isinstance(entries, list):
        raise TaskFormatError(f"{name}: field 'overrides': expected a list", field="overrides")
    out = []
    for index, entry in enumerate(entries):
        where = _Where(name, index)
        try:
            override = RecipeOverride.model_validate(entry)
            if override.version is not None:
                version_matches("0", override.version)  # a malformed spec fails here
        except ValidationError as exc:
            raise where.from_validation(exc) from None
        except ValueError as exc:
            raise where.error(str(exc), "version") from None
        out.append(override)
    return tuple(out)


def apply_recipe_overrides(
    repo: str,
    version: str | None,
    recipe: EnvRecipe,
    overrides: Iterable[RecipeOverride],
    services: Sequence[str] = (),
) -> tuple[EnvRecipe, list[str]]:
    """The recipe and service list with every matching override applied, in order. What an
    override changed is noted in the recipe's `skipped` (documentation, not part of its key)."""
    requirements = list(recipe.requirements)
    env = dict(recipe.env)
    notes = list(recipe.skipped)
    out_services = list(services)
    for o in overrides:
        if not o.matches(repo, version):
            continue
        label = f"override ({o.repo}{' ' + o.version if o.version else ''})"
        for name in o.drop:
            key = normalise(name)
            removed = [r for r in requirements if _requirement_name(r) == key]
            requirements = [r for r in requirements if _requirement_name(r) != key]
            notes += [f"{label}: dropped {r}" for r in removed]
        for name, requirement in o.pins.items():
            key = normalise(name)
            if _requirement_name(requirement) != key:
                raise TaskFormatError(f"{label}: pin {name!r} is {requirement!r}, another name")
            at = [i for i, r in enumerate(requirements) if _requirement_name(r) == key]
            if at:
                notes.append(f"{label}: {requirements[at[0]]} -> {requirement}")
                requirements[at[0]] = requirement
                requirements = [r for i, r in enumerate(requirements) if i not in at[1:]]
            else:
                notes.append(f"{label}: added {requirement}")
                requirements.append(requirement)
        env.update(o.env)
        out_services += [s for s in o.services if s not in out_services]
        if o.services:
            notes.append(f"{label}: services {', '.join(o.services)}")
    recipe = recipe.model_copy(update={"requirements": requirements, "env": env, "skipped": notes})
    return EnvRecipe.model_validate(recipe.model_dump()), out_services


# --------------------------------------------------------------------------- swebench specs


def _swebench_spec(repo: str, version: str | None) -> dict[str, Any] | None:
    specs = _swebench_specs_table()
    if specs is None or version is None:
        return None
    spec = specs.get(repo, {}).get(version)
    return dict(spec) if isinstance(spec, dict) else None


@functools.cache
def _swebench_specs_table() -> dict[str, Any] | None:
    """swebench 4.x's MAP_REPO_VERSION_TO_SPECS, when swebench is installed (5.x dropped it)."""
    try:
        from swebench.harness.constants import (  # type: ignore[import-not-found]
            MAP_REPO_VERSION_TO_SPECS,
        )
    except Exception as exc:  # a broken install (missing deps) counts as absent
        log.debug("swebench spec table unavailable: %s", exc)
        return None
    return dict(MAP_REPO_VERSION_TO_SPECS)


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value]


# Commands that change the host system (packages, locales): a sandboxed build cannot run them.
_SYSTEM_COMMAND = re.compile(r"^\s*(sudo\s+)?(apt-get|apt|yum|dnf|apk|locale-gen)\b|/etc/")


def _sandboxable(commands: list[str], skipped: list[str], what: str) -> list[str]:
    kept = []
    for cmd in commands:
        if _SYSTEM_COMMAND.search(cmd):
            skipped.append(f"{what}: {cmd}")
        else:
            kept.append(cmd)
    return kept


def _exports(commands: list[str]) -> dict[str, str]:
    env = {}
    for cmd in commands:
        parsed = _parse_export(cmd)
        if parsed:
            env[parsed[0]] = parsed[1]
    return env


def _parse_export(line: str) -> tuple[str, str] | None:
    m = re.match(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
    if not m:
        return None
    try:
        words = shlex.split(m.group(2))
    except ValueError:
        return None
    return m.group(1), " ".join(words)


def _recipe_from_spec(spec: dict[str, Any], where: _Where) -> EnvRecipe:
    """A minimal recipe from a swebench spec: its Python, its conda `packages` when they are a
    list, and its pip_packages. Requirement files it points at are not resolved here."""
    skipped: list[str] = []
    packages = spec.get("packages") or ""
    conda_reqs: list[str] = []
    if packages in ("requirements.txt", "environment.yml"):
        skipped.append(f"packages: the repository's {packages} (not resolved)")
    elif isinstance(packages, str):
        for item in shlex.split(packages):
            name = _REQ_NAME.match(item)
            if name and name.group(1).lower() in conda_only_packages():
                skipped.append(f"packages: {item}: conda-only")
                continue
            conda_reqs.append(_conda_match_to_pip(item))
    pip_packages = _as_list(spec.get("pip_packages"))
    pip_names = {_requirement_name(p) for p in pip_packages}
    conda_reqs = [r for r in conda_reqs if _requirement_name(r) not in pip_names]
    try:
        return EnvRecipe(
            python=str(spec["python"]),
            requirements=[*conda_reqs, *pip_packages],
            skipped=skipped,
        )
    except (KeyError, ValidationError) as exc:
        raise where.error(f"unusable swebench spec: {exc}", "env") from None


def _conda_match_to_pip(item: str) -> str:
    """Conda's "name=1.2" means 1.2.*; pip spells it "name==1.2.*"."""
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=([^=<>!~]+)$", item)
    if not m:
        return item
    name, version = m.groups()
    name = CONDA_TO_PYPI.get(name.lower(), name)
    return f"{name}=={version}" if version.endswith("*") else f"{name}=={version}.*"


def _spec_test_cmd(spec: dict[str, Any], repo: str, test_patch: str) -> str:
    """swebench's test command plus the test files of the test patch as arguments (Django's
    runner takes dotted module names relative to tests/)."""
    directives = [
        f for f in files_in_patch(test_patch) if not f.lower().endswith(_NON_TEST_SUFFIXES)
    ]
    if repo == "django/django":
        directives = [
            f.removesuffix(".py").removeprefix("tests/").replace("/", ".") for f in directives
        ]
    commands = _as_list(spec["test_cmd"])
    args = " ".join(shlex.quote(d) for d in directives)
    return "\n".join(f"{cmd} {args}".strip() for cmd in commands)


# --------------------------------------------------------------------------- eval scripts


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


def _is_test_runner(line: str) -> bool:
    words = line[_ASSIGNMENTS.match(line).end() :].split()  # type: ignore[union-attr]
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
    """
    lines = _script_lines(script)
    plain = [(i, line.strip()) for i, (line, inside) in enumerate(lines) if not inside]
    parts = EvalScriptParts()

    texts = [t for _, t in plain]
    if _START_MARK in texts and _END_MARK in texts[texts.index(_START_MARK) :]:
        start = texts.index(_START_MARK)
        end = texts.index(_END_MARK, start)
        test_lines = [t for t in texts[start + 1 : end] if t]
        parts.test_cmd = "\n".join(test_lines) or None
    else:
        applied = [n for n, t in enumerate(texts) if t.startswith("git apply")]
        after = texts[applied[-1] + 1 :] if applied else texts
        parts.test_cmd = next((t for t in after if _is_test_runner(t)), None)

    safe_dir = next((n for n, t in enumerate(texts) if "safe.directory" in t), None)
    if safe_dir is not None:
        cd = next((n for n, t in enumerate(texts[:safe_dir]) if t.startswith("cd ")), None)
        for text in texts[(cd + 1 if cd is not None else 0) : safe_dir]:
            if not text or text.startswith(("#", "source ", "conda activate", "set ", "cd ")):
                continue
            export = _parse_export(text)
            if export:
                parts.env[export[0]] = export[1]
            else:
                parts.setup.append(text)

    checkout = next((n for n, t in enumerate(texts) if t.startswith("git checkout ")), None)
    if checkout is not None:
        activations = [n for n, t in enumerate(texts[:checkout]) if t.startswith("conda activate")]
        if activations:
            parts.install = [t for t in texts[activations[-1] + 1 : checkout] if t]
    return parts
