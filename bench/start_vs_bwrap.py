"""A sandbox's start through the API against a bare bwrap over the same layers, at 1 and at N
concurrent starts, in one run, interleaved.

ours: `Sandbox(config).start()`, then `execute(["true"])`: the time to the first result (the
stop is not counted). bare: a bwrap process started as ours is (the host writes the user
namespace's id maps through --userns-block-fd), with the same namespaces, the same overlay (the
system layer and the layers over a fresh upper), /proc, /dev, a /tmp tmpfs, /usr and the
configuration's read-only paths bound, running `true`: spawn to exit, from the same event loop.
What ours adds is the control channel (a shell inside, its first reply, then one command),
its runtime directories, the id maps and limits written from the host, the seccomp filter, and
the host's Python packages covered. For a root caller, "bare_drop" is the bare bwrap with the
step a root caller's sandbox adds for the same isolation: `true` runs as the sandbox's uid
(the same program as ours, uiddrop.py), not as host root; its ratios are reported beside
(`*_vs_drop`), the target is judged on the plain bare.

Layer sets: none, and the first bundled example task's layers (built into --work-dir once).
At 1: --n rounds, each one of each kind, the order alternating. At N (--concurrent, 64): each
round starts N of one kind at once and waits for all (ours: all first results); the cost per
sandbox is the round's wall time / N; --rounds rounds, alternating kinds.

    python bench/start_vs_bwrap.py [--n 40] [--concurrent 64] [--rounds 3] [--work-dir DIR]
                                   [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from _common import append_jsonl, host_info, log, run_main, summarize_ms
from prep_time import make_builder

from minisandbox import Sandbox, SandboxConfig
from minisandbox.sandbox import runtime, startup, uiddrop
from minisandbox.sandbox.bwrap import find_bwrap
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks
from minisandbox.utils.safefs import discard_tree

TARGET_RATIO = 2.0
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/start_vs_bwrap")


# A root caller's sandbox drops from host root to its own uid inside (the program of
# uiddrop.py, as ours does; bwrap cannot when the host writes the id maps); a bare bwrap that
# runs `true` as host root skips that step. Both are measured for a root caller ("bare" and
# "bare_drop").
DROP_AT = "/.drop-uid"
DROP_CAPS = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]


def bare_argv(
    bwrap: Path, system: Path, config: SandboxConfig, upper: Path, drop: bool = False
) -> list[str]:
    args = [
        str(bwrap),
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *(DROP_CAPS if drop else []),
    ]
    for layer in (system, *config.layers):
        args += ["--overlay-src", str(layer)]
    args += ["--overlay", str(upper / "u"), str(upper / "w"), "/"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    args += ["--ro-bind", "/usr", "/usr"]
    for path in config.ro_paths:
        args += ["--ro-bind", str(path), str(path)]
    drop_argv: list[str] = []
    if drop:
        helper = uiddrop.drop_helper(runtime.process_dir())
        if helper is None:
            drop_argv = list(uiddrop.SETPRIV_ARGV)
        else:
            args += ["--ro-bind", str(helper), DROP_AT]
            drop_argv = [DROP_AT]
    return [*args, "--chdir", "/", "--", *drop_argv, "/usr/bin/true"]


def bare_upper(scratch: Path, config: SandboxConfig) -> Path:
    """A fresh upper and work directory, with the mount points made (as ours makes them: the
    layers' directories belong to the sandbox's uid, so bwrap could not make them itself)."""
    upper = Path(tempfile.mkdtemp(dir=scratch))
    for name in ("proc", "dev", "tmp", "usr", *(str(p).lstrip("/") for p in config.ro_paths)):
        (upper / "u" / name).mkdir(parents=True, exist_ok=True)
    (upper / "u" / DROP_AT.lstrip("/")).touch()  # (bare_drop's mount point)
    (upper / "w").mkdir()
    return upper


class Bare(NamedTuple):
    bwrap: Path
    system: Path
    scratch: Path


async def bare(config: SandboxConfig, b: Bare, drop: bool = False) -> None:
    """bwrap as ours starts it (run by the caller, the sandbox's uid mapped in by the host
    through --userns-block-fd: a root caller's layers belong to that uid), running `true`."""
    upper = bare_upper(b.scratch, config)
    owner = config.layer_owner()
    if owner is not None:
        for dirpath, _dirs, _files in os.walk(upper):
            os.chown(dirpath, *owner)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    argv = bare_argv(b.bwrap, b.system, config, upper, drop)
    argv[1:1] = ["--userns-block-fd", str(block_r), "--info-fd", str(info_w)]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            pass_fds=[block_r, info_w],
        )
        os.close(info_w)
        info_w = -1
        pid = await startup.read_child_pid(info_r)
        if pid is None:
            raise RuntimeError(f"bare bwrap failed: {argv}")
        startup.write_id_maps(pid, owner or (os.geteuid(), os.getegid()), owner is not None)
        os.write(block_w, b"1")
        if await proc.wait() != 0:
            raise RuntimeError(f"bare bwrap exited {proc.returncode}: {argv}")
    finally:
        for fd in (info_r, info_w, block_r, block_w):
            if fd >= 0:
                os.close(fd)


