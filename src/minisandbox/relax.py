"""Relaxing the pins of an environment recipe that do not resolve together as pip packages.

SWE-bench's environments are conda exports. Their pins were installed by conda, then by pip, and
were never resolved together: a conda-forge rebuild can pin a dependency its PyPI wheel does not
accept (`cf-units==3.2.0` wants `antlr4-python3-runtime==4.7.2`, the export pins 4.11.1), and a
pip pin installed last can contradict a conda one (`dask==2022.8.1` beside
`distributed==2024.9.1`). pip installed such sets with a warning; uv refuses them.

Conda also built packages whose PyPI sdists do not build for the environment's Python
(`backports.zoneinfo==0.2.1` on 3.10). When the strict install fails either way, the builder
relaxes one pin at a time, the one whose build failed or one among the packages uv's conflict
report names, and installs again:

- packages the repository does not import (at its environment commit) go before those it does:
  its tests run against the versions it imports, the rest only has to install;
- among equals, the pin listed first goes first: exports list conda's pins before pip's, and pip
  ran last, so its pins are the versions the original environment really had;
- each pin steps down a ladder, one rung per conflict it is named in: exact pin -> any wheel
  uploaded before the environment commit's date (`--exclude-newer-package`) -> any wheel -> any
  version, built from source if need be -> dropped (only for packages the repository does not
  import; a conflict left only among those it imports fails the build). Wheels first: the conda
  environment had the package built, and its sdist may need system libraries that no build here
  has (rasterio's needs GDAL).

Every step is kept (`Relaxation`) and reported in the environment layer's metadata and in
`build --json`. The outcome depends only on the recipe, the repository at its environment commit
and the package index, and the first two are part of the environment's key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
# What uv prints when a set of requirements has no solution (and nothing else fails that way).
UNSATISFIABLE = "No solution found when resolving"
_MISSING = "not found in the package registry"
_FAILED_BUILD = re.compile(r"Failed to (?:download and )?build `([A-Za-z0-9][A-Za-z0-9._-]*)")
MAX_STEPS = 60

Rung = Literal["dated", "any", "source", "dropped"]


def normalise(name: str) -> str:
    """PEP 503 name: what pip and uv compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    """The normalised distribution a requirement line names (None for an option or a URL)."""
    if line.lstrip().startswith("-") or "://" in line:
        return None
    m = _REQ.match(line)
    return normalise(m.group(1)) if m else None


def imported_names(sources: Iterable[str]) -> frozenset[str]:
    """Top-level modules imported by Python sources, normalised like distribution names.

    A distribution counts as imported when its normalised name is one of these: exact for most
    (`cf_units` / `cf-units`, `dask`, `pytest`), and a package whose import name differs
    (`yaml` / `PyYAML`) only loses its priority, never its pin unless it conflicts."""
    found: set[str] = set()
    for text in sources:
        found.update(normalise(m) for m in _IMPORT.findall(text))
    return frozenset(found)


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


class Relaxer:
    """The ladder above, over one recipe's requirement lines.

    `step(error)` takes uv's error for the current `requirements()` and relaxes one pin, or
    raises `RelaxationFailed`."""

    def __init__(self, requirements: list[str], imported: frozenset[str], date: str | None):
        self._lines = list(requirements)
        self._imported = imported
        self._date = date
        self._order = {n: i for i, line in enumerate(requirements) if (n := requirement_name(line))}
        self._rung: dict[str, Rung] = {}
        self.steps: list[Relaxation] = []

    def requirements(self) -> list[str]:
        """The requirement lines to resolve now."""
        out = []
        for line in self._lines:
            name = requirement_name(line)
            rung = self._rung.get(name) if name else None
            if rung == "dropped":
                continue
            if rung is not None:
                m = _REQ.match(line)
                assert m is not None and name is not None
                out.append(m.group(1) + (m.group(2) or ""))  # keep extras, drop the version
            else:
                out.append(line)
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
        """Relax one of the pins `error` (uv's unsatisfiable report) names.

        Raises:
            RelaxationFailed: the error names no pin that can still be relaxed, or the ladder
                ran `MAX_STEPS` steps.
        """
        if len(self.steps) >= MAX_STEPS:
            raise RelaxationFailed(f"still failing after {MAX_STEPS} relaxations")
        built = _FAILED_BUILD.search(error)
        if built is not None:
            return self._failed_build(normalise(built.group(1)), error[built.start() :])
        if UNSATISFIABLE not in error:
            raise RelaxationFailed("neither a conflict between pins nor a failed build")
        conflict = _explanation(error)
        ours = [n for n in _names_in(conflict) if n in self._order]
        if not any(n in self._rung for n in ours) and (len(ours) < 2 or _MISSING in conflict):
            # Not a conflict between pins (a package missing from the index, a version never
            # released): relaxing would only hide it.
            raise RelaxationFailed(f"not a conflict between the recipe's pins: {conflict}")
        named = [n for n in ours if self._next(n) is not None]
        if not named:
            raise RelaxationFailed(
                f"no pin left to relax among those in the conflict ({_names_listed(conflict)}): "
                f"{conflict}"
            )
        # Not imported first, then the pin listed first.
        name = min(named, key=lambda n: (n in self._imported, self._order[n]))
        return self._relax(name, conflict)

    def _failed_build(self, name: str, report: str) -> Relaxation:
        """A pin whose source build failed (a conda-built package whose sdist does not build
        for this Python, as backports.zoneinfo 0.2.1 on 3.10) steps down like a conflict."""
        tail = " ".join(report.split())[:600]
        if name not in self._order or self._next(name) is None:
            raise RelaxationFailed(f"{name} does not build and has no rung left to try: {tail}")
        return self._relax(name, tail)

    def _relax(self, name: str, conflict: str) -> Relaxation:
        rung = self._next(name)
        assert rung is not None
        self._rung[name] = rung
        step = Relaxation(
            package=name,
            pinned=self._lines[self._order[name]],
            rung=rung,
            imported=name in self._imported,
            before=self._date if rung == "dated" else None,
            conflict=conflict,
        )
        self.steps.append(step)
        return step

    def _next(self, name: str) -> Rung | None:
        current = self._rung.get(name)
        if current is None:
            pinned = "=" in self._lines[self._order[name]] or "<" in self._lines[self._order[name]]
            if not pinned:
                return None if name in self._imported else "dropped"
            return "dated" if self._date else "any"
        if current == "dated":
            return "any"
        if current == "any":
            return "source"
        if current == "source" and name not in self._imported:
            return "dropped"
        return None


def _explanation(error: str) -> str:
    """uv's report from 'No solution found' on, whitespace folded (one line for logs)."""
    at = error.find(UNSATISFIABLE)
    text = error[at:] if at >= 0 else error
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:2000]


def _names_in(text: str) -> list[str]:
    """Words of `text` that could be distribution names, normalised, first mention first."""
    seen: dict[str, None] = {}
    for m in _NAME.finditer(text):
        seen.setdefault(normalise(m.group(0).rstrip(".")), None)
    return list(seen)


def _names_listed(text: str) -> str:
    found = re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==|>=|<=|!=|~=|<|>)", text)
    return ", ".join(dict.fromkeys(found)) or "none"
