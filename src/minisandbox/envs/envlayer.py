"""The environment layer: a recipe's Python environment at /opt/venv, built once per recipe.

A uv venv (pip seeded, so agents can still `pip install`) of the recipe's interpreter with its
pinned requirements, laid out as a self-contained install (helpers/standalone.sh), its bytecode
compiled once. It is named by a content key of the recipe and the interpreter (`env/<key>`), so
tasks with the same recipe share it. A recipe whose pins do not install as pip packages (a
conda export) is installed as conda did, relaxing what still fails (relax.py).
"""

from __future__ import annotations

import asyncio
import functools
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minisandbox.envs import relax
from minisandbox.envs.asof import exclude_newer
from minisandbox.envs.kinds import format_of
from minisandbox.envs.layerbuild import BuildError, LayerBuild, LayerBuilder
from minisandbox.envs.layout import VENV
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.system_packages import apt_packages, missing_on_host
from minisandbox.envs.toolchains import Interpreter
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.utils.resources import package_text

# Bumped when what an environment layer holds changes (v2: its bytecode compiled at build;
# v3: laid out as a self-contained install, see helpers/standalone.sh; old setuptools for old
# recipes; v4: include/pythonX.Y a directory of links, packages add headers there; v5: the
# same bytecode for the same files in every environment, helpers/bytecode.py).
# Also bump it when relax.py's ladder changes what a relaxed recipe installs.
ENV_FORMAT = format_of("env")  # (envs/kinds.py)

# Requirements of a dated install tried as wheels of any date, then left out (_install_undated).
MAX_UNDATED = 8


def _included_by(error: str, name: str) -> str | None:
    """The first package of uv's "`name` (v1) was included because `a` (v2) depends on ..."
    chain, normalised: the requirement that brought `name` in."""
    chain = re.search(rf"`{re.escape(name)}` \(v[^)]*\) was included because `([^`]+)`", error)
    return relax.normalise(chain[1]) if chain else None


# What the repository imports at its environment commit and that commit's date (relax.py's
# priorities and date bound), given the build's log directory; (None, None) when unknown.
ImportsAt = Callable[[Path], tuple[frozenset[str] | None, str | None]]


def env_ref(key: str) -> str:
    """The store ref of the environment with content key `key` (EnvRecipe.key and more)."""
    return f"env/{ENV_FORMAT}-{key}"


async def env_layer(
    lb: LayerBuilder,
    recipe: EnvRecipe,
    interp: Interpreter,
    ref: str,
    *,
    what: str,
    imports: ImportsAt,
    source: str = "the repository at its environment commit",
    force: bool = False,
) -> str:
    """The environment layer `ref` of `recipe` on `interp`: the stored one, or built once.
    A failure is recorded against `ref` (and raised at once for every later task, until
    `force`); `what` (the task asking) is named in the record. `imports` reads what `source`
    (named in the logs) imports, for relaxing pins.

    Raises:
        BuildError: a step failed (RecordedBuildFailure: it failed before, until `force`).
    """

    async def make() -> str:
        build = _EnvBuild(lb, recipe, ref, lb.log_dir(ref), imports, source)
        layer = LayerBuild(
            ref=ref,
            kind="env",
            what=ref,
            interp=interp,
            logs=build.logs,
            run=functools.partial(build.run, interp),
            meta={
                "recipe": recipe.model_dump(),
                "build_constraints": [line.strip() for line in build.constraints],
            },
            collect=VENV,
        )
        return await lb.build_layer(layer, force)

    # Tasks sharing a recipe build it once, and a recipe that fails, fails once.
    return await lb.once(ref, force, make, record_for=what)


