"""Covers layers (sandbox/covers.py): a bound host tree's package directories shown empty by one
read-only overlay, and the tmpfs covers wherever an overlay could not stand in for the bind.
What an agent can read through either is the attack suite's (attacks_hostpython.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.errors import SandboxConfigError
from minisandbox.sandbox import covers, rootfs, runtime, startup
from minisandbox.sandbox.covers import COVERS_VAR, OPAQUE_XATTR, cover_layer
from minisandbox.sandbox.hostpython import hidden_dirs


@pytest.fixture(autouse=True)
def _fresh_lookups() -> None:
    covers._cover_layer.cache_clear()


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    """A host tree with a package directory two levels down, and a private root for layers."""
    tree = tmp_path / "prefix"
    site = tree / "lib" / "python3.99" / "site-packages"
    (site / "later").mkdir(parents=True)
    (site / "later" / "fix.py").write_text("the answer\n")
    os.chmod(tree / "lib", 0o750)
    root = tmp_path / "runtime"
    root.mkdir(mode=0o700)
    return tree, root


def _xattrs_here(path: Path) -> bool:
    try:
        os.setxattr(path, "user.minisandbox-test", b"1")
    except OSError:
        return False
    return True


def test_a_layer_holds_the_covered_paths_opaque_with_the_hosts_modes(tmp_path: Path) -> None:
    tree, root = _tree(tmp_path)
    if not _xattrs_here(root):
        pytest.skip("this filesystem keeps no user xattrs (the tmpfs covers are used)")
    site = tree / "lib" / "python3.99" / "site-packages"
    layer = cover_layer(root, tree, [site])
    assert layer is not None and layer.parent == root and layer.name.startswith("node-covers-")
    made = layer / "lib" / "python3.99" / "site-packages"
    assert os.listdir(made) == []
    assert os.getxattr(made, OPAQUE_XATTR) == b"y"
    with pytest.raises(OSError):
        os.getxattr(layer / "lib", OPAQUE_XATTR)  # merged with the host's, not hiding it
    assert os.stat(layer / "lib").st_mode & 0o7777 == 0o750
    # Once per node: another process (the lookup forgotten) finds the same directory.
    inode = os.stat(layer).st_ino
    covers._cover_layer.cache_clear()
    assert cover_layer(root, tree, [site]) == layer and os.stat(layer).st_ino == inode
    # Removed meanwhile (a /tmp cleaner): made again, not handed out missing.
    subprocess.run(["rm", "-rf", str(layer)], check=True)
    assert cover_layer(root, tree, [site]) == layer and layer.is_dir()
    # Partly removed (its empty leaf first, as /tmp cleaners go): not used, tmpfs covers instead.
    os.chmod(made.parent, 0o755)
    made.rmdir()
    assert cover_layer(root, tree, [site]) is None


def test_no_layer_where_an_overlay_would_not_show_what_a_bind_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, root = _tree(tmp_path)
    site = tree / "lib" / "python3.99" / "site-packages"
    # A mount point inside the tree: an overlay would show the directory beneath it.
    assert cover_layer(root, Path("/"), [Path("/usr/lib")]) is None
    # A covered directory that is not there, or is reached through a symlink.
    assert cover_layer(root, tree, [tree / "lib" / "missing"]) is None
    (tree / "lib64").symlink_to("lib")
    assert cover_layer(root, tree, [tree / "lib64" / "python3.99" / "site-packages"]) is None
    # A runtime directory whose filesystem keeps no user xattrs: nothing half-made is left.

    def no_xattrs(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", no_xattrs)
    assert cover_layer(root, tree, [site]) is None
    assert os.listdir(root) == []


def test_the_tmpfs_covers_are_asked_for_by_name_and_a_wrong_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(COVERS_VAR, "tmpfs")
    system = tmp_path / "system"
    plan = rootfs.build_plan(SandboxConfig(), system, tmp_path, tmp_path, tmp_path, tmp_path)
    at = plan.args.index("/usr")
    assert "--ro-overlay" not in plan.args and plan.args[at - 1 : at + 2] == [
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    # An interpreter whose prefix is /usr (the distribution's) names /usr: it is bound once.
    plan = rootfs.build_plan(
        SandboxConfig(ro_paths=[Path("/usr")]), system, tmp_path, tmp_path, tmp_path, tmp_path
    )
    assert plan.args.count("/usr") == 2, plan.args  # --ro-bind /usr /usr
    monkeypatch.setenv(COVERS_VAR, "squashfs")
    with pytest.raises(SandboxConfigError, match=f"{COVERS_VAR}='squashfs'.*overlay.*tmpfs"):
        rootfs.build_plan(SandboxConfig(), system, tmp_path, tmp_path, tmp_path, tmp_path)


async def test_usr_is_one_read_only_overlay_here_with_its_packages_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the host allows it (as here), /usr is mounted once, as an overlay under its covers:
    no tmpfs per covered directory. Everything else of /usr is there, read-only."""
    argvs: list[list[str]] = []
    real = startup.bwrap_argv

    def record(*args: object, **kwargs: object) -> list[str]:
        argvs.append(real(*args, **kwargs))  # type: ignore[arg-type]  # passed through as given
        return argvs[-1]

    monkeypatch.setattr(startup, "bwrap_argv", record)
    dist = Path("/usr/lib/python3/dist-packages")
    if not (dist.is_dir() and os.listdir(dist)):
        pytest.skip("this host has no /usr/lib/python3/dist-packages to cover")
    async with Sandbox(SandboxConfig()) as sb:
        r = await sb.execute(
            ["sh", "-c", f"ls -A {dist}; grep ' /usr ' /proc/self/mountinfo; touch /usr/x"]
        )
        git = await sb.execute(["git", "--version"])
    argv = argvs[-1]
    probe = Path(tempfile.mkdtemp(dir=runtime.process_dir()))
    if not (covers._overlay_stands_in(Path("/usr")) and _xattrs_here(probe)):
        pytest.skip("an overlay cannot stand in for /usr here: it has the tmpfs covers")
    at = argv.index("--ro-overlay")
    assert argv[at + 1] == "/usr" and argv[at - 4 : at - 2] == ["--overlay-src", "/usr"]
    assert not any(a == "--tmpfs" and argv[i + 1].startswith("/usr/") for i, a in enumerate(argv))
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and " - overlay " in lines[0], r.stdout  # nothing listed, one mount
    assert "Read-only file system" in r.stderr
    assert git.exit_code == 0 and git.stdout.startswith("git version")  # positive control


async def test_usr_bound_again_under_another_spelling_stays_covered(tmp_path: Path) -> None:
    """`//usr`, or a symlink to /usr, in ro_paths binds /usr again over its overlay: the covers
    must still hold (they fall back to tmpfs over every bind). `//usr` also used to loop the
    start (its parents end at `//`, not `/`)."""
    hidden = [str(h) for h in hidden_dirs([])]
    if not hidden:
        pytest.skip("this host's /usr holds no Python packages to cover")
    link = tmp_path / "usr-link"
    link.symlink_to("/usr")
    os.chmod(tmp_path, 0o755)
    script = 'for d in "$@"; do ls -A "$d"; done | wc -l; ls /usr/bin/env'
    for spelled in (Path("//usr"), link):
        async with Sandbox(SandboxConfig(ro_paths=[spelled])) as sb:
            r = await sb.execute(["sh", "-c", script, "sh", *hidden])
        assert r.exit_code == 0 and r.stdout.split() == ["0", "/usr/bin/env"], (spelled, r.output)
