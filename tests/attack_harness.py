"""Runs one attack of tests/attacks.py as a given caller.

- "root": in this process (only when we are root).
- "unprivileged": in this process when we are not root; when we are, in a subprocess under a
  dedicated unprivileged uid, with its own HOME and a venv that uid can execute (our own venv
  may live where it cannot go, e.g. a pyenv under /root).

Also the subprocess's entry point: `python attack_harness.py <attack>` reads the AttackContext
as JSON on stdin and prints one JSON line, the Outcome; `python attack_harness.py --serve` does
so for one {"name", "ctx"} request a line, for as long as its stdin is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from attacks import ATTACKS, AttackContext, AttackSkipped
from minisandbox.utils.safefs import discard_tree

CALLERS = ("unprivileged", "root")
UNPRIVILEGED_UID = 4242
ATTACK_TIMEOUT = 120.0
# Attacks whose work grows with the machine's load (each of sigkill_during_start's 21 tries
# waits up to twice a first start, seconds on a busy machine): under pytest's 300 s per test.
ATTACK_TIMEOUTS = {"sigkill_during_start": 270.0}


def budget(name: str) -> float:
    """How long attack `name` may take."""
    return ATTACK_TIMEOUTS.get(name, ATTACK_TIMEOUT)


HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Outcome(BaseModel):
    ok: bool
    error: str = ""
    skipped: str = ""


class RunnerUnavailable(Exception):
    """No way to run attacks under another uid here; the message says why."""


def run_in_process(name: str, ctx: AttackContext, timeout: float | None = None) -> Outcome:
    timeout = budget(name) if timeout is None else timeout
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
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None
        self._key: tuple[str, str] | None = None
        try:
            os.chmod(self.base, 0o755)  # the uid runs the venv from here
            self.home = self.base / "home"
            self.home.mkdir(mode=0o700)
            os.chown(self.home, uid, uid)
            self.tmp = self.base / "tmp"  # its TMPDIR: its runtime directories go with base
            self.tmp.mkdir(mode=0o700)
            os.chown(self.tmp, uid, uid)
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

    def _worker(self, ctx: AttackContext) -> subprocess.Popen[bytes]:
        """The uid's worker process (`attack_harness.py --serve`), started on first use and
        again after one was killed: one interpreter for every attack, as the root caller's
        attacks share pytest's (an interpreter's start and imports per attack cost a minute)."""
        key = (ctx.env_secret_name, ctx.env_secret_value)
        if self._proc is not None and (self._proc.poll() is not None or self._key != key):
            self._stop_worker()
        if self._proc is None:
            env = {
                "PATH": HOST_PATH,
                "HOME": str(self.home),
                "TMPDIR": str(self.tmp),
                "LANG": "C.UTF-8",
                ctx.env_secret_name: ctx.env_secret_value,
            }
            if "MINISANDBOX_BWRAP" in os.environ:
                env["MINISANDBOX_BWRAP"] = os.environ["MINISANDBOX_BWRAP"]
            self._stderr = tempfile.TemporaryFile(dir=self.base)  # noqa: SIM115 (closed in _stop_worker)
            self._proc = subprocess.Popen(
                [*_setpriv(self.uid), self.python, "-E", "-s", __file__, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                cwd=self.home,
                start_new_session=True,  # so that a timeout can kill all of it
            )
            self._key = key
        return self._proc

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 3000))
        return self._stderr.read().decode(errors="replace")

    def _stop_worker(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        if self._stderr is not None:
            self._stderr.close()
        self._proc, self._stderr = None, None

    def run(self, name: str, ctx: AttackContext, timeout: float | None = None) -> Outcome:
        timeout = budget(name) if timeout is None else timeout
        proc = self._worker(ctx)
        assert proc.stdin is not None and proc.stdout is not None
        request = json.dumps({"name": name, "ctx": ctx.model_dump(mode="json")}) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except OSError:
            tail = self._stderr_tail()
            self._stop_worker()
            return Outcome(ok=False, error=f"uid {self.uid} worker gone: {tail}")
        ready, _, _ = select.select([proc.stdout], [], [], timeout + 30)
        line = proc.stdout.readline() if ready else b""
        if not line.startswith(b"{"):
            why = "timed out" if not ready else f"exit {proc.poll()}"
            tail = self._stderr_tail()
            self._stop_worker()  # killed with everything it started: the next attack gets anew
            return Outcome(ok=False, error=f"uid {self.uid} worker {why}: stderr: {tail}")
        return Outcome.model_validate_json(line)

    def close(self) -> None:
        self._stop_worker()
        discard_tree(self.base)  # copes with the mode-000 dirs overlayfs leaves behind


def main() -> None:
    if sys.argv[1:] != ["--serve"]:
        ctx = AttackContext.model_validate_json(sys.stdin.read())
        print(run_in_process(sys.argv[1], ctx).model_dump_json(), flush=True)
        return
    # A worker: one request a line, one Outcome a line. What attacks print goes to stderr, so
    # that stdout carries nothing but the answers.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        ctx = AttackContext.model_validate(request["ctx"])
        answers.write(run_in_process(request["name"], ctx).model_dump_json() + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
