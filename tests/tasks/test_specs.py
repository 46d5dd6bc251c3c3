"""Task model and loaders, on the real SWE-bench Verified data and on files the tests write."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from minisandbox.errors import MiniSandboxError
from minisandbox.tasks.loaders import (
    CONDA_TO_PYPI,
    MissingDependencyError,
    TaskFormatError,
    TaskNotFoundError,
    conda_env_to_recipe,
    conda_only_packages,
    load_tasks,
    parse_eval_script,
)
from minisandbox.tasks.patches import reverse_patch
from minisandbox.tasks.specs import (
    EnvRecipe,
    Task,
    files_in_patch,
    path_name_problem,
    task_id_problem,
)

yaml = pytest.importorskip("yaml")

HERE = Path(__file__).resolve().parents[1]  # tests/

# SWE-bench Verified as a directory holding `verified-test.parquet` (the dataset's test split)
# and `envs/<instance_id>.yml` (swebench 4.1's per-instance conda exports). Without it, the tests
# of single instances use two real records kept in tests/data; those over all 500 skip.
FULL = Path(os.environ.get("SWEBENCH_DATA_DIR", "swebench-data-not-given"))
DATA = FULL if (FULL / "verified-test.parquet").is_file() else HERE / "data" / "swebench-sample"
VERIFIED = DATA / "verified-test.parquet"
ENVS = DATA / "envs"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "task-format.md"

needs_data = pytest.mark.skipif(
    DATA != FULL,
    reason="all 500 instances: set SWEBENCH_DATA_DIR to a directory with verified-test.parquet "
    "and envs/",
)

TEST_PATCH = """\
diff --git a/tests/test_mod.py b/tests/test_mod.py
--- a/tests/test_mod.py
+++ b/tests/test_mod.py
@@ -1,2 +1,3 @@
 def test_a():
     assert True
