"""Relaxing conflicting pins (relax.py): the ladder on uv's own reports, and real builds whose
recipe only resolves relaxed, where what the repository imports decides which pin gives way."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.relax import RelaxationFailed, Relaxer, imported_names, is_imported
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

# uv 0.13's reports as the builder captures them (no terminal: no wrapping, no box drawing),
# for SWE-bench's xarray exports.
CF_UNITS = """\
Using Python 3.10.13 environment at: /opt/venv
error: No solution found when resolving dependencies:
  cause: Because cf-units==3.2.0 depends on antlr4-python3-runtime==4.7.2 and you require antlr4-python3-runtime==4.11.1, we can conclude that your requirements and cf-units==3.2.0 are incompatible.
         And because you require cf-units==3.2.0, we can conclude that your requirements are unsatisfiable.
"""  # noqa: E501
DASK = """\
error: No solution found when resolving dependencies:
  cause: Because distributed==2024.9.1 depends on dask==2024.9.1 and you require distributed==2024.9.1, we can conclude that you require dask==2024.9.1.
         And because you require dask==2022.8.1, we can conclude that your requirements are unsatisfiable.
"""  # noqa: E501
MISSING = """\
error: No solution found when resolving dependencies:
  cause: Because no-such-package-xyz was not found in the package registry and you require no-such-package-xyz==9.9.9, we can conclude that your requirements are unsatisfiable.
