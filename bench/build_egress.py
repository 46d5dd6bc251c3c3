"""Build time through the build sandboxes' egress proxy against the host's network, side by side.

The same layers (every layer of the bundled example tasks: environments, repositories, tasks)
are built from an empty store `--rounds` times each way, the two ways interleaved so that the
machine's load falls on both alike: "proxy" is how builds run (a network namespace of their
own, sandbox/egress.py), "host" shares the host's network namespace as builds did before. Each
build downloads its packages again (the uv and pip caches are the sandbox's /tmp). Prints one
JSON object: per way every round's seconds and the median, and the median ratio proxy / host.

    python bench/build_egress.py [--rounds 3] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main

from minisandbox.envs.layerbuild import LayerBuilder
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks

_proxied_config = LayerBuilder.build_config


def _host_network_config(self: LayerBuilder, *args: Any, **kwargs: Any) -> SandboxConfig:
    """The build sandbox as it was: the host's network namespace, no proxy."""
    config = _proxied_config(self, *args, **kwargs)
    return config.model_copy(update={"egress": None, "network": True})


async def build_all(work: Path, way: str) -> float:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    LayerBuilder.build_config = _proxied_config if way == "proxy" else _host_network_config  # type: ignore[method-assign]
    settings = BuildSettings(
        store=work / "store", cache=work / "cache", git_mirror=materialize_mirror(work / "mirror")
    )
    builder = Builder(settings)
    began = time.monotonic()
    for task in load_tasks("examples"):
        result = await builder.build(task)
        if result.status != "built":
            raise SystemExit(f"error: {way}: {task.id} did not build: {result.error}")
    return round(time.monotonic() - began, 2)


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--work-dir", type=Path, default=Path("~/.cache/minisandbox-bench/build-egress")
    )
    args = ap.parse_args()
    work = args.work_dir.expanduser()
    seconds: dict[str, list[float]] = {"proxy": [], "host": []}
    for i in range(args.rounds):
        for way in ("proxy", "host") if i % 2 == 0 else ("host", "proxy"):
            seconds[way].append(await build_all(work / way, way))
            log(f"round {i + 1}: {way} {seconds[way][-1]} s")
    shutil.rmtree(work, ignore_errors=True)
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    return {
        "layers": "every layer of the bundled example tasks, from an empty store",
        "seconds": seconds,
        "median_s": medians,
        "proxy_over_host": round(medians["proxy"] / medians["host"], 3),
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
