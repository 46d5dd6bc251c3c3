"""Install one integration stack's supported range into its own venv and run its tests.

Called by scripts/test-stack. `.ci/stacks/NAME.toml`:

    python = "3.12"                       # the Python the stack's releases require
    install = ["skyrl==0.4.0", "..."]     # requirements beside this package (uv pip syntax)
    extras = ["skyrl"]                    # this package's extras to install (editable)
    tests = ["tests/integrations/test_skyrl_train.py"]
    uv_args = []                          # extra `uv pip install` arguments, if a range needs them
    clone = [{url = "https://...", ref = "v1.1.0"}]  # repositories not on PyPI: cloned at the
                                          # ref (tag or commit) into .venv-stacks/src/<repo
                                          # name>; `install` names them as -e paths
    note = "why the range is what it is"

The venv is `.venv-stacks/NAME`, reused while the file is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the core package depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"python", "install", "extras", "tests", "uv_args", "clone", "note"}


def _checkout(url: str, ref: str) -> str:
    """`url` cloned into .venv-stacks/src/<its name> (once) and checked out at `ref` (each run:
    a changed ref moves it); returns the commit checked out.

    Raises:
        subprocess.CalledProcessError: the clone, fetch or checkout failed.
    """
    dest = ROOT / ".venv-stacks" / "src" / url.rstrip("/").rsplit("/", 1)[-1]
    if dest.is_dir() and not (dest / ".git").exists():
        # A copy put there by hand (a machine that cannot reach the host): used as it is. (No
        # git command runs in it: git would find this checkout's repository above it.)
        print(f"test-stack: {dest} is not a git checkout: using it as it is", file=sys.stderr)
        return f"copy:{dest.stat().st_mtime_ns}"
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Not --branch: a ref may be a commit (a repository without releases).
        subprocess.run(["git", "clone", "-q", url, str(dest)], check=True)

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(dest), *args], capture_output=True, text=True)

    want = git("rev-parse", "--verify", "-q", f"{ref}^{{commit}}")
    if want.returncode != 0:  # a ref the clone does not have yet
        subprocess.run(["git", "-C", str(dest), "fetch", "-q", "--tags", "origin"], check=True)
        want = git("rev-parse", "--verify", "-q", f"{ref}^{{commit}}")
    commit = want.stdout.strip()
    if git("rev-parse", "HEAD").stdout.strip() != commit or not commit:
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", ref], check=True)
    return git("rev-parse", "HEAD").stdout.strip()


def matrix() -> str:
    """The stacks as a CI matrix: [{"stack": NAME, "python": VERSION}, ...] (JSON)."""
    rows = []
    for path in sorted((ROOT / ".ci" / "stacks").glob("*.toml")):
        rows.append({"stack": path.stem, "python": str(tomllib.loads(path.read_text())["python"])})
    return json.dumps(rows)


def main(argv: list[str]) -> int:
    if argv == ["--matrix"]:
        print(matrix())
        return 0
    if not argv:
        print("usage: scripts/test-stack NAME [pytest args]", file=sys.stderr)
        return 2
    name, pytest_args = argv[0], argv[1:]
    spec_path = ROOT / ".ci" / "stacks" / f"{name}.toml"
    if not spec_path.is_file():
        known = ", ".join(sorted(p.stem for p in spec_path.parent.glob("*.toml")))
        print(f"test-stack: no stack {name!r}: choose one of {known}", file=sys.stderr)
        return 2
    raw = spec_path.read_bytes()
    spec = tomllib.loads(raw.decode())
    if unknown := set(spec) - KEYS:
        print(f"test-stack: {spec_path.name}: unknown keys {sorted(unknown)}", file=sys.stderr)
        return 2
    # Imported here: --matrix runs on a bare Python, before anything is installed.
    from minisandbox.envs.toolchains import ToolchainNotFoundError, find_interpreter

    try:
        interpreter = find_interpreter(str(spec["python"]))
    except ToolchainNotFoundError as e:
        print(f"test-stack: {name} needs Python {spec['python']}: {e}", file=sys.stderr)
        return 2
    heads = [_checkout(repo["url"], repo["ref"]) for repo in spec.get("clone", [])]
    uv = str(Path(sys.executable).parent / "uv")
    venv = ROOT / ".venv-stacks" / name
    stamp = venv / ".minisandbox-stack"
    # Rebuilt when the stack file, the interpreter, this package's extras or a clone changes.
    key = [raw, str(interpreter.executable).encode(), (ROOT / "pyproject.toml").read_bytes()]
    want = hashlib.sha256(b"\0".join([*key, *(h.encode() for h in heads)])).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == want):
        subprocess.run(
            [uv, "venv", "--clear", "-q", "-p", str(interpreter.executable), str(venv)], check=True
        )
        extras = ",".join(["stacktest", *spec.get("extras", [])])
        subprocess.run(
            [
                uv,
                "pip",
                "install",
                "-q",
                "-p",
                str(venv / "bin" / "python"),
                *spec.get("uv_args", []),
                "-e",
                f"{ROOT}[{extras}]",
                *spec.get("install", []),
            ],
            check=True,
            cwd=ROOT,  # the stack file's -e paths are relative to the checkout
        )
        stamp.write_text(want)
    env = os.environ | {"MINISANDBOX_STACK": name}
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-ra",
        *spec["tests"],
        *pytest_args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