class _EnvBuild:
    """The steps of one environment build, in its build sandbox."""

    def __init__(
        self,
        lb: LayerBuilder,
        recipe: EnvRecipe,
        ref: str,
        logs: Path,
        imports: ImportsAt,
        source: str,
    ) -> None:
        self.lb, self.recipe, self.ref, self.logs = lb, recipe, ref, logs
        self.imports, self.source = imports, source
        self.constraints = build_constraints(recipe.requirements)

    async def run(self, interp: Interpreter, sb: Sandbox) -> dict[str, Any]:
        step = functools.partial(self.lb.step, sb, self.ref, self.logs)
        # As of the recipe's date, the seed (pip, setuptools, wheel) too.
        dated = f"--exclude-newer {shlex.quote(self.recipe.as_of)} " if self.recipe.as_of else ""
        await step("venv", f"uv venv --seed {dated}--python {interp.executable} {VENV}")
        await sb.write_file(
            "/tmp/standalone.sh", package_text("minisandbox.envs", "helpers", "standalone.sh")
        )
        args = " ".join(shlex.quote(str(a)) for a in (VENV, interp.prefix))
        await step("layout", f"bash /tmp/standalone.sh {args}")
        await sb.write_file("/tmp/build-constraints.txt", "".join(self.constraints))
        relaxed: list[relax.Relaxation] = []
        unresolved: dict[str, list[str]] | None = None
        if self.recipe.requirements:
            try:
                await self._install(sb, self.recipe.requirements, [])
            except BuildError as e:
                if self.recipe.relax_pins:
                    relaxed, unresolved = await self._install_relaxed(sb, e)
                elif self.recipe.as_of:
                    relaxed = await self._install_undated(sb, e)
                else:
                    raise
        # Bytecode now, once: otherwise the first import or pip run of every task writes its
        # own copy of the environment's .pyc files into its task layer. Only site-packages:
        # the standard library is the interpreter's (read-only). The same bytes in every
        # environment of this Python (helpers/bytecode.py): the store keeps pip's, setuptools'
        # and every other shared package's bytecode once, not once per environment.
        await sb.write_file(
            "/tmp/bytecode.py", package_text("minisandbox.envs", "helpers", "bytecode.py")
        )
        await step(
            "bytecode",
            f"PYTHONHASHSEED=0 {VENV}/bin/python -S /tmp/bytecode.py "
            f"{VENV}/lib/python*/site-packages || true",
        )
        meta: dict[str, Any] = {"relaxed": [r.model_dump() for r in relaxed]}
        if unresolved is not None:  # installed without resolving: what it holds, and
            meta["unresolved"] = True  # what pip finds inconsistent in it
            meta.update(unresolved)
        return meta

    async def _install(self, sb: Sandbox, requirements: list[str], uv_options: list[str]) -> None:
        """Install `requirements` into the venv (the "requirements" step)."""
        await sb.write_file("/tmp/requirements.txt", "\n".join(requirements) + "\n")
        recipe = self.recipe
        dated = exclude_newer(recipe.as_of, later=recipe.as_of_packages) if recipe.as_of else []
        options = " ".join([*self.recipe.pip_options, *map(shlex.quote, [*dated, *uv_options])])
        # No --compile-bytecode: uv's compiler needs Python >= 3.7 (3.6 has no
        # py_compile.PycInvalidationMode); the interpreter's own compileall (the bytecode
        # step) works on every version.
        await self.lb.step(
            sb,
            self.ref,
            self.logs,
            "requirements",
            f"uv pip install --python {VENV}/bin/python --link-mode copy "
            f"--build-constraints /tmp/build-constraints.txt {options} "
            "-r /tmp/requirements.txt",
        )

    async def _install_undated(self, sb: Sandbox, failed: BuildError) -> list[relax.Relaxation]:
        """A dated install in which a package did not build: its source as of the date needs
        what no build here has (cartopy 0.19 the PROJ library, which the CI's conda
        environment file that xarray's inferred recipe comes from got built; markupsafe 1.0,
        below requests' httpbin, a setuptools of its day). It is taken as a wheel of any date;
        when that does not install either, the recipe's line that brought it in (itself, or
        the first package of uv's "was included because" chain) is left out. One package a
        round, each step recorded (the layer's `relaxed`, `build --json`).

        Raises:
            BuildError: the install's own failure when it is no failed build (or, after a
                wheel was tried, nothing the recipe lists is to blame), or still failing after
                MAX_UNDATED rounds.
        """
        lines = {n: r for r in self.recipe.requirements if (n := relax.requirement_name(r))}
        reqs, steps = list(self.recipe.requirements), list[relax.Relaxation]()
        wheels: list[str] = []
        imported: frozenset[str] | None = None
        for _ in range(MAX_UNDATED):
            error = failed.log.read_text(errors="replace")
            found = relax.failed_build(error)
            if found is not None and found[0] not in wheels:
                name, report = found
                wheels.append(name)
                rung: relax.Rung = "any"
            else:
                last = found[0] if found else (wheels[-1] if wheels else None)
                root = _included_by(error, last) if last else None
                name = root if root in lines and lines[root] in reqs else (last or "")
                if name not in lines or lines[name] not in reqs:
                    raise failed
                reqs.remove(lines[name])
                report, rung = " ".join(error.split())[-600:], "dropped"
            if imported is None:
                imported = (await asyncio.to_thread(self.imports, self.logs))[0] or frozenset()
            steps.append(
                relax.Relaxation(
                    package=name,
                    pinned=lines.get(name, f"{name} (a dependency)"),
                    rung=rung,
                    imported=name.replace("-", "_") in imported,
                    conflict=report,
                )
            )
            options = [o for n in wheels for o in (f"--exclude-newer-package={n}=false",
                                                   f"--only-binary={n}")]  # fmt: skip
            try:
                await self._install(sb, reqs, options)
                return steps
            except BuildError as e:
                failed = e
        raise failed

    async def _install_relaxed(
        self, sb: Sandbox, strict: BuildError
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
            relax.Relaxer(self.recipe.requirements, None, None).step(error)
        except relax.RelaxationFailed:
            raise strict from None
        log = self.logs / "resolve.log"
        with log.open("w") as out:
            out.write("# the strict install failed; installing the pins as they are (--no-deps)\n")
            out.flush()
            relaxer = await self._relax_until_installed(sb, strict, error, out, log)
            steps = relaxer.steps if relaxer else []
            out.write(f"# installed without dependency resolution, {len(steps)} relaxations\n")
        python = f"{VENV}/bin/python"
        frozen = await sb.execute(["uv", "pip", "freeze", "--python", python])
        # The declared dependencies the environment leaves unmet, as conda's did (uv reports
        # them on stderr, one "The package `a` requires `b`, but ..." line each).
        check = await sb.execute(["uv", "pip", "check", "--python", python], merge_stderr=True)
        unmet = [line.strip() for line in check.stdout.splitlines() if " requires " in line]
        return steps, {"installed": frozen.stdout.splitlines(), "inconsistent": unmet}

    async def _relax_until_installed(
        self, sb: Sandbox, failed: BuildError, error: str, out: Any, log: Path
    ) -> relax.Relaxer | None:
        """Install the pins --no-deps, relaxing one failing pin per round; the relaxer (None
        when the pins installed as they are)."""
        relaxer: relax.Relaxer | None = None
        while True:
            reqs = relaxer.requirements() if relaxer else self.recipe.requirements
            options = ["--no-deps", *(relaxer.uv_options() if relaxer else [])]
            try:
                await self._install(sb, reqs, options)
                return relaxer
            except BuildError as e:
                failed, error = e, e.log.read_text(errors="replace")
            if relaxer is None:
                imported, date = await asyncio.to_thread(self.imports, self.logs)
                relaxer = relax.Relaxer(self.recipe.requirements, imported, date)
                known = "unknown (no environment commit)" if imported is None else len(imported)
                out.write(
                    f"# relaxing pins; top-level names {self.source} imports: {known}; "
                    f"date bound {date}\n"
                )
            try:
                step = relaxer.step(error)
            except relax.NotRelaxable as e:
                out.write(f"# {e}\n")
                raise failed from None  # the install's own error, not a conflict
            except relax.RelaxationFailed as e:
                out.write(f"# {e}\n")
                raise BuildError(
                    self.ref,
                    "resolve",
                    log,
                    f": the recipe's pins do not install even relaxed; fix the recipe "
                    f"(a `pins` override, docs/recipes.md): {e}",
                ) from None
            out.write(f"# relaxed {step.package} ({step.pinned}) to {step.rung}: {step.conflict}\n")
            out.flush()


def relaxations(env_meta: dict[str, Any]) -> list[relax.Relaxation]:
    """The pins an environment layer relaxed (recorded in its metadata at build)."""
    return [relax.Relaxation.model_validate(r) for r in env_meta.get("relaxed") or []]


# setuptools majors remove what old setup.py files use (`Feature` in 46, `use_2to3` in 58), and
# uv builds every source distribution in isolation with the newest setuptools the interpreter
# supports: astropy 1.3's `markupsafe==1.0` no longer builds. A recipe that pins setuptools
# (every conda export does) was installed with it (pip built setup.py-only sdists in the
# environment itself), so its builds get that major line: `setuptools<X+1` for a pin `X.*`,
# at least 40.x, the first with the PEP 517 backend that uv drives such sdists with. A recipe
# without a pin is left to uv (as of its date, but never before 40.8.0: asof.exclude_newer).
_SETUPTOOLS_PIN = re.compile(r"^\s*setuptools\s*===?\s*v?(\d+)(?:[.\s;]|$)", re.IGNORECASE)
_PEP517_SETUPTOOLS_MAJOR = 40


def build_constraints(requirements: list[str]) -> list[str]:
    """Lines of uv's --build-constraints file for a recipe's requirements (see above)."""
    for line in requirements:
        m = _SETUPTOOLS_PIN.match(line)
        if m:
            return [f"setuptools<{max(int(m[1]), _PEP517_SETUPTOOLS_MAJOR) + 1}\n"]
    return []


def host_warnings(recipe: EnvRecipe) -> list[str]:
    """Warnings about this host for a recipe: the system packages its official image installs
    with apt (commands the loader kept out of the build) that the host, whose /usr every
    sandbox uses, does not have."""
    missing = _missing_packages(tuple(apt_packages(recipe.skipped)))
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