+-- not a header: this added line starts with two dashes
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1,2 @@
+def test_b():
+    assert 1
diff --git a/tests/old_data.txt b/tests/old_data.txt
deleted file mode 100644
--- a/tests/old_data.txt
+++ /dev/null
@@ -1 +0,0 @@
-x
"""

GOLD_PATCH = """\
diff --git a/mod.py b/mod.py
--- a/mod.py
+++ b/mod.py
@@ -1 +1 @@
-VALUE = 1
+VALUE = 2
"""


# ------------------------------------------------------------------------------ Verified data


@pytest.fixture(scope="module")
def verified() -> dict[str, Task]:
    pytest.importorskip("pyarrow")
    tasks = load_tasks(VERIFIED, envs_dir=ENVS)
    return {t.id: t for t in tasks}


@needs_data
def test_all_verified_instances_parse(verified: dict[str, Task]) -> None:
    assert len(verified) == 500
    for task in verified.values():
        assert task.fail_to_pass, task.id
        assert task.test_cmd.strip(), task.id
        assert task.test_files, task.id
        assert task.source == str(VERIFIED)
        assert task.eval_script and task.image
        assert re.fullmatch(r"3\.\d+\.\d+", task.env.python), task.id
    # Instances with the same exported environment and environment commit share one layer.
    keys = {t.environment_key(t.env.python) for t in verified.values()}
    origins = {
        (t.env.key(t.env.python), t.repo, t.environment_setup_commit) for t in verified.values()
    }
    assert len(keys) == len(origins) and 1 < len(keys) < len(verified) / 4


def test_verified_requests_instance(verified: dict[str, Task]) -> None:
    task = verified["psf__requests-2317"]
    assert task.repo == "psf/requests"
    assert task.base_commit == "091991be0da19de9108dbe5e3752917fea3d7fdc"
    assert task.version == "2.4"
    assert task.env.python == "3.9.20"
    assert "pytest==7.4.4" in task.env.requirements
    assert task.test_cmd == "pytest -rA test_requests.py"
    assert task.test_files == ["test_requests.py"]
    assert task.log_parser == "requests"
    assert "test_requests.py::TestTimeout::test_encoded_methods" in task.fail_to_pass
    assert "test_requests.py::RequestsTestCase::test_BASICAUTH_TUPLE_HTTP_200_OK_GET" in (
        task.pass_to_pass
    )
    assert task.gold_patch.startswith("diff --git a/requests/sessions.py")
    assert "builtin_str" in task.problem_statement
    assert task.image == "swebench/sweb.eval.x86_64.psf_1776_requests-2317:latest"


def test_verified_django_instance(verified: dict[str, Task]) -> None:
    task = verified["django__django-11099"]
    assert task.repo == "django/django"
    assert task.version == "3.0"
    assert task.env.python.startswith("3.6.")
    assert task.test_cmd == (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
        "auth_tests.test_validators"
    )
    assert task.log_parser == "django"
    assert task.fail_to_pass[0] == (
        "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"
    )
    # The eval script's preamble exports become environment variables; its locale-gen is dropped.
    assert task.env.env["LANG"] == "en_US.UTF-8"
    assert any("locale-gen" in s for s in task.env.skipped)


@needs_data
def test_verified_test_command_rule() -> None:
    """Every Verified eval script yields a test command by the marker rule, and it is the line
    swebench ran."""
    pa = pytest.importorskip("pyarrow.parquet")
    for row in pa.read_table(VERIFIED).to_pylist():
        parts = parse_eval_script(row["eval_script"])
        lines = row["eval_script"].splitlines()
        start = lines.index(": '>>>>> Start Test Output'")
        assert parts.test_cmd == lines[start + 1]
        assert parts.install and parts.install[0].startswith("python")


def test_instance_ids_filter(verified: dict[str, Task]) -> None:
    wanted = ["django__django-11099", "psf__requests-2317"]
    tasks = load_tasks(VERIFIED, envs_dir=ENVS, instance_ids=wanted)
    assert sorted(t.id for t in tasks) == wanted
    assert tasks[0] == verified[tasks[0].id]
    with pytest.raises(TaskNotFoundError, match=r"nope__nope-1.*|.*nope__nope-1") as info:
        load_tasks(VERIFIED, envs_dir=ENVS, instance_ids=["psf__requests-2317", "nope__nope-1"])
    assert "psf__requests-2317" not in str(info.value)
    assert isinstance(info.value, MiniSandboxError)
    assert info.value.missing == ["nope__nope-1"]
    assert info.value.source == str(VERIFIED)


def test_not_found_lists_every_missing_id() -> None:
    """The message shows 20 ids; `missing` holds them all, sorted."""
    wanted = [f"nope__nope-{n:02d}" for n in range(25)]
    with pytest.raises(TaskNotFoundError, match="and 5 more") as info:
        load_tasks("examples", instance_ids=wanted)
    assert info.value.missing == sorted(wanted)
    assert info.value.source == "examples"


def test_verified_without_envs_dir_takes_the_shipped_spec() -> None:
    """Without its export a record gets the recipe of swebench 4.1.0's spec, which ships with
    the package (whichever swebench is installed)."""
    tasks = load_tasks(VERIFIED, instance_ids=["psf__requests-2317"])
    assert tasks[0].install == ["python -m pip install ."]
    assert tasks[0].env.python == "3.9" and "pip==24.2" in tasks[0].env.requirements


# ------------------------------------------------------------------------------ conda exports


def _read_export(path: Path) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Python version, conda (name, version) pairs and pip entries of an export, read
    independently of the loader."""
    text = path.read_text()
    python = re.search(r"^  - python=([0-9.]+)=", text, re.M)
    assert python
    conda = re.findall(r"^  - ([^=\s]+)=([^=\s]+)=\S+$", text, re.M)
    pip = re.findall(r"^      - (\S+)$", text, re.M)
    return python.group(1), conda, pip


SYSTEM_NAMES = set(
    [
        "python",
        "openssl",
        "ncurses",
        "libgcc-ng",
        "tk",
        "xz",
        "zlib",
        "readline",
        "sqlite",
        "libffi",
        "ca-certificates",
        "_libgcc_mutex",
        "ld_impl_linux-64",
    ]
)