async def ours(config: SandboxConfig, started: list[Sandbox]) -> None:
    sb = Sandbox(config)
    started.append(sb)
    await sb.start()
    r = await sb.execute(["true"])
    if r.exit_code != 0:
        raise RuntimeError(f"`true` exited {r.exit_code}: {r.output}")


async def one(kind: str, config: SandboxConfig, b: Bare) -> float:
    started: list[Sandbox] = []
    t0 = time.perf_counter()
    try:
        if kind == "ours":
            await ours(config, started)
        else:
            await bare(config, b, kind == "bare_drop")
        return time.perf_counter() - t0
    finally:
        for sb in started:
            await sb.stop()
        clear(b.scratch)


async def many(kind: str, n: int, config: SandboxConfig, b: Bare) -> float:
    started: list[Sandbox] = []
    t0 = time.perf_counter()
    try:
        if kind == "ours":
            await asyncio.gather(*(ours(config, started) for _ in range(n)))
        else:
            await asyncio.gather(*(bare(config, b, kind == "bare_drop") for _ in range(n)))
        return (time.perf_counter() - t0) / n
    finally:
        await asyncio.gather(*(sb.stop() for sb in started))
        clear(b.scratch)


def clear(scratch: Path) -> None:
    for entry in scratch.iterdir():
        discard_tree(entry)


async def measure(
    name: str, config: SandboxConfig, args: argparse.Namespace, system: Path, scratch: Path
) -> dict[str, Any]:
    b = Bare(find_bwrap(config.bwrap), system, scratch)
    kinds = ["ours", "bare", *(["bare_drop"] if config.layer_owner() is not None else [])]
    for _ in range(3):  # warm-up: page cache, the process's runtime directory
        for kind in kinds:
            await one(kind, config, b)
    single: dict[str, list[int]] = {k: [] for k in kinds}
    for i in range(args.n):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            single[kind].append(int(await one(kind, config, b) * 1e9))
    out: dict[str, Any] = {}
    for kind in kinds:
        out |= summarize_ms(f"{name}_{kind}_start", single[kind])
    per: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            per[kind].append(await many(kind, args.concurrent, config, b))
            log(f"{name}: {args.concurrent} {kind} at once: {per[kind][-1] * 1e3:.1f} ms each")
    for kind in kinds:
        out[f"{name}_{kind}_per_start_{args.concurrent}_ms"] = round(
            statistics.median(per[kind]) * 1e3, 2
        )
    for kind in kinds[1:]:
        tag = "" if kind == "bare" else "_vs_drop"
        out[f"{name}_ratio_1{tag}"] = round(
            out[f"{name}_ours_start_p50_ms"] / out[f"{name}_{kind}_start_p50_ms"], 3
        )
        out[f"{name}_ratio_{args.concurrent}{tag}"] = round(
            statistics.median(per["ours"]) / statistics.median(per[kind]), 3
        )
    return out


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="starts of each kind at 1 (default 40)")
    ap.add_argument("--concurrent", type=int, default=64, help="starts at once (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="concurrent rounds of each kind")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--out", type=Path, help="also append the JSON as one line to this file")
    args = ap.parse_args()
    work_dir = args.work_dir.expanduser().resolve()
    owner = SandboxConfig().layer_owner()
    system = startup.system_layer(runtime.process_dir().parent, owner)

    result: dict[str, Any] = {"benchmark": "start_vs_bwrap", "n": args.n}
    result["concurrent"] = args.concurrent
    log("no layers")
    scratch = Path(tempfile.mkdtemp(dir=runtime.process_dir()))  # (removed with it)
    result |= await measure("plain", SandboxConfig(), args, system, scratch)
    task = load_tasks("examples")[0]
    builder = make_builder(work_dir, materialize_mirror(work_dir / "examples-mirror"))
    log(f"{task.id}: its layers (built once into {work_dir})")
    async with builder.sandbox(task) as held:  # (keeps its layers in use in the node cache)
        config = held.config
        result["task"] = task.id
        result["task_layers"] = len(config.layers)
        result |= await measure("task", config, args, system, scratch)
    ratios = [v for k, v in result.items() if "_ratio_" in k and not k.endswith("_vs_drop")]
    result["target_ratio"] = TARGET_RATIO
    result["meets_target"] = all(r <= TARGET_RATIO for r in ratios)
    result["host"] = host_info()
    append_jsonl(args.out, result)
    return result


if __name__ == "__main__":
    run_main(main)
