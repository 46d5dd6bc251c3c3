"""Building a task's layers, each step inside a build sandbox (network on), and starting it.

Two layers per task, both published to the layer store:
- the environment layer (`/opt/venv`): a uv venv (pip seeded, so agents can still
  `pip install`) with the recipe's pinned requirements. It is named by a content key of the recipe
  and the interpreter (`env/<key>`), so tasks with the same recipe share it.
- the task layer: the repository at its base commit in `/testbed` plus what the install commands
  changed, i.e. the build sandbox's upper directory over the environment layer (`task/<key>`).

Every step's output goes to a log under `logs/`; a failure names its step and keeps the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import inspect
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import BaseModel, Field

from minisandbox.envs import githistory, relax
from minisandbox.envs.compat import compat_layer
from minisandbox.envs.system_packages import apt_packages, missing_on_host
from minisandbox.envs.toolchains import Interpreter, find_interpreter
from minisandbox.errors import MiniSandboxError
from minisandbox.evaluation.services import tools_layers
from minisandbox.layers.budget import LocalIOBudget
from minisandbox.layers.nodecache import NodeCache
from minisandbox.layers.store import LayerStore
from minisandbox.sandbox.config import GiB, Limits, SandboxConfig
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.tasks.specs import Task, files_in_patch
from minisandbox.utils import safefs

if TYPE_CHECKING:
    from minisandbox.evaluation.validation import Validation

VENV = "/opt/venv"
DEFAULT_IO_BUDGET = 2 * GiB
# Bump when what a task layer holds changes (5: only the base commit's past; 6: its submodules).
_FORMAT = 6
# Wheels of the repository's build requirements, fetched at build time: evaluation reinstalls
# the package offline (SWE-bench's eval scripts run `pip install -e .`) with pip's usual build
# isolation, from these, so the same setuptools builds it as at build time (another one can
# change how an editable install is made, and tests that inspect sys.path with it).
WHEELHOUSE = "/opt/minisandbox/wheelhouse"
_BUILD_REQUIRES = """\
import os
requires = None
if os.path.exists("pyproject.toml"):
    try:
        from pip._vendor import tomli as reader
    except ImportError:
        from pip._vendor import toml as reader
    with open("pyproject.toml", encoding="utf-8") as fh:
        requires = reader.loads(fh.read()).get("build-system", {}).get("requires")
if requires is None:
    requires = ["setuptools>=40.8.0"]
