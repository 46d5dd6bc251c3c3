"""Building a task's layers, each step inside a build sandbox (network on), and starting it.

A task is made of layers, all published to the layer store:
- the environment layer (envs.envlayer): its recipe's Python environment at /opt/venv, named
  by a content key of the recipe, the interpreter and the repository's environment commit, so
  tasks with the same recipe share it;
- the task layer: the repository at its base commit in /testbed (tasks.repos: only its past)
  plus what the install commands changed, i.e. the build sandbox's upper directory over the
  environment layer (`task/<key>`);
- for a task made by a bug patch (SWE-smith's), that layer is the repository's, shared by
  every bug at the same commit, and the task's own layer above it holds only what the bug
  changes, committed (`bug/<key>`): kilobytes, not a checkout;
- when the gold patch changes the dependencies, an evaluation-only layer of the wheels it needs
  (envs.layout.EVAL_WHEELHOUSE);
- the tools environments of its test services (envs.tools).

Every layer is built by envs.layerbuild's one skeleton. `Builder.task_layers` gives a task's
layers as data (`TaskLayers`), `launch` starts a sandbox of them; `Builder.sandbox` does both.
Every step's output goes to a log under `logs/`; a failure names its step and keeps the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import shlex
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from minisandbox.envs import relax
from minisandbox.envs.asof import AS_OF_FORMAT, FREEZE
from minisandbox.envs.compat import compat_layer
from minisandbox.envs.envlayer import env_layer, env_ref, host_warnings, relaxations
from minisandbox.envs.kinds import format_of
from minisandbox.envs.layerbuild import BuildError, LayerBuild, LayerBuilder, RecordedBuildFailure
from minisandbox.envs.layout import EVAL_WHEELHOUSE, TESTBED, VENV, WHEELHOUSE
from minisandbox.envs.settings import BuildSettings
from minisandbox.envs.toolchains import Interpreter
from minisandbox.envs.tools import tools_layers
from minisandbox.errors import MiniSandboxError, TaskBuildError, TaskNotBuiltError
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.tasks import repos as repos_module
from minisandbox.tasks.eval_script import eval_pip_requirements
from minisandbox.tasks.hidden_tests import publish_restore, restore_patch, tests_present
from minisandbox.tasks.install import install_commands
from minisandbox.tasks.repos import RepoSources
from minisandbox.tasks.service_specs import check_services, parse_service
from minisandbox.tasks.specs import Task, files_in_patch, hidden_tests, shown_tests
from minisandbox.utils.hashing import content_digest
from minisandbox.utils.resources import package_text

__all__ = ["BuildError", "BuildResult", "BuildSettings", "Builder", "TaskLayers", "launch"]

# Formats in envs/kinds.py (task 5: only the base commit's past; 6: its submodules; 7: history
# packs stored raw, their deltas made here).
_FORMAT = format_of("task")
_DEPENDENCY_FILE = re.compile(
    r"(^|/)(setup\.py|setup\.cfg|pyproject\.toml|requirements[^/]*\.txt)$"
)
_EVAL_DEPS_FORMAT = format_of("evaldeps")
_BUG_FORMAT = format_of("bug")  # 3: its hidden tests in a layer of their own (hidden_tests.py)


class TaskLayers(BaseModel):
    """What a sandbox of a task is made of, bottom to top (all of them in the store)."""

    env: str
    """The environment layer (the venv at /opt/venv)."""
    base: list[str] = Field(default_factory=list)
    """Layers the task shares with others, between the two (a bug task's repository layer)."""
    task: str
    """The task's own layer (the repository at /testbed, as installed; or its bug, committed)."""
    eval: list[str] = Field(default_factory=list)
    """Layers only evaluation sandboxes see (the wheels the gold patch needs)."""
    tools: list[str] = Field(default_factory=list)
    """The tools environments of the task's test services."""
    ro_paths: list[Path] = Field(default_factory=list)
    """Host directories mounted read-only at their own paths (interpreters)."""
    interpreters: list[str] = Field(default_factory=list)
    """Interpreters as layers, at their own paths (`portable`: for nodes without them)."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """The sandbox's environment variables (the recipe's, and the caller's)."""

    @property
    def ids(self) -> list[str]:
        return [*self.interpreters, self.env, *self.base, self.task, *self.eval, *self.tools]


@contextlib.asynccontextmanager
async def launch(lb: LayerBuilder, layers: TaskLayers, **overrides: Any) -> AsyncIterator[Sandbox]:
    """A sandbox of `layers`: made present in the node cache (once per node, under the I/O
    budget), the repository at /testbed, its venv active, SWE-bench's conda activation
    provided (envs.compat). `overrides` are more SandboxConfig fields (`ro_paths` are added to
    the task's own).

    Raises:
        SandboxStartError: the sandbox could not be set up (and the node cache's errors).
    """
    compat = compat_layer(lb.settings.cache / "compat", lb.cache.owner)
    ro_paths = {*layers.ro_paths, *overrides.pop("ro_paths", ())}
    async with lb.cache.use(layers.ids) as paths:
        config = SandboxConfig(
            layers=[compat, *paths],
            ro_paths=sorted(ro_paths),
            venv=VENV,
            workdir=TESTBED,
            env=layers.env_vars,
            **overrides,
        )
        async with Sandbox(config) as sb:
            yield sb


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
    # did (envs.envlayer).
    unresolved: bool = False
    # Pins its environment relaxed to install (relax.py): none for most recipes.
    relaxed: list[relax.Relaxation] = []
    # What may make the task behave unlike in its official image (system_packages.py).
    warnings: list[str] = []
    # What its recipe took from the repository, and from which file (tasks.repo_recipes).
    inferred: dict[str, str] = {}


class Builder(LayerBuilder):
    """Builds tasks' layers into a store (each layer once) and starts sandboxes of tasks."""

    # An environment build reads the repository through these too (relax.py's imports).
    code_files = (*LayerBuilder.code_files, repos_module.__file__)

    def __init__(self, settings: BuildSettings | None = None) -> None:
        super().__init__(settings)
        self.repos = RepoSources(self.settings)
        self._resolved: dict[tuple[str, str, str], Task | BuildError] = {}

    # ---------------------------------------------------------------- keys

    def resolved(self, task: Task) -> Task:
        """`task` with a recipe that has nothing left to read from its repository (the one
        every layer of it is built with): itself for most tasks; once per builder for those
        whose recipe names a requirements file there or is inferred (tasks.repo_recipes).

        Raises:
            BuildError: at step "resolve" (RepoSources.resolve_recipe).
        """
        if task.env.resolved:
            return task
        commit = task.environment_setup_commit or task.base_commit
        key = (task.repo, commit, task.env.model_dump_json())
        found = self._resolved.get(key)
        if found is None:
            try:
                found = self.repos.resolve_recipe(task, self.log_dir(f"task/{task.id}"))
            except BuildError as e:  # (kept: every later call fails the same, at once)
                found = e
            self._resolved[key] = found
        if isinstance(found, BuildError):
            raise found
        return task.model_copy(update={"env": found.env})

    async def resolving(self, task: Task) -> Task:
        """`resolved`, with the repository read in a thread (it runs git): the async paths
        resolve first, so that their later sync calls find it done.

        Raises:
            BuildError: at step "resolve".
        """
        if task.env.resolved:
            return task
        return await asyncio.to_thread(self.resolved, task)

    def interpreter(self, task: Task) -> Interpreter:
        python = self.resolved(task).env.python
        assert python is not None  # (a resolved recipe has one)
        return self.find_interpreter(python)

    def env_ref(self, task: Task) -> str:
        task = self.resolved(task)
        return env_ref(task.environment_key(self.interpreter(task).version))

    def task_ref(self, task: Task, env_layer: str) -> str:
        """The repository layer's ref: the checkout at the base commit, installed (the same
        for every bug of a SWE-smith repository: the bug is a layer of its own, `bug_ref`)."""
        spec: dict[str, Any] = {
            "format": _FORMAT,
            "repo": task.repo,
            "base_commit": task.base_commit,
            "env_layer": env_layer,
            "pre_install": task.pre_install,
            "install": task.install,
            "bug_patch": "",  # (kept: tasks without a bug keep their keys)
        }
        if task.bug_patch:  # one root commit, every object loose (helpers/flatten_repo.sh)
            spec["flat"] = True
        if task.install_as_of:  # (absent when unset, as above)
            spec["install_as_of"] = [task.install_as_of, AS_OF_FORMAT]
        extra = eval_pip_requirements(task.eval_script or "")
        if extra:  # (absent when none: the other tasks' keys stay as they were)
            spec["eval_requirements"] = extra
        return f"task/{content_digest(spec)}"

    def bug_ref(self, task: Task, repo_layer: str) -> str:
        """The ref of a bug task's own layer: its bug patch applied and committed on top of
        the repository layer."""
        spec = {
            "format": _BUG_FORMAT,
            "repo_layer": repo_layer,
            "bug_patch": task.bug_patch,
            "hidden_tests": hidden_tests(task),
        }
        return f"bug/{content_digest(spec)}"

    def evaluation_task(self, task: Task) -> Task:
        """`task` as evaluation runs it. A bug task's FAIL_TO_PASS test files, hidden from the
        agent, come back by the test patch its bug layer recorded (host side only); the other
        test files are reset to the task's commit (HEAD: its history is that one commit)."""
        stack = self.built_layers(task) if task.bug_patch else []
        if not stack:
            return task
        restore = restore_patch(self.store, self.store.meta(stack[-1]) or {})
        files = sorted({*shown_tests(task), *task.test_files})
        return task.model_copy(update={"test_patch": restore, "test_files": files})

    def eval_deps_ref(self, task: Task, task_layer: str) -> str | None:
        """The ref of the task's evaluation-only wheels (see EVAL_WHEELHOUSE), or None when its
        gold patch leaves the dependencies alone."""
        files = files_in_patch(task.gold_patch) if task.gold_patch else []
        if not any(_DEPENDENCY_FILE.search(f) for f in files):
            return None
        spec = {"format": _EVAL_DEPS_FORMAT, "task_layer": task_layer, "gold": task.gold_patch}
        return f"evaldeps/{content_digest(spec)}"

    def eval_layers(self, task: Task, task_layer: str) -> list[str]:
        """Layers that evaluation sandboxes of the task add to its own (present ones only)."""
        ref = self.eval_deps_ref(task, task_layer)
        found = self.store.resolve(ref) if ref else None
        return [found] if found else []

    def built_layers(self, task: Task) -> list[str]:
        """The ids of the task's own layers in the store, bottom up: environment, repository[,
        bug] (the last is the one its sandboxes start from); empty unless all are there. No
        build: `task_layers` builds what is missing."""
        env_layer = self.store.resolve(self.env_ref(task))
        repo_layer = env_layer and self.store.resolve(self.task_ref(task, env_layer))
        if not env_layer or not repo_layer:
            return []
        if not task.bug_patch:
            return [env_layer, repo_layer]
        bug_layer = self.store.resolve(self.bug_ref(task, repo_layer))
        if not bug_layer or not tests_present(self.store, bug_layer):
            return []
        return [env_layer, repo_layer, bug_layer]

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

        def phase(name: str, ref: str) -> None:
            if on_phase is not None and (
                self.forcing(ref, force) or self.store.resolve(ref) is None
            ):
                on_phase(task.id, name)

        with self.recording() as made:
            try:
                await self.resolving(task)
                phase("building env", self.env_ref(task))
                env = await self._env_layer(task, force)
                phase("building task", self.task_ref(task, env))
                task_layer = await self._task_layer(task, env, force)
                if task.bug_patch:
                    phase("building bug", self.bug_ref(task, task_layer))
                    task_layer = await self._bug_layer(task, env, task_layer, force)
                await self._eval_deps_layer(task, env, task_layer, force)
            except MiniSandboxError as e:
                return BuildResult(
                    task_id=task.id,
                    status="failed",
                    error=str(e),
                    log=str(e.log) if isinstance(e, BuildError) else None,
                    step=e.step if isinstance(e, BuildError) else None,
                    recorded_failure=isinstance(e, RecordedBuildFailure),
                    seconds=time.monotonic() - began,
                )
        env_meta = self.store.meta(env) or {}
        return BuildResult(
            task_id=task.id,
            status="built" if made else "cached",
            built_layers=made,
            env_layer=env,
            task_layer=task_layer,
            seconds=time.monotonic() - began,
            relaxed=relaxations(env_meta),
            unresolved=bool(env_meta.get("unresolved")),
            warnings=host_warnings(self.resolved(task).env),
            inferred=self.resolved(task).env.inferred,
        )

    def relaxed(self, env_layer: str) -> list[relax.Relaxation]:
        """The pins an environment layer relaxed (recorded in its metadata at build)."""
        return relaxations(self.store.meta(env_layer) or {})

    async def build_env(self, task: Task, *, force: bool = False) -> str:
        """Build (or find) only the task's environment layer and return its id: environments
        can be prepared, or checked, before the repositories are at hand.

        Raises:
            BuildError: a step failed (RecordedBuildFailure: it failed before, until `force`).
        """
        return await self._env_layer(task, force)

    async def _env_layer(self, task: Task, force: bool) -> str:
        task = self.resolved(task)
        imports = functools.partial(self.repos.imports_at, task)
        return await env_layer(
            self,
            task.env,
            self.interpreter(task),
            self.env_ref(task),
            what=task.id,
            imports=imports,
            source=f"{task.repo} at {task.environment_setup_commit}",
            force=force,
        )

    async def _task_layer(self, task: Task, env: str, force: bool) -> str:
        ref = self.task_ref(task, env)

        async def make() -> str:
            logs = self.log_dir(f"task/{task.id}")  # (only for a build: not for a stored layer)

            async def run(sb: Sandbox) -> dict[str, Any]:
                step = functools.partial(self.step, sb, task.id, logs)
                python = self.interpreter(task).version
                install, meta = await install_commands(task, self.repos, python, logs)
                if task.bug_patch:
                    await self._helper(sb, "flatten_repo.sh")
                    await step("flatten", "bash /tmp/flatten_repo.sh")
                if task.pre_install or install:
                    await step("install", "\n".join(["set -e", *task.pre_install, *install]))
                    await self._wheelhouse(sb, task, logs)
                if task.install_as_of:  # what it resolved to, so the build can be repeated
                    await step("freeze", f"{FREEZE} > /tmp/resolved.txt")
                    freeze = await sb.read_text("/tmp/resolved.txt", max_bytes=1 << 20)
                    meta["resolved"] = freeze.splitlines()
                return meta

            build = LayerBuild(
                ref=ref,
                kind="task",
                what=task.id,
                interp=self.interpreter(task),
                logs=logs,
                run=run,
                meta={"task": task.id, "env_layer": env},
                lower=[env],
                prepare=lambda upper: self.repos.checkout(task, upper / "testbed", logs),
            )
            return await self.build_layer(build, force)

        return await self.once(ref, force, make)

    async def _bug_layer(self, task: Task, env: str, repo_layer: str, force: bool) -> str:
        ref = self.bug_ref(task, repo_layer)

        async def make() -> str:
            logs = self.log_dir(f"task/{task.id}")

            async def run(sb: Sandbox) -> dict[str, Any]:
                # Made the one commit, the clean code's objects gone: neither `git diff` nor
                # the history shows the bug, i.e. the answer (helpers/apply_bug.sh).
                await sb.write_file("/tmp/bug.patch", task.bug_patch)
                await self._helper(sb, "apply_bug.sh")
                listed = [*hidden_tests(task), "--", *shown_tests(task)]
                files = " ".join(shlex.quote(f) for f in listed)
                await self.step(
                    sb,
                    task.id,
                    logs,
                    "bug_patch",
                    f"bash /tmp/apply_bug.sh /tmp/bug.patch {files}",
                )
                patch = await sb.read_text("/tmp/restore-tests.patch")
                return await asyncio.to_thread(publish_restore, self.store, patch, force)

            build = LayerBuild(
                ref=ref,
                kind="bug",
                what=task.id,
                interp=self.interpreter(task),
                logs=logs,
                run=run,
                meta={"task": task.id, "env_layer": env, "repo_layer": repo_layer},
                lower=[env, repo_layer],
            )
            return await self.build_layer(build, force)

        found = self.store.resolve(ref)
        if found and not tests_present(self.store, found):
            force = True  # its hidden tests are gone: made again with the layer
        return await self.once(ref, force, make)

    @staticmethod
    async def _helper(sb: Sandbox, name: str) -> None:
        """Copy helpers/`name` to /tmp/`name` in the build sandbox."""
        await sb.write_file(f"/tmp/{name}", package_text("minisandbox.tasks", "helpers", name))

    async def _wheelhouse(self, sb: Sandbox, task: Task, logs: Path) -> None:
        """Download the repository's build requirements into WHEELHOUSE (see there), and the
        requirements its eval script installs."""
        step = functools.partial(self.step, sb, task.id, logs)
        await sb.write_file(
            "/tmp/build_requires.py",
            package_text("minisandbox.tasks", "helpers", "build_requires.py"),
        )
        await step(
            "wheelhouse",
            "if [ -f pyproject.toml ] || [ -f setup.py ]; then "
            "python /tmp/build_requires.py > /tmp/build-requires.txt && "
            f"python -m pip download -q -d {WHEELHOUSE} -r /tmp/build-requires.txt; fi",
        )
        extra = eval_pip_requirements(task.eval_script or "")
        if extra:
            await sb.write_file("/tmp/eval-requires.txt", "\n".join(extra) + "\n")
            await step(
                "eval_requirements",
                f"python -m pip download -q -d {WHEELHOUSE} -r /tmp/eval-requires.txt",
            )

    async def _eval_deps_layer(
        self, task: Task, env: str, task_layer: str, force: bool
    ) -> str | None:
        ref = self.eval_deps_ref(task, task_layer)
        if ref is None:
            return None

        async def make() -> str:
            logs = self.log_dir(f"task/{task.id}")

            async def run(sb: Sandbox) -> None:
                await sb.write_file("/tmp/gold.patch", task.gold_patch)
                # On a copy: the task layer must not learn what the fix changes.
                await self.step(
                    sb,
                    task.id,
                    logs,
                    "eval_deps",
                    "cp -a /testbed /tmp/gold && cd /tmp/gold && git apply /tmp/gold.patch && "
                    f"python -m pip download -q -d {EVAL_WHEELHOUSE} /tmp/gold",
                )

            build = LayerBuild(
                ref=ref,
                kind="evaldeps",
                what=task.id,
                interp=self.interpreter(task),
                logs=logs,
                run=run,
                meta={"task": task.id, "task_layer": task_layer},
                collect=EVAL_WHEELHOUSE,
                lower=[env, task_layer],
            )
            return await self.build_layer(build, force)

        return await self.once(ref, force, make)

    # ---------------------------------------------------------------- running

    async def task_layers(
        self,
        task: Task,
        *,
        build: bool = True,
        evaluation: bool = False,
        extra_env: dict[str, str] | None = None,
        on_phase: Callable[[str, str], None] | None = None,
    ) -> TaskLayers:
        """The task's layers as data for `launch`: built first when missing and `build` is
        true (`on_phase` is told its phases, as `build`'s); `evaluation` adds those only
        evaluation may see (EVAL_WHEELHOUSE); `extra_env` is added to the recipe's environment
        variables.

        Raises:
            TaskNotBuiltError: not built, and `build` is false.
            TaskBuildError: building the task's layers failed.
            ServiceError: the task names an unknown or misnamed test service
                (ToolsEnvironmentError: the host has no Python for its tools environment).
            BuildError: building a tools environment failed.
            UvNotFoundError: a build is needed and there is no uv.
        """
        check_services(task)
        await self.resolving(task)
        stack = self.built_layers(task)
        if not stack:
            if not build:
                raise TaskNotBuiltError(f"task {task.id} is not built; run `minisandbox build`")
            result = await self.build(task, on_phase=on_phase)
            stack = self.built_layers(task)
            if result.status == "failed" or not stack:
                raise TaskBuildError(f"building task {task.id} failed: {result.error}")
        env, *base, task_layer = stack
        # The tools environments of the task's test services, on top.
        tools, tool_paths = await tools_layers(self, (parse_service(s)[0] for s in task.services))
        extra = self.eval_layers(task, task_layer) if evaluation else []
        env_vars = {**self.resolved(task).env.env, **(extra_env or {})}
        if extra:  # pip splits PIP_FIND_LINKS on whitespace
            links = f"{env_vars.get('PIP_FIND_LINKS', '')} {EVAL_WHEELHOUSE}"
            env_vars["PIP_FIND_LINKS"] = links.strip()
        return TaskLayers(
            env=env,
            base=base,
            task=task_layer,
            eval=extra,
            tools=tools,
            ro_paths=[self.interpreter(task).prefix, *tool_paths],
            env_vars=env_vars,
        )

    @contextlib.asynccontextmanager
    async def sandbox(
        self,
        task: Task,
        *,
        build: bool = True,
        extra_env: dict[str, str] | None = None,
        evaluation: bool = False,
        on_phase: Callable[[str, str], None] | None = None,
        **overrides: Any,
    ) -> AsyncIterator[Sandbox]:
        """A sandbox of the task: `task_layers` (see there), then `launch`, on this host, with no
        policy: what the build and its checks use. `overrides` are more SandboxConfig fields.
        Agents, graders and integrations take theirs from `minisandbox.Runtime.sandbox(task,
        purpose=...)`, which checks the validation policy for agents' sandboxes.

        Raises:
            TaskNotBuiltError, TaskBuildError, ServiceError, BuildError, UvNotFoundError: see
                `task_layers`.
            SandboxStartError: the sandbox could not be set up.
            TypeError: `require_validated` was passed (Runtime.sandbox checks validations).
        """
        if "require_validated" in overrides:
            raise TypeError(
                "Builder.sandbox does not check validations: agents' sandboxes come from "
                "minisandbox.Runtime(builder=builder).sandbox(task, require_validated=...)"
            )
        layers = await self.task_layers(
            task, build=build, evaluation=evaluation, extra_env=extra_env, on_phase=on_phase
        )
        async with launch(self, layers, **overrides) as sb:
            yield sb
