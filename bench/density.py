"""Density: N idle sandboxes, each holding one shell session, alive at once.

Starts them with bounded concurrency, then sums the proportional set size (`Pss` in
/proc/<pid>/smaps_rollup) of every host process that belongs to a sandbox: all processes in its
pid namespace, plus the outer bwrap that created that namespace, plus any descendants. PSS
splits each shared page among all processes that map it, so the sum is memory these sandboxes
are actually responsible for; divided by N it is the cost of one more sandbox. Then every session
must answer `echo ok`.

The per-process janitor and the controlling Python process are one each for the whole run, not
per sandbox: they are reported separately.

    python bench/density.py [--n 200] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from _common import host_info, log, run_main

from minisandbox import Sandbox, SandboxConfig, ShellSession
from minisandbox.sandbox import runtime

TARGET_PSS_MB = 5.0
MB = 1024 * 1024


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    pidns: int | None  # inode of /proc/<pid>/ns/pid
    started: int  # start time in clock ticks since boot: tells a reused pid apart
    state: str  # R, S, Z (zombie), ...


def scan_procs() -> dict[int, Proc]:
    """Every host process, with its parent and pid namespace. Processes that exit meanwhile
    are skipped."""
    procs: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            ns: int | None = os.stat(f"/proc/{pid}/ns/pid").st_ino
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            ns = None
        # comm may hold spaces and parentheses: it ends at the last ")".
        close = stat.rfind(")")
        comm = stat[stat.find("(") + 1 : close]
        fields = stat[close + 2 :].split()  # fields[0] is field 3 (state) of proc(5)
        procs[pid] = Proc(pid, int(fields[1]), comm, ns, int(fields[19]), fields[0])
    return procs


def descendants(roots: set[int], procs: dict[int, Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, stack = set(roots), list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def memory_kb(pid: int) -> dict[str, int]:
    """Pss, Rss and private (Private_Clean + Private_Dirty) in kB, and page tables (VmPTE),
    which smaps does not count. Empty when the process is gone."""
    out = {"pss": 0, "rss": 0, "private": 0, "pte": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Rss", "Private_Clean", "Private_Dirty"):
                    value = int(rest.split()[0])
                    out["private" if key.startswith("Private") else key.lower()] += value
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmPTE:"):
                    out["pte"] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return out


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def sandbox_processes(sandboxes: list[Sandbox], procs: dict[int, Proc]) -> dict[int, set[int]]:
    """Host pids of each sandbox (keyed by its pid 1), found as described in the docstring."""
    by_ns: dict[int, list[int]] = {}
    for p in procs.values():
        if p.pidns is not None:
            by_ns.setdefault(p.pidns, []).append(p.pid)
    out: dict[int, set[int]] = {}
    for sb in sandboxes:
        init = sb.pid
        assert init is not None
        members = set(by_ns.get(os.stat(f"/proc/{init}/ns/pid").st_ino, []))
        outer = procs[init].ppid  # the bwrap that cloned pid 1 into the new namespace
        out[init] = descendants(members | {outer}, procs)
    return out


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="sandboxes alive at once (default 200)")
    ap.add_argument("--concurrency", type=int, default=8, help="starts in flight (default 8)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to wait before measuring")
    args = ap.parse_args()

    # Each sandbox holds a few descriptors in this process (pipes, channel dir, pty master).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 16 * args.n + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        log(f"raised RLIMIT_NOFILE from {soft} to {new}")

    config = SandboxConfig()
    avail_before = mem_available_kb()
    sandboxes: list[Sandbox] = []
    sessions: dict[int, ShellSession] = {}
    sem = asyncio.Semaphore(args.concurrency)
    result: dict[str, Any] = {"benchmark": "density", "requested": args.n}
    members: dict[int, int] = {}  # pid -> start time, of every sandbox process measured
    try:

        async def start_one(i: int) -> None:
            async with sem:
                sb = Sandbox(config)
                sandboxes.append(sb)  # before start: a half-started one is stopped too
                await sb.start()
                sessions[i] = await sb.create_session("main")
            if len(sessions) % 25 == 0:
                log(f"{len(sessions)}/{args.n} sandboxes up")

        log(f"starting {args.n} sandboxes, {args.concurrency} at a time")
        began = time.monotonic()
        outcomes = await asyncio.gather(
            *(start_one(i) for i in range(args.n)), return_exceptions=True
        )
        result["start_all_s"] = round(time.monotonic() - began, 3)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        result["failed_starts"] = len(errors)
        if errors:
            result["first_start_error"] = repr(errors[0])[:500]
            log(f"{len(errors)} starts failed; first: {errors[0]!r}")
        running = [sb for sb in sandboxes if sb.running]
        result["sandboxes"] = len(running)
        await asyncio.sleep(args.settle)

        procs = scan_procs()
        groups = sandbox_processes(running, procs)
        totals: Counter[str] = Counter()
        by_comm: Counter[str] = Counter()
        pss_by_comm: Counter[str] = Counter()
        for pids in groups.values():
            for pid in pids:
                members[pid] = procs[pid].started
                mem = memory_kb(pid)
                totals.update(mem)
                by_comm[procs[pid].comm] += 1
                pss_by_comm[procs[pid].comm] += mem.get("pss", 0)
        n = max(len(running), 1)
        # Not per sandbox: this process, and its janitor (which deletes our runtime directory
        # even if we are SIGKILLed).
        me = os.getpid()
        janitors = [
            p.pid
            for p in procs.values()
            if p.ppid == me and p.pid not in members and "python" in p.comm
        ]
        avail_after = mem_available_kb()
        result |= {
            "pss_per_sandbox_mb": round(totals["pss"] / 1024 / n, 3),
            "rss_per_sandbox_mb": round(totals["rss"] / 1024 / n, 3),
            "private_per_sandbox_mb": round(totals["private"] / 1024 / n, 3),
            "page_tables_per_sandbox_mb": round(totals["pte"] / 1024 / n, 3),
            "processes_per_sandbox": round(sum(len(g) for g in groups.values()) / n, 3),
            "processes_by_name_per_sandbox": {k: round(v / n, 3) for k, v in by_comm.items()},
            "pss_by_name_per_sandbox_mb": {
                k: round(v / 1024 / n, 3) for k, v in sorted(pss_by_comm.items())
            },
            # Includes what PSS cannot see (kernel memory: mounts, namespaces, tmpfs, ptys,
            # page tables) but also everything else that changed on the host meanwhile.
            "mem_available_drop_per_sandbox_mb": round((avail_before - avail_after) / 1024 / n, 3),
            "janitor_processes": len(janitors),
            "janitor_pss_mb": round(sum(memory_kb(p).get("pss", 0) for p in janitors) / 1024, 3),
            "controller_pss_mb": round(memory_kb(me)["pss"] / 1024, 3),
            "controller_threads": threads_of(me),
            "controller_fds": fds_of(me),
        }
        log(
            f"{len(running)} sandboxes: {result['pss_per_sandbox_mb']} MB PSS each, "
            f"{result['processes_per_sandbox']} processes each"
        )

        async def answer(s: ShellSession) -> bool:
            async with sem:
                try:
                    r = await s.run("echo ok", timeout=30)
                except Exception as e:
                    log(f"session of sandbox {s.sandbox.id} failed: {e!r}")
                    return False
                return r.exit_code == 0 and r.output.strip() == "ok"

        began = time.monotonic()
        answers = await asyncio.gather(*(answer(s) for s in sessions.values()))
        result["check_all_s"] = round(time.monotonic() - began, 3)
        result["alive"] = sum(answers)
        result["all_alive"] = len(running) == args.n and all(answers)
    finally:
        log(f"stopping {len(sandboxes)} sandboxes")
        began = time.monotonic()

        async def stop_one(sb: Sandbox) -> None:
            async with sem:
                await sb.stop()

        await asyncio.gather(*(stop_one(sb) for sb in sandboxes), return_exceptions=True)
        result["stop_all_s"] = round(time.monotonic() - began, 3)

    # Cleanup check: nothing of the sandboxes may survive stop().
    await asyncio.sleep(0.2)
    after = scan_procs()
    left = [after[p] for p, t in members.items() if p in after and after[p].started == t]
    result["leftover_processes"] = sum(1 for p in left if p.state != "Z")
    # Exited but not reaped: waiting for whoever they were reparented to (see bench/README.md).
    result["leftover_zombies"] = sum(1 for p in left if p.state == "Z")
    result["leftover_zombie_parents"] = sorted({p.ppid for p in left if p.state == "Z"})
    # The per-process system layer (system, system-<uid>) is shared and lives until exit.
    leftover_dirs = [d for d in os.listdir(runtime.process_dir()) if not d.startswith("system")]
    result["leftover_dirs"] = len(leftover_dirs)
    result["target_pss_per_sandbox_mb"] = TARGET_PSS_MB
    result["meets_target"] = (
        result.get("all_alive", False) and result["pss_per_sandbox_mb"] <= TARGET_PSS_MB
    )
    result["host"] = host_info()
    return result


if __name__ == "__main__":
    run_main(main)
