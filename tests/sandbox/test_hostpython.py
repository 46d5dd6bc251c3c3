"""Which host directories a sandbox covers because they hold installed Python packages
(sandbox/hostpython.py), on trees laid out as a distribution's /usr and interpreters lay them
out, and a real interpreter in a real sandbox."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.sandbox.hostpython import (
    hidden_dirs,
    is_python_prefix,
    prefix_package_dirs,
    usr_package_dirs,
)


def touch(root: Path, *rels: str) -> None:
    for rel in rels:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


def test_usr_walk_finds_package_trees_and_spares_standard_libraries(tmp_path: Path) -> None:
    usr = tmp_path / "usr"
    touch(
        usr,
        "lib/python3.11/os.py",  # a standard library: kept, with its own packages
        "lib/python3.11/json/__init__.py",
        "lib/python3/dist-packages/flask/__init__.py",
        "local/lib/python3.11/dist-packages/requests/__init__.py",
        "lib/cloud-sdk/lib/third_party/requests/__init__.py",  # vendored by other software
        "lib/cloud-sdk/lib/third_party/requests/adapters.py",
        "lib/cloud-sdk/bin/tool",
        "share/wheelhouse/flask-3.1.0-py3-none-any.whl",  # archives
        "share/python-wheels/pip-23.0-py3-none-any.whl",  # but ensurepip's (venv needs them)
        "bin/lsb_release.py",  # a lone script: a program, not a project's tree
        "lib/git-core/git",
    )
    (usr / "lib" / "linked").symlink_to(usr / "lib" / "cloud-sdk")  # never followed
    got = [p.relative_to(usr).as_posix() for p in usr_package_dirs(str(usr))]
    assert got == [
        "lib/cloud-sdk/lib/third_party",
        "lib/python3/dist-packages",
        "local/lib/python3.11/dist-packages",
        "share/wheelhouse",
    ]


def test_a_directory_added_under_usr_is_seen_by_the_next_walk(tmp_path: Path) -> None:
    usr = tmp_path / "usr"
    touch(usr, "lib/python3.11/os.py")
    assert usr_package_dirs(str(usr)) == ()
    touch(usr, "lib/vendor/pkgs/flask/__init__.py")
    assert usr_package_dirs(str(usr)) == (usr / "lib/vendor/pkgs",)


def test_interpreter_prefixes_show_their_standard_library_only(tmp_path: Path) -> None:
    pyenv = tmp_path / "pyenv-3.11"
    touch(pyenv, "bin/python3.11", "lib/python3.11/os.py", "lib/python3.11/site-packages/x.pth")
    conda = tmp_path / "conda"
    touch(
        conda,
        "bin/python3.12",
        "lib/python3.12/os.py",
        "lib/python3.12/site-packages/flask/__init__.py",
        "pkgs/flask-3.1.0-py_0/info/index.json",
        "envs/other/lib/python3.12/os.py",
        "conda-meta/history",
    )
    venv = tmp_path / "venv"  # a venv holds no standard library: not a prefix, bound as it is
    touch(venv, "pyvenv.cfg", "lib/python3.11/site-packages/tool/__init__.py")
    assert is_python_prefix(pyenv) and is_python_prefix(conda) and not is_python_prefix(venv)
    assert prefix_package_dirs(pyenv) == [pyenv / "lib/python3.11/site-packages"]
    assert sorted(prefix_package_dirs(conda)) == sorted(
        [
            conda / "lib/python3.12/site-packages",
            conda / "envs",
            conda / "pkgs",
            conda / "conda-meta",
        ]
    )
    usr = tmp_path / "usr"
    touch(usr, "lib/python3/dist-packages/a/__init__.py")
    assert hidden_dirs([pyenv, venv, usr / "lib"], usr=str(usr)) == sorted(
        [usr / "lib/python3/dist-packages", pyenv / "lib/python3.11/site-packages"]
    )


async def test_this_interpreter_runs_without_its_installed_packages() -> None:
    """The interpreter running these tests, bound as a task's is: its standard library works,
    its site-packages is empty inside (and a venv of it keeps its own)."""
    prefix = Path(sys.base_prefix)
    site = next(iter(prefix_package_dirs(prefix)), None)
    if not is_python_prefix(prefix) or site is None or prefix.is_relative_to("/usr"):
        pytest.skip(f"{prefix} is not a prefix outside /usr with a site-packages")
    python = prefix / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    async with Sandbox(SandboxConfig(ro_paths=[prefix])) as sb:
        r = await sb.execute([str(python), "-c", "import json, ssl, sqlite3; print('stdlib')"])
        assert r.stdout.strip() == "stdlib", r
        r = await sb.execute(["ls", "-A", str(site)])
        assert r.exit_code == 0 and r.stdout == "", f"{site} shows {r.stdout[:300]!r}"


def test_a_walk_is_kept_for_the_node_and_redone_when_usr_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk's result is kept in the caller's private runtime directory: another process
    (here: this one with its in-process cache cleared) reads it instead of walking, until a
    directory is added up to three levels below /usr; a record another user owns is not read."""
    import minisandbox.sandbox.hostpython as hp

    usr = tmp_path / "usr"
    touch(usr, "lib/python3/dist-packages/a/__init__.py", "lib/sdk/lib/x")
    first = usr_package_dirs(str(usr))
    assert first == (usr / "lib/python3/dist-packages",)
    walks: list[str] = []
    real = hp._package_trees

    def counted(root: str) -> list[str]:
        walks.append(root)
        return real(root)

    monkeypatch.setattr(hp, "_package_trees", counted)
    hp._usr_package_dirs.cache_clear()
    assert usr_package_dirs(str(usr)) == first and walks == []  # read, not walked
    touch(usr, "lib/sdk/third_party/flask/__init__.py")  # a new directory three levels down
    hp._usr_package_dirs.cache_clear()
    assert usr_package_dirs(str(usr)) == (
        usr / "lib/python3/dist-packages",
        usr / "lib/sdk/third_party",
    )
    assert walks == [str(usr)]
    if os.geteuid() == 0:  # a record of another owner: walked again, not believed
        record = hp._record_path(str(usr), hp._tree_stamp(str(usr)))
        os.chown(record, 4242, 4242)
        hp._usr_package_dirs.cache_clear()
        usr_package_dirs(str(usr))
        assert walks == [str(usr), str(usr)]
