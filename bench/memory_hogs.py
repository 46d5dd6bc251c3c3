"""N sandboxes at their default limits, a memory hog in each: do the host and the other
sandboxes survive?

Each hog sandbox starts `--procs` processes that each allocate up to 3.5 GiB (under the
default 4 GiB per process), touching it page by page, so that together they ask for far more
than the host has. Beside them: one quiet sandbox that keeps answering, and a host process
holding 256 MiB. Prints one JSON object: how each hog sandbox ended (stopped by its memory cap,
or its hog killed by the kernel's OOM killer first) and when, the host's lowest MemAvailable
during the run, the kernel's OOM kills meanwhile (dmesg says whose: with every sandbox process at
the highest OOM score they are the hogs'), and whether the quiet sandbox and the host process
survived.

    python bench/memory_hogs.py [-n 3] [--procs 8]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from _common import host_info, log, run_main

from minisandbox import Sandbox
from minisandbox.errors import MiniSandboxError
from minisandbox.sandbox import memory

HOG = """
import sys, time
chunks = []
for _ in range(int(3.5 * 1024)):  # MiB
    chunks.append(bytearray(1 << 20))
    time.sleep(0.001)
time.sleep(60)
"""


def oom_kills() -> int:
    """The kernel's count of OOM kills since boot."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


async def hog(i: int, procs: int, began: float) -> dict[str, Any]:
    async with Sandbox() as sb:
        spawn = " ".join([f"python3 -c '{HOG}' &"] * procs)
        try:
            r = await sb.execute(f"{spawn} wait; echo survived", timeout=300)
            how = "ran to the end" if "survived" in r.stdout else f"exit {r.exit_code}"
        except MiniSandboxError as e:
            how = type(e).__name__ + ": " + str(e)[:160]
        return {"sandbox": i, "ended": how, "after_s": round(time.monotonic() - began, 1)}


async def quiet(stop: asyncio.Event) -> dict[str, Any]:
    answered = failed = 0
    async with Sandbox() as sb:
        await sb.execute("python3 -c 'x = bytearray(64 << 20); import time; time.sleep(1)'")
        while not stop.is_set():
            try:
                r = await sb.execute("echo ok", timeout=60)
                answered += r.stdout == "ok\n"
            except MiniSandboxError:
                failed += 1
            await asyncio.sleep(0.5)
        alive = (await sb.execute("echo ok")).stdout == "ok\n"
    return {"answered": answered, "failed": failed, "alive_at_the_end": alive}


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=3, help="hog sandboxes")
    ap.add_argument("--procs", type=int, default=8, help="hog processes in each")
    args = ap.parse_args()
    host = subprocess.Popen(
        [sys.executable, "-c", "x = bytearray(256 << 20); import time; time.sleep(3600)"]
    )
    lowest = available()
    kills_before = oom_kills()
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal lowest
        while not stop.is_set():
            lowest = min(lowest, available())
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    quiet_task = asyncio.create_task(quiet(stop))
    began = time.monotonic()
    log(f"{args.n} hog sandboxes x {args.procs} processes of 3.5 GiB")
    hogs = await asyncio.gather(*(hog(i, args.procs, began) for i in range(args.n)))
    stop.set()
    quiet_result = await quiet_task
    await sampler
    host_alive = host.poll() is None
    host.kill()
    host.wait()
    return {
        "hog_sandboxes": args.n,
        "procs_each": args.procs,
        "asked_gib_each": round(args.procs * 3.5, 1),
        "default_cap_gib": round(memory.default_share() / 2**30, 2),
        "host_memory_gib": round(memory.host_memory() / 2**30, 2),
        "lowest_available_gib": round(lowest / 2**30, 2),
        "kernel_oom_kills": oom_kills() - kills_before,
        "hogs": hogs,
        "quiet_sandbox": quiet_result,
        "host_process_alive": host_alive,
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
