"""What a patch may change: the code under test, never what decides how its tests run.

A patch that writes a path below is refused before anything of it runs (reward 0, with the rule
that fired), rather than reset: SWE-bench resets only the test files it knows, and a reset
conftest or config would still have said what the patch meant. A correct fix has no reason to
touch any of them (SWE-bench's own split puts every path with a test directory in the test
patch; docs/evaluation.md has the measured gold patches).

- `.git/` (hooks, config: code git itself runs), a path outside the checkout, `.gitattributes`
  (how git checks out and patches the test files);
- every `conftest.py` and `conftest` package; `pytest.ini` / `.pytest.ini`; nose's and
  coverage's files; `sitecustomize.py`, `usercustomize.py`, `*.pth` (code the interpreter runs
  at start);
- a new `pytest.py`, `_pytest/`, `pytest/`, `pluggy/` or `py.py` that would shadow the runner
  (changing the repository's own, in pytest's repository, is changing the code under test);
- the repository's own runner when the test command runs it (`bin/test`, `runtests.py`) and
  the modules it grades with (sympy's `testing/`);
- the files of the hidden tests and everything in their test directories;
- the test runner's sections of `setup.cfg`, `tox.ini` and `pyproject.toml` (checked after
  the patch applies, by their contents: the rest of those files is the project's);
- a new top-level module that shadows one the tests import (the standard library's or an
  installed one), in a directory of the checkout that is on `sys.path`.
"""

from __future__ import annotations

import posixpath
import re
import sys
from collections.abc import Iterable

from minisandbox.tasks.patches import PatchedFile
from minisandbox.tasks.specs import Task, files_in_patch, files_of_tests

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Names whose change is refused wherever they are.
_INFRA_NAMES = {
    "conftest.py": "a conftest.py (pytest loads its hooks)",
    "pytest.ini": "pytest's configuration",
    ".pytest.ini": "pytest's configuration",
    ".coveragerc": "coverage's configuration",
    ".noserc": "nose's configuration",
    "nose.cfg": "nose's configuration",
    "sitecustomize.py": "a sitecustomize.py (run at interpreter start)",
    "usercustomize.py": "a usercustomize.py (run at interpreter start)",
    ".gitattributes": "a .gitattributes (how git checks out the test files)",
}
_RUNNER_SHADOWS = {"pytest.py", "_pytest", "pytest", "pluggy", "py.py"}
_TEST_WORDS = re.compile(r"^(tests?|testing)$|^test_|_tests?$")
# Modules the repository's own runner grades with, beside the script the test command runs.
_RUNNER_FILES = re.compile(
    r"(^|/)runtests\.py$|^sympy/(testing|utilities)/(runtests|pytest|quality_unicode)\.py$"
    r"|^sympy/testing/"
)
# Config files where only the test runner's sections are infrastructure.
_MIXED_CONFIGS = {"setup.cfg", "tox.ini", "pyproject.toml"}
_INI_SECTIONS = re.compile(r"^(pytest|tool:pytest|nosetests|coverage:.*)$")
# tox.ini's own: the environment tox gives the test command (setenv, passenv, commands).
_TOX_SECTIONS = re.compile(r"^(tox|testenv.*)$")


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _where(path: str) -> str | None:
    """Why `path` is outside what a patch may write, ignoring the task: None when it is not."""
    parts = _parts(path)
    if path.startswith("/") or not parts or ".." in parts:
        return f"{path!r} is outside the checkout"
    if any(p.lower() == ".git" for p in parts):
        return f"{path!r} is inside .git/ (git runs its hooks and config)"
    name = parts[-1]
    if name in _INFRA_NAMES:
        return f"{path!r} is {_INFRA_NAMES[name]}"
    if name.endswith(".pth"):
        return f"{path!r} is a .pth file (run at interpreter start)"
    if "conftest" in parts[:-1]:
        return f"{path!r} is in a conftest package"
    return None


def _test_support(path: str) -> str | None:
    """Test support anywhere: what the hidden tests import to decide (a package's testing
    helpers, django's test case classes) is the tests', not the code under test's."""
    parts = _parts(path)
    if any(_TEST_WORDS.search(p) for p in parts[:-1]) or parts[-1:] == ["testing.py"]:
        return f"{path!r} is test code (a test directory or testing helpers)"
    if parts[:2] == ["django", "test"]:
        return f"{path!r} is django's test framework"
    return None


def test_dirs(task: Task) -> set[str]:
    """Directories of the hidden tests that are test directories (a directory named tests,
    test, testing, test_*, *_tests): everything below them belongs to the tests. A test file at
    the root or beside the code protects only itself."""
    dirs = set()
    files = {*files_in_patch(task.test_patch), *task.test_files}
    files |= files_of_tests([*task.fail_to_pass, *task.pass_to_pass])
    for f in files:
        parts = _parts(posixpath.dirname(f))
        for i, part in enumerate(parts):
            if _TEST_WORDS.search(part):
                dirs.add("/".join(parts[: i + 1]))
                break
    return dirs


