"""SWE-bench records (one row of a SWE-bench dataset) turned into tasks.

A record gives `instance_id`, `repo`, `base_commit`, `patch` (the gold patch), `test_patch`,
`FAIL_TO_PASS`, `PASS_TO_PASS`, `version`, and optionally `eval_script`, `log_parser`, `image`
(SWE-bench 5.x files carry these three). The environment recipe is the instance's conda export
(`envs_dir/<instance_id>.yml`) when there is one, else the recipe of swebench 4.1.0's spec
(shipped as data, swebench_specs), else one inferred from the repository at its environment
commit (tasks.repo_recipes: a repository nobody described, its installs as of the commit's
date); install and test commands come from the eval script, else from the spec, else
`pip install -e .` and pytest on the test patch's files. Last, the matching recipe overrides
apply. Invariant: the same record, envs_dir and swebench table give
the same task (its keys depend on it); docs/task-format.md describes each rule.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from minisandbox.envs.recipe import EnvRecipe, FromRepository
from minisandbox.tasks.loaders.conda_exports import conda_env_to_recipe
from minisandbox.tasks.loaders.eval_script_parts import EvalScriptParts, exports, parse_eval_script
from minisandbox.tasks.loaders.fields import (
    Where,
    as_list,
    required,
    string_list,
    text,
    validate_task,
    version_text,
)
from minisandbox.tasks.loaders.overrides import apply_recipe_overrides, recipe_overrides
from minisandbox.tasks.loaders.swebench_specs import (
    HARNESS_AS_OF,
    recipe_from_spec,
    sandboxable,
    spec_test_cmd,
    swebench_spec,
)
from minisandbox.tasks.specs import Task

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
# A repository nobody described: installed as swebench's specs mostly do, tested with pytest.
_DEFAULT_INSTALL = "python -m pip install -e ."
_DEFAULT_TEST_CMD = {"test_cmd": "pytest -rA"}


def swebench_task(record: dict[str, Any], where: Where, source: str, envs_dir: Path | None) -> Task:
    """The task of one SWE-bench record. Checks run in field order, so the first problem of a
    record is the one reported.

    Raises:
        TaskFormatError: a field is missing or malformed.
        MissingDependencyError: PyYAML is not installed (conda exports, recipe overrides).
    """
    iid = text(record, "instance_id", where) or required(record, "instance_id", where)
    repo = text(record, "repo", where) or required(record, "repo", where)
    required(record, "base_commit", where)
    test_patch = text(record, "test_patch", where) or required(record, "test_patch", where)
    fail_to_pass = string_list(record, "FAIL_TO_PASS", where)
    if "FAIL_TO_PASS" not in record:
        raise where.error("missing", "FAIL_TO_PASS")
    version = version_text(record.get("version"))
    eval_script = text(record, "eval_script", where) or None
    spec = swebench_spec(repo, version)
    recipe, install_as_of = _base_recipe(iid, repo, spec, envs_dir, where)
    parts = parse_eval_script(eval_script) if eval_script else None
    pre_install, install, recipe = _commands(spec, parts, recipe)
    test_cmd = _test_cmd(spec, parts, repo, test_patch)
    if recipe.from_repository is not None and recipe.from_repository.infer:
        recipe, runner_install = _runner_recipe(_report_recipe(recipe, test_cmd, repo), test_cmd)
        install = [*install, *runner_install]
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
        "eval_type": text(record, "eval_type", where) or "pass_and_fail",
        "gold_patch": text(record, "patch", where),
        "test_patch": test_patch,
        "fail_to_pass": fail_to_pass,
        "pass_to_pass": string_list(record, "PASS_TO_PASS", where),
        "eval_script": eval_script,
        "problem_statement": text(record, "problem_statement", where),
        "hints_text": text(record, "hints_text", where),
        "version": version,
        "image": text(record, "image", where) or None,
        "environment_setup_commit": text(record, "environment_setup_commit", where) or None,
        "install_as_of": text(record, "install_as_of", where) or install_as_of,
        "source": source,
        "services": services,
    }
    return validate_task(data, where)


def _base_recipe(
    iid: str, repo: str, spec: dict[str, Any] | None, envs_dir: Path | None, where: Where
) -> tuple[EnvRecipe, str | None]:
    """The instance's conda export when envs_dir has it, else the spec's recipe, else one
    inferred from the repository (by the builder, at the environment commit); and the date
    the repository's install resolves as of. An export pins the whole environment: none. The
    spec's: when the harness built its images, as its environment (its `pip install -e .`
    got the dependencies of then: sphinx 3.x imports docutils' `roman`, gone in 0.22). An
    inferred one: the commit's, as its environment."""
    env_file = envs_dir / f"{iid}.yml" if envs_dir is not None else None
    if env_file is not None and env_file.is_file():
        return conda_env_to_recipe(env_file), None
    if spec is not None:
        return recipe_from_spec(spec, repo, where), HARNESS_AS_OF
    return EnvRecipe(python=None, from_repository=FromRepository(infer=True)), "commit"


