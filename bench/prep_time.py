"""Task sandbox preparation: our layers and node cache vs per-task tarballs extracted per start.

Ours: a task's environment layer and task layer sit in the content-addressed store; a node unpacks
each layer once into its node cache, and every sandbox is an overlay over those directories.
The paper's: per task a `venv.tar.gz` and a `testbed.tar.gz`, extracted into a fresh directory at
every sandbox start; the sandbox (our own `Sandbox`, that directory as its only layer) then starts
on it, so the preparation is the only difference.

The tarballs are made from our built layers (`tar czf`, GNU tar, gzip level 6) and cached under
`--work-dir` beside the store, so both sides hold exactly the same files.

    python bench/prep_time.py [--swebench verified.parquet --envs-dir DIR --git-mirror DIR]
                              [--instance-ids ID ...] [--rounds 3] [--warm 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import host_info, log, percentile, run_main

from minisandbox import Sandbox, SandboxConfig
from minisandbox.envs.githistory import GIT_ENV
from minisandbox.envs.layout import VENV
from minisandbox.layers.store import LayerStore
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task
from minisandbox.utils.safefs import discard_tree

DEFAULT_INSTANCE_IDS = [
    "psf__requests-1142",
    "psf__requests-2317",
    "psf__requests-5414",
    "pytest-dev__pytest-5262",
    "pytest-dev__pytest-7432",
    "pytest-dev__pytest-10051",
]
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/prep")
TARGET_WARM_MS = 50.0
TARGET_COLD_RATIO = 0.25
# Run once per task in both kinds of sandbox (untimed): both must see the same task filesystem.
VIEW_CHECK = (
    "git -C /testbed rev-parse HEAD; git -C /testbed status --porcelain | wc -l; "
    f"{VENV}/bin/python -c 'import importlib.metadata as m, sys; "
    'print(sys.version.split()[0], sorted(d.metadata["Name"] + "==" + d.version '
    "for d in m.distributions()))'; "
    "find /testbed /opt/venv -xdev | wc -l"
)


@dataclass
class Job:
    """One task, where its repository comes from, and (once built) its layers and tarballs."""

    task: Task
    source: str  # "examples" or "swebench"
    mirror: Path | None
    env_layer: str = ""
    task_layer: str = ""
    tarballs: Tarballs | None = None


@dataclass
class Tarballs:
    venv: Path
    testbed: Path
    logical_bytes: int  # apparent bytes of the files in opt/venv and testbed
    files: int
    left_out: list[str] = field(default_factory=list)  # top-level paths of the layers not in them

    @property
    def bytes(self) -> int:
        return self.venv.stat().st_size + self.testbed.stat().st_size


# ---------------------------------------------------------------- tasks and builds


def add_task_args(ap: argparse.ArgumentParser) -> None:
    """The options both prep_time.py and storage.py take to select and build tasks."""
    ap.add_argument(
        "--swebench",
        "--tasks",
        dest="swebench",
        help="SWE-bench records (.parquet/.jsonl or a Hugging Face name); without it, only the "
        "bundled examples run",
    )
    ap.add_argument("--envs-dir", type=Path, help="per-instance conda exports (<id>.yml)")
    ap.add_argument(
        "--git-mirror",
        type=Path,
        help="directory of <owner>__<name> clones for the SWE-bench repositories "
        "(default: clone from GitHub)",
    )
    ap.add_argument("--instance-ids", nargs="+", default=DEFAULT_INSTANCE_IDS)
    ap.add_argument("--no-examples", action="store_true", help="skip the bundled examples")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"layer store, node cache and tarballs, kept for re-runs (default {DEFAULT_WORK_DIR})",
    )


def load_jobs(args: argparse.Namespace, work_dir: Path) -> list[Job]:
    jobs: list[Job] = []
    if not args.no_examples:
        # The examples' repositories live in a mirror of our own: --git-mirror may be read-only.
        mirror = materialize_mirror(work_dir / "examples-mirror")
        jobs += [Job(t, "examples", mirror) for t in load_tasks("examples")]
    if args.swebench:
        tasks = load_tasks(args.swebench, envs_dir=args.envs_dir, instance_ids=args.instance_ids)
        jobs += [Job(t, "swebench", args.git_mirror) for t in tasks]
    if not jobs:
        raise SystemExit("no tasks: pass --swebench, or drop --no-examples")
    return jobs


def make_builder(work_dir: Path, mirror: Path | None, cache: Path | None = None) -> Builder:
    settings = BuildSettings(
        store=work_dir / "store", cache=cache or work_dir / "cache", git_mirror=mirror
    )
    return Builder(settings)


async def build_jobs(jobs: list[Job], work_dir: Path) -> dict[Path | None, Builder]:
    """Build every task's layers (the store keeps them: re-runs only look them up). Returns one
    builder per git mirror; all share the store and the node cache."""
    builders: dict[Path | None, Builder] = {}
    for job in jobs:
        if job.mirror not in builders:
            builders[job.mirror] = make_builder(work_dir, job.mirror)
        builder = builders[job.mirror]
        began = time.monotonic()
        result = await builder.build(job.task)
        if result.status == "failed":
            raise SystemExit(f"building {job.task.id} failed: {result.error} (log: {result.log})")
        assert result.env_layer and result.task_layer
        job.env_layer, job.task_layer = result.env_layer, result.task_layer
        log(f"{job.task.id}: {result.status} in {time.monotonic() - began:.1f} s")
    return builders


# ---------------------------------------------------------------- the paper's tarballs


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _drop_whiteouts(root: str) -> None:
    # Whiteouts under a directory that had no lower counterpart hide nothing.
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if _is_whiteout(os.lstat(path)):
                os.unlink(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        discard_tree(Path(path))
    elif os.path.lexists(path):
        os.unlink(path)


def apply_upper(upper: str, lower: str) -> None:
    """Merge an overlay upper directory into `lower` in place, as overlayfs would show the two:
    whiteouts delete, opaque directories replace, everything else wins over the lower entry.
    Entries are moved (renamed), not copied: `upper` is consumed."""
    lower_mode = os.lstat(lower).st_mode
    if not lower_mode & stat.S_IWUSR:  # a non-root caller must be able to write into it
        os.chmod(lower, stat.S_IMODE(lower_mode) | stat.S_IWUSR)
    with os.scandir(upper) as it:
        entries = list(it)
    for entry in entries:
        target = os.path.join(lower, entry.name)
        st = entry.stat(follow_symlinks=False)
        if _is_whiteout(st):
            _remove(target)
        elif stat.S_ISDIR(st.st_mode) and not _is_opaque(entry.path) and os.path.isdir(target):
            if not os.path.islink(target):
                apply_upper(entry.path, target)
                continue
            _remove(target)
            os.rename(entry.path, target)
            _drop_whiteouts(target)
        else:
            _remove(target)
            os.rename(entry.path, target)
            if stat.S_ISDIR(st.st_mode):
                _drop_whiteouts(target)
    os.chmod(lower, stat.S_IMODE(os.lstat(upper).st_mode))  # overlayfs shows the upper's mode


def tree_size(root: Path) -> tuple[int, int]:
    """(apparent bytes of regular files, number of regular files) under root."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                files += 1
    return total, files