def _dropped(conda: list[tuple[str, str]], pip: list[str]) -> set[str]:
    """Pins of the conda-only packages that no kept package (renamed, or from pip) also gives."""
    skip = conda_only_packages()
    kept = {f"{CONDA_TO_PYPI.get(n, n)}=={v}" for n, v in conda if n not in skip} | set(pip)
    return {f"{n}=={v}" for n, v in conda if n in skip} - kept


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[=<>!~ ;\[]", r, maxsplit=1)[0].lower() for r in requirements}


@pytest.mark.parametrize(
    "instance",
    [
        "psf__requests-2317",
        "pytest-dev__pytest-10051",
        "pallets__flask-5014",
        "django__django-11099",
        "matplotlib__matplotlib-23314",
        "pydata__xarray-4094",
    ],
)
def test_conda_env_to_recipe(instance: str) -> None:
    path = ENVS / f"{instance}.yml"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in the sample: set SWEBENCH_DATA_DIR for all exports")
    recipe = conda_env_to_recipe(path)
    python, conda, pip_entries = _read_export(path)
    assert recipe.python == python
    assert not _names(recipe.requirements) & SYSTEM_NAMES
    assert not _dropped(conda, pip_entries) & set(recipe.requirements)
    for name, version in conda:
        if name in conda_only_packages():
            assert any(s.startswith(f"{name}={version}=") for s in recipe.skipped)
    for entry in pip_entries:
        assert entry in recipe.requirements
    assert any("openssl" in s for s in recipe.skipped)


@needs_data
def test_every_verified_export_converts_to_pins() -> None:
    for path in sorted(ENVS.glob("*.yml")):
        recipe = conda_env_to_recipe(path)
        _, conda, pip = _read_export(path)
        assert not _dropped(conda, pip) & set(recipe.requirements), path.name
        assert not _names(recipe.requirements) & SYSTEM_NAMES, path.name
        seen = set()
        for req in recipe.requirements:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", req)
            assert m, (path.name, req)
            key = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            assert key not in seen, (path.name, req)  # one pin per distribution
            seen.add(key)


def test_conda_rules_on_a_written_export(tmp_path: Path) -> None:
    path = tmp_path / "env.yml"
    path.write_text(
        """\
name: testbed
channels: [defaults]
dependencies:
  - python=3.10.14=h955ad1f_1
  - openssl=3.0.15=h5eee18b_0
  - matplotlib=3.9.2=py310h06a4308_1
  - matplotlib-base=3.9.2=py310h68603db_1
  - msgpack-python=1.1.0=py310h3788b33_0
  - numpy=1.26.4=py310h5f9d8c6_0
  - tzdata=2024b=h04d1e81_0
  - conda-forge::six=1.16.0=pyh6c4a22f_0
  - pip:
      - numpy==1.25.2
      - --extra-index-url https://example.invalid/simple
variables:
  MPLBACKEND: agg
prefix: /opt/miniconda3/envs/testbed
"""
    )
    recipe = conda_env_to_recipe(path)
    assert recipe.python == "3.10.14"
    expected = ["matplotlib==3.9.2", "msgpack==1.1.0", "six==1.16.0", "numpy==1.25.2"]
    assert recipe.requirements == expected
    assert recipe.pip_options == ["--extra-index-url https://example.invalid/simple"]
    assert recipe.env == {"MPLBACKEND": "agg"}
    assert any(s.startswith("conda numpy==1.26.4: overridden by pip") for s in recipe.skipped)
    assert any(s.startswith("openssl=") for s in recipe.skipped)
    assert any(s.startswith("tzdata=") for s in recipe.skipped)


def test_conda_export_without_python(tmp_path: Path) -> None:
    path = tmp_path / "env.yml"
    path.write_text("dependencies:\n  - six=1.16.0=py_0\n")
    with pytest.raises(TaskFormatError, match=r"env\.yml.*'dependencies'.*python"):
        conda_env_to_recipe(path)


# ------------------------------------------------------------------------------ recipe keys


def test_keys_equal_for_identical_recipes() -> None:
    a = EnvRecipe(
        python="3.9",
        requirements=["numpy==1.26.4", "six==1.16.0; python_version > '3'"],
        env={"A": "1", "B": "2"},
        skipped=["openssl"],
    )
    b = EnvRecipe(
        python="3.9.18",
        requirements=[" numpy==1.26.4 ", "six==1.16.0;  python_version > '3'"],
        env={"B": "2", "A": "1"},
    )
    assert len(a.key("3.9.18")) == 64
    assert a.key("3.9.18") == b.key("3.9.18")


def test_keys_differ_otherwise() -> None:
    base = EnvRecipe(python="3.9", requirements=["numpy==1.26.4", "six==1.16.0"])
    variants = [
        base.model_copy(update={"requirements": ["six==1.16.0", "numpy==1.26.4"]}),
        base.model_copy(update={"requirements": ["numpy==1.26.3", "six==1.16.0"]}),
        base.model_copy(update={"pip_options": ["--no-build-isolation"]}),
        base.model_copy(update={"env": {"LANG": "C.UTF-8"}}),
    ]
    keys = {base.key("3.9.18"), *(v.key("3.9.18") for v in variants), base.key("3.9.17")}
    assert len(keys) == 6
    with pytest.raises(ValueError, match=r"3\.10\.1"):
        base.key("3.10.1")


def test_recipe_validation() -> None:
    with pytest.raises(ValueError, match="not a Python version"):
        EnvRecipe(python="three")
    with pytest.raises(ValueError, match="environment variable"):
        EnvRecipe(python="3.9", env={"BAD-NAME": "x"})
    with pytest.raises(ValueError, match="extra"):
        EnvRecipe(python="3.9", requirement=["x"])  # type: ignore[call-arg]


# ------------------------------------------------------------------------------ our task file


def _task_file(tmp_path: Path) -> Path:
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "gold.diff").write_text(GOLD_PATCH)
    (tmp_path / "patches" / "test.diff").write_text(TEST_PATCH)
    path = tmp_path / "tasks.yaml"
    path.write_text(
        """\
tasks:
  - id: demo-1
    repo: example/demo
    base_commit: 0123456789abcdef0123456789abcdef01234567
    env:
      python: "3.11"
      requirements: [pytest==8.3.3]
      env: {LANG: C.UTF-8}
    install: [python -m pip install -e .]
    test_cmd: pytest -rA tests/test_mod.py
    gold_patch_file: patches/gold.diff
    test_patch_file: patches/test.diff
    fail_to_pass: [tests/test_mod.py::test_a]
    problem_statement: VALUE should be 2.
  - id: demo-2
    repo: example/demo
    base_commit: abcdef0
    env: {python: "3.11", requirements: [pytest==8.3.3], env: {LANG: C.UTF-8}}
    test_cmd: pytest
"""
    )
    return path


