"""Attacks that look for the answer in the host's installed Python packages (issue: the host's
installed packages must not hold the answer): a later release of the task's project installed
into the interpreter the task uses, cached in a conda root, installed by the distribution under
/usr, or vendored by other software under /usr. Registered into attacks.ATTACKS, run as root and
as an unprivileged caller by test_attacks.py like every other attack."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from attacks import AttackContext, AttackSkipped, attack, sh
from minisandbox import Sandbox, SandboxConfig
from minisandbox.sandbox.covers import COVERS_VAR
from minisandbox.utils.safefs import discard_tree

# The gold line of SWE-bench Verified pallets__flask-5014, as a later flask ships it.
FIX_LINE = "raise ValueError(\"'name' may not be empty.\")"
# What these attacks plant outside the test session's directory (the host's /usr, /var/tmp) is
# named `<prefix><pid>-...`: conftest.py removes a killed run's (its pid dead) at the next start.
USR_PLANT_PREFIX = "minisandbox-attack-"


@contextlib.contextmanager
def _covered_by(how: str) -> Iterator[None]:
    """Covers made as `how` says (covers.py: one overlay per bound tree, or the tmpfs per
    directory that a host without usable overlays falls back to): each attack tries both."""
    old = os.environ.get(COVERS_VAR)
    os.environ[COVERS_VAR] = how
    try:
        yield
    finally:
        if old is None:
            del os.environ[COVERS_VAR]
        else:
            os.environ[COVERS_VAR] = old


COVERS = ("overlay", "tmpfs")


def _plant(root: Path, rel: str, token: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {token}\n{FIX_LINE}\n")
    for p in [path, *path.parents]:
        if p == root.parent:
            break
        os.chmod(p, 0o755 if p.is_dir() else 0o644)  # readable to any sandbox uid
    return path


def _throwaway_prefix(base: Path, token: str) -> tuple[Path, str]:
    """An interpreter prefix as uv, pyenv or conda lay one out: this Python's executable and
    the start of its standard library, with a later flask installed into it, a `.pth` file, and
    a conda package cache and second environment holding it too. Returns (prefix, stdlib)."""
    prefix = base / "python"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lib = prefix / "lib" / version
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(sys.executable), prefix / "bin" / version)
    lib.mkdir(parents=True)
    shutil.copy2(stdlib / "os.py", lib / "os.py")
    shutil.copytree(stdlib / "json", lib / "json", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in (
        f"lib/{version}/site-packages/flask/sansio/blueprints.py",
        f"lib/{version}/dist-packages/flask/sansio/blueprints.py",
        "lib64/python3.99/site-packages/flask/sansio/blueprints.py",
        "pkgs/flask-9.9.9-py_0/site-packages/flask/sansio/blueprints.py",
        f"envs/other/lib/{version}/site-packages/flask/sansio/blueprints.py",
    ):
        _plant(prefix, rel, token)
    (lib / "site-packages" / "zz-later.pth").write_text(f"# {token}\n")
    for dirpath, _dirs, files in os.walk(prefix):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o755 if "/bin/" in f"{dirpath}/" else 0o644)
    return prefix, version


async def _search(sb: Sandbox, roots: list[str], token: str) -> str:
    """What an agent looking for the fix finds: every readable file under `roots` holding the
    token (grep -r, as an agent would type it)."""
    quoted = " ".join(shlex.quote(r) for r in roots)
    r = await sh(sb, f"grep -rlF -- {shlex.quote(token)} {quoted} 2>/dev/null; true", timeout=120)
    return r.stdout.strip()


@attack
async def attack_read_packages_of_the_task_interpreter(ctx: AttackContext) -> None:
    """A later flask installed into the interpreter prefix a task's venv links to (and a conda
    root's package cache and other environment) is readable through the read-only bind of the
    prefix, though no venv imports it."""
    # Not under /tmp: a root caller's sandbox uid cannot traverse the caller's private /tmp
    # directories (as attack_escape_ro_path_with_dotdot).
    outside_tmp = "/var/tmp" if os.access("/var/tmp", os.W_OK) else ctx.scratch_dir
    base = Path(tempfile.mkdtemp(prefix=f"{USR_PLANT_PREFIX}{os.getpid()}-", dir=outside_tmp))
    token = f"later-release-{secrets.token_hex(8)}"
    try:
        os.chmod(base, 0o755)
        prefix, version = _throwaway_prefix(base, token)
        for how in COVERS:
            with _covered_by(how):
                await _search_prefix(prefix, version, token, how)
    finally:
        discard_tree(base)


async def _search_prefix(prefix: Path, version: str, token: str, how: str) -> None:
    async with Sandbox(SandboxConfig(ro_paths=[prefix])) as sb:
        # Positive control: the prefix is bound, its standard library readable.
        r = await sh(
            sb, f"head -c 200 {prefix}/lib/{version}/os.py; ls {prefix}/lib/{version}/json"
        )
        assert r.exit_code == 0 and "__init__.py" in r.stdout, (
            f"the interpreter's standard library is not visible (positive control): {r}"
        )
        r = await sh(sb, f"test -x {prefix}/bin/{version} && echo exe")
        assert r.stdout.strip() == "exe", f"the interpreter's binary is not visible: {r}"
        found = await _search(sb, [str(prefix)], token)
        assert not found, (
            f"a later release installed into the task's interpreter is readable ({how} "
            f"covers): {found}"
        )
        r = await sh(sb, f"ls -A {prefix}/lib/{version}/site-packages {prefix}/pkgs 2>&1")
        assert "flask" not in r.stdout and "zz-later.pth" not in r.stdout, r.stdout


@contextlib.contextmanager
def _usr_plants(token: str) -> Iterator[list[Path]]:
    """A later flask where a distribution installs packages (dist-packages), and vendored by
    other software (a cloud SDK's lib/third_party) under the host's /usr (root only)."""
    made: list[Path] = []
    try:
        dist = next((p for p in (Path("/usr/lib/python3/dist-packages"),) if p.is_dir()), None)
        if dist is not None:
            pkg = dist / f"{USR_PLANT_PREFIX}{os.getpid()}-{token}"
            made.append(pkg)
            _plant(dist, f"{pkg.name}/flask/sansio/blueprints.py", token)
        vendor = Path("/usr/lib") / f"{USR_PLANT_PREFIX}{os.getpid()}-{token}"
        made.append(vendor)
        _plant(vendor, "lib/third_party/flask/sansio/blueprints.py", token)
        (vendor / "lib" / "third_party" / "flask" / "__init__.py").write_text("")
        os.chmod(vendor / "lib" / "third_party" / "flask" / "__init__.py", 0o644)
        (vendor / "bin").mkdir()
        (vendor / "bin" / "tool").write_text("#!/bin/sh\necho vendored-tool\n")
        os.chmod(vendor / "bin", 0o755)
        os.chmod(vendor / "bin" / "tool", 0o755)
        yield made
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@attack
async def attack_read_host_usr_python_packages(ctx: AttackContext) -> None:
    """A later flask under the host's /usr: in the distribution's dist-packages, and vendored by
    other software. The root caller plants both; an unprivileged caller cannot write /usr and
    looks for what the host already has there."""
    token = f"later-release-{secrets.token_hex(8)}"
    if ctx.caller == "root" and os.geteuid() == 0:
        with _usr_plants(token) as made:
            for how in COVERS:
                with _covered_by(how):
                    await _search_usr(made, token, how)
        return
    dist = Path("/usr/lib/python3/dist-packages")
    names = sorted(os.listdir(dist)) if dist.is_dir() else []
    if not names:
        raise AttackSkipped("the host has no /usr/lib/python3/dist-packages to look into")
    for how in COVERS:
        with _covered_by(how):
            async with Sandbox(SandboxConfig()) as sb:
                r = await sh(sb, "ls /usr/bin/env && ls -A /usr/lib/python3/dist-packages")
                assert "/usr/bin/env" in r.stdout, f"/usr is not bound (positive control): {r}"
                leaked = sorted(set(r.stdout.split()) & set(names))
                assert not leaked, f"the host's dist-packages is readable ({how}): {leaked[:10]}"


async def _search_usr(made: list[Path], token: str, how: str) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        vendor = next(p for p in made if p.parent == Path("/usr/lib"))
        r = await sh(sb, f"cat {vendor}/bin/tool")
        assert "vendored-tool" in r.stdout, f"/usr is not bound (positive control): {r}"
        found = await _search(sb, [str(p) for p in made], token)
        assert not found, f"a later release under the host's /usr is readable ({how}): {found}"
