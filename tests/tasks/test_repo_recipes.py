"""Recipes taken from a repository (tasks.repo_recipes): swebench's `packages: requirements.txt`
and `environment.yml`, and recipes inferred for repositories nobody described; the spec table
shipped as data; a spec-less task built and graded for real."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minisandbox.envs.asof import exclude_newer
from minisandbox.envs.recipe import EnvRecipe, FromRepository
from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.loaders.swebench_records import _TOX_ADDOPTS_PTH
from minisandbox.tasks.loaders.swebench_specs import (
    HARNESS_AS_OF,
    harness_seed,
    swebench_spec,
)
from minisandbox.tasks.repo_recipes import (
    RecipeResolveError,
    RepoTree,
    infer_python,
    infer_requirements,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]


def tree(files: dict[str, str], date: str | None = "2022-06-01T00:00:00Z") -> RepoTree:
    blobs = {path: len(text.encode()) for path, text in files.items()}
    return RepoTree(blobs, lambda path: files[path], date)


# ---------------------------------------------------------------- requirements files


def test_a_requirements_file_is_read_as_the_harness_read_it() -> None:
    files = {
        "requirements/dev.txt": (
            "# pinned by pip-compile\n"
            "-r tests.txt\n"
            "-e .\n"
            ".[test]\n"
            "--index-url https://example.invalid/simple\n"
            "-c constraints.txt\n"
            "Werkzeug==2.0.0  # via flask\n"
            "sphinx==4.0.0 \\\n"
            "    ; python_version >= '3.6'\n"
        ),
        "requirements/tests.txt": "pytest==6.2.4\n-r ../../outside.txt\n",
    }
    recipe = EnvRecipe(
        python="3.9",
        requirements=["Werkzeug==2.3.7", "pip==24.2"],
        from_repository=FromRepository(
            requirements_files=["requirements-missing.txt", "requirements/dev.txt"]
        ),
    )
    resolved = resolve(recipe, tree(files))
    assert resolved.resolved and resolved.from_repository is None
    # The file's lines first (its include inlined); a package the recipe pins is the recipe's.
    assert resolved.requirements == [
        "pytest==6.2.4",
        "sphinx==4.0.0 ; python_version >= '3.6'",
        "Werkzeug==2.3.7",
        "pip==24.2",
    ]
    assert resolved.inferred == {"requirements": "requirements/dev.txt"}
    left_out = " | ".join(resolved.skipped)
    for line in ("-e .", ".[test]", "--index-url", "-c constraints.txt", "../../outside.txt"):
        assert line in left_out, left_out
    # The key exists only once resolved.
    assert resolved.key("3.9.18")
    with pytest.raises(ValueError, match="resolve"):
        recipe.key("3.9.18")


def test_a_recipe_naming_files_the_repository_lacks_is_an_error() -> None:
    recipe = EnvRecipe(
        python="3.9", from_repository=FromRepository(requirements_files=["requirements.txt"])
    )
    with pytest.raises(RecipeResolveError, match=r"requirements\.txt"):
        resolve(recipe, tree({"setup.py": ""}))
    # A link in the tree is not a file here (RepoTree knows regular files only).
    with pytest.raises(RecipeResolveError):
        resolve(recipe, RepoTree({}, lambda p: "pytest\n", None))


def test_a_conda_environment_file_becomes_pip_requirements() -> None:
    files = {
        "ci/environment.yml": (
            "name: test\nchannels: [conda-forge]\ndependencies:\n"
            "  - python=3.10\n  - numpy=1.23\n  - pandas>=1.4\n  - hdf5\n  - pip\n"
            "  - pip:\n      - pytest-env==0.8.1\n      - -e ..\n"
        )
    }
    recipe = EnvRecipe(
        python="3.10",
        from_repository=FromRepository(environment_files=["environment.yml", "ci/environment.yml"]),
    )
    resolved = resolve(recipe, tree(files))
    assert resolved.requirements == ["numpy==1.23.*", "pandas>=1.4", "pytest-env==0.8.1"]
    assert any("hdf5" in s for s in resolved.skipped)


def test_what_a_hostile_repository_writes_is_bounded_and_never_crashes() -> None:
    """A repository's files are input: includes that include each other, options smuggled
    after a URL, structures where strings belong, an alias bomb, deep nesting."""
    loop = {"a.txt": "-r b.txt\n" * 6 + "six\n", "b.txt": "-r a.txt\n" * 6 + "-r b.txt\n"}
    reads: list[str] = []
    t = tree(loop)
    counted = RepoTree(t.blobs, lambda p: reads.append(p) or loop[p], t.date)
    skipped: list[str] = []
    from minisandbox.tasks.repo_recipes import environment_file, requirements_file

    assert requirements_file(counted, "a.txt", skipped) == ["six"]
    assert len(reads) <= 4, reads  # each file once
    hashed = "attrs==21.2.0 --hash=sha256:abc \\\n    --hash=sha256:def\n"
    url = "https://x.invalid/a.tar.gz#egg=a --index-url https://evil.invalid/simple\n"
    assert requirements_file(tree({"r.txt": hashed + url}), "r.txt", skipped) == ["attrs==21.2.0"]
    spaced = "-r" + " " * 30000 + "a b\n"  # (no regular expression backtracks on it)
    assert requirements_file(tree({"r.txt": spaced}), "r.txt", []) == []
    yml = "dependencies:\n  - pip: 5\n  - 7\n  - numpy 1.19\n  - pip:\n    - [nested]\n"
    assert environment_file(yml, []) == ["numpy==1.19.*"]
    bomb = (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefg", "bcdefgh", strict=True)
        )
        + "dependencies: [*h, *h]\n"
    )
    assert environment_file(bomb, []) == []
    odd = {
        "pyproject.toml": "[project]\nclassifiers = 5\noptional-dependencies = {test = 3}\n",
        "setup.py": "x = " + "1+" * 200000 + "1\n",
        "setup.cfg": "[options\n",
    }
    assert resolve(EnvRecipe(python=None, from_repository=FromRepository(infer=True)), tree(odd))
    with pytest.raises(RecipeResolveError, match="YAML"):
        environment_file("[" * 100000, [])


def test_markers_keep_both_pins_of_one_package() -> None:
    text = "numpy<1.17; python_version < '3.5'\nnumpy>=1.17; python_version >= '3.5'\nnumpy\n"
    recipe = EnvRecipe(python="3.9", from_repository=FromRepository(requirements_files=["r.txt"]))
    got = resolve(recipe, tree({"r.txt": text})).requirements
    assert got == [
        "numpy<1.17; python_version < '3.5'",
        "numpy>=1.17; python_version >= '3.5'",
        "numpy",
    ]


# ---------------------------------------------------------------- inference


def test_python_is_the_newest_claimed_that_the_commit_could_use() -> None:
    setup_py = (
        "setup(name='x', python_requires='>=3.6',\n"
        "      classifiers=['Programming Language :: Python :: 3.6',\n"
        "                   'Programming Language :: Python :: 3.7',\n"
        "                   'Programming Language :: Python :: 3.8'])\n"
    )
    # In mid-2019 3.8 was not out: 3.7. Two years later: 3.8, the newest claimed.
    assert infer_python(tree({"setup.py": setup_py}, "2019-06-01"))[0] == "3.7"
    assert infer_python(tree({"setup.py": setup_py}, "2021-06-01"))[0] == "3.8"
    # python_requires excludes what classifiers claim.
    narrowed = setup_py.replace(">=3.6", ">=3.6,<3.8")
    assert infer_python(tree({"setup.py": narrowed}, "2021-06-01"))[0] == "3.7"
    # tox and CI files count as claims too.
    tox = "[tox]\nenvlist = py37,py39,docs\n"
    assert infer_python(tree({"tox.ini": tox}, "2022-01-01"))[0] == "3.9"
    braces = "[tox]\nenvlist = py{36,37,38}-django{22,30}, py3.9\n"
    assert infer_python(tree({"tox.ini": braces}, "2019-09-01"))[0] == "3.7"
    assert infer_python(tree({"tox.ini": braces}, "2021-06-01"))[0] == "3.9"
    ci = ".github/workflows/tests.yml"
    workflow = (
        "jobs:\n  t:\n    strategy:\n      matrix:\n        python-version: ['3.8', '3.10']\n"
    )
    assert infer_python(tree({ci: workflow}, "2022-06-01"))[0] == "3.10"
    # A claimed version counts once released (flask 2.3's TOML tests need 3.11, then 6 months
    # old); one released after the commit does not (a CI's "3.11-dev" before 3.11.0).
    newest = workflow.replace("'3.10'", "'3.11'")
    assert infer_python(tree({ci: newest}, "2023-04-13"))[0] == "3.11"
    assert infer_python(tree({ci: newest}, "2022-10-01"))[0] == "3.8"
    # A patch release in python_requires allows its minor.
    patch = setup_py.replace(">=3.6", ">=3.6.1")
    assert infer_python(tree({"setup.py": patch}, "2018-03-01"))[0] == "3.6"
    compatible = '[project]\nrequires-python = "~=3.7.2"\n'
    assert infer_python(tree({"pyproject.toml": compatible}, "2021-01-01"))[0] == "3.7"
    # Nothing claimed: the newest Python out six months before the commit.
    assert infer_python(tree({}, "2024-01-01"))[0] == "3.11"
    # Older than every Python known here: the oldest the repository allows.
    assert infer_python(tree({}, "2014-07-01"))[0] == "3.6"
    with pytest.raises(RecipeResolveError, match="python"):
        infer_python(tree({"pyproject.toml": '[project]\nrequires-python = ">=4"\n'}))


def test_test_requirements_come_from_the_first_source_found() -> None:
    extras = "setup(extras_require={'testing': ['hypothesis>=3.56', 'nose'], 'docs': ['x']})\n"
    reqs, where = infer_requirements(tree({"setup.py": extras}), [])
    assert reqs == ["hypothesis>=3.56", "nose", "pytest"] and where == "setup.py [testing] + pytest"
    named = "TESTS = ['pytest>=6', 'mock']\nsetup(extras_require={'test': TESTS})\n"
    assert infer_requirements(tree({"setup.py": named}), [])[0] == ["pytest>=6", "mock"]
    cfg = "[options.extras_require]\ntests =\n    pytest-cov\n"
    assert infer_requirements(tree({"setup.cfg": cfg}), [])[1] == "setup.cfg [tests] + pytest"
    toml = '[project.optional-dependencies]\ntest = ["pytest==7.1"]\n'
    assert infer_requirements(tree({"pyproject.toml": toml}), []) == (
        ["pytest==7.1"],
        "pyproject.toml [test]",
    )
    both = {"setup.py": extras, "requirements-dev.txt": "flake8\n"}
    assert infer_requirements(tree(both), [])[1] == "requirements-dev.txt + pytest"
    # A CI's conda environment file (xarray's): its packages, conda-only ones left out.
    conda = "dependencies:\n  - python=3.8\n  - dask\n  - numpy>=1.17\n  - pip:\n    - pint\n"
    reqs, where = infer_requirements(tree({"ci/requirements/environment.yml": conda}), [])
    assert reqs == ["dask", "numpy>=1.17", "pint", "pytest"], reqs
    assert where == "ci/requirements/environment.yml + pytest"
    broken = {"ci/requirements/environment.yml": "dependencies: [", "req.txt": "six\n"}
    skipped: list[str] = []
    tox_only = "[testenv]\ndeps =\n    mock\n"
    assert infer_requirements(tree({**broken, "tox.ini": tox_only}), skipped)[0] == [
        "mock",
        "pytest",
    ]
    assert skipped and skipped[0].startswith("ci/requirements/environment.yml")
    tox = "[testenv]\ndeps =\n    mock\n    py37: oldthing\n    -r{toxinidir}/req.txt\n"
    reqs, where = infer_requirements(tree({"tox.ini": tox, "req.txt": "six\n"}), [])
    assert reqs == ["mock", "six", "pytest"] and where.startswith("tox.ini")


def test_an_inferred_recipe_is_dated_and_says_why() -> None:
    recipe = EnvRecipe(python=None, from_repository=FromRepository(infer=True))
    resolved = resolve(recipe, tree({"setup.cfg": "[options]\npython_requires = >=3.7\n"}))
    assert resolved.python == "3.10" and resolved.as_of == "2022-06-01T00:00:00Z"
    assert set(resolved.inferred) == {"python", "requirements", "as_of"}
    assert "python_requires '>=3.7'" in resolved.inferred["python"]
    with pytest.raises(ValueError, match="python"):
        EnvRecipe(python=None)
    # A commit older than its Python: resolved as of when that Python had settled.
    old = resolve(recipe, tree({}, "2014-07-01"))
    assert old.python == "3.6" and old.as_of == "2017-06-21T00:00:00Z", old.inferred
    # What the recipe says itself is kept.
    given = EnvRecipe(python="3.8", from_repository=FromRepository(infer=True))
    assert resolve(given, tree({})).python == "3.8"
    # A claimed Python out for weeks: as of the commit still (its CI installed that day).
    ci = {".github/workflows/t.yml": "python-version: ['3.11']\n"}
    young = resolve(recipe, tree(ci, "2023-04-13"))
    assert (young.python, young.as_of) == ("3.11", "2023-04-13T00:00:00Z"), young.inferred
    # Not claimed, only allowed (and none older is): as of six months after its release.
    only = {"pyproject.toml": '[project]\nrequires-python = ">=3.12"\n'}
    allowed = resolve(recipe, tree(only, "2024-01-01"))
    assert (allowed.python, allowed.as_of) == ("3.12", "2024-03-30T00:00:00Z"), allowed.inferred


def test_the_runner_the_test_command_needs_replaces_an_older_pin() -> None:
    """`pytest -rA` needs pytest 4.5: a requests commit of 2014 pinned pytest 2.8, which
    ignores the `A`, and every test read "not run" (SWE-bench Lite's requests, inferred)."""
    source = FromRepository(infer=True, runner=["pytest>=4.5"])
    recipe = EnvRecipe(python="3.6", from_repository=source)
    files = {"requirements-dev.txt": "pytest==2.8.1\npytest-cov==2.1.0\nsix\n"}
    old = resolve(recipe, tree(files, "2014-07-01"))
    assert "pytest==2.8.1" not in old.requirements and "pytest>=4.5" in old.requirements
    assert "pytest-cov==2.1.0" in old.requirements and "six" in old.requirements
    # It and what it depends on as of after its release; everything else as of the commit.
    assert old.as_of == "2016-12-23T00:00:00Z"  # (Python 3.6 came out then)
    assert old.as_of_packages["pytest"] == "2019-06-15T00:00:00Z"
    assert old.as_of_packages["atomicwrites"] == "2022-12-31T00:00:00Z"  # (uploaded again)
    assert "six" in old.as_of_packages and "pytest-cov" not in old.as_of_packages
    assert "replaced by pytest>=4.5" in old.inferred["runner"]
    # What the options say: the package's own date only where it is later.
    options = exclude_newer(old.as_of or "", later=old.as_of_packages)
    assert "pytest=2019-06-15T00:00:00Z" in options and "pytest-cov" not in " ".join(options)
    later = " ".join(exclude_newer("2020-01-01", later=old.as_of_packages))
    assert "pytest=" not in later and "atomicwrites=2022-12-31T00:00:00Z" in later
    # A later commit whose lines give it already: untouched (the same key as without).
    new = resolve(recipe, tree({"requirements-dev.txt": "pytest>=3.0\n"}, "2021-01-01"))
    plain = resolve(
        EnvRecipe(python="3.6", from_repository=FromRepository(infer=True)),
        tree({"requirements-dev.txt": "pytest>=3.0\n"}, "2021-01-01"),
    )
    assert new.key("3.6.15") == plain.key("3.6.15") and "runner" not in new.inferred
    # ... and one that pins an older pytest: replaced, not dated.
    pinned = resolve(recipe, tree({"requirements-dev.txt": "pytest~=3.6\n"}, "2021-01-01"))
    assert "pytest>=4.5" in pinned.requirements and not pinned.as_of_packages
    assert pinned.key("3.6.15") != plain.key("3.6.15")


def test_a_binding_conda_brought_its_library_for_comes_as_of_wheels_that_carry_it() -> None:
    """xarray's CI conda file lists cfgrib: pip's eccodes of 2021 installs without the ecCodes
    library conda brought, and its import raised RuntimeError in every test module (all four
    inferred xarray Lite tasks). From a conda environment file, dated earlier: as of the
    wheels that carry it; from a requirements file, or dated later: untouched."""
    recipe = EnvRecipe(python="3.9", from_repository=FromRepository(infer=True))
    conda = {"ci/requirements/environment.yml": "dependencies:\n  - cfgrib\n  - numpy\n"}
    old = resolve(recipe, tree(conda, "2021-05-04"))
    assert old.as_of_packages == {
        "eccodes": "2024-11-01T00:00:00Z",
        "findlibs": "2024-11-01T00:00:00Z",
    }, old.as_of_packages
    assert resolve(recipe, tree(conda, "2025-01-01")).as_of_packages == {}
    plain = resolve(recipe, tree({"requirements-dev.txt": "cfgrib\n"}, "2021-05-04"))
    assert plain.as_of_packages == {}
    spec = EnvRecipe(
        python="3.9",
        as_of=HARNESS_AS_OF,
        from_repository=FromRepository(environment_files=["ci/requirements/environment.yml"]),
    )
    assert resolve(spec, tree(conda, "2021-05-04")).as_of_packages == {}  # the harness's date


# ---------------------------------------------------------------- the loader


def _record(repo: str, version: str | None, **more: object) -> dict[str, object]:
    test_patch = "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n"
    return {
        "instance_id": f"{repo.replace('/', '__')}-1",
        "repo": repo,
        "base_commit": "a" * 40,
        "patch": "",
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_one"]),
        "PASS_TO_PASS": "[]",
        "version": version,
        "environment_setup_commit": "b" * 40,
        **more,
    }


def test_records_get_recipes_whichever_swebench_is_installed(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    records = [_record("pallets/flask", "2.0"), _record("nobody/described", "1.0")]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    flask, unknown = load_tasks(path)
    # The spec (shipped data): its requirements file, its pins, the harness's pip and dates.
    assert flask.env.python == "3.9" and flask.env.as_of == HARNESS_AS_OF
    assert flask.env.from_repository == FromRepository(requirements_files=["requirements/dev.txt"])
    assert "pip==24.2" in flask.env.requirements and "setuptools==70.0.0" in flask.env.requirements
    assert not any(r.startswith("setuptools==75") for r in flask.env.requirements)
    assert flask.install_as_of == HARNESS_AS_OF  # its `pip install -e .` too, as the image had
    # No spec, no export: inferred from the repository, installed as of the commit, pytest.
    assert unknown.env.python is None and unknown.env.from_repository is not None
    assert unknown.env.from_repository.infer
    assert unknown.install == ["python -m pip install -e ."]
    assert unknown.test_cmd == "pytest -rA tests/test_a.py"
    assert unknown.install_as_of == "commit" and unknown.log_parser == "pytest"
    assert unknown.env.from_repository.runner == ["pytest>=4.5"]  # for its -rA
    path.write_text(json.dumps(_record("pytest-dev/pytest", "0.1")) + "\n")
    (itself,) = load_tasks(path)  # pytest's own repository is its runner
    assert itself.env.from_repository is not None and itself.env.from_repository.runner == []
    # A record whose eval script runs tox (sphinx's): tox and its plugin, on the env's Python.
    script = "#!/bin/bash\n: '>>>>> Start Test Output'\ntox --current-env -epy39 -v -- tests/a.py\n"
    script += ": '>>>>> End Test Output'\n"
    tox = _record("nobody/described", "1.0", instance_id="nobody__described-2", eval_script=script)
    path.write_text(json.dumps(tox) + "\n")
    (task,) = load_tasks(path)
    assert task.env.python == "3.9" and "py39" in task.env.inferred["python"]
    assert task.env.requirements[-2:] == ["tox", "tox-current-env"]
    assert task.env.env["PYTEST_ADDOPTS"] == "-rA"  # the summary the log parser reads
    passed = task.env.env["TOX_TESTENV_PASSENV"].split()  # through any tox.ini
    assert passed == ["PYTEST_ADDOPTS", "MINISANDBOX_PYTEST_ADDOPTS"]
    assert task.install[-1] == _TOX_ADDOPTS_PTH  # and past its own setenv (below)
    for other in ("pytest -c tox.ini tests/a.py", "tox -epy27 -- tests/a.py"):
        plain = {
            **tox,
            "eval_script": script.replace("tox --current-env -epy39 -v -- tests/a.py", other),
        }
        path.write_text(json.dumps(plain) + "\n")
        (task,) = load_tasks(path)
        assert task.env.python is None, other  # not tox's (a file), or no Python 3 named


def test_the_harness_seed_by_python_version() -> None:
    assert harness_seed("3.6") == ["pip==21.2.2", "setuptools==58.0.4", "wheel==0.37.1"]
    assert harness_seed("3.11.7") == ["pip==24.2", "setuptools==75.1.0", "wheel==0.44.0"]
    assert swebench_spec("sympy/sympy", "1.1") is not None
    assert swebench_spec("sympy/sympy", None) is None and swebench_spec("no/repo", "1") is None


def test_the_shipped_spec_table_is_swebench_4_1_0s() -> None:
    if importlib.metadata.version("swebench") != "4.1.0":
        pytest.skip("the table is checked against swebench 4.1.0, which is not installed")
    script = ROOT / "scripts" / "swebench_specs.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, "the shipped table differs: run scripts/swebench_specs.py"


# ---------------------------------------------------------------- built for real


def test_pytest_gets_its_summary_past_a_tox_ini_that_sets_its_own_options(
    settings: BuildSettings, built: list
) -> None:
    """sphinx 3.x's tox.ini sets `PYTEST_ADDOPTS = --color yes`, replacing the `-rA` passed
    on: no PASSED lines, every test "not run" (sphinx-8273 and -8282, inferred). The .pth
    the install step writes puts it back in the interpreter pytest runs in, as tox's setenv
    leaves the environment (here without tox: the variable replaced the same way)."""
    task = load_tasks("examples")[0]
    run = (
        "cd /tmp && printf 'def test_one():\\n    pass\\n' > test_x.py && "
        "PYTEST_ADDOPTS='--color no' MINISANDBOX_PYTEST_ADDOPTS=-rA python -m pytest test_x.py"
    )

    async def go() -> tuple[str, str]:
        async with Builder(settings).sandbox(task) as sb:
            before = await sb.execute(["bash", "-c", run])
            wrote = await sb.execute(["bash", "-c", _TOX_ADDOPTS_PTH])
            assert wrote.exit_code == 0, wrote.output
            after = await sb.execute(["bash", "-c", run])
            return before.stdout, after.stdout

    before, after = asyncio.run(go())
    assert "PASSED test_x.py::test_one" not in before, before  # the control
    assert "PASSED test_x.py::test_one" in after, after


def test_a_task_nobody_described_builds_and_grades(settings: BuildSettings, built: list) -> None:
    """A bundled example with its recipe withheld: Python, requirements and dates inferred
    from its repository, installed as of its commit; gold resolves and the empty patch does
    not; what was inferred is in the build result and the environment layer's metadata."""
    example = load_tasks("examples", instance_ids=["examples__datekit-1"])[0]
    task = example.model_copy(
        update={
            "id": "examples__datekit-inferred",
            "env": EnvRecipe(python=None, from_repository=FromRepository(infer=True)),
            "install": ["python -m pip install -e ."],
            "install_as_of": "commit",
        }
    )
    builder = Builder(settings)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    assert result.inferred["python"].startswith("3.11:"), result.inferred
    assert result.inferred["as_of"].startswith("2024-01-01T00:00:00Z")
    meta = builder.store.meta(result.env_layer or "") or {}
    assert meta["recipe"]["inferred"] == result.inferred
    assert "pytest" in meta["recipe"]["requirements"]
    evaluator = Evaluator(builder)

    async def both() -> tuple:
        return await asyncio.gather(
            evaluator.evaluate(task, task.gold_patch), evaluator.evaluate(task, "")
        )

    gold, empty = asyncio.run(both())
    assert gold.resolved, gold.reason
    assert not empty.resolved and not empty.swebench_resolved

    # The same task as a SWE-bench record of a repository nobody described, through the CLI:
    # `build --json` says what was inferred (the layers are the ones built above).
    from conftest import run_cli

    record = {
        "instance_id": "minisandbox-examples__datekit-9",
        "repo": example.repo,
        "base_commit": example.base_commit,
        "patch": example.gold_patch,
        "test_patch": example.test_patch,
        "FAIL_TO_PASS": example.fail_to_pass,
        "PASS_TO_PASS": example.pass_to_pass,
    }
    records = settings.store.parent / "nobody-described.jsonl"
    records.write_text(json.dumps(record) + "\n")
    where = ["--store", str(settings.store), "--cache", str(settings.cache)]
    r = run_cli("build", str(records), "--json", *where, "--git-mirror", str(settings.git_mirror))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    summary = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert summary["cached"] == [record["instance_id"]], summary
    assert summary["inferred"][record["instance_id"]] == result.inferred
