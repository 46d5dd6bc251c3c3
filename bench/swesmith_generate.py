"""SWE-smith-format tasks made here: SWE-smith's procedural bug generators on repositories from
its profile list, validated in our sandboxes by SWE-smith's rules, written as a dataset file.

    python bench/swesmith_generate.py --mirrors DIR --out tasks.jsonl \\
        [--repos mewwts__addict.75284f95 ...] [--max-per-repo N] [--swesmith-python PY]

`--mirrors` holds a git repository per GitHub repository, named `owner__repo` or `owner+repo`
(with the profile's commit). Phase 1 runs swesmith_candidates.py with `--swesmith-python` (an
interpreter with the `swesmith` package; default $SWESMITH_PYTHON, else `uv run --with
swesmith==0.0.9 ...`). Phase 2, here: per repository, one test run of the clean code and one per
bug, each in a sandbox of the bug's task (its layers built as minisandbox builds them: the
repository's once, a small one per bug). As SWE-smith's harness: FAIL_TO_PASS = tests FAILED
with the bug and PASSED clean, PASS_TO_PASS = PASSED in both; a bug is kept with at least one of
each and no timeout. Prints one JSON object (per repository: candidates, kept, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

from minisandbox.errors import CommandTimeoutError, MiniSandboxError
from minisandbox.evaluation.evaluator import swesmith_log_parser
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.patches import reverse_patch
from minisandbox.tasks.specs import Task

DEFAULT_REPOS = [
    "mewwts__addict.75284f95",
    "keleshev__schema.24a30457",
    "termcolor__termcolor.3a42086f",
]
# SWE-smith's test command, without its conda activation (the venv is active in a sandbox).
TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
# What a repository's tests need besides the repository (its profile installs `-e .`).
REQUIREMENTS = {"default": ["pytest==8.3.4"]}
SWESMITH_DEPS = [
    "swesmith==0.0.9",
    "libcst",
    "astor",
    "docker",
    "python-dotenv",
    "ghapi",
    "swebench<5",
]
GRAMMARS = [
    "python",
    "go",
    "java",
    "javascript",
    "rust",
    "c",
    "c-sharp",
    "cpp",
    "php",
    "ruby",
    "typescript",
]


def swesmith_command(given: str | None) -> list[str]:
    python = given or os.environ.get("SWESMITH_PYTHON")
    if python:
        return [python]
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    deps = [*SWESMITH_DEPS, "tree-sitter", *(f"tree-sitter-{g}" for g in GRAMMARS)]
    return [
        uv,
        "run",
        "-q",
        "--no-project",
        "--python",
        "3.11",
        *(a for d in deps for a in ("--with", d)),
        "python",
    ]


def mirror_of(mirrors: Path, owner: str, repo: str) -> Path:
    for name in (f"{owner}__{repo}", f"{owner}+{repo}"):
        for path in (mirrors / name, mirrors / name / "repo"):
            if (path / "HEAD").exists() or (path / ".git").exists():
                return path
    raise SystemExit(f"error: no mirror of {owner}/{repo} in {mirrors} (owner__repo or owner+repo)")


def candidates(cmd: list[str], repo_name: str, mirrors: Path, limit: int) -> dict[str, Any]:
    owner, rest = repo_name.split("__", 1)
    repo, commit8 = rest.rsplit(".", 1)
    with tempfile.TemporaryDirectory() as tmp:
        checkout = Path(tmp) / repo_name
        subprocess.run(
            ["git", "clone", "-q", str(mirror_of(mirrors, owner, repo)), str(checkout)], check=True
        )
        subprocess.run(["git", "-C", str(checkout), "checkout", "-q", commit8], check=True)
        script = Path(__file__).with_name("swesmith_candidates.py")
        out = subprocess.run(
            [*cmd, str(script), repo_name, str(checkout), "--max", str(limit)],
            check=True,
            capture_output=True,
            text=True,
            cwd=tmp,
        )
    return json.loads(out.stdout)


def records(
    found: dict[str, Any], tests: dict[str, dict[str, list[str]]] | None = None
) -> list[dict[str, Any]]:
    p = found["profile"]
    reqs = REQUIREMENTS.get(p["repo_name"], REQUIREMENTS["default"])
    out = []
    for c in found["candidates"]:
        t = (tests or {}).get(c["instance_id"], {"FAIL_TO_PASS": [], "PASS_TO_PASS": []})
        failing = ", ".join(t["FAIL_TO_PASS"][:3])
        out.append(
            {
                "instance_id": c["instance_id"],
                "repo": p["mirror_name"],
                "base_commit": p["commit"],
                "patch": c["patch"],
                **t,
                "image_name": p["image_name"],
                "problem_statement": f"Tests fail after a recent change: {failing}."
                if failing
                else "",
                "environment": {"python": p["python"], "requirements": reqs},
                "install": p["install"],
                "test_cmd": TEST_CMD,
            }
        )
    return out


async def run_tests(
    builder: Builder, task: Task, patch: str, timeout: float
) -> dict[str, str] | None:
    """The tests' statuses in a sandbox of `task` after `patch` (None: timed out)."""
    async with builder.sandbox(task) as sb:
        if patch:
            await sb.write_file("/tmp/fix.patch", patch)
            r = await sb.execute("git apply /tmp/fix.patch", timeout=60)
            if r.exit_code:
                raise RuntimeError(f"{task.id}: the reversed bug does not apply: {r.output}")
        try:
            r = await sb.execute(task.test_cmd, timeout=timeout, merge_stderr=True)
        except CommandTimeoutError:
            return None
    return swesmith_log_parser(task)(r.stdout)


