"""The guarded grading's steps in a task sandbox, around the harness's procedure (evaluator).

Before the patch: what the checkout and the environment hold (every file's git blob id, what
Python imports from where). Then the patch's paths, as our parser and as git's own read them,
against the rules (patch_rules); after it applies, the test runner's config sections. Before
the tests: the grader's pytest plugin written into site-packages, and it and the runner's
packages made read-only there (a patch's setup.py runs before the tests, with the environment
writable). After them: the plugin's record against the log (tampering).

Nothing of the patch has run before the tests: the checks up to there read a sandbox the
patch has only written files into.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Callable, Mapping

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel, Field

from minisandbox.errors import SandboxFileError
from minisandbox.evaluation.mounts import mount_in
from minisandbox.evaluation.patch_rules import (
    config_refusal,
    mixed_configs,
    refusals,
    shadowing,
)
from minisandbox.evaluation.tampering import (
    PLUGIN_ADDOPT,
    PLUGIN_MODULE,
    RESULTS_MAX_BYTES,
    RESULTS_PATH,
    SYMPY_HOOK_MODULE,
    check_pytest_run,
    check_sympy_run,
)
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.tasks.eval_script import eval_pip_requirements
from minisandbox.tasks.patches import PatchedFile, patched_files, unquote_path
from minisandbox.tasks.specs import Task, files_in_patch
from minisandbox.utils.resources import package_text

_CONFIG_MAX_BYTES = 4 << 20
# The runner's packages in site-packages, made read-only beside the plugin.
_RUNNER_PACKAGES = ("_pytest", "pytest", "pluggy", "py", "pytest.py", "py.py")


# Their distributions, which an eval script may pin (astropy 3.1's `pip install 'pytest<7.2'`).
_RUNNER_DISTRIBUTIONS = {"pytest", "pluggy", "py"}


async def install_runner_pins(sb: SandboxAPI, task: Task, env: Mapping[str, str]) -> None:
    """Install the eval script's own pins of the runner now (from the wheelhouse, as the
    script's install would), before anything of the patch and before the runner is made
    read-only: the script's install is then a no-op, where it used to fail half-way (pip had
    removed pytest's command before it met the read-only package: "pytest: command not
    found"). A pin that does not install is left to the script, which fails the same way.
    `env`: evaluation's offline pip settings."""
    pins = [
        r
        for r in eval_pip_requirements(task.eval_script or "")
        if canonicalize_name(Requirement(r).name) in _RUNNER_DISTRIBUTIONS
    ]
    if pins:
        # From /: the checkout is not on sys.path (a top-level pip/ of the repository's).
        await sb.execute(
            ["python", "-m", "pip", "install", "-q", *pins], cwd="/", env=env, timeout=600
        )


class BaseState(BaseModel):
    """The checkout and its environment before the patch."""

    blobs: dict[str, str] = Field(default_factory=dict, description="file → git blob id")
    paths: set[str] = Field(default_factory=set, description="every file and directory")
    purelib: str | None = None
    path_dirs: list[str] = Field(default_factory=list, description="sys.path inside /testbed")
    modules: set[str] = Field(default_factory=set, description="importable from outside")
    runner_paths: list[str] = Field(default_factory=list, description="to make read-only")
    test_blobs: dict[str, str | None] = Field(
        default_factory=dict, description="test patch's files → blob id, as it writes them"
    )


def _helper(name: str) -> str:
    return package_text("minisandbox.evaluation", "helpers", name)


_TEST_PATCH = "/tmp/.minisandbox-grader-test.patch"
_INDEX = "/tmp/.minisandbox-grader-index"


async def _test_blobs(sb: SandboxAPI, task: Task) -> dict[str, str | None]:
    """The blob id of each file the test patch writes, as applying it to HEAD writes it (into
    a scratch index: the checkout is not touched); None for one it deletes. Empty when the
    test patch does not apply there (the eval script's own apply fails the same way)."""
    files = files_in_patch(task.test_patch) if task.test_patch else []
    if not files:
        return {}
    await sb.write_file(_TEST_PATCH, task.test_patch)
    script = (
        f'export GIT_INDEX_FILE={_INDEX}; git read-tree HEAD && git apply --cached "$1" '
        '&& shift && git ls-files -s -z -- "$@"'
    )
    r = await sb.execute(["sh", "-c", script, "sh", _TEST_PATCH, *files], cwd="/testbed")
    if r.exit_code != 0:
        return {}
    out: dict[str, str | None] = dict.fromkeys(files)
    for entry in r.stdout.split("\0"):
        meta, _, path = entry.partition("\t")
        fields = meta.split()
        if len(fields) == 3 and path in out:
            out[path] = fields[1]
    return out