def layer_owner() -> tuple[int, int] | None:
    """Owner of unpacked files: as root, the sandbox's root uid (like the builder's node cache),
    so that tar records it and root's `tar x` restores it; otherwise the caller."""
    return SandboxConfig().layer_owner()


def task_filesystem(store: LayerStore, env_layer: str, task_layer: str, dest: Path) -> None:
    """The task's whole filesystem at `dest` (absent): the env layer with the task layer over it."""
    owner = layer_owner()
    store.unpack(env_layer, dest, owner=owner)
    upper = dest.parent / f"{dest.name}.upper"
    store.unpack(task_layer, upper, owner=owner)
    try:
        apply_upper(str(upper), str(dest))
    finally:
        discard_tree(upper)


# Bumped when the tarballs are made differently (2: .git repacked as git keeps it).
PAPER_FORMAT = 2


def git_packs_as_git_keeps_them(repo: Path) -> None:
    """Repack the checkout's history with git's own defaults (zlib, each object on its own).
    Our layers store it raw, for the layer store's zstd to compress across objects; a clone
    in a container image has git's packs, and a tarball of those is the paper's."""
    if not (repo / ".git").is_dir():
        return
    subprocess.run(
        ["git", "-c", "safe.directory=*", "-C", str(repo), "repack", "-a", "-d", "-F", "-q"],
        check=True,
        env={**os.environ, **GIT_ENV},
    )