def runner_script(task: Task) -> str | None:
    """The repository file the test command runs (`bin/test`, `./tests/runtests.py`, `python
    x/run.py`), if any: its command word, past variable assignments."""
    words = [w for w in task.test_cmd.split() if "=" not in w.split("/")[0]]
    if words and words[0].startswith("python") and len(words) > 1:
        words = words[1:]
    if words and "/" in words[0] and not words[0].startswith(("-", "/")):
        return posixpath.normpath(words[0])
    return None


def is_test_file(path: str) -> bool:
    """A test module by its name or place (a doctest id names a module of the code instead)."""
    name = posixpath.basename(path)
    parts = _parts(posixpath.dirname(path))
    looks = name.startswith("test") or name.endswith(("_test.py", "_tests.py", "tests.py"))
    return looks or any(_TEST_WORDS.search(p) for p in parts)


def refusals(task: Task, files: Iterable[PatchedFile], base_paths: set[str]) -> list[str]:
    """Each rule `files` (what a patch changes) breaks for `task`, as "path: ..." reasons.
    `base_paths`: every path (files and directories) of the checkout before the patch."""
    protected = {*files_in_patch(task.test_patch), *task.test_files}
    protected |= {
        f for f in files_of_tests([*task.fail_to_pass, *task.pass_to_pass]) if is_test_file(f)
    }
    dirs = test_dirs(task)
    runner = runner_script(task)
    out: list[str] = []
    for f in files:
        for path in filter(None, (f.path, f.old_path)):
            norm = posixpath.normpath(path) if path else path
            why = _where(path)
            if why is None and (norm in protected or any(norm.startswith(d + "/") for d in dirs)):
                why = f"{path!r} belongs to the hidden tests"
            if why is None and (norm == runner or _RUNNER_FILES.search(norm)):
                why = f"{path!r} is the repository's test runner"
            if why is None:
                why = _test_support(norm)
            if why is None:
                parts = _parts(norm)
                for i, part in enumerate(parts):
                    if part in _RUNNER_SHADOWS and "/".join(parts[: i + 1]) not in base_paths:
                        why = f"{path!r} would shadow the test runner ({part})"
                        break
            if why is not None:
                out.append(f"path: {why}")
    return list(dict.fromkeys(out))


def mixed_configs(files: Iterable[PatchedFile]) -> list[str]:
    """The paths among `files` whose test-runner sections must be compared before and after."""
    return sorted(
        {
            p
            for f in files
            for p in (f.path, f.old_path)
            if p and posixpath.basename(p) in _MIXED_CONFIGS
        }
    )


def runner_sections(path: str, text: str | None) -> dict[str, object]:
    """The test runner's sections of a setup.cfg / tox.ini / pyproject.toml (empty when the file
    is absent; an unreadable file is all one section, so any change to it counts)."""
    if text is None:
        return {}
    if path.endswith(".toml"):
        try:
            tool = tomllib.loads(text).get("tool", {})
        except tomllib.TOMLDecodeError:
            return {"<unreadable>": text}
        if not isinstance(tool, dict):
            return {"<unreadable>": text}
        return {k: v for k, v in tool.items() if k in ("pytest", "coverage", "nose", "nose2")}
    # Sections as pytest's own reader (iniconfig) splits them: a header is a line that starts
    # with "[", named up to its first "]" (configparser reads `[pytest] ; ]` otherwise).
    tox = path.endswith("tox.ini")
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            name = line[1:].split("]", 1)[0].strip()
            keep = _INI_SECTIONS.match(name) or (tox and _TOX_SECTIONS.match(name))
            current = sections.setdefault(name, []) if keep else None
        elif current is not None and line and not line.startswith(("#", ";")):
            current.append(line)
    return dict(sections)


def config_refusal(path: str, before: str | None, after: str | None) -> str | None:
    """The reason when the patch changed the test runner's sections of `path`, else None."""
    if runner_sections(path, before) != runner_sections(path, after):
        return f"path: {path!r}'s test runner sections changed (pytest reads them)"
    return None


def shadowing(files: Iterable[PatchedFile], path_dirs: list[str], modules: set[str]) -> list[str]:
    """New top-level modules in `path_dirs` (directories of the checkout on `sys.path`,
    relative, "" for its root) named like one of `modules` (what the environment can import
    besides the repository: the standard library's and the installed ones)."""
    out = []
    for f in files:
        if f.change not in ("create", "rename", "copy"):
            continue
        parent, name = posixpath.split(posixpath.normpath(f.path))
        top = None
        if name.endswith(".py") and parent in path_dirs:
            top = name[:-3]
        elif name == "__init__.py" and posixpath.dirname(parent) in path_dirs:
            top = posixpath.basename(parent)
        if top and top in modules:
            out.append(f"path: {f.path!r} shadows the module {top!r} the tests can import")
    return out
