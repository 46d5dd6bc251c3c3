"""A recipe's `from_repository`, resolved by reading the repository at its environment commit.

Three things a recipe can leave to its repository (envs.recipe.FromRepository):
- a requirements file (swebench's `packages: requirements.txt`): the first of its paths that
  exists is read, `-r` includes followed inside the repository, the repository itself (`-e .`,
  `.[test]`), constraints and index options left out, as swebench's harness did; a package the
  recipe pins itself is taken from the recipe (the harness installed its pins after the file);
- a conda environment file (`packages: environment.yml`): its pip section, and its conda
  packages as pip requirements;
- everything (`infer`, a repository nobody wrote a recipe for): the Python version, from what
  the repository says it supports and tests (python_requires, classifiers, tox, CI) and when
  the commit was made; its test requirements, from the first of a test requirements file, the
  test extras of its package metadata, or tox's deps; pytest; all resolved as of the commit's
  date. docs/fidelity.md says where this inference stops.

What was decided, and from which file, is kept in the recipe's `inferred` (the environment
layer's metadata, `build --json`). The repository is read through `RepoTree`: regular files of
the commit's tree only, each read bounded.
"""

from __future__ import annotations

import ast
import configparser
import datetime as dt
import posixpath
import re
from collections.abc import Callable, Iterable
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from minisandbox.envs.asof import as_of_date
from minisandbox.envs.recipe import EnvRecipe, FromRepository, minor_version
from minisandbox.envs.relax import parse_requirement
from minisandbox.errors import MiniSandboxError
from minisandbox.tasks.loaders.conda_exports import (
    CONDA_TO_PYPI,
    conda_only_packages,
    requirement_name,
)
from minisandbox.tasks.loaders.formats import yaml_module

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover (3.10)
    import tomli as tomllib

# A file larger than this is not a recipe's source (and is not read).
MAX_FILE_BYTES = 1 << 20
_MAX_INCLUDE_DEPTH = 5

# First release of each Python minor (python.org): inference never picks one the commit predates.
PYTHON_RELEASES = {
    "3.6": "2016-12-23",
    "3.7": "2018-06-27",
    "3.8": "2019-10-14",
    "3.9": "2020-10-05",
    "3.10": "2021-10-04",
    "3.11": "2022-10-24",
    "3.12": "2023-10-02",
    "3.13": "2024-10-07",
}
# A Python its ecosystem had caught up with by the commit: out at least this long before it
# (wheels of the dependencies exist).
_SETTLED = dt.timedelta(days=180)
# Test requirements files, in the order they are looked for.
_TEST_REQUIREMENT_FILES = (
    "requirements-test.txt",
    "requirements_test.txt",
    "requirements-tests.txt",
    "requirements_tests.txt",
    "test-requirements.txt",
    "test_requirements.txt",
    "tests/requirements.txt",
    "requirements/test.txt",
    "requirements/tests.txt",
    "requirements/testing.txt",
    "requirements/testing/default.txt",
    "requirements-dev.txt",
    "requirements_dev.txt",
    "dev-requirements.txt",
    "dev_requirements.txt",
    "requirements/dev.txt",
    # astropy's convention (and its affiliated packages'): no .txt, its dev file includes the
    # build requirements (Cython, jinja2) a legacy setup.py would fetch undated otherwise.
    "pip-requirements-dev",
    "pip-requirements-test",
    "pip-requirements",
)
# Conda environment files the test CI installs (xarray's tests need dask, listed only there).
_TEST_ENVIRONMENT_FILES = (
    "ci/requirements/environment.yml",
    "ci/requirements/environment-dev.yml",
    "ci/environment.yml",
    "environment-dev.yml",
    "environment_dev.yml",
    "dev-environment.yml",
)
_TEST_EXTRAS = ("test", "tests", "testing")
_CLASSIFIER = re.compile(r"Programming Language :: Python :: (3\.\d+)\b")
_TOX_ENV = re.compile(r"\bpy(3\.?\d+)\b")
_CI_VERSION = re.compile(r"""(?<![\d.])['"]?(3\.\d{1,2})['"]?(?![\d.])""")
_PYTHON_REQUIRES = re.compile(r"""python_requires\s*=\s*(['"])([^'"]+)\1""")
# Python bindings of a C library that conda installs beside them, whose PyPI wheels carry the
# library only from a later release: eccodes from 2.38 (October 2024); an older one installs,
# then its import raises RuntimeError ("Cannot find the ecCodes library"), which a test
# module's importorskip does not catch (xarray's inferred recipes get it through cfgrib from
# their CI's conda file, and every test module importing it failed to collect). A recipe from
# a conda environment file dated earlier takes them as of then.
BUNDLED_LIBRARIES = {"eccodes": "2024-11-01", "findlibs": "2024-11-01"}
# A test runner a task's command needs a feature of (FromRepository.runner): a time after the
# first release with it, and one when what it depends on can be installed beside it. pytest's
# `-rA` (4.5.0, 2019-05-11) prints the PASSED lines the log parsers read; an older pytest
# ignores the `A` and every test reads "not run" (a requests commit of 2014 dates pytest 2.x).
# Its dependencies as of the end of 2022: atomicwrites' files were all uploaded again in July
# 2022 (none is older), and pytest 4.6's own bounds keep the rest compatible.
RUNNER_RELEASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pytest": (
        "2019-06-15",
        "2022-12-31",
        (
            "pluggy", "py", "attrs", "more-itertools", "atomicwrites", "six", "wcwidth",
            "packaging", "pyparsing", "importlib-metadata", "zipp", "funcsigs", "pathlib2",
            "scandir", "colorama", "configparser", "contextlib2",
        ),
    ),
}  # fmt: skip


