"""Every shell and Python block of README.md and docs/ runs as written (issue 13).

Each ```python block runs with this venv's python, each ```sh / ```bash block with `bash -e`,
in a fresh temporary directory, with `minisandbox` on PATH and MINISANDBOX_STORE /
MINISANDBOX_CACHE / MINISANDBOX_GIT_MIRROR naming the suite's built example tasks. A block that
cannot run in CI as written says so in an HTML comment on the line right before its fence:

    <!-- docs-test: slow -->             runs only in the slow set (pytest -m slow)
    <!-- docs-test: skip (why) -->       never runs here (a dataset, the network, a model key...)
    <!-- docs-test: stack NAME -->       runs in that integration stack's own venv, by
                                         `scripts/test-stack NAME` (.ci/stacks/NAME.toml lists
                                         tests/test_docs.py), and is skipped everywhere else

Any other block that fails fails the test. Other fences (```text, ```json, bare) are output, not
programs, and are not run; every ```yaml block must parse.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from minisandbox.tasks.builder import BuildSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python": "python", "sh": "sh", "bash": "sh"}
DEADLINE = 240  # seconds per block

# A fence opens a block (up to 3 spaces of indentation; a backtick fence's info string has no
# backtick, so inline ```` ```bash ```` in prose is not one).
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
MARKER_VALUE = re.compile(
    r"^(slow|skip \((?P<reason>[^)]+(?:\([^)]*\)[^)]*)*)\)|stack (?P<stack>[a-z0-9_]+))$"
)
# Set by scripts/test-stack: the stack whose venv runs this suite (its blocks run, no others).
STACK = os.environ.get("MINISANDBOX_STACK")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # "python" or "sh"
    code: str
    marker: str | None  # the docs-test comment's value, if any

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).lower()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence[0] * len(fence))
            and not lines[end].strip().strip(fence[0])
        ):
            end += 1
        if info in LANGUAGES:
            prev = i - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            mm = MARKER.match(lines[prev]) if prev >= 0 else None
            found.append(
                Block(
                    path=path,
                    line=i + 1,
                    language=LANGUAGES[info],
                    code="\n".join(lines[i + 1 : end]) + "\n",
                    marker=mm.group(1) if mm else None,
                )
            )
        i = end + 1
    return found


BLOCKS = [b for path in DOCS for b in blocks_of(path)]


def params() -> Iterator[object]:
    for b in BLOCKS:
        marks: list[pytest.MarkDecorator] = []
        m = MARKER_VALUE.match(b.marker or "")
        stack = m.group("stack") if m else None
        if b.marker == "slow":
            marks.append(pytest.mark.slow)
        elif m and m.group("reason"):
            marks.append(pytest.mark.skip(reason=f"docs-test: {m.group('reason')}"))
        elif stack and stack != STACK:
            marks.append(pytest.mark.skip(reason=f"docs-test: runs by scripts/test-stack {stack}"))
        if STACK and stack != STACK:
            marks.append(pytest.mark.skip(reason=f"not a block of the {STACK} stack"))
        yield pytest.param(b, id=b.id, marks=marks)


def test_stack_markers_name_stacks() -> None:
    stacks = {p.stem for p in (ROOT / ".ci" / "stacks").glob("*.toml")}
    bad = [
        f"{b.id}: {m.group('stack')}"
        for b in BLOCKS
        if (m := MARKER_VALUE.match(b.marker or ""))
        and m.group("stack")
        and m.group("stack") not in stacks
    ]
    assert not bad, "docs-test: stack markers naming no .ci/stacks/NAME.toml: " + ", ".join(bad)


def yaml_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the fence, text) of each ```yaml / ```yml block of `path`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != m.group(1):
            end += 1
        if m.group(2).lower() in ("yaml", "yml"):
            found.append((i + 1, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_blocks_parse(path: Path) -> None:
    """Configuration the docs show is configuration a user can paste: it must be YAML."""
    import yaml

    bad = []
    for line, text in yaml_blocks(path):
        try:
            list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            bad.append(f"{path.relative_to(ROOT)}:{line}: {str(e).splitlines()[0]}")
    assert not bad, "yaml blocks that do not parse: " + "; ".join(bad)


def test_markers_are_well_formed() -> None:
    bad = [f"{b.id}: {b.marker!r}" for b in BLOCKS if b.marker and not MARKER_VALUE.match(b.marker)]
    assert not bad, "docs-test markers must be 'slow' or 'skip (reason)': " + ", ".join(bad)


def test_markers_precede_blocks() -> None:
    """A marker that no python/sh block follows (a typo'd fence, a moved block) is an error."""
    stray = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        marked = {b.line for b in BLOCKS if b.path == path and b.marker}
        for i, line in enumerate(lines):
            if MARKER.match(line):
                nxt = i + 1
                while nxt < len(lines) and not lines[nxt].strip():
                    nxt += 1
                if nxt + 1 not in marked:
                    stray.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not stray, "docs-test markers not right before a python/sh block: " + ", ".join(stray)


def test_blocks_are_found() -> None:
    assert any(b.path.name == "README.md" and b.language == "python" for b in BLOCKS)
    assert any(b.language == "sh" and b.marker is None for b in BLOCKS)
    assert not any("mswea_bash_command" in b.code for b in BLOCKS), "prose is not a block"


def test_parser(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text(
        "Prose with ```` ```bash ```` inline.\n\n"
        "```text\nnot code\n```\n\n"
        "<!-- docs-test: skip (needs a dataset) -->\n\n"
        "```sh\nfalse\n```\n\n"
        "```python\nprint(1)\n```\n"
        "<!-- docs-test: slow -->\n"
        "````bash\n```\ninner fence\n```\n````\n",
        encoding="utf-8",
    )
    got = [(b.line, b.language, b.code, b.marker) for b in blocks_of(md)]
    assert got == [
        (9, "sh", "false\n", "skip (needs a dataset)"),
        (13, "python", "print(1)\n", None),
        (17, "sh", "```\ninner fence\n```\n", "slow"),
    ]
    assert not MARKER_VALUE.match("skip") and not MARKER_VALUE.match("skip ()")
    assert not MARKER_VALUE.match("sloow")


@pytest.fixture(scope="module")
def docs_env(settings: BuildSettings, built: list) -> dict[str, str]:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env["MINISANDBOX_STORE"] = str(settings.store)
    env["MINISANDBOX_CACHE"] = str(settings.cache)
    if settings.git_mirror is not None:
        env["MINISANDBOX_GIT_MIRROR"] = str(settings.git_mirror)
    env["MSWEA_SILENT_STARTUP"] = "1"
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture
def workdir(layer_dir: Path) -> Path:
    """A fresh directory the sandbox's unprivileged uid (root callers) can also traverse
    (conftest's layer_dir)."""
    return layer_dir


@pytest.mark.timeout(DEADLINE + 60)
@pytest.mark.parametrize("block", list(params()))
def test_block_runs(block: Block, docs_env: dict[str, str], workdir: Path) -> None:
    if block.language == "python":
        script = workdir / "block.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        script = workdir / "block.sh"
        script.write_text(block.code, encoding="utf-8")
        cmd = ["bash", "-e", str(script)]
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=docs_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a deadline kills the block's whole process group
    )
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{block.id}: still running after {DEADLINE} s (mark it `<!-- docs-test: slow -->`?)"
            f"\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}"
        )
    assert proc.returncode == 0, (
        f"{block.id} ({block.language}) exited {proc.returncode}; mark it in the markdown if it "
        f"cannot run in CI as written.\n--- code\n{block.code}\n--- stdout\n{stdout[-4000:]}"
        f"\n--- stderr\n{stderr[-4000:]}"
    )


@pytest.mark.skipif(
    bool(STACK), reason="generated from the main venv's modules (a stack venv lacks some extras)"
)
def test_the_api_reference_is_current() -> None:
    # docs/api.md is generated from the docstrings: a changed docstring or signature without
    # a regenerated reference fails here, naming the command.
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