async def base_state(sb: SandboxAPI, task: Task) -> BaseState:
    """What the checkout (HEAD: the base commit) and its Python hold, read in the sandbox."""
    tree = await sb.execute(
        ["git", "ls-tree", "-r", "-t", "-z", "--full-tree", "HEAD"],
        cwd="/testbed",
        max_output=64 << 20,
    )
    state = BaseState()
    for entry in tree.stdout.split("\0"):
        meta, _, path = entry.partition("\t")
        fields = meta.split()
        if len(fields) != 3 or not path:
            continue
        state.paths.add(path)
        if fields[1] == "blob":
            state.blobs[path] = fields[2]
    state.test_blobs = await _test_blobs(sb, task)
    probe = await sb.execute(["python", "-c", _helper("site_probe.py")], cwd="/testbed")
    try:
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return state  # no Python here: nothing imports, nothing to shadow
    state.purelib = found.get("purelib")
    state.path_dirs = [p for p in found.get("path", []) if isinstance(p, str)]
    state.modules = {m for m in found.get("modules", []) if isinstance(m, str)}
    state.modules.add(PLUGIN_MODULE)
    if state.purelib:
        listed = await sb.execute(["ls", "-1A", state.purelib])
        present = set(listed.stdout.split("\n"))
        state.runner_paths = [
            posixpath.join(state.purelib, p) for p in _RUNNER_PACKAGES if p in present
        ]
    return state


async def check_patch(
    sb: SandboxAPI, task: Task, patch_path: str, patch: str, base: BaseState
) -> list[str]:
    """The rules the patch breaks, by its headers and by git's own reading of its paths."""
    files = patched_files(patch)
    named = {p for f in files for p in (f.path, f.old_path) if p}
    numstat = await sb.execute(["git", "apply", "--numstat", "-z", patch_path], cwd="/testbed")
    out = []
    if numstat.exit_code == 0:
        for entry in numstat.stdout.split("\0"):
            path = entry.split("\t", 2)[-1] if entry.count("\t") >= 2 else entry
            if path and path not in named:
                out.append(f"path: git reads a path the patch's headers do not name ({path!r})")
                files.append(PatchedFile(path=path))
    out += refusals(task, files, base.paths)
    out += shadowing(files, base.path_dirs, base.modules)
    return list(dict.fromkeys(out))


async def check_patch_fallback(
    sb: SandboxAPI, task: Task, patch_path: str, base: BaseState
) -> list[str]:
    """What `patch` (the harness's last fallback) would write, by its own dry run, against the
    rules: it reads headers git ignores, and follows none of git's refusals."""
    dry = await sb.execute(
        f"patch --dry-run --batch --fuzz=5 -p1 -i {shlex.quote(patch_path)}",
        cwd="/testbed",
        merge_stderr=True,
    )
    files = []
    for line in dry.stdout.splitlines():
        for prefix in ("checking file ", "checking symbolic link "):
            if line.startswith(prefix):
                name, _, renamed = line[len(prefix) :].partition(" (renamed from ")
                name = name.strip()
                if len(name) >= 2 and name[0] == name[-1] == "'":
                    name = name[1:-1]
                files.append(PatchedFile(path=unquote_path(name), change="create"))
                if renamed:
                    files.append(PatchedFile(path=renamed.rstrip(")"), change="delete"))
    return refusals(task, files, base.paths) + shadowing(files, base.path_dirs, base.modules)


async def check_configs(sb: SandboxAPI, patch: str) -> list[str]:
    """The test runner's sections of the mixed config files the patch changed, before and
    after it applied."""
    out = []
    for path in mixed_configs(patched_files(patch)):
        shown = await sb.execute(["git", "show", f"HEAD:{path}"], cwd="/testbed")
        before = shown.stdout if shown.exit_code == 0 else None
        try:
            after: str | None = await sb.read_text(
                posixpath.join("/testbed", path), max_bytes=_CONFIG_MAX_BYTES
            )
        except SandboxFileError:
            # Absent is absent; anything else unreadable (too large, not a file) counts as a
            # change: its sections cannot be shown to be the base's.
            exists = await sb.execute(["test", "-e", posixpath.join("/testbed", path)])
            after = None if exists.exit_code != 0 else "[pytest]\n<unreadable file>\n"
        why = config_refusal(path, before, after)
        if why:
            out.append(why)
    return out