def test_yaml_task_file_round_trip(tmp_path: Path) -> None:
    path = _task_file(tmp_path)
    first, second = load_tasks(path)
    assert first.gold_patch == GOLD_PATCH
    assert first.test_patch == TEST_PATCH
    assert first.test_files == ["tests/test_mod.py", "tests/test_new.py", "tests/old_data.txt"]
    assert first.source == str(path)
    assert first.install == ["python -m pip install -e ."]
    assert first.environment_key("3.11.7") == second.environment_key("3.11.7")

    dumped = {"tasks": [t.model_dump(mode="json", exclude={"source"}) for t in (first, second)]}
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(dumped, sort_keys=False))
    reloaded = load_tasks(again)
    as_json = tmp_path / "again.json"
    as_json.write_text(json.dumps(dumped))
    for other in (reloaded, load_tasks(as_json)):
        assert [t.model_copy(update={"source": ""}) for t in other] == [
            t.model_copy(update={"source": ""}) for t in (first, second)
        ]


def test_task_file_env_as_conda_export(tmp_path: Path) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "e.yml").write_text(
        "dependencies:\n  - python=3.9.20=he870216_1\n  - zlib=1.2.13=h5eee18b_1\n"
        "  - pip:\n      - six==1.16.0\n"
    )
    path = tmp_path / "t.yml"
    path.write_text(
        "tasks:\n  - {id: a, repo: o/r, base_commit: abcdef0, env: envs/e.yml, test_cmd: pytest}\n"
    )
    (task,) = load_tasks(path, instance_ids=["a"])
    assert task.env.python == "3.9.20"
    assert task.env.requirements == ["six==1.16.0"]


def test_docs_example_loads(tmp_path: Path) -> None:
    """The complete example in docs/task-format.md is a valid task file."""
    example = re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert example
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "requests-2317.gold.diff").write_text(GOLD_PATCH)
    (tmp_path / "patches" / "requests-2317.test.diff").write_text(TEST_PATCH)
    (tmp_path / "envs").mkdir()
    env_file = ENVS / "django__django-11099.yml"
    if env_file.is_file():
        shutil.copy(env_file, tmp_path / "envs" / env_file.name)
    else:
        (tmp_path / "envs" / env_file.name).write_text("dependencies:\n  - python=3.6.13=h1\n")
    path = tmp_path / "tasks.yaml"
    path.write_text(example.group(1))
    requests_task, django_task = load_tasks(path)
    assert requests_task.env.python == "3.9"
    assert requests_task.gold_patch == GOLD_PATCH
    assert django_task.env.python.startswith("3.6")


