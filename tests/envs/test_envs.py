"""Environments of every Python version the SWE-bench exports use, built for real (uv, PyPI)
through the Builder, and what their python does inside a task sandbox when reached the way tox,
nox or `python -m venv` reach it. Needs the package index and pyenv-style interpreters; a
version this machine lacks is skipped."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minisandbox
from minisandbox.envs import egress
from minisandbox.envs.envlayer import build_constraints
from minisandbox.envs.layerbuild import _host_build_env
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.toolchains import ToolchainNotFoundError, find_interpreter
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task


@pytest.fixture(scope="module")
def own(home: Path, settings: BuildSettings) -> BuildSettings:
    base = home / "envs"
    return BuildSettings(
        store=base / "store", cache=base / "layers", git_mirror=settings.git_mirror
    )


def _task(python: str, requirements: list[str], name: str) -> Task:
    """A quick task: the recipe under test, no install step (the checkout is the task layer)."""
    try:
        find_interpreter(python)
    except ToolchainNotFoundError:
        pytest.skip(f"no Python {python} interpreter here")
    task = load_tasks("examples")[0]
    env = EnvRecipe(python=python, requirements=requirements)
    return task.model_copy(update={"id": f"env-{name}", "env": env, "install": []})


def _build(settings: BuildSettings, task: Task) -> Builder:
    builder = Builder(settings)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    print(f"{task.id}: built in {result.seconds:.1f} s")
    return builder


# What tox (with tox-current-env, as sphinx's eval scripts run it) and SWE-bench's conda path do:
# a python in another directory linking to the environment's, directly and through two links.
_LINKS = """
set -e
mkdir -p /tmp/tox/.tox/py39/bin /tmp/chain
ln -s /opt/venv/bin/python /tmp/tox/.tox/py39/bin/python
ln -s /tmp/tox/.tox/py39/bin/python /tmp/chain/python
for exe in python /opt/venv/bin/python3 /tmp/tox/.tox/py39/bin/python /tmp/chain/python \\
    /opt/miniconda3/envs/testbed/bin/python; do
  echo "$exe $($exe -X dev -c 'import sys, six; print(sys.prefix)')"