async def validate(
    settings: BuildSettings, found: dict[str, Any], workdir: Path, timeout: float
) -> dict[str, dict[str, list[str]]]:
    path = workdir / f"{found['profile']['repo_name']}.candidates.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(found)))
    tasks = load_tasks(path)
    builder = Builder(settings)
    first = tasks[0]
    built = await builder.build(first)
    if built.status == "failed":
        raise RuntimeError(f"{first.id}: {built.error}")
    clean = await run_tests(builder, first, reverse_patch(first.bug_patch), timeout)
    if not clean:
        raise RuntimeError(f"{found['profile']['repo_name']}: the clean test run timed out")
    gate = asyncio.Semaphore(2)

    async def one(task: Task) -> tuple[str, dict[str, list[str]] | None]:
        async with gate:
            try:
                result = await builder.build(task)
                if result.status == "failed":
                    _common.log(
                        f"{task.id}: build failed ({(result.error or '').splitlines()[0][:120]})"
                    )
                    return task.id, None
                bug = await run_tests(builder, task, "", timeout)
            except (MiniSandboxError, RuntimeError) as e:
                _common.log(f"{task.id}: {e}")
                return task.id, None
        if bug is None:
            return task.id, None
        f2p = sorted(t for t, s in bug.items() if s == "FAILED" and clean.get(t) == "PASSED")
        p2p = sorted(t for t, s in bug.items() if s == "PASSED" and clean.get(t) == "PASSED")
        return task.id, ({"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p} if f2p and p2p else None)

    results = await asyncio.gather(*(one(t) for t in tasks))
    return {iid: tests for iid, tests in results if tests}


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repos", nargs="+", default=DEFAULT_REPOS)
    parser.add_argument("--max-per-repo", type=int, default=0)
    parser.add_argument("--swesmith-python")
    parser.add_argument(
        "--work-dir", type=Path, default=Path.home() / ".cache" / "minisandbox-bench" / "swesmith"
    )
    parser.add_argument("--timeout", type=float, default=90.0, help="per test run (SWE-smith's)")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    mirror_links = args.work_dir / "mirrors"
    mirror_links.mkdir(exist_ok=True)
    for name in args.repos:
        owner, rest = name.split("__", 1)
        link = mirror_links / f"{owner}__{rest.rsplit('.', 1)[0]}"
        if not link.exists():
            link.symlink_to(mirror_of(args.mirrors, owner, rest.rsplit(".", 1)[0]).resolve())
    settings = BuildSettings(
        store=args.work_dir / "store", cache=args.work_dir / "layers", git_mirror=mirror_links
    )
    cmd = swesmith_command(args.swesmith_python)
    kept: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for name in args.repos:
        began = time.monotonic()
        found = candidates(cmd, name, args.mirrors, args.max_per_repo)
        _common.log(f"{name}: {len(found['candidates'])} candidates")
        tests = await validate(settings, found, args.work_dir, args.timeout)
        valid = [r for r in records(found, tests) if r["instance_id"] in tests]
        kept += valid
        summary[name] = {
            "candidates": len(found["candidates"]),
            "kept": len(valid),
            "seconds": round(time.monotonic() - began, 1),
        }
        _common.log(f"{name}: kept {len(valid)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return {"out": args.out.name, "tasks": len(kept), "repos": summary, "host": _common.host_info()}


if __name__ == "__main__":
    _common.run_main(main)