def paper_tarballs(store: LayerStore, job: Job, work_dir: Path) -> Tarballs:
    """`venv.tar.gz` and `testbed.tar.gz` of the task, made once from its layers and cached
    under `work_dir/paper/<key>` (the key is the pair of layer ids)."""
    pair = f"{PAPER_FORMAT}:{job.env_layer}:{job.task_layer}"
    key = hashlib.sha256(pair.encode()).hexdigest()[:16]
    final = work_dir / "paper" / key
    info_path = final / "info.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        return Tarballs(final / "venv.tar.gz", final / "testbed.tar.gz", **info)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        began = time.monotonic()
        root = tmp / "fs"
        task_filesystem(store, job.env_layer, job.task_layer, root)
        left_out = sorted(
            str(p.relative_to(root))
            for p in [*root.iterdir(), *(root / "opt").iterdir()]
            if p.name not in ("opt", "testbed") and p != root / "opt" / "venv"
        )
        git_packs_as_git_keeps_them(root / "testbed")
        venv_bytes, venv_files = tree_size(root / "opt" / "venv")
        testbed_bytes, testbed_files = tree_size(root / "testbed")
        # `tar czf`: GNU tar piping through gzip at its default level, 6.
        for name, member in (("venv", "opt/venv"), ("testbed", "testbed")):
            subprocess.run(
                ["tar", "czf", str(tmp / f"{name}.tar.gz"), "-C", str(root), member], check=True
            )
        discard_tree(root)
        info = {
            "logical_bytes": venv_bytes + testbed_bytes,
            "files": venv_files + testbed_files,
            "left_out": left_out,
        }
        (tmp / "info.json").write_text(json.dumps(info))
        if final.exists():
            discard_tree(final)
        tmp.rename(final)
        log(f"{job.task.id}: tarballs made in {time.monotonic() - began:.1f} s")
    except BaseException:
        discard_tree(tmp)
        raise
    return Tarballs(final / "venv.tar.gz", final / "testbed.tar.gz", **info)


def make_all_tarballs(jobs: list[Job], work_dir: Path) -> None:
    store = LayerStore(work_dir / "store")
    for job in jobs:
        job.tarballs = paper_tarballs(store, job, work_dir)
        if job.tarballs.left_out:
            log(f"{job.task.id}: not in the tarballs: {', '.join(job.tarballs.left_out)}")


# ---------------------------------------------------------------- the three ways to start


@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)  # the sandbox's uid must traverse it (mkdtemp made it 0700)
    try:
        yield path
    finally:
        discard_tree(path)


async def _first_result(sb: Sandbox, command: str | None) -> str:
    r = await sb.execute(["true"] if command is None else ["/bin/bash", "-c", command], timeout=120)
    if r.exit_code != 0:
        raise RuntimeError(f"exit code {r.exit_code}: {r.output}")
    return r.stdout


@dataclass
class Sample:
    seconds: float
    output: str = ""
    extract_s: float = 0.0  # paper only: the extraction part
    cleanup_s: float = 0.0  # paper only: deleting the extracted tree afterwards


async def start_cold(job: Job, work_dir: Path, scratch: Path, command: str | None = None) -> Sample:
    """Ours, from layers in the store but not on this node: an empty node cache of its own."""
    with scratch_dir(scratch, "cold-") as cache:
        builder = make_builder(work_dir, job.mirror, cache=cache)
        builder.interpreter(job.task)  # interpreter discovery: once per process, not per start
        t0 = time.perf_counter()
        async with builder.sandbox(job.task, build=False) as sb:
            out = await _first_result(sb, command)
            t1 = time.perf_counter()
    return Sample(t1 - t0, out)