done
python -m venv /tmp/x
echo "venv $(/tmp/x/bin/python -c 'import sys; print(sys.prefix)')"
/tmp/x/bin/python -c 'import six' 2>/dev/null && echo "isolated no" || echo "isolated yes"
"""


@pytest.mark.parametrize("python", ["3.6", "3.13"])
def test_env_python_keeps_its_packages_through_links(own: BuildSettings, python: str) -> None:
    """Python 3.6 builds (uv's bytecode compiler does not run on it), and however its python
    is reached, through tox's link or a chain of two, it is the environment: sys.prefix is
    /opt/venv and its packages import; a venv made inside the sandbox is its own. 3.6 finds
    its prefix with the old C getpath, 3.13 with getpath.py: both are covered."""
    # pybind11-global installs headers of its own into include/pythonX.Y (matplotlib's
    # environments): that directory must take them beside the interpreter's read-only ones.
    headers = ["pybind11-global==2.13.6"] if python != "3.6" else []
    task = _task(python, ["six==1.16.0", *headers], f"links-{python}")
    builder = _build(own, task)

    async def run() -> tuple[str, str, str]:
        async with builder.sandbox(task) as sb:
            r = await sb.execute(_LINKS)
            assert r.exit_code == 0, r.output
            pip = await sb.execute("pip --version")
            h = await sb.execute("ls /opt/venv/include/python3*/")
            return r.stdout, pip.stdout, h.stdout

    out, pip, include = asyncio.run(run())
    assert "Python.h" in include.split(), include  # the interpreter's headers
    if headers:
        assert "pybind11-global" in include.split(), include
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    for exe in (
        "python",
        "/opt/venv/bin/python3",
        "/tmp/tox/.tox/py39/bin/python",
        "/tmp/chain/python",
    ):
        assert lines[exe] == "/opt/venv", out
    # The compatibility layer's conda environment is a link to /opt/venv's directory: its
    # python is found there, as in the official images.
    assert lines["/opt/miniconda3/envs/testbed/bin/python"] == "/opt/miniconda3/envs/testbed"
    assert lines["venv"] == "/tmp/x", out
    assert lines["isolated"] == "yes", out
    assert f"python {python}" in pip  # seeded pip runs on this Python


def test_build_constraints_follow_the_recipes_setuptools() -> None:
    assert build_constraints(["six==1.16.0", "setuptools==38.2.4"]) == ["setuptools<41\n"]
    assert build_constraints(["setuptools==58.0.4"]) == ["setuptools<59\n"]
    assert build_constraints(["SetupTools == 65.6.3 ; python_version >= '3'"]) == [
        "setuptools<66\n"
    ]
    assert build_constraints(["setuptools-scm==6.0", "six"]) == []
    assert build_constraints(["setuptools>=40"]) == []


@pytest.mark.parametrize(
    ("python", "setuptools"),
    [
        ("3.6", "38.2.4"),  # as astropy 1.3's export (the default run keeps this one)
        pytest.param("3.7", "44.1.1", marks=pytest.mark.slow),
    ],
)
def test_old_sdists_build_with_the_recipes_setuptools(
    own: BuildSettings, python: str, setuptools: str
) -> None:
    """`markupsafe==1.0` (setup.py imports setuptools.Feature, gone in 46) builds from source
    in an environment pinning an old setuptools, and imports in its sandbox. The control: the
    same recipe without the pin fails on exactly that."""
    bare = _task(python, ["six==1.16.0", "markupsafe==1.0"], f"bare-{python}")
    result = asyncio.run(Builder(own).build(bare))
    assert result.status == "failed" and "'requirements'" in (result.error or ""), result
    assert "Feature" in Path(result.log or "").read_text()

    pinned = [f"setuptools=={setuptools}", "six==1.16.0", "markupsafe==1.0"]
    task = _task(python, pinned, f"markupsafe-{python}")
    builder = _build(own, task)

    async def run() -> str:
        async with builder.sandbox(task) as sb:
            r = await sb.execute(
                "python -c 'import six, markupsafe, setuptools; "
                "print(markupsafe.__version__, setuptools.__version__)'"
            )
            assert r.exit_code == 0, r.output
            return r.stdout.split()

    assert asyncio.run(run()) == ["1.0", setuptools]


def test_an_environment_dated_before_pep_517_setuptools_builds_sdists(own: BuildSettings) -> None:
    """An inferred recipe as of 2018 (astropy 2.0's environment commit) with a source-only
    pin: uv builds it through setuptools' PEP 517 backend (40.8.0, February 2019), which the
    date alone would exclude ("only setuptools<=40.4.3 is available")."""
    task = _task("3.6", ["markupsafe==1.0"], "dated-2018")
    env = task.env.model_copy(update={"as_of": "2018-10-01T00:00:00Z"})
    task = task.model_copy(update={"env": env})
    builder = _build(own, task)

    async def run() -> str:
        async with builder.sandbox(task) as sb:
            r = await sb.execute("python -c 'import markupsafe, pip; print(pip.__version__)'")
            assert r.exit_code == 0, r.output
            return r.stdout.strip()

    assert asyncio.run(run()) == "18.0"  # the seed still as of the date


def test_a_dated_requirement_that_does_not_build_is_taken_as_a_wheel(own: BuildSettings) -> None:
    """Dated before its Python, a package's source does not build (as of 2017 every sdist
    builds with setuptools 40.8, which Python 3.9 broke; xarray's inferred recipe as of 2021
    gets cartopy, whose source needs the PROJ library): it is taken as a wheel of any date,
    recorded, and the rest stays as of the date; the dependency of a line (jinja2's
    markupsafe) too. With no wheel to take (an exact pin), the line is left out. The control:
    the same install without it needs no step."""
    task = _task("3.9", ["six", "jinja2"], "undated-wheel")
    task = task.model_copy(update={"env": task.env.model_copy(update={"as_of": "2017-06-01"})})
    builder = Builder(own)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    assert [(r.package, r.rung) for r in result.relaxed] == [("markupsafe", "any")], result
    assert "markupsafe" in result.relaxed[0].conflict

    async def versions(task: Task) -> list[str]:
        async with builder.sandbox(task) as sb:
            code = "from importlib.metadata import version as v; print(v('six'), v('markupsafe'))"
            r = await sb.execute(["python", "-c", code])
            return r.stdout.split() or [r.output]

    six, markupsafe = asyncio.run(versions(task))
    assert six == "1.10.0" and int(markupsafe.split(".")[0]) >= 2  # as of the date; a wheel

    def variant(name: str, requirements: list[str]) -> Task:
        env = task.env.model_copy(update={"requirements": requirements})
        return task.model_copy(update={"id": f"env-undated-{name}", "env": env})

    pinned = variant("pinned", ["six", "markupsafe==1.0"])
    result = asyncio.run(builder.build(pinned))
    assert result.status == "built", result.error
    steps = [(r.package, r.rung, r.pinned) for r in result.relaxed]
    assert steps == [
        ("markupsafe", "any", "markupsafe==1.0"),
        ("markupsafe", "dropped", "markupsafe==1.0"),
    ], steps
    assert "PackageNotFoundError: markupsafe" in asyncio.run(versions(pinned))[0]
    result = asyncio.run(builder.build(variant("none", ["six"])))
    assert result.status == "built" and result.relaxed == [], result


_PYPROJECT = """[project]
name = "x"  # requires = ["not-this"]

[build-system]  # PEP 518
  requires = [
    "setuptools>=40.8",  # not "commented-out"
    'setuptools_scm[toml]>=3.4',
    "cython",
  ]
build-backend = "setuptools.build_meta"

[tool.other]
requires = ["nor-this"]
"""


@pytest.mark.parametrize("vendored", ["none", "tomli"])
def test_build_requirements_are_read_with_or_without_a_vendored_toml_reader(
    tmp_path: Path, vendored: str
) -> None:
    """The wheelhouse step's reader (helpers/build_requires.py) under a pip that vendors no
    TOML reader (pip 9) and under one that does: the same requirements."""
    fake = tmp_path / "site" / "pip" / "_vendor"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    if vendored == "tomli":
        (fake / "tomli.py").write_text("from tomllib import loads\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text(_PYPROJECT)
    helper = Path(minisandbox.__file__).parent / "tasks" / "helpers" / "build_requires.py"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    r = subprocess.run(
        [sys.executable, "-S", str(helper)],  # -S: no site-packages, only the fake pip
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["setuptools>=40.8", "setuptools_scm[toml]>=3.4", "cython", "wheel"]


def test_every_pip_of_a_build_is_named_the_hosts_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's pip files are not in the build sandbox (and pips before 10 default to
    pypi.python.org): PIP_INDEX_URL is always set, to what the host's pip would use."""
    conf = tmp_path / "pip.conf"
    monkeypatch.setattr(egress, "_pip_config_files", lambda: [tmp_path / "absent", conf])
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert _host_build_env()["PIP_INDEX_URL"] == "https://pypi.org/simple/"
    conf.write_text("[install]\nindex-url = https://x.example/simple\n")  # not pip download's
    assert _host_build_env()["PIP_INDEX_URL"] == "https://pypi.org/simple/"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nextra-index-url = b\n")
    assert _host_build_env()["PIP_INDEX_URL"] == "https://mirror.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert _host_build_env()["PIP_INDEX_URL"] == "https://env.example/simple"


def test_a_pip_from_before_pypi_org_reaches_the_index(own: BuildSettings) -> None:
    """An environment dated 2017 (an inferred recipe of a 2012 commit) is seeded with pip 9,
    whose default index is pypi.python.org: builds name today's PyPI to every pip (that host
    does not resolve on every network), and the wheelhouse step reads build requirements
    without the TOML reader later pips vendor."""
    task = _task("3.6", [], "pip-9")
    env = task.env.model_copy(update={"as_of": "2017-06-21T00:00:00Z"})
    # The repository as of then: a build-system table of 2017's setuptools (pip 9 vendors
    # no TOML reader: the wheelhouse step reads it by pattern).
    old_build = (
        'printf \'[build-system]\\nrequires = ["setuptools>=36", "six"]\\n\' > pyproject.toml'
    )
    install = [old_build, "python -m pip download -q -d /tmp/w six==1.10.0"]
    task = task.model_copy(update={"env": env, "install": install})
    builder = _build(own, task)

    async def look() -> tuple[str, str]:
        async with builder.sandbox(task) as sb:
            pip = await sb.execute("python -m pip --version")
            return pip.stdout, (await sb.execute("ls /opt/minisandbox/wheelhouse")).stdout

    pip, wheelhouse = asyncio.run(look())
    assert pip.startswith("pip 9."), "the control: an old pip"
    assert {"setuptools", "six", "wheel"} <= {f.split("-")[0] for f in wheelhouse.split()}


async def test_a_build_sees_the_ca_bundle_the_host_names(
    settings: BuildSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a TLS-intercepting proxy the host names its CA in SSL_CERT_FILE (or pip's
    PIP_CERT...): a file the build sandbox cannot see. The build gets a copy, and its env
    names the copy, for uv, pip, requests and git alike."""
    from minisandbox.envs.layerbuild import BUILD_CA, install_host_ca
    from minisandbox.sandbox.sandbox import Sandbox

    builder = Builder(settings)
    interp = builder.find_interpreter("3.11")
    ca = tmp_path / "corporate-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nour proxy's CA\n-----END CERTIFICATE-----\n")
    ca.chmod(0o600)  # readable by the caller only: the sandbox could not open the host's file
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    config = builder.build_config(interp, upper=tmp_path / "upper")
    assert {config.env[v] for v in ("SSL_CERT_FILE", "PIP_CERT", "GIT_SSL_CAINFO")} == {BUILD_CA}
    async with Sandbox(config) as sb:
        await install_host_ca(sb)
        r = await sb.execute('cat "$SSL_CERT_FILE" "$REQUESTS_CA_BUNDLE"')
    assert r.exit_code == 0 and r.stdout == ca.read_text() * 2, r
    assert not (tmp_path / "upper" / BUILD_CA.lstrip("/")).exists()  # /tmp: never in a layer
    # Positive control: without one named, the build's env names none.
    monkeypatch.delenv("SSL_CERT_FILE")
    for var in ("REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"):
        monkeypatch.delenv(var, raising=False)
    assert "SSL_CERT_FILE" not in builder.build_config(interp, upper=tmp_path / "u2").env
