"""A repository layer can install as of a date (its commit's, by default): pip installs made uv
installs with --exclude-newer, and what was resolved recorded in the layer's metadata."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from minisandbox.envs.asof import install_env, not_before_python, pip_as_of
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task


def test_pip_installs_are_made_uv_installs_as_of_a_date() -> None:
    date = "2024-01-01T01:00:00+01:00"  # given to uv (and pip) as UTC, whatever the host's zone
    as_uv = "pip_install_as_of"
    assert pip_as_of("python -m pip install -e .", date) == f"{as_uv} -e ."
    assert pip_as_of("pip install -e '.[dev]'", date) == f"{as_uv} -e '.[dev]'"
    assert pip_as_of("python3.10 -m pip install x", date) == f"{as_uv} x"
    # Every command of a chain or a script, not only the first.
    chain = "pip install -e . && pip install pytest; cd sub || pip install .\npip3 install y"
    assert pip_as_of(chain, date) == (
        f"{as_uv} -e . && {as_uv} pytest; cd sub || {as_uv} .\n{as_uv} y"
    )
    for other in ("python setup.py develop", "hash -r", "pipx install x", "pip installer"):
        assert pip_as_of(other, date) == other
    for bad in ("yesterday; rm -rf /", "2023-W18-1", "2024-13-01"):
        with pytest.raises(ValueError, match="not an ISO 8601 date"):
            pip_as_of("pip install x", bad)
    # The function: uv as of the date (UTC), into the environment's venv.
    preamble = install_env(date)
    uv = "uv pip install --python /opt/venv/bin/python --exclude-newer 2024-01-01T00:00:00Z"
    assert f'{uv} "$@"' in preamble and "pip_install_as_of() {" in preamble
    # Before setuptools could build editables as uv builds them, setuptools is taken later.
    old = install_env("2021-01-05")
    assert ' --exclude-newer-package setuptools=2022-09-01T00:00:00Z "$@"' in old, old
    # Installers that are not a plain pip install meet the date through the environment.
    assert preamble.startswith(
        "export UV_EXCLUDE_NEWER=2024-01-01T00:00:00Z PIP_UPLOADED_PRIOR_TO=2024-01-01T00:00:00Z\n"
    )


def test_the_date_is_not_before_the_python_the_environment_uses() -> None:
    # addict's SWE-smith commit (January 2021) predates Python 3.10: pytest as of then (6.2.1)
    # does not run on it; a quarter after 3.10.0 came out, pytest 6.2.5 does.
    assert not_before_python("2021-01-05T07:16:38+00:00", "3.10.13") == "2022-01-02T00:00:00Z"
    assert not_before_python("2024-11-28T10:05:53-08:00", "3.10") == "2024-11-28T18:05:53Z"
    assert not_before_python("2021-01-05", "2.7") == "2021-01-05T00:00:00Z"  # (no release known)


def test_install_as_of_must_be_a_date_or_commit() -> None:
    (datekit,) = [t for t in load_tasks("examples") if "datekit" in t.id]
    for bad in ("soon", "2024-13-01", "$(date)"):
        with pytest.raises(ValidationError, match="ISO 8601"):
            Task.model_validate({**datekit.model_dump(), "install_as_of": bad})


async def test_a_repository_layer_installs_as_of_its_commit_and_records_it(
    settings: BuildSettings,
) -> None:
    (datekit,) = [t for t in load_tasks("examples") if "datekit" in t.id]
    # On the example's commit date (2024-01-01) tomli was at 2.0.1 (2.1.0: November 2024) and
    # idna at 3.6 (3.7: April 2024): an install that ignored the date would get later ones.
    # tomli's install is made a uv one; idna's is not a plain pip install, so pip meets the
    # date through its environment.
    task = datekit.model_copy(
        update={
            "id": "examples__datekit-as-of",
            "install": [
                *datekit.install,
                "python -m pip install tomli",
                "PIP_NO_INPUT=1 python -m pip install idna",
            ],
            "install_as_of": "commit",
        }
    )
    builder = Builder(settings)
    result = await builder.build(task)
    assert result.status in ("built", "cached"), result.error
    meta = builder.store.meta(result.task_layer or "") or {}
    assert meta["commit_date"] == "2024-01-01T00:00:00+00:00"
    assert meta["install_as_of"] == "2024-01-01T00:00:00Z"
    assert {"tomli==2.0.1", "idna==3.6"} <= set(meta["resolved"]), meta["resolved"]
    async with builder.sandbox(task) as sb:
        r = await sb.execute("python -c 'import tomli; print(tomli.__version__)'")
    assert r.stdout.strip() == "2.0.1", r.output


async def _datekit_installed_by(
    settings: BuildSettings, name: str, install: list[str], date: str
) -> str:
    """Build datekit with `install` as of `date`; where its sandbox imports datekit from."""
    (datekit,) = [t for t in load_tasks("examples") if "datekit" in t.id]
    task = datekit.model_copy(
        update={"id": f"examples__datekit-{name}", "install": install, "install_as_of": date}
    )
    builder = Builder(settings)
    result = await builder.build(task)
    assert result.status in ("built", "cached"), result.error
    async with builder.sandbox(task) as sb:
        r = await sb.execute("cd / && python -c 'import datekit; print(datekit.__file__)'")
    return r.stdout.strip() or r.output


async def test_an_editable_install_without_a_pep_660_backend_falls_back_as_pip_did(
    settings: BuildSettings,
) -> None:
    """pylint 2.15's build-system table pins `setuptools~=62.6`, which has no build_editable
    hook: uv's isolated editable build fails where pip (the harness's) fell back to
    `setup.py develop` with the environment's setuptools. Dated installs do the same."""
    pin = "sed -i 's/setuptools>=61/setuptools~=62.6/' pyproject.toml"
    install = [pin, "python -m pip install -e ."]
    where = await _datekit_installed_by(settings, "no-pep660", install, "2023-01-22")
    assert where == "/testbed/src/datekit/__init__.py"


async def test_what_uv_cannot_install_as_pip_did_goes_to_the_environments_pip(
    settings: BuildSettings,
) -> None:
    """Spec install commands carry pip-only options (scikit-learn's `--no-use-pep517`; here
    `--progress-bar off`, which the environment's pip still has): uv refuses them, and the dated
    install falls back to the environment's own pip, as the harness ran it (undated), instead
    of failing the build."""
    install = ["python -m pip install --progress-bar off -e ."]
    where = await _datekit_installed_by(settings, "pip-only-options", install, "2024-11-01")
    assert where == "/testbed/src/datekit/__init__.py"