async def start_cold_task_only(job: Job, work_dir: Path, scratch: Path) -> Sample:
    """Ours, the common cold case: the environment layer is already on this node (the tasks of
    a repository share it), the task layer is not."""
    with scratch_dir(scratch, "cold-") as cache:
        builder = make_builder(work_dir, job.mirror, cache=cache)
        builder.interpreter(job.task)
        layers = builder.built_layers(job.task)
        assert layers
        async with builder.cache.use([layers[0]]):  # untimed: the shared environment layer
            pass
        t0 = time.perf_counter()
        async with builder.sandbox(job.task, build=False) as sb:
            out = await _first_result(sb, None)
            t1 = time.perf_counter()
    return Sample(t1 - t0, out)


async def start_warm(job: Job, builder: Builder, command: str | None = None) -> Sample:
    """Ours, with the layers already in the node cache."""
    t0 = time.perf_counter()
    async with builder.sandbox(job.task, build=False) as sb:
        out = await _first_result(sb, command)
        t1 = time.perf_counter()
    return Sample(t1 - t0, out)


async def _untar(archive: Path, dest: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        "tar", "-xzf", str(archive), "-C", str(dest), stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"tar -xzf {archive} exited {proc.returncode}: {err.decode()}")


@contextlib.asynccontextmanager
async def paper_sandbox(
    job: Job, builder: Builder, root: Path, timings: dict[str, float]
) -> AsyncIterator[Sandbox]:
    """The paper's start: both tarballs extracted (at once, two tar processes) into `root`, then a
    sandbox configured as `Builder.sandbox` does, with `root` as its only layer."""
    assert job.tarballs is not None
    t0 = time.perf_counter()
    await asyncio.gather(_untar(job.tarballs.venv, root), _untar(job.tarballs.testbed, root))
    timings["extract_s"] = time.perf_counter() - t0
    config = SandboxConfig(
        layers=[root],
        ro_paths=[builder.interpreter(job.task).prefix],
        venv=VENV,
        workdir="/testbed",
        env=dict(job.task.env.env),
    )
    async with Sandbox(config) as sb:
        yield sb


async def start_paper(
    job: Job, builder: Builder, scratch: Path, command: str | None = None
) -> Sample:
    timings: dict[str, float] = {}
    with scratch_dir(scratch, "paper-") as root:
        t0 = time.perf_counter()
        async with paper_sandbox(job, builder, root, timings) as sb:
            out = await _first_result(sb, command)
            t1 = time.perf_counter()
        c0 = time.perf_counter()
    # Leaving scratch_dir deleted the tree: a per-start cost of theirs, reported apart.
    cleanup = time.perf_counter() - c0
    return Sample(t1 - t0, out, extract_s=timings["extract_s"], cleanup_s=cleanup)


