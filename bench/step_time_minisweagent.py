"""Time per agent step through mini-swe-agent's environment interface: its own LocalEnvironment
(no isolation: the host's shell) vs MiniSandboxEnvironment (a plain sandbox: the host's system,
as LocalEnvironment's), side by side in one run, on the same commands. With `--task`, also our
environment on that task's sandbox; with a working docker daemon, also mini-swe-agent's
DockerEnvironment (on `--docker-image`).

A step is what a 2.x agent sends per model action: `execute({"command": ...})` of one shell
command on a git repository (status, a listing, a file read). All environments run in this
process, interleaved (one step of each per iteration, rotating which goes first), so background
load affects them alike. Also: start (construction and first command) and cleanup, per
environment (median of `--starts`).

    python bench/step_time_minisweagent.py [--n 100] [--warmup 10] [--starts 5] [--task ID]

Needs mini-swe-agent 2.x (the `minisweagent` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from _common import host_info, log, percentile, run_main, summarize_ms
from minisweagent.environments.local import LocalEnvironment

from minisandbox.integrations.minisweagent import MiniSandboxEnvironment

STEP = "git status --short && ls | head -5 && cat f1"
SETUP = (
    "git init -q && for i in $(seq 50); do echo $i > f$i; done && git add -A && "
    "git -c user.name=b -c user.email=b@b commit -qm init"
)


def _docker_unavailable() -> str | None:
    """Why DockerEnvironment cannot run here, or None."""
    try:
        r = subprocess.run(["docker", "version"], capture_output=True, text=True, timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"docker: {e}"
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["docker version failed"])[-1]
    return None


def _step(env: Any, cwd: str) -> int:
    began = time.perf_counter_ns()
    result = env.execute({"command": STEP}, cwd=cwd)
    elapsed = time.perf_counter_ns() - began
    assert result["returncode"] == 0 and result["output"].endswith("1\n"), result
    return elapsed


def _lifecycle(make: Callable[[], Any], starts: int) -> dict[str, float]:
    up, down = [], []
    for _ in range(starts):
        began = time.perf_counter()
        env = make()
        env.execute({"command": "true"})
        up.append(time.perf_counter() - began)
        began = time.perf_counter()
        if hasattr(env, "cleanup"):  # (LocalEnvironment has nothing to clean up)
            env.cleanup()
        down.append(time.perf_counter() - began)
    return {"start_s": round(percentile(up, 50), 3), "stop_s": round(percentile(down, 50), 3)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "step_time_minisweagent", "steps": args.n}
    with tempfile.TemporaryDirectory() as tmp:
        repo = str(Path(tmp) / "repo")
        os.mkdir(repo)
        makers: dict[str, Callable[[], Any]] = {
            "local": lambda: LocalEnvironment(cwd=repo),
            "minisandbox": lambda: MiniSandboxEnvironment(plain=True, cwd="/testbed/repo"),
        }
        if args.task:
            makers["minisandbox_task"] = lambda: MiniSandboxEnvironment(
                task=args.task, cwd="/tmp/repo"
            )
        why_not = _docker_unavailable()
        if why_not is None:
            from minisweagent.environments.docker import DockerEnvironment

            makers["docker"] = lambda: DockerEnvironment(image=args.docker_image, cwd="/tmp/repo")
        else:
            result["docker"] = f"not measured: {why_not}"
        log(f"starting {', '.join(makers)}")
        envs = {name: make() for name, make in makers.items()}
        cwds = {"local": repo, "minisandbox": "/testbed/repo"}
        try:
            for name, env in envs.items():
                cwd = cwds.get(name, "/tmp/repo")
                setup = env.execute({"command": f"mkdir -p {cwd} && cd {cwd} && {SETUP}"}, cwd="/")
                assert setup["returncode"] == 0, (name, setup)
            samples: dict[str, list[int]] = {name: [] for name in envs}
            names = list(envs)
            for i in range(args.warmup + args.n):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    ns = _step(envs[name], cwds.get(name, "/tmp/repo"))
                    if i >= args.warmup:
                        samples[name].append(ns)
        finally:
            for env in envs.values():
                if hasattr(env, "cleanup"):
                    env.cleanup()
        log("start/stop")
        for name, make in makers.items():
            result.update(summarize_ms(f"{name}_step", samples[name]))
            result.update({f"{name}_{k}": v for k, v in _lifecycle(make, args.starts).items()})
    local = result["local_step_p50_ms"]
    for name in makers:
        if name != "local":
            result[f"step_p50_ratio_{name}_over_local"] = round(
                result[f"{name}_step_p50_ms"] / local, 3
            )
    result["host"] = host_info()
    return result


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--task", help="also a task's sandbox (built on first use)")
    parser.add_argument("--docker-image", default="python:3.11")
    args = parser.parse_args()
    # The environments are synchronous (ours waits on minisandbox's own event loop).
    return await asyncio.to_thread(bench, args)


if __name__ == "__main__":
    run_main(main)
