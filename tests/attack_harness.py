"""Runs one attack of tests/attacks.py as a given caller.

- "root": in this process (only when we are root).
- "unprivileged": in this process when we are not root; when we are, in a subprocess under a
  dedicated unprivileged uid, with its own HOME and a venv that uid can execute (our own venv
  may live where it cannot go, e.g. a pyenv under /root).

Also the subprocess's entry point: `python attack_harness.py <attack>` reads the AttackContext
as JSON on stdin and prints one JSON line: the Outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from pydantic import BaseModel

from attacks import ATTACKS, AttackContext, AttackSkipped
from minisandbox.sandbox.runtime import remove_tree

CALLERS = ("unprivileged", "root")
UNPRIVILEGED_UID = 4242
ATTACK_TIMEOUT = 120.0
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Outcome(BaseModel):
    ok: bool
    error: str = ""
    skipped: str = ""


class RunnerUnavailable(Exception):
    """No way to run attacks under another uid here; the message says why."""


def run_in_process(name: str, ctx: AttackContext, timeout: float = ATTACK_TIMEOUT) -> Outcome:
    # The secret must be in the environment of whoever creates the sandboxes.
    os.environ[ctx.env_secret_name] = ctx.env_secret_value
    try:
        asyncio.run(asyncio.wait_for(ATTACKS[name](ctx), timeout))
    except AttackSkipped as e:
        return Outcome(ok=False, skipped=str(e))
    except asyncio.TimeoutError:
        # The chained CancelledError's traceback shows where the attack was stuck.
        return Outcome(ok=False, error=f"no end within {timeout} s:\n{traceback.format_exc()}")
    except Exception:
        return Outcome(ok=False, error=traceback.format_exc())
    return Outcome(ok=True)


def _setpriv(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


# Runs as the uid, and through a shell: setpriv execs its own target while it still holds
# capabilities, which would let a Python under /root (a pyenv) pass. Its stdlib must be its own.
_PY_CHECK = (
    "import os, sys, json; assert sys.version_info >= (3, 10); "
    "assert os.path.realpath(json.__file__).startswith(os.path.realpath(sys.base_prefix))"
)


def _usable_by(uid: int, python: str) -> bool:
    """Can `uid` itself run `python` (>= 3.10), stdlib included?"""
    shell = ["/bin/sh", "-c", 'exec "$0" -I -c "$1"', python, _PY_CHECK]
    try:
        r = subprocess.run(
            [*_setpriv(uid), *shell],
            env={"PATH": HOST_PATH},
            cwd="/",
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def find_python(uid: int) -> str:
    candidates = [sys.executable, getattr(sys, "_base_executable", sys.executable)]
    candidates += ["/usr/bin/python3", "/usr/local/bin/python3"]
    candidates += [shutil.which(f"python3.{minor}", path=HOST_PATH) for minor in range(10, 15)]
    seen = set()
    for cand in candidates:
        if not cand or not os.path.exists(cand):
            continue
        real = os.path.realpath(cand)
        if real not in seen and _usable_by(uid, real):
            return real
        seen.add(real)
    raise RunnerUnavailable(f"no Python >= 3.10 that uid {uid} can execute (tried {sorted(seen)})")


def _find_uv(repo: Path) -> str:
    for cand in (repo / ".venv/bin/uv", Path(sys.executable).parent / "uv", shutil.which("uv")):
        if cand and os.access(cand, os.X_OK):
            return str(cand)
    raise RunnerUnavailable("no `uv` to build a venv for the unprivileged uid (scripts/bootstrap)")


class UidRunner:
    """Runs attacks in a subprocess as `uid`, from a venv of its own with the project in it."""

    def __init__(self, repo: Path, uid: int = UNPRIVILEGED_UID) -> None:
        if shutil.which("setpriv", path=HOST_PATH) is None:
            raise RunnerUnavailable("no `setpriv` (util-linux) to switch to an unprivileged uid")
        self.uid = uid
        self.repo = repo
        self.base = Path(tempfile.mkdtemp(prefix="msb-attack-uid-"))
        try:
            os.chmod(self.base, 0o755)  # the uid runs the venv from here
            self.home = self.base / "home"
            self.home.mkdir(mode=0o700)
            os.chown(self.home, uid, uid)
            self._build_venv()
        except BaseException:
            self.close()
            raise

    def _build_venv(self) -> None:
        python = find_python(self.uid)
        uv = _find_uv(self.repo)
        venv = self.base / "venv"
        subprocess.run([uv, "venv", "-q", "-p", python, str(venv)], check=True, timeout=120)
        install = [uv, "pip", "install", "-q", "--python", str(venv / "bin/python")]
        # With Ray when we have it: the node agent's attacks need minisandbox.cluster.
        extra = "[ray]" if importlib.util.find_spec("ray") is not None else ""
        install += ["-e", f"{self.repo}{extra}"]
        # Offline first: the uv cache usually has everything; only then ask the index.
        if subprocess.run([*install, "--offline"], capture_output=True, timeout=300).returncode:
            r = subprocess.run(install, capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"cannot install the project into {venv}: {r.stderr}")
        self.python = str(venv / "bin/python")
        if not _usable_by(self.uid, self.python):
            raise RunnerUnavailable(f"uid {self.uid} cannot run {self.python}")

    def make_dir(self, prefix: str, mode: int = 0o755) -> Path:
        """A directory owned by the uid, inside our (removed at close) base dir."""
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.base))
        os.chmod(path, mode)
        os.chown(path, self.uid, self.uid)
        return path

    def run(self, name: str, ctx: AttackContext, timeout: float = ATTACK_TIMEOUT) -> Outcome:
        env = {
            "PATH": HOST_PATH,
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            ctx.env_secret_name: ctx.env_secret_value,
        }
        if "MINISANDBOX_BWRAP" in os.environ:
            env["MINISANDBOX_BWRAP"] = os.environ["MINISANDBOX_BWRAP"]
        argv = [*_setpriv(self.uid), self.python, "-E", "-s", __file__, name]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=self.home,
            start_new_session=True,  # so that a timeout can kill all of it
        )
        try:
            out, err = proc.communicate(ctx.model_dump_json().encode(), timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return Outcome(ok=False, error=f"timed out after {timeout} s; stderr: {err[-3000:]!r}")
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            tail = (out + err).decode(errors="replace")[-3000:]
            return Outcome(ok=False, error=f"uid {self.uid} runner exit {proc.returncode}: {tail}")
        return Outcome.model_validate_json(lines[-1])

    def close(self) -> None:
        remove_tree(self.base)  # copes with the mode-000 dirs overlayfs leaves behind


def main() -> None:
    ctx = AttackContext.model_validate_json(sys.stdin.read())
    print(run_in_process(sys.argv[1], ctx).model_dump_json(), flush=True)


if __name__ == "__main__":
    main()
