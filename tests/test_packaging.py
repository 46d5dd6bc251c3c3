"""The package as users will install it: a wheel and an sdist built by `python -m build` (what
the release workflow publishes), accepted by `twine check`, the wheel installed into a fresh
venv with no extras running a real sandbox from its own files (no checkout beside it), and
each extra resolvable beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover (3.10)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--installer", "uv", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("swe_minisandbox-*.whl")
    return wheel


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "uv", "venv", "-q", str(where)], check=True)
    return where / "bin" / "python"


def test_the_distributions_pass_twine_check(dist: Path) -> None:
    files = sorted(str(p) for p in dist.iterdir() if p.suffix in (".whl", ".gz"))
    assert len(files) == 2, files  # the wheel and the sdist
    r = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.count("PASSED") == 2, r.stdout + r.stderr


def test_the_wheel_alone_runs_a_sandbox_and_an_example_task(dist: Path, tmp_path: Path) -> None:
    """Installed from the wheel into a fresh venv, run from an empty directory with an empty
    home: the package's own data (helpers, seccomp, examples, spec table) is all it has."""
    python = _venv(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(python),
         str(_wheel(dist))],
        check=True,
    )  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    cli = str(python.parent / "minisandbox")
    r = subprocess.run(
        [cli, "exec", "--", "sh", "-c", "echo inside; test ! -e /work"],
        cwd=home, env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "inside", r.stdout + r.stderr
    shown = subprocess.run(
        [str(python), "-c", "import minisandbox, sys; print(minisandbox.__file__)"],
        cwd=home, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert str(tmp_path / "venv") in shown.stdout  # the wheel's copy, not this checkout's
    r = subprocess.run(
        [cli, "tasks", "examples"],
        cwd=home, env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "examples__datekit-1" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    sorted(
        e
        for e in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
        if e != "dev"
    ),
)
def test_each_extra_resolves_beside_the_wheel(dist: Path, tmp_path: Path, extra: str) -> None:
    python = _venv(tmp_path / "venv")
    r = subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "--dry-run", "--python", str(python),
         f"swe-minisandbox[{extra}] @ {_wheel(dist).as_uri()}"],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