TOX_MARKER = "/tmp/.minisandbox-grader/tox"
_TOX_PTH = (
    "import os; p = os.environ.get('PYTEST_PLUGINS', ''); "
    f"os.path.exists({TOX_MARKER!r}) and '{PLUGIN_MODULE}' not in p.split(',') and "
    f"os.environ.__setitem__('PYTEST_PLUGINS', ','.join(filter(None, [p, '{PLUGIN_MODULE}'])))\n"
)


async def install_plugin(sb: SandboxAPI, base: BaseState, *, tox: bool = False) -> dict[str, str]:
    """The grader's plugin in site-packages, it and the runner's packages read-only; the
    environment that makes pytest load it first. Empty when there is no site-packages."""
    if not base.purelib:
        return {}
    target = posixpath.join(base.purelib, f"{PLUGIN_MODULE}.py")
    await sb.write_file(target, _helper(f"{PLUGIN_MODULE}.py"))
    paths = [target, *base.runner_paths]
    if tox:
        # tox may set PYTEST_ADDOPTS itself (older sphinx: `setenv = PYTEST_ADDOPTS = --color
        # yes`) and passes few variables on: a .pth names the plugin in PYTEST_PLUGINS in the
        # interpreter tox starts, while the marker is there (absent: no plugin, tampering).
        pth = posixpath.join(base.purelib, "minisandbox-grader-tox.pth")
        await sb.write_file(TOX_MARKER, "")
        await sb.write_file(pth, _TOX_PTH)
        paths.append(pth)
    await read_only(sb, paths)
    return {"PYTEST_ADDOPTS": PLUGIN_ADDOPT}


_SYMPY_RUNNER = ("bin/test", "sympy/testing/runtests.py", "sympy/utilities/runtests.py")


async def install_sympy_hook(sb: SandboxAPI, base: BaseState) -> dict[str, str]:
    """The grader's hook into sympy's runner (helpers/minisandbox_grader_sympy.py), imported by
    a .pth at every interpreter start; it, and sympy's runner in the checkout, read-only (the
    eval script's reinstall runs the patch's setup.py first). Empty without site-packages."""
    if not base.purelib:
        return {}
    module = posixpath.join(base.purelib, f"{SYMPY_HOOK_MODULE}.py")
    pth = posixpath.join(base.purelib, "minisandbox-grader.pth")
    await sb.write_file(module, _helper(f"{SYMPY_HOOK_MODULE}.py"))
    await sb.write_file(pth, f"import {SYMPY_HOOK_MODULE}\n")
    runner = [f"/testbed/{p}" for p in _SYMPY_RUNNER if p in base.blobs]
    await read_only(sb, [module, pth, *runner])
    return {"MINISANDBOX_GRADER": "sympy"}


async def read_only(sb: SandboxAPI, paths: list[str]) -> None:
    """Bind each of `paths` read-only over itself in the sandbox (helpers/mounts.py).

    Raises:
        SandboxFileError: the sandbox is not running, or the kernel refused a mount.
    """
    try:
        await mount_in(sb, "read-only", *paths)
    except SandboxFileError as e:
        raise SandboxFileError(f"making the test runner read-only failed: {e}") from None


async def check_run(
    sb: SandboxAPI,
    task: Task,
    base: BaseState,
    *,
    log_results: dict[str, str],
    test_exit_code: int | None,
    patch: str,
    parse: Callable[[str], dict[str, str]] | None = None,
) -> list[str]:
    """The plugin's (or sympy hook's) record against the log and the exit status
    (tampering.check_pytest_run, check_sympy_run)."""
    try:
        text: str | None = await sb.read_text(RESULTS_PATH, max_bytes=RESULTS_MAX_BYTES)
    except SandboxFileError:
        text = None
    if task.log_parser == "sympy":
        return check_sympy_run(
            task, text, log_results=log_results, test_exit_code=test_exit_code, parse=parse
        )
    patched = {p for f in patched_files(patch) for p in (f.path, f.old_path) if p}
    return check_pytest_run(
        task,
        text,
        log_results=log_results,
        test_exit_code=test_exit_code,
        base_blobs=base.blobs,
        patched=patched,
        parse=parse,
        test_blobs=base.test_blobs,
    )