print("\\n".join([*requires, "wheel"]))
"""
# When the gold patch changes the package's dependencies, the official harness installs the new
# ones from PyPI while evaluating (its eval script reinstalls the package). Evaluation here has no
# network, so the wheels the patched package needs are fetched at build time into a layer that
# only evaluation sandboxes mount: an agent never sees which packages the fix brings.
EVAL_WHEELHOUSE = "/opt/minisandbox/eval-wheelhouse"
_DEPENDENCY_FILE = re.compile(
    r"(^|/)(setup\.py|setup\.cfg|pyproject\.toml|requirements[^/]*\.txt)$"
)
_EVAL_DEPS_FORMAT = 1
# Upper-layer paths that are build noise, not part of a layer.
_NOISE = (
    "run",
    "tmp",
    "root/.cache",
    "root/.config/uv",
    "root/.local/share/uv",
    "etc/hostname",
    "etc/hosts",
    "etc/resolv.conf",
)
# Bumped when what an environment layer holds changes (v2: its bytecode compiled at build;
# v3: laid out as a self-contained install, see _STANDALONE; old setuptools for old recipes).
# Also bump it when relax.py's ladder changes what a relaxed recipe installs.
_ENV_FORMAT = "v4"  # v4: include/pythonX.Y a directory of links (packages add headers there)


class BuildError(MiniSandboxError):
    """A build step failed. `step` names it; `log` is the kept log file."""

    def __init__(self, task_or_env: str, step: str, log: Path, tail: str) -> None:
        super().__init__(f"{task_or_env}: step '{step}' failed (log: {log}){tail}")
        self.step, self.log = step, log
        self.tail = tail.removeprefix(":").strip()  # the error's last lines, or its reason


class RecordedBuildFailure(BuildError):
    """An environment whose build failed earlier, in this process or another sharing the
    store: its tasks fail at once with that error instead of each rebuilding it (minutes
    each) to fail the same way. `minisandbox build --force` retries."""

    def __init__(self, ref: str, record: dict[str, object]) -> None:
        step, log, tail = str(record["step"]), Path(str(record["log"])), str(record["tail"])
        MiniSandboxError.__init__(
            self,
            f"{ref}: step '{step}' failed (log: {log}); recorded failure of this recipe "
            f"(building {record.get('task')} at {record.get('at')}), not rebuilt; "
            f"--force retries (`minisandbox build --force`)" + (f":\n{tail}" if tail else ""),
        )
        self.step, self.log, self.tail = step, log, tail


# Host settings a build needs to reach the package index as the host does (proxies, private
# indexes, a corporate CA). Only for build sandboxes: task sandboxes get none of the host's env.
_BUILD_ENV_PREFIXES = ("PIP_", "UV_", "SSL_CERT_")
_BUILD_ENV_NAMES = {
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
}
_BUILD_ENV_OWN = {"UV_CACHE_DIR", "PIP_CACHE_DIR", "PIP_FIND_LINKS", "UV_FIND_LINKS"}


def _host_build_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if (k in _BUILD_ENV_NAMES or k.startswith(_BUILD_ENV_PREFIXES)) and k not in _BUILD_ENV_OWN
    }


def default_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minisandbox"


class BuildSettings(BaseModel):
    """Where things live. Each location also reads an environment variable, so a cluster or an
    integration can set it once."""

    store: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("MINISANDBOX_STORE") or default_home() / "store"
        )
    )
    cache: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("MINISANDBOX_CACHE") or default_home() / "layers"
        )
    )
    git_mirror: Path | None = Field(
        default_factory=lambda: (
            Path(os.environ["MINISANDBOX_GIT_MIRROR"])
            if os.environ.get("MINISANDBOX_GIT_MIRROR")
            else None
        )
    )
    git_url_template: str = "https://github.com/{repo}.git"
    cache_max_bytes: int = 100 * GiB
    # Sandboxes refuse a task without a passing validation (`minisandbox build --validate`).
    require_validated: bool = Field(
        default_factory=lambda: (
            os.environ.get("MINISANDBOX_REQUIRE_VALIDATED", "").strip().lower()
            not in ("", "0", "false", "no")
        )
    )

    @property
    def logs(self) -> Path:
        return self.store.parent / "logs" if self.store.name == "store" else self.store / "logs"


class BuildResult(BaseModel):
    task_id: str
    status: Literal["built", "cached", "failed"]
    env_layer: str | None = None
    task_layer: str | None = None
    error: str | None = None
    log: str | None = None
    seconds: float = 0.0
    built_layers: list[str] = []  # the refs this build made (the others were in the store)
    step: str | None = None  # the build step that failed
    recorded_failure: bool = False  # failed at once: the environment's failure was recorded
    # The recipe's pins did not install as pip packages (a conflict, or a pin that does not
    # build): installed as they are, without resolving their declared dependencies, as conda
    # did (Builder._install_relaxed).
    unresolved: bool = False
    # Pins its environment relaxed to install (relax.py): none for most recipes.
    relaxed: list[relax.Relaxation] = []
    # What may make the task behave unlike in its official image (system_packages.py).
    warnings: list[str] = []


class Builder:
    def __init__(self, settings: BuildSettings | None = None) -> None:
        self.settings = settings or BuildSettings()
        self.store = LayerStore(self.settings.store)
        owner = SandboxConfig().layer_owner()
        # Unpacking on this node, across all its processes, is bounded by the I/O budget:
        # $MINISANDBOX_IO_BUDGET bytes in flight, 2 GiB when unset.
        budget = LocalIOBudget.from_env(self.settings.cache / "io-budget") or LocalIOBudget(
            self.settings.cache / "io-budget", DEFAULT_IO_BUDGET
        )
        self.cache = NodeCache(
            self.settings.cache,
            self.store,
            max_bytes=self.settings.cache_max_bytes,
            budget=budget,
            owner=owner,
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._interpreters: dict[str, Interpreter] = {}
        self._swept = False
        self._forced: set[str] = set()  # refs a `force` build remade in this builder
        self.require_validated = self.settings.require_validated

    # ---------------------------------------------------------------- keys

    def interpreter(self, task: Task) -> Interpreter:
        # Discovery runs programs (uv, interpreters): once per version, not once per start.
        if task.env.python not in self._interpreters:
            self._interpreters[task.env.python] = find_interpreter(task.env.python)
        return self._interpreters[task.env.python]

    def env_ref(self, task: Task) -> str:
        return f"env/{_ENV_FORMAT}-{task.environment_key(self.interpreter(task).version)}"

    def task_ref(self, task: Task, env_layer: str) -> str:
        spec = {
            "format": _FORMAT,
            "repo": task.repo,
            "base_commit": task.base_commit,
            "env_layer": env_layer,
            "pre_install": task.pre_install,
            "install": task.install,
            "bug_patch": task.bug_patch,
        }
        extra = eval_pip_requirements(task.eval_script or "")
        if extra:  # (absent when none: the other tasks' keys stay as they were)
            spec["eval_requirements"] = extra
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        return f"task/{digest}"

    def eval_deps_ref(self, task: Task, task_layer: str) -> str | None:
        """The ref of the task's evaluation-only wheels (see EVAL_WHEELHOUSE), or None when its
        gold patch leaves the dependencies alone."""
        files = files_in_patch(task.gold_patch) if task.gold_patch else []
        if not any(_DEPENDENCY_FILE.search(f) for f in files):
            return None
        spec = {"format": _EVAL_DEPS_FORMAT, "task_layer": task_layer, "gold": task.gold_patch}
        return f"evaldeps/{hashlib.sha256(json.dumps(spec).encode()).hexdigest()}"

    def eval_layers(self, task: Task, task_layer: str) -> list[str]:
        """Layers that evaluation sandboxes of the task add to its own (present ones only)."""
        ref = self.eval_deps_ref(task, task_layer)
        found = self.store.resolve(ref) if ref else None
        return [found] if found else []

    def layers_of(self, task: Task) -> tuple[str, str] | None:
        """(environment layer, task layer) ids when both are in the store."""
        env_layer = self.store.resolve(self.env_ref(task))
        if env_layer is None:
            return None
        task_layer = self.store.resolve(self.task_ref(task, env_layer))
        return (env_layer, task_layer) if task_layer else None

    def validation(self, task: Task) -> Validation | None:
        """The task's recorded validation (see `validation`), None when there is none for its
        current layers and test spec."""
        from minisandbox.evaluation.validation import read_validation

        return read_validation(self, task)

    # ---------------------------------------------------------------- building

    async def build(
        self,
        task: Task,
        *,
        force: bool = False,
        on_phase: Callable[[str, str], None] | None = None,
    ) -> BuildResult:
        """Build the task's layers that the store lacks (all of them with `force`, each ref
        once per Builder: tasks sharing an environment rebuild it once). A failure is a
        "failed" result naming its step and log. An environment whose build failed before is
        not rebuilt but fails at once with the recorded error, until `force`.

        `on_phase(task_id, phase)` is told "building env" and "building task" as the build
        reaches a layer it has to make (for progress displays)."""
        began = time.monotonic()
        made: list[str] = []

        def phase(name: str, ref: str) -> None:
            if on_phase is not None and (
                (force and ref not in self._forced) or self.store.resolve(ref) is None
            ):
                on_phase(task.id, name)

        try:
            phase("building env", self.env_ref(task))
            env_layer = await self._env_layer(task, force, made)
            phase("building task", self.task_ref(task, env_layer))
            task_layer = await self._task_layer(task, env_layer, force, made)
            await self._eval_deps_layer(task, env_layer, task_layer, force, made)
        except MiniSandboxError as e:
            return BuildResult(
                task_id=task.id,
                status="failed",
                error=str(e),
                log=str(getattr(e, "log", "") or "") or None,
                step=getattr(e, "step", None),
                recorded_failure=isinstance(e, RecordedBuildFailure),
                seconds=time.monotonic() - began,
            )
        env_meta = self.store.meta(env_layer) or {}
        return BuildResult(
            task_id=task.id,
            status="built" if made else "cached",
            built_layers=made,
            env_layer=env_layer,
            task_layer=task_layer,
            seconds=time.monotonic() - began,
            relaxed=_relaxations(env_meta),
            unresolved=bool(env_meta.get("unresolved")),
            warnings=host_warnings(task),
        )

    def relaxed(self, env_layer: str) -> list[relax.Relaxation]:
        """The pins an environment layer relaxed (recorded in its metadata at build)."""
        return _relaxations(self.store.meta(env_layer) or {})

    async def build_env(self, task: Task, *, force: bool = False) -> str:
        """Build (or find) only the task's environment layer and return its id: environments
        can be prepared, or checked, before the repositories are at hand.

        Raises:
            BuildError: a step failed (RecordedBuildFailure: it failed before, until `force`).
        """
        return await self._env_layer(task, force, [])

    @contextlib.asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[None]:
        """One build of `name` at a time: across coroutines (an asyncio lock) and across
        processes on this machine (flock on a file beside the store's build area)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            locks = self.settings.store.parent / "build-locks"
            locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{name.replace('/', '_')}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing drops the lock

    async def _once(
        self,
        ref: str,
        force: bool,
        make: Callable[[], Awaitable[str]],
        *,
        record_for: str | None = None,
    ) -> str:
        """The layer `ref` names: the stored one, else (or with `force`, once per Builder) the
        one `make()` builds and publishes, under the ref's build lock, so it is built once.

        With `record_for` (the task asking), a failed step is recorded in the store against
        `ref` (see `_record_failure`): later requests, from any process, raise it at once
        (RecordedBuildFailure) instead of building again, until a `force` build; a successful
        build clears the record.

        Raises:
            BuildError: `make()` failed at a step, or (RecordedBuildFailure) did before.
        """
        async with self._lock(ref):
            force = force and ref not in self._forced
            existing = self.store.resolve(ref)
            if existing and not force:
                return existing
            if record_for is not None and not force:
                known = self._recorded_failure(ref)
                if known is not None:
                    raise known
            if force:
                self._forced.add(ref)
            if record_for is None:
                return await make()
            try:
                layer = await make()
            except BuildError as e:
                await asyncio.to_thread(self._record_failure, ref, record_for, e)
                raise
            await asyncio.to_thread(self.store.clear_failure, ref)
            return layer

    async def _env_layer(self, task: Task, force: bool, made: list[str]) -> str:
        ref = self.env_ref(task)
        # Tasks sharing a recipe build it once, and a recipe that fails, fails once.
        return await self._once(
            ref,
            force,
            lambda: self._make_env_layer(task, ref, made, force),
            record_for=task.id,
        )

    def _record_failure(self, ref: str, task_id: str, error: BuildError) -> None:
        """Record in the store why building `ref` failed: its step, log and the error's tail
        (the log may be on another machine), and which builder code failed (see `_recorded_
        failure`)."""
        self.store.record_failure(
            ref,
            {
                "ref": ref,
                "task": task_id,
                "step": error.step,
                "log": str(error.log),
                "tail": error.tail,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                "builder": _builder_code(),
            },
        )

    def _recorded_failure(self, ref: str) -> RecordedBuildFailure | None:
        """The recorded failure of `ref`, unless another version of the builder recorded it:
        a fix to how environments are built must not be hidden behind old failures."""
        record = self.store.failure(ref)
        if record is None or record.get("builder") != _builder_code():
            return None
        if not all(isinstance(record.get(k), str) for k in ("step", "log", "tail")):
            return None
        return RecordedBuildFailure(ref, record)

    async def _make_env_layer(
        self, task: Task, ref: str, made: list[str], force: bool = False
    ) -> str:
        interp = self.interpreter(task)
        logs = self._log_dir(ref)
        constraints = build_constraints(task.env.requirements)
        with self._workdir("env-") as work:
            upper = work / "upper"
            config = self._build_config(interp, upper=upper)
            async with Sandbox(config) as sb:
                await self._step(
                    sb, ref, logs, "venv", f"uv venv --seed --python {interp.executable} {VENV}"
                )
                await sb.write_file("/tmp/standalone.sh", _STANDALONE)
                args = " ".join(shlex.quote(str(a)) for a in (VENV, interp.prefix))
                await self._step(sb, ref, logs, "layout", f"bash /tmp/standalone.sh {args}")
                await sb.write_file("/tmp/build-constraints.txt", "".join(constraints))
                relaxed: list[relax.Relaxation] = []
                unresolved: dict[str, list[str]] | None = None
                if task.env.requirements:
                    try:
                        await self._install(sb, ref, logs, task, task.env.requirements, [])
                    except BuildError as e:
                        if not task.env.relax_pins:
                            raise
                        relaxed, unresolved = await self._install_relaxed(sb, ref, logs, task, e)
                # Bytecode now, once: otherwise the first import or pip run of every task
                # writes its own copy of the environment's .pyc files into its task layer.
                # Only site-packages: the standard library is the interpreter's (read-only).
                await self._step(
                    sb,
                    ref,
                    logs,
                    "bytecode",
                    f"{VENV}/bin/python -m compileall -q -j 0 {VENV}/lib/python*/site-packages"
                    " || true",
                )
            layer_dir = work / "layer"
            (layer_dir / "opt").mkdir(parents=True)
            _collect(upper, VENV, layer_dir, ref, logs)
            meta = {
                "kind": "env",
                "recipe": task.env.model_dump(),
                "build_constraints": [line.strip() for line in constraints],
                "relaxed": [r.model_dump() for r in relaxed],
            }
            if unresolved is not None:  # installed without resolving: what it holds, and
                meta["unresolved"] = True  # what pip finds inconsistent in it
                meta.update(unresolved)
            return await self._publish(ref, layer_dir, meta, interp, logs, made, force)

    async def _install(
        self,
        sb: Sandbox,
        ref: str,
        logs: Path,
        task: Task,
        requirements: list[str],
        uv_options: list[str],
    ) -> None:
        """Install `requirements` into the venv (the "requirements" step)."""
        await sb.write_file("/tmp/requirements.txt", "\n".join(requirements) + "\n")
        options = " ".join([*task.env.pip_options, *map(shlex.quote, uv_options)])
        # No --compile-bytecode: uv's compiler needs Python >= 3.7 (3.6 has no
        # py_compile.PycInvalidationMode); the interpreter's own compileall (the bytecode
        # step) works on every version.
        await self._step(
            sb,
            ref,
            logs,
            "requirements",
            f"uv pip install --python {VENV}/bin/python --link-mode copy "
            f"--build-constraints /tmp/build-constraints.txt {options} "
            "-r /tmp/requirements.txt",
        )

    async def _install_relaxed(
        self, sb: Sandbox, ref: str, logs: Path, task: Task, strict: BuildError
    ) -> tuple[list[relax.Relaxation], dict[str, list[str]]]:
        """After the strict install failed with `strict` (the pins conflict as pip packages, or
        one does not build), install them as conda did: every pin as it is, without resolving
        the dependencies their PyPI metadata declares (`--no-deps`; an export lists the whole
        environment). A pin that still fails to install then steps down relax.py's ladder, one
        at a time. Every round is kept in resolve.log (the last install's output in
        requirements.log). Returns the steps, and what got installed (`uv pip freeze`) and
        which declared dependencies it leaves unmet (`uv pip check`).

        Raises:
            BuildError: an install's own failure when it is neither a conflict among the
                recipe's pins nor a failed build of one (a missing package, the index
                unreachable); at step "resolve" when no pin is left to relax.
        """
        error = strict.log.read_text(errors="replace")
        try:  # a first look, before reading the repository: is it relaxable at all?
            relax.Relaxer(task.env.requirements, None, None).step(error)
        except relax.RelaxationFailed:
            raise strict from None
        log = logs / "resolve.log"
        with log.open("w") as out:
            out.write("# the strict install failed; installing the pins as they are (--no-deps)\n")
            out.flush()
            relaxer: relax.Relaxer | None = None
            failed = strict
            while True:
                reqs = relaxer.requirements() if relaxer else task.env.requirements
                options = ["--no-deps", *(relaxer.uv_options() if relaxer else [])]
                try:
                    await self._install(sb, ref, logs, task, reqs, options)
                    break
                except BuildError as e:
                    failed, error = e, e.log.read_text(errors="replace")
                if relaxer is None:
                    imported, date = await asyncio.to_thread(self._environment_imports, task, logs)
                    relaxer = relax.Relaxer(task.env.requirements, imported, date)
                    known = "unknown (no environment commit)" if imported is None else len(imported)
                    out.write(
                        f"# relaxing pins; top-level names the repository imports at "
                        f"{task.environment_setup_commit}: {known}; date bound {date}\n"
                    )
                try:
                    step = relaxer.step(error)
                except relax.NotRelaxable as e:
                    out.write(f"# {e}\n")
                    raise failed from None  # the install's own error, not a conflict
                except relax.RelaxationFailed as e:
                    out.write(f"# {e}\n")
                    raise BuildError(
                        ref,
                        "resolve",
                        log,
                        f": the recipe's pins do not install even relaxed; fix the recipe "
                        f"(a `pins` override, docs/recipes.md): {e}",
                    ) from None
                out.write(
                    f"# relaxed {step.package} ({step.pinned}) to {step.rung}: {step.conflict}\n"
                )
                out.flush()
            steps = relaxer.steps if relaxer else []
            out.write(f"# installed without dependency resolution, {len(steps)} relaxations\n")
        python = f"{VENV}/bin/python"
        frozen = await sb.execute(["uv", "pip", "freeze", "--python", python])
        # The declared dependencies the environment leaves unmet, as conda's did (uv reports
        # them on stderr, one "The package `a` requires `b`, but ..." line each).
        check = await sb.execute(["uv", "pip", "check", "--python", python], merge_stderr=True)
        unmet = [line.strip() for line in check.stdout.splitlines() if " requires " in line]
        return steps, {"installed": frozen.stdout.splitlines(), "inconsistent": unmet}

    def _environment_imports(
        self, task: Task, logs: Path
    ) -> tuple[frozenset[str] | None, str | None]:
        """What the repository imports at its environment commit, and that commit's date
        (relax.py's priorities and date bound); (None, None) without such a commit.

        Raises:
            BuildError: at step "resolve", when the repository cannot be read at that commit.
        """
        commit = task.environment_setup_commit
        if not commit:
            return None, None
        log = logs / "resolve-source.log"
        source = self._repo_source(task, log, commits=[commit])
        try:
            found = githistory.python_imports_at(source, commit)
            date = githistory.commit_date(source, commit) or None
        except githistory.HistoryError as e:
            log.write_text(f"{e}\n")
            raise BuildError(
                task.id,
                "resolve",
                log,
                f": cannot read {task.repo} at its environment commit {commit} in {source}: "
                f"{str(e)[-300:]}",
            ) from None
        return relax.imported_names([found]), date

    async def _task_layer(self, task: Task, env_layer: str, force: bool, made: list[str]) -> str:
        ref = self.task_ref(task, env_layer)
        return await self._once(
            ref, force, lambda: self._make_task_layer(task, env_layer, ref, made, force)
        )

    async def _make_task_layer(
        self, task: Task, env_layer: str, ref: str, made: list[str], force: bool = False
    ) -> str:
        interp = self.interpreter(task)
        logs = self._log_dir(f"task/{task.id}")
        with self._workdir("task-") as work:
            upper = work / "upper"
            upper.mkdir()
            await asyncio.to_thread(self._checkout, task, upper / "testbed", logs)
            async with self.cache.use([env_layer]) as (env_path,):
                config = self._build_config(interp, upper=upper, layers=[env_path])
                async with Sandbox(config) as sb:
                    if task.bug_patch:
                        await sb.write_file("/tmp/bug.patch", task.bug_patch)
                        await self._step(
                            sb,
                            task.id,
                            logs,
                            "bug_patch",
                            "git apply /tmp/bug.patch && git commit -qam bug",
                        )
                    script = "\n".join(["set -e", *task.pre_install, *task.install])
                    if task.pre_install or task.install:
                        await self._step(sb, task.id, logs, "install", script)
                        await self._wheelhouse(sb, task, logs)
            # The install commands wrote this tree: it is cleaned by descriptors that refuse
            # symlinks (a planted `/root/.config -> /host/dir` must not steer a delete).
            for noise in _NOISE:
                with contextlib.suppress(safefs.UnsafePathError):  # behind a link: not here
                    safefs.remove(upper, noise)
            # The empty mount points of the build's host paths (interpreter, uv): a layer
            # must not depend on where the builder's host keeps them.
            for host_path in config.ro_paths:
                safefs.rmdir_empty_chain(upper, str(host_path).lstrip("/"))
            meta = {"kind": "task", "task": task.id, "env_layer": env_layer}
            return await self._publish(ref, upper, meta, interp, logs, made, force)

    async def _publish(
        self,
        ref: str,
        tree: Path,
        meta: dict,
        interp: Interpreter,
        logs: Path,
        made: list[str],
        force: bool = False,
    ) -> str:
        """Store a built tree as a layer and name it `ref` (last: a ref never names a layer
        that is not fully there). A forced build re-hashes the blobs it reuses and rewrites
        corrupt ones: rebuilding is how a damaged layer is repaired."""
        meta = {**meta, "interpreter": interp.model_dump(mode="json"), "logs": str(logs)}
        layer = await asyncio.to_thread(self.store.publish, tree, meta=meta, verify_existing=force)
        self.store.tag(ref, layer.id)
        made.append(ref)
        return layer.id

    def _build_config(
        self, interp: Interpreter, *, upper: Path, layers: list[Path] | None = None
    ) -> SandboxConfig:
        uv = _uv_binary()
        return SandboxConfig(
            layers=layers or [],
            upper=upper,
            network=True,
            ro_paths=sorted({interp.prefix, uv.parent}),
            venv=VENV,
            env={
                # The system's CA store (a copy of the host's is in the sandbox) rather than
                # uv's bundled one: behind a corporate proxy only the former knows its CA.
                "UV_NATIVE_TLS": "1",
                **_host_build_env(),
                # Whatever the host asks: uv's bytecode compiler fails on Python 3.6 (builds
                # compile with the interpreter's own compileall instead).
                "UV_COMPILE_BYTECODE": "0",
                "UV_CACHE_DIR": "/tmp/uv-cache",
                "PIP_CACHE_DIR": "/tmp/pip-cache",
                "PATH": f"{VENV}/bin:{uv.parent}:/usr/local/bin:/usr/bin:/bin",
            },
            limits=Limits(
                tmp_bytes=16 * GiB,
                upper_bytes=64 * GiB,
                upper_inodes=8_000_000,
                command_timeout=3600,
            ),
        )

    async def _step(self, sb: Sandbox, what: str, logs: Path, step: str, command: str) -> None:
        result = await sb.execute(["/bin/bash", "-c", command], merge_stderr=True)
        log = logs / f"{step}.log"
        log.write_text(f"$ {command}\n{result.stdout}\n[exit code {result.exit_code}]\n")
        if result.exit_code != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-15:])
            raise BuildError(what, step, log, f":\n{tail}" if tail else "")

    def _checkout(self, task: Task, dest: Path, logs: Path) -> None:
        """The repository at its base commit holding only its past (see `githistory`): no
        object, ref, reflog or remote from after it, so an agent cannot find the fix."""
        name = task.repo.replace("/", "__")
        log = logs / "checkout.log"
        source = self._repo_source(task, log, commits=[task.base_commit])
        try:
            githistory.checkout_past(
                source, task.base_commit, dest, githistory.PackCache(self._packs_dir(name))
            )
        except githistory.HistoryError as e:
            log.write_text(f"{task.repo} at {task.base_commit}: {e}\n")
            raise BuildError(task.id, "checkout", log, f": {task.repo}: {e}") from None
        try:
            subs = githistory.submodules(dest)
        except githistory.HistoryError as e:
            raise BuildError(task.id, "checkout", log, f": {task.repo}: .gitmodules: {e}") from None
        for sub in subs:
            # As the official harness's clone has them once its install ran `git submodule
            # update --init` (with the network, which evaluation here does not have).
            repo = _github_repo(sub.url, task.repo)
            if repo is None and not sub.url.startswith("https://"):
                raise BuildError(
                    task.id,
                    "checkout",
                    log,
                    f": submodule {sub.path}: URL {sub.url!r} is neither on GitHub nor https; "
                    "only those are fetched (put a clone in the git mirror as <owner>__<name>)",
                )
            sub_name = (repo or hashlib.sha256(sub.url.encode()).hexdigest()[:16]).replace(
                "/", "__"
            )
            # A GitHub submodule is fetched like any repository (the mirror, or the URL
            # template), whatever protocol its .gitmodules names.
            source = self._repo_source(
                task,
                log,
                commits=[sub.commit],
                repo=repo or sub_name,
                url=None if repo else sub.url,
            )
            try:
                githistory.add_submodule(
                    dest, sub, source, githistory.PackCache(self._packs_dir(sub_name))
                )
            except githistory.HistoryError as e:
                log.write_text(f"{task.repo} at {task.base_commit}, submodule {sub.path}: {e}\n")
                raise BuildError(
                    task.id, "checkout", log, f": {task.repo}: submodule {sub.path}: {e}"
                ) from None
        owner = SandboxConfig().layer_owner()
        if owner is not None:  # a root caller's sandbox root (an unprivileged uid) must own it
            safefs.chown_tree(dest, *owner)

    def _repo_source(
        self,
        task: Task,
        log: Path,
        commits: list[str],
        repo: str | None = None,
        url: str | None = None,
    ) -> Path:
        """A local git repository of `repo` (the task's by default) holding `commits`: the
        mirror's, the bundled examples' or the machine's bare clone cache (cloned from `url`,
        by default the repository's GitHub URL).

        Raises:
            BuildError: at step "checkout", when there is no mirror or the clone fails.
        """
        s = self.settings
        repo = repo or task.repo
        name = repo.replace("/", "__")
        if s.git_mirror is not None and (s.git_mirror / name).is_dir():
            return s.git_mirror / name
        if task.source == "examples" and repo == task.repo:  # they come with the package
            from minisandbox.tasks.examples import materialize_mirror

            return materialize_mirror(s.store.parent / "examples-mirror") / name
        if s.git_mirror is not None:
            raise BuildError(
                task.id, "checkout", log, f": no mirror of {repo} at {s.git_mirror / name}"
            )
        url = url or s.git_url_template.format(repo=repo)
        return self._git_cache(task.id, url, name, log, commits)

    def _packs_dir(self, name: str) -> Path:
        """The repository's history packs, shared by its tasks' checkouts (githistory)."""
        return self.settings.store.parent / "git-packs" / name

    def _git_cache(self, task_id: str, url: str, name: str, log: Path, commits: list[str]) -> Path:
        """A local bare clone of `url` (fetched once per machine, then only what a new commit
        needs): checkouts are cut from it, never cloned whole."""
        cache = self.settings.store.parent / "git-cache" / f"{name}.git"
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache.parent / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            env = {**os.environ, **githistory.GIT_ENV}  # never a password prompt
            # (command, the commit it looks for: fetched when missing)
            steps: list[tuple[list[str], str | None]] = []
            if not (cache / "HEAD").exists():
                steps.append((["git", "clone", "--quiet", "--bare", "--", url, str(cache)], None))
            steps += [
                (["git", "-C", str(cache), "cat-file", "-e", f"{c}^{{commit}}"], c) for c in commits
            ]
            with log.open("a") as out:
                for cmd, commit in steps:
                    out.write(f"$ {' '.join(cmd)}\n")
                    out.flush()
                    r = subprocess.run(
                        cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env
                    )
                    if r.returncode != 0 and commit is not None:
                        cmd = ["git", "-C", str(cache), "fetch", "--quiet", "--", url, commit]
                        out.write(f"$ {' '.join(cmd)}\n")
                        out.flush()
                        r = subprocess.run(
                            cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env
                        )
                    if r.returncode != 0:
                        raise BuildError(
                            task_id, "checkout", log, f": `{' '.join(cmd[:4])}` failed"
                        )
        finally:
            os.close(fd)
        return cache

    async def _eval_deps_layer(
        self, task: Task, env_layer: str, task_layer: str, force: bool, made: list[str]
    ) -> str | None:
        ref = self.eval_deps_ref(task, task_layer)
        if ref is None:
            return None
        return await self._once(
            ref,
            force,
            lambda: self._make_eval_deps_layer(task, env_layer, task_layer, ref, made, force),
        )

    async def _make_eval_deps_layer(
        self,
        task: Task,
        env_layer: str,
        task_layer: str,
        ref: str,
        made: list[str],
        force: bool = False,
    ) -> str:
        interp = self.interpreter(task)
        logs = self._log_dir(f"task/{task.id}")
        with self._workdir("evaldeps-") as work:
            upper = work / "upper"
            upper.mkdir()
            async with self.cache.use([env_layer, task_layer]) as paths:
                config = self._build_config(interp, upper=upper, layers=paths)
                async with Sandbox(config) as sb:
                    await sb.write_file("/tmp/gold.patch", task.gold_patch)
                    # On a copy: the task layer must not learn what the fix changes.
                    await self._step(
                        sb,
                        task.id,
                        logs,
                        "eval_deps",
                        "cp -a /testbed /tmp/gold && cd /tmp/gold && "
                        "git apply /tmp/gold.patch && "
                        f"python -m pip download -q -d {EVAL_WHEELHOUSE} /tmp/gold",
                    )
            layer_dir = work / "layer"
            (layer_dir / "opt" / "minisandbox").mkdir(parents=True)
            _collect(upper, EVAL_WHEELHOUSE, layer_dir, task.id, logs)
            meta = {"kind": "evaldeps", "task": task.id, "task_layer": task_layer}
            return await self._publish(ref, layer_dir, meta, interp, logs, made, force)

    async def _wheelhouse(self, sb: Sandbox, task: Task, logs: Path) -> None:
        """Download the repository's build requirements into WHEELHOUSE (see there)."""
        await sb.write_file("/tmp/build_requires.py", _BUILD_REQUIRES)
        await self._step(
            sb,
            task.id,
            logs,
            "wheelhouse",
            "if [ -f pyproject.toml ] || [ -f setup.py ]; then "
            "python /tmp/build_requires.py > /tmp/build-requires.txt && "
            f"python -m pip download -q -d {WHEELHOUSE} -r /tmp/build-requires.txt; fi",
        )
        extra = eval_pip_requirements(task.eval_script or "")
        if extra:
            await sb.write_file("/tmp/eval-requires.txt", "\n".join(extra) + "\n")
            await self._step(
                sb,
                task.id,
                logs,
                "eval_requirements",
                f"python -m pip download -q -d {WHEELHOUSE} -r /tmp/eval-requires.txt",
            )

    def _collect(self, upper: Path, path: str, layer_dir: Path, what: str, logs: Path) -> None:
        """`_collect` for the layer kinds built elsewhere (the tools layers of services.py)."""
        _collect(upper, path, layer_dir, what, logs)

    def _log_dir(self, name: str) -> Path:
        path = self.settings.logs / name.replace("/", "_")
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def _workdir(self, prefix: str):  # type: ignore[no-untyped-def]
        """A work directory under build-tmp/, named after its owner (see `_work_name`) so that
        what a killed build leaves is recognised and swept: here, on a Builder's first build,
        and by `minisandbox cache gc`."""
        root = build_tmp(self.settings)
        root.mkdir(parents=True, exist_ok=True)
        if not self._swept:
            self._swept = True
            sweep_build_tmp(root)
        path = root / f"{prefix}{_work_name()}"
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            # Sandbox-written uppers: removed by descriptors, never through a planted link.
            safefs.remove_tree(path)

    # ---------------------------------------------------------------- running

    @contextlib.asynccontextmanager
    async def sandbox(
        self,
        task: Task,
        *,
        build: bool = True,
        extra_env: dict[str, str] | None = None,
        evaluation: bool = False,
        require_validated: bool | None = None,
        **overrides: object,
    ) -> AsyncIterator[Sandbox]:
        """A sandbox of the task: its layers made present in the node cache (once per node,
        under the I/O budget), the repository at /testbed, its venv active, its interpreter
        mounted, SWE-bench's conda activation provided. Builds the layers first when missing
        and `build` is true. `extra_env` is added to the task's environment variables.
        `evaluation` adds the layers only evaluation may see (EVAL_WHEELHOUSE).
        `require_validated` (default: the settings') refuses a task without a passing
        validation."""
        if self.require_validated if require_validated is None else require_validated:
            from minisandbox.evaluation.validation import check_validated

            check_validated(self, task)
        layers = self.layers_of(task)
        if layers is None:
            if not build:
                raise MiniSandboxError(f"task {task.id} is not built; run `minisandbox build`")
            result = await self.build(task)
            if result.status == "failed":
                raise MiniSandboxError(f"building task {task.id} failed: {result.error}")
            layers = (result.env_layer, result.task_layer)  # type: ignore[assignment]
        interp = self.interpreter(task)
        compat = compat_layer(self.settings.cache / "compat", self.cache.owner)
        # The tools environments of the task's test services (services.py), on top.
        tools, tool_paths = await tools_layers(self, task)
        # Evaluation's own layers (EVAL_WHEELHOUSE) go only into evaluation sandboxes.
        extra = self.eval_layers(task, layers[1]) if evaluation else []
        env = {**task.env.env, **(extra_env or {})}
        if extra:  # pip splits PIP_FIND_LINKS on whitespace
            env["PIP_FIND_LINKS"] = f"{env.get('PIP_FIND_LINKS', '')} {EVAL_WHEELHOUSE}".strip()
        async with self.cache.use([*layers, *extra, *tools]) as paths:
            config = SandboxConfig(
                layers=[compat, *paths],
                ro_paths=sorted({interp.prefix, *tool_paths}),
                venv=VENV,
                workdir="/testbed",
                env=env,
                **overrides,  # type: ignore[arg-type]
            )
            async with Sandbox(config) as sb:
                yield sb


