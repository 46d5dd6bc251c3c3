"""Installing a conda export whose pins pip will not install as they are.

SWE-bench's environments are conda exports. conda installed their packages with conda's own
metadata, then pip installed some more, and the set was never resolved as pip packages: a
conda-forge build can depend on versions its PyPI wheel does not accept (`cf-units==3.2.0`
wants `antlr4-python3-runtime==4.7.2`, the export pins 4.11.1), and pip's pins, installed last,
can contradict conda's (`dask==2022.8.1` beside `distributed==2024.9.1`). Some of their packages
conda had built while PyPI has only sources that no longer build (`backports.zoneinfo==0.2.1`
on Python 3.10, `markupsafe==1.0` with a current setuptools).

So when the strict install fails either way (and the recipe asks for it: `relax_pins`, set for
conda exports), the builder first installs every pin as it is, without resolving the
dependencies the wheels declare (`--no-deps`: the export lists the whole environment, as conda
had it). A pin that still does not install steps down a ladder, one pin and one rung per failure,
and the install runs again:

- exact pin -> any wheel uploaded before the environment commit's date
  (`--exclude-newer-package`) -> any wheel -> any version, built from source if need be ->
  dropped. Wheels first: the conda environment had the package built, and its sdist may need
  system libraries no build here has (rasterio's needs GDAL);
- a package the repository imports (at its environment commit; `import_names.txt` for those
  imported under another name), or might (imports unknown), is never dropped;
- when an unsatisfiable report names several pins (the same distribution pinned twice, say), the
  one the repository does not import gives way first, then the one listed first (conda's before
  pip's, which pip installed last);
- a missing package, an unreachable index or a failed build of something the recipe does not
  pin is never relaxed: the build fails as it would have.

Every step is kept (`Relaxation`) and reported in the environment layer's metadata and in
`build --json`, with what got installed. The outcome depends on the recipe, the repository at its
environment commit and the package index; the first two are part of the environment's key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import BaseModel, ConfigDict, Field

# `import a, b as c` and `from a.b import c`: the top-level names.
_IMPORT = re.compile(r"^[ \t]*(?:import[ \t]+([\w., \t]+)|from[ \t]+(\w+))", re.MULTILINE)
_NAME = r"([A-Za-z0-9][A-Za-z0-9._-]*)"
# Where uv's reports name a package: before a version or extras, or after these words.
_NAMED = re.compile(
    rf"{_NAME}(?=\[|==|>=|<=|!=|~=|<|>)|(?:versions? of|you require|depends on) {_NAME}"
)
# What uv prints when a set of requirements has no solution (and nothing else fails that way).
UNSATISFIABLE = "No solution found when resolving"
_MISSING = "not found in the package registry"
_FAILED_BUILD = re.compile(rf"Failed to (?:download and )?build `{_NAME}")
MAX_STEPS = 60

Rung = Literal["dated", "any", "source", "dropped"]


def normalise(name: str) -> str:
    """PEP 503 name: what pip and uv compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def failed_build(error: str) -> tuple[str, str] | None:
    """The package whose build uv's report says failed (normalised), and the report from
    there on; None when it says no build failed."""
    built = _FAILED_BUILD.search(error)
    if built is None:
        return None
    return normalise(built.group(1)), " ".join(error[built.start() :].split())[:600]


def parse_requirement(line: str) -> Requirement | None:
    """The requirement a line states; None for an option, a URL requirement or anything
    `packaging` cannot read (such lines are kept as they are, never relaxed)."""
    if line.lstrip().startswith("-"):
        return None
    try:
        req = Requirement(line)
    except InvalidRequirement:
        return None
    return None if req.url else req


def requirement_name(line: str) -> str | None:
    """The normalised distribution a requirement line names (None for an option or a URL)."""
    req = parse_requirement(line)
    return normalise(req.name) if req else None


def imported_names(sources: Iterable[str]) -> frozenset[str]:
    """Top-level modules imported by Python sources, normalised like distribution names."""
    found: set[str] = set()
    for text in sources:
        for names, module in _IMPORT.findall(text):
            for part in names.split(",") if names else [module]:
                top = part.strip().split(" ")[0].split(".")[0]
                if top.isidentifier():
                    found.add(normalise(top))
    return frozenset(found)


@cache
def _module_names() -> dict[str, tuple[str, ...]]:
    """Distributions whose import names differ from their names (data/import_names.txt)."""
    text = (resources.files("minisandbox") / "data" / "import_names.txt").read_text("utf-8")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, _, modules = line.partition(":")
            out[normalise(dist)] = tuple(normalise(m) for m in modules.split())
    return out


def is_imported(distribution: str, imported: frozenset[str]) -> bool:
    """Whether code importing `imported` (normalised top-level names) uses `distribution`:
    its own name, the names data/import_names.txt gives it (`PyYAML` is `yaml`), or its name
    without a `python-` prefix or `-python` suffix."""
    name = normalise(distribution)
    candidates = {name, name.removeprefix("python-"), name.removesuffix("-python")}
    candidates.update(_module_names().get(name, ()))
    return not candidates.isdisjoint(imported)


class Relaxation(BaseModel):
    """One pin the builder relaxed to make a recipe resolve."""

    model_config = ConfigDict(extra="forbid")

    package: str = Field(description="normalised distribution name")
    pinned: str = Field(description="the recipe's requirement line")
    rung: Rung = Field(
        description='"dated": any wheel uploaded before `before`; "any": any wheel; "source": '
        'any version, built from source if need be; "dropped": not installed'
    )
    imported: bool = Field(description="whether the repository imports it")
    before: str | None = Field(default=None, description="the date bound of a dated rung")
    conflict: str = Field(
        description="uv's explanation of the conflict (or the failed build) that forced this step"
    )