# ------------------------------------------------------------------------------ SWE-smith


def _swesmith_records() -> list[dict[str, object]]:
    return [
        {
            "instance_id": "oauthlib__oauthlib.1fd52536.combine_file__abcd1234",
            "repo": "swesmith/oauthlib__oauthlib.1fd52536",
            "patch": GOLD_PATCH,
            "FAIL_TO_PASS": ["tests/test_a.py::test_x"],
            "PASS_TO_PASS": ["tests/test_a.py::test_y"],
            "image_name": "swebench/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
            "problem_statement": "Tokens are rejected.",
            "environment": {"python": "3.10", "requirements": ["blinker==1.8.2"]},
        },
        {
            "instance_id": "oauthlib__oauthlib.1fd52536.func_pm_op__efgh5678",
            "repo": "oauthlib__oauthlib.1fd52536",
            "patch": GOLD_PATCH,
            "FAIL_TO_PASS": json.dumps(["tests/test_b.py::test_z"]),
            "PASS_TO_PASS": [],
            "image_name": "swebench/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
            "test_cmd": "pytest -rA",
        },
    ]


def test_swesmith_jsonl(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "oauthlib__oauthlib.1fd52536.yml").write_text(
        "dependencies:\n  - python=3.10.15=h1\n  - ncurses=6.4=h6a678d5_0\n"
        "  - pip:\n      - cryptography==43.0.1\n"
    )
    path = tmp_path / "smith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _swesmith_records()))
    first, second = load_tasks(path, envs_dir=envs)
    for task in (first, second):
        assert task.repo == "oauthlib/oauthlib"
        assert task.base_commit == "1fd52536"
        assert task.bug_patch == GOLD_PATCH
        assert task.gold_patch == reverse_patch(GOLD_PATCH) and task.test_patch == ""
        assert task.image == "swebench/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536"
        assert task.install == ["python -m pip install -e ."]
    assert first.env.requirements == ["blinker==1.8.2"]
    assert first.test_cmd.startswith("pytest")
    assert first.pass_to_pass == ["tests/test_a.py::test_y"]
    assert second.env.python == "3.10.15"
    assert second.env.requirements == ["cryptography==43.0.1"]
    assert second.fail_to_pass == ["tests/test_b.py::test_z"]
    assert second.test_cmd == "pytest -rA"

    # Without envs_dir, the second record has no environment: SWE-smith's profile gives it
    # (tests/tasks/test_swesmith_profiles.py), unless the repo names none.
    records = _swesmith_records()
    records[1] |= {"repo": "oauthlib/oauthlib", "base_commit": "1fd52536"}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(TaskFormatError, match=r"record 1 .*field 'environment'"):
        load_tasks(path)


# ------------------------------------------------------------------------------ malformed input


def _swebench_record(**changes: object) -> dict[str, object]:
    record: dict[str, object] = {
        "instance_id": "example__demo-1",
        "repo": "example/demo",
        "base_commit": "0123456789abcdef0123456789abcdef01234567",
        "patch": GOLD_PATCH,
        "test_patch": TEST_PATCH,
        "problem_statement": "VALUE should be 2.",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_mod.py::test_a"]),
        "PASS_TO_PASS": "[]",
        "eval_script": "cd /testbed\n: '>>>>> Start Test Output'\npytest -rA tests\n"
        ": '>>>>> End Test Output'\n",
    }
    record.update(changes)
    return {k: v for k, v in record.items() if v is not None}


@pytest.fixture
def demo_envs(tmp_path: Path) -> Path:
    envs = tmp_path / "envs"
    envs.mkdir()
    for n in range(1, 4):
        (envs / f"example__demo-{n}.yml").write_text("dependencies:\n  - python=3.11.7=h1\n")
    return envs