_PIP_INSTALL = re.compile(r"^(?:python[\d.]*\s+-m\s+)?pip3?\s+install\s+(?P<args>.+)$")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_PIP_FLAGS = {"-q", "--quiet", "-v", "--verbose", "-U", "--upgrade", "--pre"}
_SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>&1"}


def eval_pip_requirements(script: str) -> list[str]:
    """The requirements an eval script installs from the index besides the package itself
    (astropy 3.1's runs `pip install 'pytest<7.2'` before its tests). The official harness
    fetches them while evaluating; evaluation here is offline, so the task's build downloads
    them into WHEELHOUSE, where evaluation's pip looks. (They are the harness's steps, not the
    fix: nothing of the hidden patches, whose heredoc bodies are skipped.)

    The script is data, so only plain requirements are taken: a line with any option other
    than -q/-v/-U/--pre (an index URL, a requirements file) is left out whole, and so is a
    word that is not a requirement `packaging` reads without a URL, or holds `$` (pip expands
    variables in requirement files)."""
    out: list[str] = []
    heredoc: str | None = None
    for raw in script.splitlines():
        line = raw.strip()
        if heredoc is not None:
            if line == heredoc:
                heredoc = None
            continue
        if (m := _HEREDOC.search(line)) is not None:
            heredoc = m.group(1)
        m = _PIP_INSTALL.match(line)
        if m is None:
            continue
        try:
            words = shlex.split(m.group("args"), comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word in _SHELL_OPERATORS:
                words = words[:i]
                break
        if any(w.startswith("-") and w not in _PIP_FLAGS for w in words):
            continue  # an index, a file, an editable install: not a plain requirement
        reqs = [w for w in words if not w.startswith("-")]
        if all(_plain_requirement(w) for w in reqs):
            out += [r for r in reqs if r not in out]
    return out


def _plain_requirement(word: str) -> bool:
    if "$" in word or any(c.isspace() for c in word) or word in (".", "..") or "/" in word:
        return False
    try:
        return Requirement(word).url is None
    except InvalidRequirement:
        return False


def _relaxations(env_meta: dict) -> list[relax.Relaxation]:
    return [relax.Relaxation.model_validate(r) for r in env_meta.get("relaxed") or []]


def host_warnings(task: Task) -> list[str]:
    """Warnings about this host for `task`: the system packages its official image installs
    with apt (commands the loader kept out of the build) that the host, whose /usr every
    sandbox uses, does not have."""
    missing = _missing_packages(tuple(apt_packages(task.env.skipped)))
    if not missing:
        return []
    return [
        f"its official image installs system packages this host lacks: {', '.join(missing)} "
        f"(sandboxes use the host's /usr; tests needing them fail): "
        f"apt-get install {' '.join(missing)}"
    ]


@functools.cache  # once per package set per process: dpkg is asked per build otherwise
def _missing_packages(packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(missing_on_host(list(packages)) or ())


_GITHUB = re.compile(
    r"^(?:https://github\.com/|git@github\.com:|git://github\.com/)([\w-]+/[\w.-]+?)(?:\.git)?/?$"
)


def _github_repo(url: str, parent: str) -> str | None:
    """The GitHub repository ("owner/name") a submodule URL names, on GitHub or relative to
    its superproject's (`../name.git`); None for any other URL."""
    if url.startswith("../"):
        name = url[3:].removesuffix("/").removesuffix(".git")
        ok = re.fullmatch(r"[\w.-]+", name) and name not in (".", "..")
        return f"{parent.split('/')[0]}/{name}" if ok else None
    m = _GITHUB.match(url)
    return m.group(1) if m else None


def _collect(upper: Path, path: str, layer_dir: Path, what: str, logs: Path) -> None:
    """Move the directory a build made at `path` (absolute inside the sandbox) from its upper
    into `layer_dir`, refusing a symlink on the way: a build process can swap `/opt` for a link
    to a host directory, which a plain rename would move into the layer.

    Raises:
        BuildError: step 'collect', when `path` is missing, not a directory, or behind a link.
    """
    rel = path.lstrip("/")
    try:
        safefs.move_dir(upper, rel, layer_dir, rel)
    except (safefs.UnsafePathError, FileNotFoundError, NotADirectoryError) as e:
        log = logs / "collect.log"
        reason = e if isinstance(e, safefs.UnsafePathError) else f"{upper / rel} is missing"
        log.write_text(f"collecting {path} from {upper}: {reason}\n")
        raise BuildError(what, "collect", log, f": {path}: {reason}") from None


# The environment as a self-contained install, as the official images' conda environment is,
# rather than a venv of the host's interpreter. A venv is found from the path its python was
# started by (pyvenv.cfg beside it), so a link to the venv's python from another directory
# (tox-current-env's `.tox/py39/bin/python`, nox, a chain of links) ran the bare interpreter
# without the environment's packages. Python finds an install's prefix from its binary's real
# location instead: with a copy of the binary in bin/ and the standard library's entries
# linked into lib/pythonX.Y/ (beside the real site-packages), sys.prefix is /opt/venv however
# its python is reached, and `python -m venv` inside the sandbox makes venvs of it. No
# pyvenv.cfg: it would send the prefix search back to the host interpreter's directory.
# The interpreter's shared libraries (libpython) are linked into lib/, where a binary or an
# extension module that finds them relative to itself ($ORIGIN/../lib) looks; its headers
# into include/, where building an extension looks for them (sys.base_prefix/include).
# A distribution-patched interpreter that looks elsewhere for its packages (Debian's
# dist-packages) fails the check: the environment then stays a venv, with a warning in the log.
# Runs inside the build sandbox: $1 the venv, $2 the interpreter's prefix (mounted read-only).
_STANDALONE = r"""set -euo pipefail
shopt -s nullglob dotglob
venv=$1 prefix=$2
cd "$venv/lib"
libs=(python*)
[ ${#libs[@]} = 1 ] || { echo "expected one lib/python* in $venv, found: ${libs[*]}"; exit 1; }
lib=${libs[0]}
stdlib=$prefix/lib/$lib
[ -f "$stdlib/os.py" ] || { echo "no standard library at $stdlib"; exit 1; }
real=$(readlink -f "$venv/bin/python")
for name in python python3 "$lib"; do
  rm -f "$venv/bin/$name"
  cp "$real" "$venv/bin/$name"
done
for entry in "$stdlib"/*; do
  case ${entry##*/} in
    site-packages|dist-packages|EXTERNALLY-MANAGED) ;;
    *) ln -s "$entry" "$venv/lib/$lib/${entry##*/}" ;;
  esac
done
for so in "$prefix"/lib/lib*.so*; do
  if [ -f "$so" ]; then ln -s "$so" "$venv/lib/${so##*/}"; fi
done
# The headers: a directory of links, not a link, so that packages installing headers of their
# own there (pybind11-global: include/pythonX.Y/pybind11) can; the interpreter's are read-only.
for inc in "$prefix"/include/python*; do
  mkdir -p "$venv/include/${inc##*/}"
  for h in "$inc"/*; do ln -s "$h" "$venv/include/${inc##*/}/${h##*/}"; done
done
mv "$venv/pyvenv.cfg" /tmp/pyvenv.cfg
# The proof: run directly and through a chain of two links from elsewhere, the environment's
# python is its own prefix and imports its packages (pip is seeded).
mkdir -p /tmp/standalone/a /tmp/standalone/b
ln -sfn "$venv/bin/python" /tmp/standalone/a/python
ln -sfn /tmp/standalone/a/python /tmp/standalone/b/python
check='import sys, pip; assert sys.prefix == sys.argv[1], (sys.executable, sys.prefix)'
if "$venv/bin/python" -c "$check" "$venv" && /tmp/standalone/b/python -c "$check" "$venv"; then
  echo "$venv: a self-contained $lib install"
  exit 0
fi
echo "WARNING: $real does not work as a self-contained install; $venv stays a venv" \
  "(a link to its python from another directory runs without its packages)"
find "$venv/lib/$lib" "$venv/lib" -maxdepth 1 -type l -delete
find "$venv/include" -mindepth 2 -maxdepth 2 -type l -delete 2>/dev/null || true
find "$venv/include" -mindepth 1 -maxdepth 1 -type d -empty -delete 2>/dev/null || true
rmdir "$venv/include" 2>/dev/null || true
ln -sfn "$real" "$venv/bin/python"
ln -sfn python "$venv/bin/python3"
ln -sfn python "$venv/bin/$lib"
mv /tmp/pyvenv.cfg "$venv/pyvenv.cfg"
"$venv/bin/python" -c "$check" "$venv"
"""

# setuptools majors remove what old setup.py files use (`Feature` in 46, `use_2to3` in 58), and
# uv builds every source distribution in isolation with the newest setuptools the interpreter
# supports: astropy 1.3's `markupsafe==1.0` no longer builds. A recipe that pins setuptools
# (every conda export does) was installed with it (pip built setup.py-only sdists in the
# environment itself), so its builds get that major line: `setuptools<X+1` for a pin `X.*`,
# at least 40.x, the first with the PEP 517 backend that uv drives such sdists with. A recipe
# without a pin is left to uv.
_SETUPTOOLS_PIN = re.compile(r"^\s*setuptools\s*===?\s*v?(\d+)(?:[.\s;]|$)", re.IGNORECASE)
_PEP517_SETUPTOOLS_MAJOR = 40


def build_constraints(requirements: list[str]) -> list[str]:
    """Lines of uv's --build-constraints file for a recipe's requirements (see above)."""
    for line in requirements:
        m = _SETUPTOOLS_PIN.match(line)
        if m:
            return [f"setuptools<{max(int(m[1]), _PEP517_SETUPTOOLS_MAJOR) + 1}\n"]
    return []


# ---------------------------------------------------------------- build work directories


def build_tmp(settings: BuildSettings) -> Path:
    """Where builds keep their work directories (upper layers, staged layers)."""
    return settings.store.parent / "build-tmp"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _work_name() -> str:
    """`<host>.<pid>.<start time>.<random>`: whose work directory this is, across the machines
    that share a store and across pid reuse."""
    pid = os.getpid()
    return f"{_host()}.{pid}.{_start_time(pid) or 0}.{secrets.token_hex(4)}"


_WORK_NAME = re.compile(
    r"^[a-z]+-(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.(?P<start>\d+)\.[0-9a-f]+$"
)
# Work directories named before owners were recorded: removed once this old.
_UNNAMED_GRACE_SECONDS = 24 * 3600.0


def _owner_dead(name: str) -> bool:
    m = _WORK_NAME.match(name)
    if m is None or m["host"] != _host():
        return False  # another machine's (a shared store): its own sweep decides
    return _start_time(int(m["pid"])) != m["start"]


def sweep_build_tmp(root: Path) -> list[tuple[Path, int]]:
    """Remove the work directories under `root` whose builder process is gone (killed builds
    leave them), and unattributable ones older than a day; returns (path, bytes) removed.
    They hold sandbox-written trees, so they are measured and removed by descriptors."""
    removed: list[tuple[Path, int]] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    cutoff = time.time() - _UNNAMED_GRACE_SECONDS
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        stale = _owner_dead(name) or (_WORK_NAME.match(name) is None and st.st_mtime < cutoff)
        if not stale:
            continue
        size = 0
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                size = sum(s.st_size for _fd, _n, s in safefs.walk(path))
        try:
            gone = safefs.remove_tree(path)
        except OSError:  # another user's, say: not ours to remove
            gone = False
        if gone:
            removed.append((path, size))
    return removed


@functools.cache
def _builder_code() -> str:
    """A digest of the code that builds environments: failures it records name it."""
    digest = hashlib.sha256()
    for path in (__file__, inspect.getfile(find_interpreter)):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def _uv_binary() -> Path:
    found = shutil.which("uv")
    if found:
        return Path(found).resolve()
    try:
        from uv import find_uv_bin

        return Path(find_uv_bin()).resolve()
    except (ImportError, FileNotFoundError):
        raise MiniSandboxError("building environments needs uv: pip install uv") from None