# ---------------------------------------------------------------- the benchmark


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (the longest matching mount point)."""
    best, kind = "", "unknown"
    with open("/proc/self/mounts") as fh:
        for line in fh:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def _median(values: list[float]) -> float:
    return percentile(values, 50)


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_task_args(ap)
    ap.add_argument(
        "--rounds", type=int, default=3, help="timed cold and paper starts per task (default 3)"
    )
    ap.add_argument("--warm", type=int, default=20, help="timed warm starts per task (default 20)")
    ap.add_argument(
        "--scratch-dir",
        type=Path,
        help="where cold starts' fresh node caches and the paper's extracted trees go "
        "(default: WORK_DIR/tmp); e.g. a tmpfs, to take the disk's file creation cost out",
    )
    args = ap.parse_args()
    if args.warm < 20:
        log("note: fewer than 20 warm starts per task")
    work_dir = args.work_dir.expanduser().resolve()
    scratch = (args.scratch_dir or work_dir / "tmp").expanduser().resolve()
    jobs = load_jobs(args, work_dir)
    log(f"{len(jobs)} tasks; building (cached in {work_dir / 'store'})")
    builders = await build_jobs(jobs, work_dir)
    make_all_tarballs(jobs, work_dir)

    rows: list[dict[str, Any]] = []
    warm_all: dict[str, list[float]] = {}
    views_match = True
    for job in jobs:
        tid = job.task.id
        builder = builders[job.mirror]
        # Untimed warm-up of each side, which also checks that both show the same files.
        ours = await start_cold(job, work_dir, scratch, VIEW_CHECK)
        theirs = await start_paper(job, builder, scratch, VIEW_CHECK)
        same = ours.output == theirs.output
        views_match &= same
        if not same:
            log(f"{tid}: views differ\n  ours:  {ours.output!r}\n  paper: {theirs.output!r}")
        cold: list[Sample] = []
        paper: list[Sample] = []
        task_only: list[Sample] = []
        for i in range(args.rounds):
            task_only.append(await start_cold_task_only(job, work_dir, scratch))
            # Alternate which side goes first: neither always finds the other's pages cached.
            if i % 2 == 0:
                cold.append(await start_cold(job, work_dir, scratch))
                paper.append(await start_paper(job, builder, scratch))
            else:
                paper.append(await start_paper(job, builder, scratch))
                cold.append(await start_cold(job, work_dir, scratch))
        await start_warm(job, builder)  # untimed: unpacks into the shared node cache if needed
        warm = [(await start_warm(job, builder)).seconds for _ in range(args.warm)]
        warm_all[tid] = warm
        assert job.tarballs is not None
        row = {
            "id": tid,
            "source": job.source,
            "cold_s": round(_median([s.seconds for s in cold]), 3),
            "cold_task_only_s": round(_median([s.seconds for s in task_only]), 3),
            "warm_ms": round(_median(warm) * 1000, 2),
            "paper_s": round(_median([s.seconds for s in paper]), 3),
            "paper_extract_s": round(_median([s.extract_s for s in paper]), 3),
            "paper_cleanup_s": round(_median([s.cleanup_s for s in paper]), 3),
            "same_view": same,
            "logical_bytes": job.tarballs.logical_bytes,
            "files": job.tarballs.files,
            "tarball_bytes": job.tarballs.bytes,
        }
        rows.append(row)
        log(
            f"{tid}: cold {row['cold_s']} s, warm {row['warm_ms']} ms, paper {row['paper_s']} s "
            f"(extract {row['paper_extract_s']} s)"
        )

    def summary(selected: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
        cold_s = _median([r["cold_s"] for r in selected])
        paper_s = _median([r["paper_s"] for r in selected])
        warm_ms = _median([w * 1000 for r in selected for w in warm_all[r["id"]]])
        task_only_s = _median([r["cold_task_only_s"] for r in selected])
        return {
            f"cold_start_s{suffix}": round(cold_s, 3),
            f"cold_task_only_s{suffix}": round(task_only_s, 3),
            f"cold_task_only_ratio{suffix}": round(task_only_s / paper_s, 4),
            f"warm_start_ms{suffix}": round(warm_ms, 2),
            f"paper_start_s{suffix}": round(paper_s, 3),
            f"cold_ratio{suffix}": round(cold_s / paper_s, 4),
            f"warm_ratio{suffix}": round(warm_ms / 1000 / paper_s, 5),
        }

    result: dict[str, Any] = {"benchmark": "prep_time", "n": len(rows)}
    result |= summary(rows, "")
    result["warm_start_p95_ms"] = round(
        percentile([w * 1000 for ws in warm_all.values() for w in ws], 95), 2
    )
    swe = [r for r in rows if r["source"] == "swebench"]
    if swe:
        result |= summary(swe, "_swebench")
    result |= {
        "rounds": args.rounds,
        "warm_per_task": args.warm,
        "same_view": views_match,
        "scratch_fs": fs_type(scratch),
        "tasks": rows,
        "target_warm_ms_swebench": TARGET_WARM_MS,
        "target_cold_ratio": TARGET_COLD_RATIO,
    }
    if swe:
        result["meets_target"] = (
            result["warm_start_ms_swebench"] <= TARGET_WARM_MS
            and result["cold_ratio"] <= TARGET_COLD_RATIO
        )
    result["host"] = host_info()
    return result


if __name__ == "__main__":
    run_main(main)