def _write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_swebench_jsonl_and_json(tmp_path: Path, demo_envs: Path) -> None:
    records = [_swebench_record(), _swebench_record(instance_id="example__demo-2")]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", records)
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(records))
    for path in (jsonl, as_json):
        tasks = load_tasks(path, envs_dir=demo_envs)
        assert [t.id for t in tasks] == ["example__demo-1", "example__demo-2"]
        assert tasks[0].test_cmd == "pytest -rA tests"
        assert tasks[0].fail_to_pass == ["tests/test_mod.py::test_a"]
        assert tasks[0].log_parser == "pytest"


def test_missing_field_names_file_record_field(tmp_path: Path, demo_envs: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [_swebench_record(), _swebench_record(instance_id="example__demo-2", base_commit=None)],
    )
    with pytest.raises(TaskFormatError) as info:
        load_tasks(path, envs_dir=demo_envs)
    message = str(info.value)
    assert str(path) in message and "record 1" in message and "line 2" in message
    assert "example__demo-2" in message and "'base_commit'" in message
    assert info.value.field == "base_commit" and info.value.index == 1


def test_bad_commit_names_file_record_field(tmp_path: Path, demo_envs: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl", [_swebench_record(instance_id="example__demo-3", base_commit="xyz")]
    )
    with pytest.raises(TaskFormatError) as info:
        load_tasks(path, envs_dir=demo_envs)
    message = str(info.value)
    assert str(path) in message and "record 0" in message and "example__demo-3" in message
    assert "'base_commit'" in message and "commit hash" in message


def test_bad_json_line(tmp_path: Path, demo_envs: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_swebench_record()) + "\n\n{not json\n")
    with pytest.raises(TaskFormatError) as info:
        load_tasks(path, envs_dir=demo_envs)
    message = str(info.value)
    assert str(path) in message and "record 1" in message and "line 3" in message
    assert "not valid JSON" in message


def test_bad_fail_to_pass_encoding(tmp_path: Path, demo_envs: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [_swebench_record(FAIL_TO_PASS="[not json")])
    with pytest.raises(TaskFormatError, match=r"record 0 .*field 'FAIL_TO_PASS'"):
        load_tasks(path, envs_dir=demo_envs)


def test_task_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    cases = {
        "- {id: a, repo: o/r, base_commit: abcdef0, env: {python: '3.9'}}": "'test_cmd': missing",
        "- {id: a, repo: o/r, base_commit: abcdef0, env: {python: x}, test_cmd: t}": "'env.python'",
        "- {id: a, repo: r, base_commit: abcdef0, env: {python: '3.9'}, test_cmd: t}": "'repo'",
        "- {id: a, repo: o/r, base_commit: abcdef0, env: {python: '3.9'}, test_cmd: t, x: 1}": (
            "'x': unknown field"
        ),
        "- {id: a, repo: o/r, base_commit: abcdef0, env: {python: '3.9'}, test_cmd: t, "
        "gold_patch_file: nope.diff}": "'gold_patch_file': no such file",
    }
    for body, expected in cases.items():
        path.write_text("tasks:\n  " + body + "\n")
        with pytest.raises(TaskFormatError) as info:
            load_tasks(path)
        assert str(path) in str(info.value) and "record 0 (id 'a')" in str(info.value)
        assert expected in str(info.value)
    path.write_text("tasks: [\n")
    with pytest.raises(TaskFormatError, match="not valid YAML"):
        load_tasks(path)
    path.write_text("task: []\n")
    with pytest.raises(TaskFormatError, match="'tasks'"):
        load_tasks(path)


def test_duplicate_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    entry = "- {id: a, repo: o/r, base_commit: abcdef0, env: {python: '3.9'}, test_cmd: t}"
    path.write_text(f"tasks:\n  {entry}\n  {entry}\n")
    with pytest.raises(TaskFormatError, match=r"task 1 .*duplicate"):
        load_tasks(path)


def test_unknown_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.parquet")
    with pytest.raises(TaskFormatError, match="not a Hugging Face dataset name"):
        load_tasks("no-such-thing")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="pip install datasets"):
            load_tasks("princeton-nlp/SWE-bench_Verified")


def test_errors_are_specific() -> None:
    from minisandbox.tasks import loaders

    for name in loaders.__all__:
        value = getattr(loaders, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, MiniSandboxError) and value is not MiniSandboxError, name
    with pytest.raises(loaders.VersionSpecError, match="not a version comparison"):
        loaders.version_matches("1.0", ">=x")
    assert issubclass(loaders.VersionSpecError, ValueError)