"""  # noqa: E501
XARRAY = ["antlr4-python3-runtime==4.11.1", "cf-units==3.2.0", "distributed==2024.9.1"]
XARRAY_PIP = [*XARRAY, "numpy==1.23.0", "dask==2022.8.1"]  # pip's list comes after conda's


def test_what_the_repository_does_not_import_gives_way_first() -> None:
    imports = imported_names(
        ["import cf_units\nfrom dask import array\n", "import numpy as np\nimport distributed"]
    )
    assert {"cf-units", "dask", "numpy"} <= imports
    r = Relaxer(XARRAY_PIP, imports, "2021-05-03T20:38:52-07:00")
    step = r.step(CF_UNITS)
    assert (step.package, step.rung, step.imported) == ("antlr4-python3-runtime", "dated", False)
    assert "antlr4-python3-runtime" in r.requirements() and "cf-units==3.2.0" in r.requirements()
    assert r.uv_options() == [
        "--only-binary=antlr4-python3-runtime",
        "--exclude-newer-package=antlr4-python3-runtime=2021-05-03T20:38:52-07:00",
    ]
    # Both imported: the pin listed first (conda's) gives way to pip's, installed last.
    step = r.step(DASK)
    assert (step.package, step.rung, step.imported) == ("distributed", "dated", True)
    assert "distributed" in r.requirements() and "dask==2022.8.1" in r.requirements()


def test_a_pin_steps_down_the_ladder_and_only_what_is_not_imported_is_dropped() -> None:
    r = Relaxer(XARRAY_PIP, frozenset({"cf-units"}), "2021-05-03")
    rungs = [r.step(CF_UNITS).rung for _ in range(4)]
    assert rungs == ["dated", "any", "source", "dropped"]
    assert not any(line.startswith("antlr4") for line in r.requirements())
    assert r.uv_options() == []
    # The same conflict again: cf-units (imported) steps down, but is never dropped.
    assert [r.step(CF_UNITS).rung for _ in range(3)] == ["dated", "any", "source"]
    with pytest.raises(RelaxationFailed, match="no rung left"):
        r.step(CF_UNITS)
    # Without a date the ladder starts at any version.
    assert Relaxer(XARRAY, frozenset(), None).step(CF_UNITS).rung == "any"


def test_what_is_not_a_conflict_between_pins_is_never_relaxed() -> None:
    """A package the index lacks, or a report naming one pin, fails as it is: relaxing it
    would hide a broken recipe (or a broken index) behind a smaller environment."""
    with pytest.raises(RelaxationFailed, match="not a conflict between the recipe's pins"):
        Relaxer(["no-such-package-xyz==9.9.9", "six==1.16.0"], frozenset(), None).step(MISSING)
    with pytest.raises(RelaxationFailed, match="not a conflict"):
        Relaxer(["dask==2022.8.1"], frozenset(), None).step(DASK)


def test_a_pin_whose_source_build_fails_steps_down_too() -> None:
    """conda built backports.zoneinfo 0.2.1 for Python 3.10; its sdist does not compile there
    and PyPI has no 3.10 wheel of it: the pin gives way like a conflicting one. A failed build
    of a package the recipe does not pin cannot be relaxed."""
    failed = (
        "Resolved 156 packages in 5.63s\n"
        "error: Failed to build `backports-zoneinfo==0.2.1`\n"
        "  cause: The build backend returned an error\n"
    )
    r = Relaxer(["backports.zoneinfo==0.2.1", "numpy==1.23.0"], frozenset({"numpy"}), "2021")
    assert [r.step(failed).rung for _ in range(4)] == ["dated", "any", "source", "dropped"]
    assert r.requirements() == ["numpy==1.23.0"]
    with pytest.raises(RelaxationFailed, match="does not build"):
        Relaxer(["numpy==1.23.0"], frozenset(), None).step(failed)
    with pytest.raises(RelaxationFailed, match="neither"):
        Relaxer(["numpy==1.23.0"], frozenset(), None).step("error: network unreachable")


def test_what_counts_as_imported() -> None:
    """`import a, b as c`, `from a.b import c`, indented imports; distributions named apart
    from their modules (data/import_names.txt) or by a python- prefix."""
    imports = imported_names(["import os, yaml as y\n  from dateutil.parser import parse\n"])
    assert {"os", "yaml", "dateutil"} <= imports
    assert is_imported("PyYAML", imports) and is_imported("python-dateutil", imports)
    assert not is_imported("pytest-env", imports)
    # PyYAML, though the word "yaml" is not its name, is never dropped.
    r = Relaxer(["PyYAML==6.0", "no-wheel==1.0"], imports, None)
    failed = "error: Failed to build `pyyaml==6.0`\n"
    assert [r.step(failed).rung for _ in range(2)] == ["any", "source"]
    with pytest.raises(RelaxationFailed, match="does not build at any version tried"):
        r.step(failed)


def test_relaxing_keeps_markers_and_extras_and_reads_names_once() -> None:
    lines = [
        'pywin32==305; sys_platform == "win32"',
        "dask[array]==2022.8.1",
        "distributed==2024.9.1",
        "dask==2024.1.0",  # listed twice: the first line is the one that counts
        "--no-binary=:none:",
        "pkg @ https://example.org/pkg.whl",
    ]
    r = Relaxer(lines, frozenset(), None)
    step = r.step(DASK)
    assert (step.package, step.pinned) == ("dask", "dask[array]==2022.8.1")
    assert r.requirements() == [lines[0], "dask[array]", lines[2], "dask", *lines[4:]]
    # A marker stays when its pin goes.
    r = Relaxer(lines[:3], frozenset(), None)
    r.step(DASK.replace("dask==2022.8.1", "pywin32==305").replace("dask==2024.9.1", "pywin32"))
    assert r.requirements()[0] == 'pywin32; sys_platform == "win32"'


def test_without_known_imports_nothing_is_dropped() -> None:
    """No environment commit: what the repository imports is unknown, so every package might
    be imported: pins step down but are never dropped."""
    r = Relaxer(XARRAY, None, None)
    steps = [r.step(CF_UNITS) for _ in range(3)]
    assert [(s.package, s.rung) for s in steps] == [
        ("antlr4-python3-runtime", "any"),
        ("antlr4-python3-runtime", "source"),
        ("cf-units", "any"),  # the first has no rung left
    ]
    assert all(s.imported for s in steps)
    with pytest.raises(RelaxationFailed, match="no rung left"):
        for _ in range(4):
            r.step(CF_UNITS)
    assert all(s.rung != "dropped" for s in r.steps)


# ------------------------------------------------------------------------- real builds


def _repo_importing(mirror: Path, module: str) -> str:
    """A one-commit repository `acme/relax-<module>` whose code imports `module`."""
    repo = mirror / f"acme__relax-{module}"
    repo.mkdir(parents=True)
    (repo / "mod.py").write_text(f"import {module}\n")

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("add", "mod.py")
    git("commit", "-q", "-m", "import")
    return git("rev-parse", "HEAD")


def _task(example: Task, module: str, commit: str) -> Task:
    # requests 2.31 needs urllib3>=1.21.1: the two pins cannot both hold.
    recipe = EnvRecipe(
        python=example.env.python,
        requirements=["requests==2.31.0", "urllib3==1.20"],
        relax_pins=True,  # as the loader sets for conda exports
    )
    return example.model_copy(
        update={
            "id": f"relax-{module}",
            "repo": f"acme/relax-{module}",
            "source": None,
            "base_commit": commit,
            "environment_setup_commit": commit,
            "env": recipe,
            "pre_install": [],
            "install": [],
        }
    )


async def _versions(builder: Builder, task: Task) -> str:
    """The installed versions (from metadata: urllib3 1.20 no longer imports on new Pythons)."""
    code = "from importlib.metadata import version as v; print(v('requests'), v('urllib3'))"
    async with builder.sandbox(task) as sb:
        r = await sb.execute(["python", "-c", code])
    assert r.exit_code == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_conflicting_pins_install_as_conda_installed_them(
    home: Path, settings: BuildSettings
) -> None:
    """The recipe pins requests 2.31 and urllib3 1.20, which pip cannot install together (the
    wheel of requests 2.31 asks for urllib3>=1.21.1). As conda installed such an export, every
    pin goes in as it is, without resolving the dependencies the wheels declare: both versions
    are there, the layer says it was installed unresolved and what it holds. A recipe without
    the conflict installs as ever, and one that does not ask for relaxing fails on it."""
    base = home / "relax"
    mirror = base / "mirror"
    example = load_tasks("examples")[0]
    own = BuildSettings(store=base / "store", cache=base / "layers", git_mirror=mirror)
    task = _task(example, "requests", _repo_importing(mirror, "requests"))
    builder = Builder(own)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    assert result.unresolved and result.relaxed == [], result
    assert asyncio.run(_versions(builder, task)).split() == ["2.31.0", "1.20"]
    meta = builder.store.meta(result.env_layer)
    assert meta["unresolved"] and "urllib3==1.20" in meta["installed"]
    assert any("urllib3" in line for line in meta["inconsistent"]), meta["inconsistent"]
    logs = builder.settings.logs / builder.env_ref(task).replace("/", "_")
    assert (
        "installed without dependency resolution, 0 relaxations"
        in (logs / "resolve.log").read_text()
    )
    # The cached build reports it from the layer's metadata.
    again = asyncio.run(Builder(own).build(task))
    assert again.status == "cached" and again.unresolved

    plain = task.model_copy(
        update={"id": "relax-none", "env": EnvRecipe(python=example.env.python,
                                                     requirements=["requests==2.31.0"],
                                                     relax_pins=True)}
    )  # fmt: skip
    result = asyncio.run(builder.build(plain))
    assert result.status == "built" and not result.unresolved and result.relaxed == [], result
    strict = task.model_copy(
        update={"id": "relax-off", "env": task.env.model_copy(update={"relax_pins": False})}
    )
    result = asyncio.run(builder.build(strict))
    assert result.status == "failed" and result.step == "requirements", result


def test_a_pin_that_does_not_build_steps_down_to_a_wheel(
    home: Path, settings: BuildSettings
) -> None:
    """markupsafe 1.0's setup.py imports setuptools.Feature (gone since setuptools 46): as an
    exact pin it does not build, with or without dependency resolution. It steps down to a
    wheel from before the environment commit's date, and the repository's import works."""
    base = home / "relax-build"
    mirror = base / "mirror"
    example = load_tasks("examples")[0]
    own = BuildSettings(store=base / "store", cache=base / "layers", git_mirror=mirror)
    task = _task(example, "markupsafe", _repo_importing(mirror, "markupsafe"))
    task = task.model_copy(
        update={"env": task.env.model_copy(update={"requirements": ["markupsafe==1.0"]})}
    )
    builder = Builder(own)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    assert [(r.package, r.rung, r.imported) for r in result.relaxed] == [
        ("markupsafe", "dated", True)
    ]

    async def version() -> str:
        async with builder.sandbox(task) as sb:
            code = "import markupsafe; print(markupsafe.__version__)"
            r = await sb.execute(["python", "-c", code])
            assert r.exit_code == 0, r.stdout + r.stderr
            return r.stdout.strip()

    assert asyncio.run(version()) != "1.0"