class RecipeResolveError(MiniSandboxError):
    """The repository does not give what the recipe leaves to it."""


class RepoTree:
    """The regular files of a repository's tree at one commit, read on demand and bounded.

    `blobs` maps each path to its size; `read(path)` gives a file's text (one that is absent,
    a link, or larger than MAX_FILE_BYTES reads as None).
    """

    def __init__(self, blobs: dict[str, int], read: Callable[[str], str], date: str | None) -> None:
        self.blobs = blobs
        self._read = read
        self.date = date
        """The commit's date (ISO 8601), when known."""

    def read(self, path: str) -> str | None:
        path = posixpath.normpath(path)
        size = self.blobs.get(path)
        if size is None or size > MAX_FILE_BYTES:
            return None
        return self._read(path)

    def first(self, paths: Iterable[str]) -> str | None:
        """The first of `paths` that is a readable file."""
        return next((p for p in paths if self.read(p) is not None), None)


def resolve(recipe: EnvRecipe, tree: RepoTree) -> EnvRecipe:
    """`recipe` with what it leaves to the repository read from `tree` (its environment
    commit), `from_repository` cleared and `inferred` saying what was decided.

    Raises:
        RecipeResolveError: none of the files the recipe names is there, or inference found
            no Python version the repository allows.
    """
    source = recipe.from_repository
    if source is None:
        return recipe
    notes: dict[str, str] = dict(recipe.inferred)
    skipped = list(recipe.skipped)
    python = recipe.python
    as_of = recipe.as_of
    found, conda = _named_files(source, tree, skipped, notes)
    if source.infer:
        claimed = python is not None  # the recipe's own: as good as a claim
        if python is None:
            python, why = infer_python(tree)
            notes["python"] = f"{python}: {why}"
            claimed = _CLAIMED in why
        reqs, where = infer_requirements(tree, skipped)
        found += reqs
        notes["requirements"] = where
        conda |= where.split(" + ")[0] in _TEST_ENVIRONMENT_FILES
        if tree.date and as_of is None:
            as_of, notes["as_of"] = _inferred_date(tree.date, python, claimed)
    later = {**recipe.as_of_packages, **(_bundled_later(as_of) if conda else {})}
    if source.runner:
        found, runner_later = with_runner(found, source.runner, as_of, notes)
        later.update(runner_later)
    own = {requirement_name(r) for r in recipe.requirements if "://" not in r}
    kept = [r for r in _unique(found) if "://" in r or requirement_name(r) not in own]
    # Validated as any recipe is (model_copy would not: what a repository says is input).
    return EnvRecipe.model_validate(
        {
            **recipe.model_dump(),
            "python": python,
            "requirements": [*kept, *recipe.requirements],
            "as_of": as_of,
            "as_of_packages": later,
            "from_repository": None,
            "inferred": notes,
            "skipped": skipped,
        }
    )