def test_ids_that_are_not_strings_are_never_wanted(tmp_path: Path, demo_envs: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [_swebench_record(instance_id=["x"])])
    assert load_tasks(path, envs_dir=demo_envs, instance_ids=[]) == []
    with pytest.raises(TaskFormatError, match="'instance_id': expected a string"):
        load_tasks(path, envs_dir=demo_envs)


def test_swesmith_commands_must_be_commands(tmp_path: Path) -> None:
    record = {**_swesmith_records()[0], "install": 5}
    path = _write_jsonl(tmp_path / "smith.jsonl", [record])
    with pytest.raises(TaskFormatError, match=r"record 0 .*field 'install': expected a command"):
        load_tasks(path)


# ------------------------------------------------------------------------------ helpers


def test_files_in_patch() -> None:
    assert files_in_patch(TEST_PATCH) == [
        "tests/test_mod.py",
        "tests/test_new.py",
        "tests/old_data.txt",
    ]
    assert files_in_patch("") == []


def test_eval_script_without_markers() -> None:
    script = """\
#!/bin/bash
set -uxo pipefail
cd /testbed
export LANG=en_US.UTF-8
git config --global --add safe.directory /testbed
source /opt/miniconda3/bin/activate
conda activate testbed
python -m pip install -e .
git checkout abc1234 tests/test_x.py
git apply -v - <<'EOF_1'
diff --git a/tests/test_x.py b/tests/test_x.py
+pytest -this is patch text
EOF_1
echo running
LC_ALL=C python -m pytest -rA tests/test_x.py
git checkout abc1234 tests/test_x.py
"""
    parts = parse_eval_script(script)
    assert parts.test_cmd == "LC_ALL=C python -m pytest -rA tests/test_x.py"
    assert parts.env == {"LANG": "en_US.UTF-8"}
    assert parts.install == ["python -m pip install -e ."]


# ------------------------------------------------------------------------------ names as paths


def test_path_names() -> None:
    for good in ("a", "examples__datekit-1", "org__model v2", "é", "a" * 200):
        assert path_name_problem(good) is None, good
    for bad, why in {
        "": "empty",
        ".": "'.'",
        "..": "'..'",
        "a/b": "'/'",
        "a\n": "control character",
        "a\x00b": "control character",
        "a\x1bb": "control character",
        "a\u2028b": "control character",  # a line break to str.splitlines
        "a" * 201: "longer than 200 bytes",
    }.items():
        problem = path_name_problem(bad)
        assert problem is not None and why in problem, (bad, problem)
    assert task_id_problem("psf__requests-2317") is None
    for bad in ("x\n", "../x", ".x", "-x", "a b", ""):
        assert task_id_problem(bad) is not None, bad


def test_names_with_a_trailing_newline_are_refused() -> None:
    """`$` in a regex matches before a final newline: every name check is a full match."""
    base = {
        "id": "a",
        "repo": "o/r",
        "base_commit": "abcdef0",
        "env": {"python": "3.9"},
        "test_cmd": "t",
    }
    Task.model_validate(base)
    for field, value in {"id": "a\n", "repo": "o/r\n"}.items():
        with pytest.raises(ValueError, match=field):
            Task.model_validate({**base, field: value})
    with pytest.raises(ValueError, match="environment variable"):
        EnvRecipe(python="3.9", env={"X\n": "1"})


def test_record_paths_stay_in_the_dataset_unless_allowed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.yml"
    outside.write_text("dependencies:\n  - python=3.8.1=h1\n")
    data = tmp_path / "data"
    data.mkdir()
    row = {
        "instance_id": "o__r.abcdef0.x__1",
        "repo": "o__r.abcdef0",
        "patch": "diff --git a/x b/x\n",
        "FAIL_TO_PASS": [],
        "environment": str(outside),
    }
    path = _write_jsonl(data / "d.jsonl", [row])
    with pytest.raises(TaskFormatError, match=r"record 0 .*field 'environment'.*--allow-abs"):
        load_tasks(path)
    (task,) = load_tasks(path, allow_absolute_paths=True)
    assert task.env.python == "3.8.1"