def _commands(
    spec: dict[str, Any] | None, parts: EvalScriptParts | None, recipe: EnvRecipe
) -> tuple[list[str], list[str], EnvRecipe]:
    """pre_install, install, and the recipe with the variables the spec or eval script sets
    (and the commands left out noted in `skipped`)."""
    pre_install: list[str] = []
    install: list[str] = []
    skipped = list(recipe.skipped)
    env_vars = dict(recipe.env)
    if spec is not None:
        pre_install = sandboxable(as_list(spec.get("pre_install")), skipped, "pre_install")
        install = as_list(spec.get("install"))
        if parts is None:  # the eval script's exports are the same commands, already parsed
            setup = sandboxable(as_list(spec.get("eval_commands")), skipped, "eval_commands")
            env_vars.update(exports(setup))
    if parts is not None:
        env_vars.update(parts.env)
        skipped.extend(f"eval_script setup: {cmd}" for cmd in parts.setup)
        if spec is None:  # the eval script reinstalls the repository: the same install commands
            install = parts.install
    if spec is None and parts is None:
        install = [_DEFAULT_INSTALL]
    return pre_install, install, recipe.model_copy(update={"env": env_vars, "skipped": skipped})


def _test_cmd(
    spec: dict[str, Any] | None, parts: EvalScriptParts | None, repo: str, test_patch: str
) -> str:
    if parts is not None and parts.test_cmd:
        return parts.test_cmd
    if spec is not None and spec.get("test_cmd"):
        return spec_test_cmd(spec, repo, test_patch)
    return spec_test_cmd(_DEFAULT_TEST_CMD, repo, test_patch)


_REPORT_ALL = re.compile(r"(?:^|\s)-r[a-zA-Z]*A")  # pytest's -rA (or -rfA, ...)
# pytest's own repository installs itself as the runner: nothing to add.
_PYTEST_REPOSITORY = "pytest-dev/pytest"


def _report_recipe(recipe: EnvRecipe, test_cmd: str, repo: str) -> EnvRecipe:
    """An inferred recipe with the pytest whose summary the log parsers read: `-rA` came in
    pytest 4.5, and an older one (what a requests commit of 2014 dates) prints no PASSED
    lines, so every test would read "not run" (repo_recipes.with_runner)."""
    source = recipe.from_repository
    if source is None or not _REPORT_ALL.search(test_cmd):
        return recipe
    if repo == _PYTEST_REPOSITORY:
        return recipe
    runner = source.model_copy(update={"runner": [*source.runner, "pytest>=4.5"]})
    return recipe.model_copy(update={"from_repository": runner})


_TOX = re.compile(r"(?:^|[\s;&|])tox(?![\w.-])")  # the command, not tox.ini
_TOX_ENV = re.compile(r"\s-e\s*py(3)(\d+)\b")


# tox.ini's `setenv` can set PYTEST_ADDOPTS itself (sphinx 3.x: `--color yes`), replacing the
# `-rA` passed on: a .pth, run at the start of the interpreter tox runs pytest in (tox-current-env:
# the environment's own), appends what MINISANDBOX_PYTEST_ADDOPTS holds when it is missing.
_ADDOPTS_PTH_LINE = (
    'import os; a = os.environ.get("MINISANDBOX_PYTEST_ADDOPTS", ""); '
    'p = os.environ.get("PYTEST_ADDOPTS", ""); '
    'a and a not in p and os.environ.__setitem__("PYTEST_ADDOPTS", (p + " " + a).strip())'
)
_TOX_ADDOPTS_PTH = (
    f"printf '%s\\n' '{_ADDOPTS_PTH_LINE}' > \"$(python -c "
    '\'import sysconfig; print(sysconfig.get_paths()["purelib"])\')/minisandbox-pytest-addopts.pth"'
)


def _runner_recipe(recipe: EnvRecipe, test_cmd: str) -> tuple[EnvRecipe, list[str]]:
    """An inferred recipe with what the record's test command runs that the repository's own
    requirements may not list: tox (and tox-current-env for `--current-env`), on the Python
    of the tox environment it names (`-epy39`: tox-current-env refuses another). pytest under
    tox runs as the repository's tox.ini says, without the `-rA` the log parsers read (the
    harness's image edited tox.ini): PYTEST_ADDOPTS adds it, TOX_TESTENV_PASSENV passes it
    through tox 3 where tox.ini does not, and a .pth where tox.ini sets its own (the install
    step writes it: _TOX_ADDOPTS_PTH). Returns the recipe and the install commands to add."""
    if not _TOX.search(test_cmd):
        return recipe, []
    extra = ["tox", *(["tox-current-env"] if "--current-env" in test_cmd else [])]
    update: dict[str, Any] = {
        "requirements": [*recipe.requirements, *extra],
        # tox 3 passes a variable to its commands only when tox.ini or this names it.
        "env": {
            "PYTEST_ADDOPTS": "-rA",
            "MINISANDBOX_PYTEST_ADDOPTS": "-rA",  # for tox.ini's own PYTEST_ADDOPTS (above)
            "TOX_TESTENV_PASSENV": "PYTEST_ADDOPTS MINISANDBOX_PYTEST_ADDOPTS",
            **recipe.env,
        },
    }
    env = _TOX_ENV.search(test_cmd)
    if recipe.python is None and env is not None:
        update["python"] = f"{env[1]}.{env[2]}"
        why = f"the tox environment the test command names (py{env[1]}{env[2]})"
        update["inferred"] = {**recipe.inferred, "python": f"{update['python']}: {why}"}
    return recipe.model_copy(update=update), [_TOX_ADDOPTS_PTH]


def _log_parser(record: dict[str, Any], repo: str, where: Where) -> str:
    name = text(record, "log_parser", where)
    if name:
        return name.removeprefix("parse_log_")
    return _LOG_PARSER_BY_REPO.get(repo, "pytest")
