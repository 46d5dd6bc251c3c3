"""Many sandboxes stopping at once: does one stop block the others, or the event loop?

Starts `--n` sandboxes, writes `--files` small files into each one's upper layer (what an
agent's pip install or build leaves), then stops them all at once with `asyncio.gather`, while
a ticker on the same loop wakes every 5 ms. Reports the wall time of the stops and the longest
the loop went without running the ticker (a stop that removes its directories on the loop holds
it for as long as that takes; in a thread, the loop keeps going).

    python bench/concurrent_stops.py [--n 64] [--files 2000]

Prints one JSON object. To compare two versions of the code, run this from each, alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _common import host_info, log, run_main

from minisandbox import Sandbox, SandboxConfig


async def _ticker(gaps: list[float], done: asyncio.Event) -> None:
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--files", type=int, default=2000)
    args = parser.parse_args()
    boxes = [Sandbox(SandboxConfig()) for _ in range(args.n)]
    await asyncio.gather(*(sb.start() for sb in boxes))
    fill = f"mkdir -p /root/f && cd /root/f && seq {args.files} | xargs touch"
    await asyncio.gather(*(sb.execute(["bash", "-c", fill]) for sb in boxes))
    log(f"{args.n} sandboxes started, {args.files} files each")
    gaps: list[float] = []
    done = asyncio.Event()
    ticker = asyncio.create_task(_ticker(gaps, done))
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await asyncio.gather(*(sb.stop() for sb in boxes))
    stop_s = time.perf_counter() - t0
    done.set()
    await ticker
    return {
        "benchmark": "concurrent_stops",
        "sandboxes": args.n,
        "files_per_upper": args.files,
        "stop_all_s": round(stop_s, 3),
        "loop_max_gap_ms": round(max(gaps) * 1000, 1),
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