def _named_files(
    source: FromRepository, tree: RepoTree, skipped: list[str], notes: dict[str, str]
) -> tuple[list[str], bool]:
    """The requirements of the files `source` names (the first present of each kind), and
    whether a conda environment file gave some.

    Raises:
        RecipeResolveError: none of the files of a kind is there.
    """
    found: list[str] = []
    conda = False
    for paths, read, kind in (
        (source.requirements_files, requirements_file, "requirements"),
        (source.environment_files, _environment_file_at, "environment"),
    ):
        if not paths:
            continue
        path = tree.first(paths)
        if path is None:
            raise RecipeResolveError(
                f"none of the {kind} files {', '.join(paths)} is in the repository at its "
                "environment commit"
            )
        found += read(tree, path, skipped)
        notes["requirements"] = ", ".join(filter(None, [notes.get("requirements"), path]))
        conda |= kind == "environment"
    return found, conda


def _bundled_later(as_of: str | None) -> dict[str, str]:
    """The BUNDLED_LIBRARIES a conda file's recipe dated `as_of` takes as of later."""
    date = _date(as_of)
    if date is None:
        return {}
    return {n: d for n, d in BUNDLED_LIBRARIES.items() if date < dt.date.fromisoformat(d)}


def with_runner(
    reqs: list[str], runner: list[str], as_of: str | None, notes: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """`reqs` with what the test command needs of its runner (`runner`, e.g. `pytest>=4.5`),
    where they would not give it: a line of the same package that allows no such version
    (the repository pinned an older pytest) is replaced by it; and when `as_of` predates the
    runner's release (RUNNER_RELEASES), its lines are narrowed to it, and it and what it
    depends on are resolved as of then (the second value). Lines that already give it, as
    of a later date, are left alone. What was changed goes into `notes["runner"]`."""
    out, later, said = list(reqs), dict[str, str](), list[str]()
    date = _date(as_of)
    for line in runner:
        need = Requirement(line)
        name = requirement_name(line)
        release = RUNNER_RELEASES.get(need.name.lower())
        since = _date(release[0]) if release else None
        early = since is not None and date is not None and date < since
        mine = [i for i, r in enumerate(out) if "://" not in r and requirement_name(r) == name]
        for i in reversed(mine):
            theirs = parse_requirement(out[i])
            if theirs is None or not _compatible(theirs.specifier, need.specifier):
                said.append(f"{out[i]} replaced by {line}")
                del out[i]
            elif early:
                theirs.specifier &= need.specifier
                out[i] = str(theirs)
        if not any("://" not in r and requirement_name(r) == name for r in out):
            out.append(line)
        if early and release is not None:
            later.update({need.name: release[0], **dict.fromkeys(release[2], release[1])})
            said.append(
                f"{line} as of {release[0]}, what it depends on as of {release[1]} (after the "
                "commit)"
            )
    if said:
        notes["runner"] = "the test command's runner: " + "; ".join(said)
    return out, later


def _compatible(theirs: SpecifierSet, need: SpecifierSet) -> bool:
    """Whether some version both allow: tried on the versions either names."""
    candidates = {spec.version.rstrip(".*") for spec in (*theirs, *need)}
    return any(
        theirs.contains(c, prereleases=True) and need.contains(c, prereleases=True)
        for c in candidates
    )


def _inferred_date(commit_date: str, python: str, claimed: bool) -> tuple[str, str]:
    """The date an inferred environment resolves as of, and why: the commit's, but not before
    its Python had settled (packages from before it do not run on it): six months after its
    release, or for a Python the repository claims (its CI installed on it), its release."""
    settled = _date(PYTHON_RELEASES.get(minor_version(python), ""))
    commit = _date(commit_date)
    margin = dt.timedelta(0) if claimed else _SETTLED
    if settled is not None and commit is not None and commit < settled + margin:
        date = as_of_date((settled + margin).isoformat())
        after = "six months after" if margin else "the release of"
        return date, f"{date}: {after} Python {python}, later than the commit"
    date = as_of_date(commit_date)
    return date, f"{date}: the environment commit's date"


def _environment_file_at(tree: RepoTree, path: str, skipped: list[str]) -> list[str]:
    return environment_file(tree.read(path) or "", skipped)


# ---------------------------------------------------------------- requirements files


_MAX_REQUIREMENT_LINES = 5000


def requirements_file(
    tree: RepoTree, path: str, skipped: list[str], seen: set[str] | None = None
) -> list[str]:
    """The requirement lines of the file at `path`, its `-r` includes inlined (relative to the
    including file, inside the repository, each file once, at most _MAX_INCLUDE_DEPTH deep and
    _MAX_REQUIREMENT_LINES in all); what cannot be a pip requirement of an environment is
    noted in `skipped` instead."""
    seen = set() if seen is None else seen
    text = tree.read(path)
    if text is None:
        skipped.append(f"{path}: not in the repository")
        return []
    seen.add(path)
    here = posixpath.dirname(path)
    out: list[str] = []
    for line in _logical_lines(text)[:_MAX_REQUIREMENT_LINES]:
        included = _include(line)
        if included is not None:
            target = posixpath.normpath(posixpath.join(here, included))
            if len(seen) > _MAX_INCLUDE_DEPTH * 4 or target.startswith("../") or target in seen:
                skipped.append(f"{path}: {line}")
            else:
                out += requirements_file(tree, target, skipped, seen)
            continue
        req = requirement_line(line)
        if req is None:
            skipped.append(f"{path}: {line}")
        else:
            out.append(req)
    return out[:_MAX_REQUIREMENT_LINES]


def _include(line: str) -> str | None:
    """The file a `-r FILE` / `--requirement=FILE` line includes (None: not such a line)."""
    for flag in ("--requirement", "-r"):
        if line.startswith(flag):
            rest = line[len(flag) :].lstrip(" \t=")
            return rest if rest and not any(c.isspace() for c in rest) else None
    return None


def _logical_lines(text: str) -> list[str]:
    """Lines without comments and blank ones, continuations joined."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            lines.append(line)
    if pending.strip():  # a last line that ends in a backslash
        lines.append(pending.strip())
    return lines


def requirement_line(line: str) -> str | None:
    """`line` as one requirement of an environment, or None: the repository itself (`.`,
    `-e .`, `.[test]`), a local path, a constraint or index option, or not a requirement."""
    line = re.sub(r"\s--hash[=\s]\S+", "", f" {line.strip()}").strip()  # pip-compile's hashes
    editable = re.match(r"^(-e|--editable)\s+(\S+)$", line)
    if editable:
        line = editable[2]
    if line.startswith(("-", ".", "/")):
        return None
    if re.match(r"^(git\+|hg\+|svn\+|bzr\+)?https?://", line):
        if any(c.isspace() for c in line):  # one URL, no options after it
            return None
        return line if "#egg=" in line or "@" in line.split("://", 1)[1] else None
    try:
        Requirement(line)
    except InvalidRequirement:
        return None
    return line


def environment_file(text: str, skipped: list[str]) -> list[str]:
    """The requirements of a conda environment file: its conda packages as pip requirements
    (conda-only ones and Python left out) and its pip section."""
    yaml = yaml_module()
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as e:
        raise RecipeResolveError(f"the environment file is not YAML: {e}") from None
    deps = doc.get("dependencies") if isinstance(doc, dict) else None
    out: list[str] = []
    for dep in deps if isinstance(deps, list) else []:
        if isinstance(dep, dict):
            pip = dep.get("pip")
            for line in pip if isinstance(pip, list) else []:
                req = requirement_line(line) if isinstance(line, str) else None
                if req is None:
                    skipped.append(f"pip: {line!r}"[:200])
                else:
                    out.append(req)
            continue
        if not isinstance(dep, str):  # (an alias of a structure: never expanded)
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", dep.strip())
        if not m or m[1].lower() in ("python", "pip"):
            continue
        if m[1].lower() in conda_only_packages():
            skipped.append(f"conda: {dep}: conda-only")
            continue
        name = CONDA_TO_PYPI.get(m[1].lower(), m[1])
        version = m[2].strip().replace(" ", "")
        if version and version[0].isdigit():  # "numpy 1.19": conda's "numpy=1.19"
            version = "=" + version
        if version.startswith("=") and not version.startswith("=="):
            version = "==" + version[1:] + ("" if version.endswith("*") else ".*")
        req = requirement_line(f"{name}{version}")
        if req is None:
            skipped.append(f"conda: {dep}")
        else:
            out.append(req)
    return out


def _unique(reqs: list[str]) -> list[str]:
    """The first requirement of each name (a name pinned twice would not resolve)."""
    seen: set[str] = set()
    out = []
    for r in reqs:
        name = None if "://" in r else requirement_name(r)
        if name is None:
            out.append(r)
            continue
        key = f"{name};{r.partition(';')[2].strip()}"
        if key not in seen:
            out.append(r)
            seen.add(key)
    return out


# ---------------------------------------------------------------- inference


def _metadata(tree: RepoTree) -> tuple[str, configparser.ConfigParser, dict[str, Any]]:
    """setup.py's text, setup.cfg parsed and pyproject.toml parsed (each empty when absent or
    unreadable)."""
    setup_py = tree.read("setup.py") or ""
    cfg = configparser.ConfigParser(interpolation=None)
    try:
        cfg.read_string(tree.read("setup.cfg") or "")
    except configparser.Error:
        cfg = configparser.ConfigParser(interpolation=None)
    try:
        pyproject = tomllib.loads(tree.read("pyproject.toml") or "")
    except (tomllib.TOMLDecodeError, RecursionError):
        pyproject = {}
    return setup_py, cfg, pyproject


_CLAIMED = "the newest claimed"


def infer_python(tree: RepoTree) -> tuple[str, str]:
    """The Python minor version for the repository at its commit, and why.

    The newest of the versions the repository says it supports (classifiers) or tests (tox,
    CI) that its python_requires allows and that was out at the commit (its tests may need
    it: flask 2.3's TOML tests skip before 3.11); without any such claim, the newest Python
    that had been out for six months (packages had wheels for it by then).

    Raises:
        RecipeResolveError: no Python version fits.
    """
    requires, claimed = _python_claims(tree)
    try:
        allowed = SpecifierSet(requires or "")
    except InvalidSpecifier:  # computed in setup.py ('>=' + a variable): not read
        allowed, requires = SpecifierSet(""), None
    commit = _date(tree.date)

    def out(v: str, margin: dt.timedelta) -> bool:
        released = _date(PYTHON_RELEASES.get(v))
        return released is not None and (commit is None or released + margin <= commit)

    def settled(v: str) -> bool:
        return out(v, _SETTLED)

    def allows(v: str) -> bool:  # any release of the minor (">=3.6.1" allows 3.6)
        return any(allowed.contains(f"{v}.{patch}", prereleases=True) for patch in (0, 99))

    # A claimed version counts once released: the repository's CI installed on it that day.
    fits = [v for v in claimed if out(v, dt.timedelta(0)) and allows(v)]
    note = f"python_requires {requires!r}, " if requires else ""
    if fits:
        best = max(fits, key=_minor)
        return best, f"{note}{_CLAIMED} ({claimed[best]}) out by the commit"
    fallback = [v for v in PYTHON_RELEASES if settled(v) and allows(v)]
    if fallback:
        best = max(fallback, key=_minor)
        return best, f"{note}no version claimed: the newest out six months before the commit"
    oldest = [v for v in PYTHON_RELEASES if allows(v)]
    if oldest:  # a commit older than every Python 3 here: the oldest the repository allows
        best = min(oldest, key=_minor)
        return best, f"{note}none out six months before the commit: the oldest allowed"
    raise RecipeResolveError(
        f"no Python version fits the repository (python_requires {requires!r}, commit "
        f"{tree.date}): give the recipe a `python`"
    )


def _python_claims(tree: RepoTree) -> tuple[str | None, dict[str, str]]:
    """The repository's python_requires, and the Python versions it claims, each with where
    it says so (classifiers, tox's envlist, CI files)."""
    setup_py, cfg, pyproject = _metadata(tree)
    project = pyproject.get("project") if isinstance(pyproject.get("project"), dict) else {}
    assert isinstance(project, dict)
    requires = None
    m = _PYTHON_REQUIRES.search(setup_py)
    if m:
        requires = m[2]
    elif cfg.has_option("options", "python_requires"):
        requires = cfg.get("options", "python_requires")
    elif isinstance(project.get("requires-python"), str):
        requires = project["requires-python"]
    claimed: dict[str, str] = {}
    sources = [
        ("setup.py classifiers", _CLASSIFIER.findall(setup_py)),
        (
            "setup.cfg classifiers",
            _CLASSIFIER.findall(cfg.get("metadata", "classifiers", fallback="")),
        ),
        (
            "pyproject classifiers",
            _CLASSIFIER.findall(" ".join(_strings(project.get("classifiers")))),
        ),
        ("tox.ini", _tox_versions(_tox_envlist(tree))),
        ("CI files", _ci_versions(tree)),
    ]
    for where, versions in sources:
        for v in versions:
            claimed.setdefault(v, where)
    return requires, claimed


def _strings(value: Any) -> list[str]:
    """`value` when it is a list of strings (what a file says may be anything)."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _minor(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def _date(value: str | None) -> dt.date | None:
    if not value:
        return None
    return dt.date.fromisoformat(value[:10])


def _tox_versions(envlist: str) -> list[str]:
    """Python versions of a tox envlist: py37, py3.8, py{36,37}-django."""
    braces = re.findall(r"\bpy\{([\d,\s.]+)\}", envlist)
    numbers = _TOX_ENV.findall(envlist) + [n for b in braces for n in re.split(r"[,\s]+", b)]
    out = []
    for n in numbers:
        n = n.replace(".", "")
        if len(n) >= 2 and n.isdigit() and n[0] == "3":
            out.append(f"3.{n[1:]}")
    return out


def _tox_envlist(tree: RepoTree) -> str:
    cfg = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        cfg.read_string(tree.read("tox.ini") or "")
    except configparser.Error:
        return ""
    return cfg.get("tox", "envlist", fallback="")


def _ci_versions(tree: RepoTree) -> list[str]:
    """Python versions named on the python version lines of CI files."""
    out: list[str] = []
    files = [p for p in tree.blobs if p.startswith(".github/workflows/")]
    files += [p for p in (".travis.yml", "azure-pipelines.yml", ".circleci/config.yml")]
    for path in sorted(files):
        for line in (tree.read(path) or "").splitlines():
            if re.search(r"python(-version|_version)?\s*:|\bpython\s*-\s|toxenv|PYTHON", line):
                out += _CI_VERSION.findall(line)
    return out


def infer_requirements(tree: RepoTree, skipped: list[str]) -> tuple[list[str], str]:
    """The test requirements of the repository (the package itself is installed by the task's
    install step): the first test requirements file, else the first conda environment file
    of its CI (one that is not YAML is noted in `skipped` and passed over), else the test
    extras of its metadata, else tox's deps; pytest always. Returns them and where they came
    from."""
    path = tree.first(_TEST_REQUIREMENT_FILES)
    conda = tree.first(_TEST_ENVIRONMENT_FILES)
    from_conda = None
    if path is None and conda is not None:
        from_conda = _environment_or_none(tree, conda, skipped)
    if path is not None:
        reqs, where = requirements_file(tree, path, skipped), path
    elif from_conda is not None:
        reqs, where = from_conda, str(conda)
    else:
        reqs, where = _test_extras(tree)
        if not reqs:
            reqs, where = _tox_deps(tree, skipped)
    if not any(requirement_name(r) == "pytest" for r in reqs):
        reqs.append("pytest")
        where = f"{where} + pytest" if where else "pytest only"
    return reqs, where


def _environment_or_none(tree: RepoTree, path: str, skipped: list[str]) -> list[str] | None:
    """A CI environment file's requirements; None (noted) when it is not YAML."""
    try:
        return environment_file(tree.read(path) or "", skipped)
    except RecipeResolveError as e:
        skipped.append(f"{path}: {e}"[:200])
        return None


def _test_extras(tree: RepoTree) -> tuple[list[str], str]:
    setup_py, cfg, pyproject = _metadata(tree)
    project = pyproject.get("project") if isinstance(pyproject.get("project"), dict) else {}
    assert isinstance(project, dict)
    optional = project.get("optional-dependencies") or {}
    for extra in _TEST_EXTRAS:
        if isinstance(optional, dict) and isinstance(optional.get(extra), list):
            return _valid(_strings(optional[extra])), f"pyproject.toml [{extra}]"
    if cfg.has_section("options.extras_require"):
        for extra in _TEST_EXTRAS:
            if cfg.has_option("options.extras_require", extra):
                lines = cfg.get("options.extras_require", extra).splitlines()
                return _valid(lines), f"setup.cfg [{extra}]"
    extras = _setup_py_extras(setup_py)
    for extra in _TEST_EXTRAS:
        if extra in extras:
            return _valid(extras[extra]), f"setup.py [{extra}]"
    return [], ""


def _valid(lines: Iterable[Any]) -> list[str]:
    return [r for r in (requirement_line(str(line)) for line in lines) if r is not None]


def _setup_py_extras(text: str) -> dict[str, list[str]]:
    """`extras_require` of setup.py when it is made of literals: a dict, names bound to
    literals at module level, lists added together."""
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (any text a file holds)
        return {}
    names: dict[str, ast.expr] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                names[target.id] = node.value

    def value(node: ast.expr, depth: int = 0) -> Any:
        if depth > 10:
            raise ValueError("too deep")
        if isinstance(node, ast.Name) and node.id in names:
            return value(names[node.id], depth + 1)
        if isinstance(node, ast.Dict):
            return {
                value(k, depth + 1): value(v, depth + 1)
                for k, v in zip(node.keys, node.values, strict=True)
                if k is not None
            }
        if isinstance(node, ast.List | ast.Tuple):
            return [value(e, depth + 1) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return value(node.left, depth + 1) + value(node.right, depth + 1)
        return ast.literal_eval(node)

    for found_node in ast.walk(module):
        if isinstance(found_node, ast.keyword) and found_node.arg == "extras_require":
            try:
                found = value(found_node.value)
            except (ValueError, TypeError, SyntaxError, KeyError):
                return {}
            if isinstance(found, dict):
                return {
                    str(k): [str(x) for x in v] for k, v in found.items() if isinstance(v, list)
                }
    return {}


def _tox_deps(tree: RepoTree, skipped: list[str]) -> tuple[list[str], str]:
    cfg = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        cfg.read_string(tree.read("tox.ini") or "")
    except configparser.Error:
        return [], ""
    out: list[str] = []
    for line in cfg.get("testenv", "deps", fallback="").splitlines():
        line = line.strip()
        if not line or re.match(r"^[\w,{}.-]+:\s", line):  # a factor's own deps
            continue
        m = re.match(r"^-r\s*\{toxinidir\}/(\S+)$|^-r\s*(\S+)$", line)
        if m:
            out += requirements_file(tree, m[1] or m[2], skipped)
        elif (req := requirement_line(line)) is not None:
            out.append(req)
    return out, "tox.ini [testenv] deps" if out else ""