class RelaxationFailed(Exception):
    """No rung is left to try: the conflict is only among packages the repository imports."""


class NotRelaxable(RelaxationFailed):
    """The failure is not one relaxing answers: neither a conflict between the recipe's pins
    nor a failed build of one (a missing package, the index unreachable)."""


class Relaxer:
    """The ladder above, over one recipe's requirement lines.

    `imported` holds the top-level names the repository imports, or None when they are unknown
    (no environment commit): then nothing is dropped and the pin listed first gives way first.
    `step(error)` takes uv's report for the current `requirements()` and relaxes one pin, or
    raises `RelaxationFailed`."""

    def __init__(
        self, requirements: list[str], imported: frozenset[str] | None, date: str | None
    ) -> None:
        self._lines = list(requirements)
        self._reqs = [parse_requirement(line) for line in requirements]
        self._imported = imported
        self._date = date
        self._order: dict[str, int] = {}
        for i, req in enumerate(self._reqs):
            if req is not None:
                self._order.setdefault(normalise(req.name), i)  # a name listed twice: the first
        self._rung: dict[str, Rung] = {}
        self.steps: list[Relaxation] = []

    def requirements(self) -> list[str]:
        """The requirement lines to install now."""
        out = []
        for line, req in zip(self._lines, self._reqs, strict=True):
            rung = self._rung.get(normalise(req.name)) if req else None
            if rung is None:
                out.append(line)
            elif rung != "dropped":
                assert req is not None
                extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                marker = f"; {req.marker}" if req.marker else ""
                out.append(f"{req.name}{extras}{marker}")  # the version goes, the rest stays
        return out

    def uv_options(self) -> list[str]:
        """Options the current rungs need: wheels only, and a date bound for dated ones."""
        out = []
        for name, rung in sorted(self._rung.items()):
            if rung in ("dated", "any"):
                out.append(f"--only-binary={name}")
            if rung == "dated" and self._date:
                out.append(f"--exclude-newer-package={name}={self._date}")
        return out

    def step(self, error: str) -> Relaxation:
        """Relax the pin whose build failed in `error` (uv's output), or one of the pins its
        unsatisfiable report names.

        Raises:
            RelaxationFailed: the error is neither; it names no pin that can still be relaxed
                (or only one pin, never relaxed before: a missing package, not a conflict); or
                the ladder ran `MAX_STEPS` steps.
        """
        if len(self.steps) >= MAX_STEPS:
            raise RelaxationFailed(f"still failing after {MAX_STEPS} relaxations")
        built = _FAILED_BUILD.search(error)
        if built is not None:
            return self._failed_build(normalise(built.group(1)), error[built.start() :])
        if UNSATISFIABLE not in error:
            raise NotRelaxable("neither a conflict between pins nor a failed build")
        conflict = _explanation(error)
        ours = [n for n in _names_in(conflict) if n in self._order]
        if not any(n in self._rung for n in ours) and (len(ours) < 2 or _MISSING in conflict):
            # Not a conflict between pins (a package missing from the index, a version never
            # released): relaxing would only hide it.
            raise NotRelaxable(f"not a conflict between the recipe's pins: {conflict}")
        named = [n for n in ours if self._next(n) is not None]
        if not named:
            raise RelaxationFailed(
                f"the pins in conflict ({', '.join(ours) or 'none'}) have no rung left (what "
                f"the repository imports is never dropped): {conflict}"
            )
        # Not imported first, then the pin listed first.
        name = min(named, key=lambda n: (self._imports(n), self._order[n]))
        return self._relax(name, conflict)

    def _imports(self, name: str) -> bool:
        return self._imported is None or is_imported(name, self._imported)

    def _failed_build(self, name: str, report: str) -> Relaxation:
        """A pin whose source build failed (a conda-built package whose sdist does not build
        for this Python, as backports.zoneinfo 0.2.1 on 3.10) steps down like a conflict."""
        tail = " ".join(report.split())[:600]
        if name not in self._order:
            raise RelaxationFailed(f"{name}, which the recipe does not pin, does not build: {tail}")
        if self._next(name) is None:
            raise RelaxationFailed(f"{name} does not build at any version tried: {tail}")
        return self._relax(name, tail)

    def _relax(self, name: str, conflict: str) -> Relaxation:
        rung = self._next(name)
        assert rung is not None
        self._rung[name] = rung
        step = Relaxation(
            package=name,
            pinned=self._lines[self._order[name]],
            rung=rung,
            imported=self._imports(name),
            before=self._date if rung == "dated" else None,
            conflict=conflict,
        )
        self.steps.append(step)
        return step

    def _next(self, name: str) -> Rung | None:
        """The rung below `name`'s current one; None at the bottom (a package the repository
        imports, or might, is never dropped)."""
        current = self._rung.get(name)
        req = self._reqs[self._order[name]]
        droppable = not self._imports(name)
        if current is None:
            if req is None or not req.specifier:
                return "dropped" if droppable else None
            return "dated" if self._date else "any"
        if current == "dated":
            return "any"
        if current == "any":
            return "source"
        if current == "source" and droppable:
            return "dropped"
        return None


def _explanation(error: str) -> str:
    """uv's report from 'No solution found' on, whitespace folded (one line for logs)."""
    at = error.find(UNSATISFIABLE)
    text = error[at:] if at >= 0 else error
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:2000]


def _names_in(text: str) -> list[str]:
    """The package names uv's report mentions, normalised, first mention first."""
    seen: dict[str, None] = {}
    for m in _NAMED.finditer(text):
        seen.setdefault(normalise((m.group(1) or m.group(2)).rstrip(".,")), None)
    return list(seen)
