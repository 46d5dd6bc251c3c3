"""Time per agent step through SWE-ReX's interface: SWE-ReX's own LocalDeployment (no
isolation: the host's shell) vs MiniSandboxDeployment (a plain sandbox), side by side in one
run. A step is what SWE-agent sends per model action: a `BashAction` in the session (with
`check="silent"`, its exit code read) followed by reading a small file, on a git repository.

Both deployments run in this process, interleaved (one step of each per iteration, alternating
which goes first), so background load affects them alike. Also: start + first session, and
stop, per deployment (median of `--starts`).

    python bench/step_time_swerex.py [--n 100] [--warmup 10] [--starts 5]

Needs swe-rex (the `bench` or `swerex` extra).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, percentile, run_main, summarize_ms
from swerex.deployment.local import LocalDeployment
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest, ReadFileRequest

from minisandbox.integrations.swerex import MiniSandboxDeployment

COMMAND = "cd {repo} && git status --short && ls | head -5"


async def _prepare(deployment: Any, repo: str) -> None:
    await deployment.start()
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    setup = (
        f"mkdir -p {repo} && cd {repo} && git init -q && for i in $(seq 50); do echo $i > f$i; "
        "done && git add -A && git -c user.name=b -c user.email=b@b commit -qm init"
    )
    await rt.run_in_session(BashAction(command=setup, timeout=60, check="raise"))


async def _step(deployment: Any, repo: str) -> int:
    rt = deployment.runtime
    began = time.perf_counter_ns()
    await rt.run_in_session(
        BashAction(command=COMMAND.format(repo=repo), timeout=30, check="silent")
    )
    await rt.read_file(ReadFileRequest(path=f"{repo}/f1"))
    return time.perf_counter_ns() - began


async def _lifecycle(make: Any, starts: int) -> dict[str, float]:
    up, down = [], []
    for _ in range(starts):
        d = make()
        began = time.perf_counter()
        await d.start()
        await d.runtime.create_session(CreateBashSessionRequest())
        up.append(time.perf_counter() - began)
        began = time.perf_counter()
        await d.stop()
        down.append(time.perf_counter() - began)
    return {"start_s": round(percentile(up, 50), 3), "stop_s": round(percentile(down, 50), 3)}


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local_repo = str(Path(tmp) / "repo")
        ours_repo = "/testbed/repo"
        local, ours = LocalDeployment(), MiniSandboxDeployment()
        log("starting both deployments")
        await _prepare(local, local_repo)
        await _prepare(ours, ours_repo)
        samples: dict[str, list[int]] = {"swerex_local": [], "minisandbox": []}
        try:
            for i in range(args.warmup + args.n):
                pair = [("swerex_local", local, local_repo), ("minisandbox", ours, ours_repo)]
                for name, d, repo in pair if i % 2 else pair[::-1]:
                    ns = await _step(d, repo)
                    if i >= args.warmup:
                        samples[name].append(ns)
        finally:
            await local.stop()
            await ours.stop()
        log("start/stop")
        lifecycle = {
            "swerex_local": await _lifecycle(LocalDeployment, args.starts),
            "minisandbox": await _lifecycle(MiniSandboxDeployment, args.starts),
        }
    result: dict[str, Any] = {"benchmark": "step_time_swerex", "steps": args.n}
    for name, values in samples.items():
        result.update(summarize_ms(f"{name}_step", values))
        result.update({f"{name}_{k}": v for k, v in lifecycle[name].items()})
    result["step_p50_ratio_minisandbox_over_local"] = round(
        result["minisandbox_step_p50_ms"] / result["swerex_local_step_p50_ms"], 3
    )
    result["host"] = host_info()
    return result


if __name__ == "__main__":
    run_main(main)
