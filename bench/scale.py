"""Episodes across the nodes of a Ray cluster: throughput per node and per CPU-second, node caches,
I/O budgets, placement, and what a lost node leaves behind.

On one machine, one simulated cluster (`ray.cluster_utils.Cluster`) holds a head node without
sandbox slots and, for each node count N, a group of N sandbox nodes, each node with its own,
empty node cache, runtime directory and I/O budget; each group has a pool of its own. The layer
store is shared and built once up front by the driver. An episode is
`SandboxPool.evaluate(task, task.gold_patch)`: a fresh sandbox on some node of the group, the
task's tests, stop; every gold patch must resolve (reward 1). Each group runs two passes of the
same task mix, `--concurrency` at a time (4, at every node count: the same load offered to more
nodes; 0: every slot of the group). The groups take turns, `--chunk` episodes at a time, so
that a slow spell of this shared machine falls on every node count alike; each group's raylets
(and so its agents and sandboxes) run in a cgroup of their own, and a group is charged the CPU
spent during its turns less what the other, idle, groups spent meanwhile.

    python bench/scale.py [--dataset verified.parquet --envs-dir ENVS --git-mirror MIRRORS]
                          [--repos psf/requests pytest-dev/pytest] [--instances 1]
                          [--instance-ids ID ...] [--episodes 256] [--nodes 1,2,4] [--slots 4]
                          [--concurrency N] [--chunk 16] [--unaware-episodes N] [--no-node-loss]
                          [--quick]
                          [--work-dir ~/.cache/minisandbox-bench/scale]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
from _common import dataset_records, host_info, log, percentile, run_main
from ray.cluster_utils import Cluster

from minisandbox.cluster import PoolConfig, SandboxPool
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task
from minisandbox.utils.aio import settle
from minisandbox.utils.safefs import discard_tree

DEFAULT_REPOS = ["psf/requests", "pytest-dev/pytest"]
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/scale")
IO_BUDGET = "1G"
TARGET_EFFICIENCY = 0.9
TARGET_HIT_RATE = 0.9


# ---------------------------------------------------------------- machine CPU time


def cpu_seconds() -> float:
    """CPU time the whole machine has spent working (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    assert fields[0] == "cpu"
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class RunCgroup:
    """A cpuacct cgroup (v1) holding this process and so everything it starts (Ray's processes,
    agents, sandboxes): the CPU time of the run alone, whatever else the machine does; and one
    child cgroup per group of nodes, holding what those nodes' raylets start. None of it where
    cgroup v1's cpuacct is not writable."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, enabled: bool = True) -> None:
        self.path: Path | None = None
        self.children: list[Path] = []
        if not enabled or os.geteuid() != 0 or not (self.ROOT / "cgroup.procs").exists():
            return
        path = self.ROOT / f"minisandbox-bench-scale-{os.getpid()}"
        try:
            path.mkdir()
            (path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return
        self.path = path

    def _at(self, child: str | None) -> Path | None:
        if self.path is None:
            return None
        return self.path / child if child else self.path

    def seconds(self, child: str | None = None) -> float | None:
        """CPU seconds of the run (or of one child's processes)."""
        path = self._at(child)
        if path is None:
            return None
        return int((path / "cpuacct.usage").read_text()) / 1e9

    def system_seconds(self, child: str | None = None) -> float | None:
        """The kernel's share of `seconds()` (cpuacct.stat)."""
        path = self._at(child)
        if path is None:
            return None
        stat = dict(line.split() for line in (path / "cpuacct.stat").read_text().splitlines())
        return int(stat["system"]) / os.sysconf("SC_CLK_TCK")

    @contextlib.contextmanager
    def inside(self, child: str) -> Iterator[None]:
        """This process in child cgroup `child` meanwhile, so that what it starts stays there."""
        if self.path is None:
            yield
            return
        path = self.path / child
        if not path.exists():
            path.mkdir()
            self.children.append(path)
        (path / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """Leave the cgroup and remove it, once the processes of the run have all exited."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
        for path in [*self.children, self.path]:
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self.path = None


RUN_CGROUP = RunCgroup(enabled=False)  # main() makes the run's

# Trees of finished clusters (their node caches), removed only once the run is over: on an ext4
# without a journal, creating files within minutes of deleting many is slow (the inode
# allocator passes over the recently deleted), and one cluster's cleanup would be charged to
# the next one's unpacks.
SPENT: list[Path] = []


@dataclass
class CpuMeter:
    """CPU seconds charged to one group of nodes while it alone runs episodes: the machine's and
    the run's, less what the other groups' processes (idle meanwhile) spent."""

    groups: list[str]

    def _read(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"machine": cpu_seconds()}
        out["run"] = RUN_CGROUP.seconds()
        out["run_system"] = RUN_CGROUP.system_seconds()
        for g in self.groups:
            out[g] = RUN_CGROUP.seconds(g)
            out[g + ".system"] = RUN_CGROUP.system_seconds(g)
        return out

    @contextlib.contextmanager
    def charge(self, group: str, into: dict[str, float | None]) -> Iterator[None]:
        """Add to `into` (`cpu_s`, `run_cpu_s`, `run_system_s`) what the block cost `group`:
        None where it cannot be measured."""
        before = self._read()
        yield
        after = self._read()

        def delta(key: str) -> float | None:
            a, b = after[key], before[key]
            return None if a is None or b is None else a - b

        others = [g for g in self.groups if g != group]
        for key, base, of_group in (
            ("cpu_s", "machine", ""),
            ("run_cpu_s", "run", ""),
            ("run_system_s", "run_system", ".system"),
        ):
            total = delta(base)
            if total is None or (key in into and into[key] is None):
                into[key] = None
                continue
            for g in others:
                total -= delta(g + of_group) or 0.0
            into[key] = (into.get(key) or 0.0) + total


# ---------------------------------------------------------------- tasks


def select_tasks(args: argparse.Namespace) -> list[Task]:
    """The bundled examples, then the first `--instances` Verified instances of each of `--repos`
    in dataset order (or exactly `--instance-ids`)."""
    tasks = list(load_tasks("examples"))
    if args.dataset is None:
        return tasks
    ids = args.instance_ids
    if ids is None:
        ids = []
        for repo in args.repos:
            of_repo = [r["instance_id"] for r in dataset_records(args.dataset) if r["repo"] == repo]
            ids += of_repo[: args.instances]
    if ids:
        tasks += load_tasks(args.dataset, envs_dir=args.envs_dir, instance_ids=ids)
    return tasks


def task_mix(tasks: list[Task], n: int, seed: int) -> list[Task]:
    """`n` episodes over `tasks`, each task as often as the others (±1), in a shuffled order."""
    mix = [tasks[i % len(tasks)] for i in range(n)]
    random.Random(seed).shuffle(mix)
    return mix


# ---------------------------------------------------------------- leftovers


def our_processes(marker: str) -> list[int]:
    """Processes whose command line names `marker` (our runtime directories): every bwrap of a
    sandbox names its runtime directory, and so does each runtime directory's janitor."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


def leftover_dirs(roots: list[Path]) -> int:
    """Process and sandbox runtime directories left in the nodes' runtime roots."""
    return sum(len(os.listdir(r)) for r in roots if r.is_dir())


async def wait_leftovers(marker: str, roots: list[Path], grace: float) -> tuple[int, int, float]:
    """Processes and directories left, once they are gone or after `grace` seconds."""
    began = time.monotonic()
    while True:
        procs, dirs = len(our_processes(marker)), leftover_dirs(roots)
        waited = time.monotonic() - began
        if (procs == 0 and dirs == 0) or waited >= grace:
            return procs, dirs, round(waited, 1)
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------- one cluster


class SimCluster:
    """A head node without slots and, per group, that many sandbox nodes (group "4n": 4 nodes),
    each with its own cache and runtime directory. A group's nodes have the slots resource
    `minisandbox_slots_<group>`, so that a pool of that resource sees them alone, and their
    raylets (so their agents and sandboxes too) start in the group's child of the run's cgroup."""

    def __init__(self, root: Path, sizes: list[int], slots: int, one_cache: bool = False):
        self.root = root
        self.sizes = {f"{n}n": n for n in sizes}
        self.slots = slots
        self.one_cache = one_cache
        self.cluster: Cluster | None = None
        self.workers: list[Any] = []
        self.ray_dir: str | None = None
        self.old_tmpdir: str | None = None

    @staticmethod
    def resource(group: str) -> str:
        return f"minisandbox_slots_{group}"

    def marker(self, group: str) -> str:
        """What the command line of each of the group's sandboxes' processes names."""
        return f"{self.root / group}/"

    def runtime_roots(self, group: str) -> list[Path]:
        return [self.root / group / f"node-{i}" / "run" for i in range(self.sizes[group])]

    def start(self) -> None:
        if self.root.exists():
            discard_tree(str(self.root))
        # Ray's files (sessions, sockets, the cluster's address) in a short directory of ours,
        # removed in stop(): $RAY_TMPDIR, inherited by Ray's nodes. (Given a temp_dir instead,
        # Ray still writes the address under /tmp/ray, and fails where that does not exist.)
        self.ray_dir = tempfile.mkdtemp(prefix="msb-ray-")
        self.old_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.ray_dir
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(num_cpus=1, object_store_memory=100 << 20, include_dashboard=False),
        )
        for group, n in self.sizes.items():
            for i in range(n):
                self._add_node(group, i)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level=logging.WARNING)

    def _add_node(self, group: str, i: int) -> None:
        assert self.cluster is not None
        node_dir = self.root / group / f"node-{i}"
        node_dir.mkdir(parents=True, mode=0o700)
        env = {
            # --one-cache: every node of the group uses node-0's (a diagnostic only).
            "MINISANDBOX_CACHE": str(node_dir.parent / f"node-{0 if self.one_cache else i}/cache"),
            "MINISANDBOX_RUNTIME": str(node_dir / "run"),
            "MINISANDBOX_IO_BUDGET": IO_BUDGET,
        }
        with RUN_CGROUP.inside(group):
            node = self.cluster.add_node(
                num_cpus=1,
                object_store_memory=80 << 20,
                resources={self.resource(group): self.slots},
                env_vars=env,
            )
        self.workers.append(node)

    def worker(self, node_id: str) -> Any:
        return next(w for w in self.workers if w.node_id == node_id)

    def stop(self) -> None:
        """Everything start() started, however far it got."""
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        if self.ray_dir is not None:
            if self.old_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = self.old_tmpdir
            discard_tree(self.ray_dir)
            self.ray_dir = None


# ---------------------------------------------------------------- episodes


async def run_episodes(pool: SandboxPool, mix: list[Task], concurrency: int) -> list[EvalResult]:
    """Every task of `mix` evaluated with its gold patch, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> EvalResult:
        async with gate:
            return await pool.evaluate(task, task.gold_patch)

    return list(await asyncio.gather(*map(one, mix)))


def hit_rate(facts: list[dict[str, Any]]) -> float | None:
    hits = sum(f["hits"] for f in facts)
    misses = sum(f["misses"] for f in facts)
    return round(hits / (hits + misses), 4) if hits + misses else None


def failures(results: list[EvalResult]) -> dict[str, int]:
    """Episodes whose gold patch did not get reward 1, by first line of their reason."""
    out: dict[str, int] = {}
    for r in results:
        if r.reward != 1.0:
            first = next(iter((r.reason or "").splitlines()), "")
            key = f"{r.instance_id}: {r.status}: {first[:160]}"
            out[key] = out.get(key, 0) + 1
    return out


async def node_loss(
    pool: SandboxPool, sim: SimCluster, mix: list[Task], concurrency: int, kill_after: float
) -> dict[str, Any]:
    """Episodes while one sandbox node is killed (its raylet and workers SIGKILLed) mid-run:
    `kill_after` seconds after the first sandbox of the phase started, the node with the most
    of its episodes under way goes."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> EvalResult:
        async with gate:
            return await pool.evaluate(task, task.gold_patch)

    began = time.monotonic()
    first = len(pool.started)
    running = asyncio.ensure_future(asyncio.gather(*map(one, mix)))
    while len(pool.started) == first and not running.done():
        await asyncio.sleep(0.05)
    await asyncio.sleep(kill_after)
    while not running.done() and not any(n.alive and n.mine for n in pool.nodes):
        await asyncio.sleep(0.05)
    victim = max((n for n in pool.nodes if n.alive), key=lambda n: n.mine)
    open_there = victim.mine
    started_before = len(pool.started) - first
    log(f"node loss: removing node {victim.node_id[:8]} with {open_there} episodes on it")
    await asyncio.to_thread(sim.cluster.remove_node, sim.worker(victim.node_id), False)  # type: ignore[union-attr]
    results = await running
    lost = sum("NodeLostError" in r.reason for r in results if r.reward != 1.0)
    other = sum(1 for r in results if r.reward != 1.0) - lost
    return {
        "episodes": len(mix),
        "removed_after_s": kill_after,
        "episodes_started_before_removal": started_before,
        "episodes_on_node_when_removed": open_there,
        "failed_node_lost": lost,
        "failed_other": other,
        "failed_other_reasons": {k: v for k, v in failures(results).items() if "NodeLost" not in k},
        "succeeded": sum(1 for r in results if r.reward == 1.0),
        "wall_s": round(time.monotonic() - began, 1),
    }


@dataclass
class Group:
    """One node count's pool in the shared cluster, and what its episodes did."""

    name: str
    nodes: int
    pool: SandboxPool
    concurrency: int
    results: list[EvalResult] = field(default_factory=list)
    passes: list[dict[str, Any]] = field(default_factory=list)


async def run_passes(
    groups: list[Group], meter: CpuMeter, tasks: list[Task], episodes: int, chunk: int
) -> None:
    """Two passes of `episodes // 2` episodes for every group. Groups take turns, `chunk`
    episodes each, in an order reversed every round (A B C, C B A, ...), all on the same tasks:
    a slow minute of the machine falls on every group alike, and each group's CPU is what the
    machine and the run spent during its own turns, less the other groups' (idle) processes."""
    half = episodes // 2
    rounds = 0  # counted over both passes: each group goes first as often as last
    for p, n in enumerate((half, episodes - half), start=1):
        mix = task_mix(tasks, n, seed=p)
        sums: dict[str, dict[str, Any]] = {g.name: {"wall_s": 0.0} for g in groups}
        firsts = {g.name: len(g.pool.started) for g in groups}
        for k in range(0, len(mix), chunk):
            rounds += 1
            for g in groups if rounds % 2 else groups[::-1]:
                began = time.monotonic()
                with meter.charge(g.name, sums[g.name]):
                    g.results += await run_episodes(g.pool, mix[k : k + chunk], g.concurrency)
                sums[g.name]["wall_s"] += time.monotonic() - began
        for g in groups:
            facts = list(g.pool.started)[firsts[g.name] :]
            g.passes.append(
                {
                    "episodes": n,
                    **{k: round(v, 1) if v is not None else None for k, v in sums[g.name].items()},
                    "hit_rate": hit_rate(facts),
                    "prep_p50_s": round(percentile([f["prep_s"] for f in facts], 50), 3),
                    "prep_p95_s": round(percentile([f["prep_s"] for f in facts], 95), 3),
                }
            )
            log(f"[{g.name}] pass {p}: {g.passes[-1]}")


async def idle_cpu(meter: CpuMeter, groups: list[Group], seconds: float) -> dict[str, Any]:
    """CPUs each group's cluster would keep busy doing nothing (its nodes' raylets and agents,
    and the head's processes), sampled once the passes are over."""
    out: dict[str, dict[str, float | None]] = {g.name: {} for g in groups}
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        for g in groups:
            stack.enter_context(meter.charge(g.name, out[g.name]))
        await asyncio.sleep(seconds)
    took = time.monotonic() - began

    def per_s(v: float | None) -> float | None:
        return round(v / took, 3) if v is not None else None

    return {
        name: {
            "idle_cpu_per_s": per_s(o["cpu_s"]),
            "idle_run_cpu_per_s": per_s(o["run_cpu_s"]),
        }
        for name, o in out.items()
    }


def group_report(g: Group, stats: dict[str, Any]) -> dict[str, Any]:
    """One group's figures: both passes together, per node, budgets, unpacks."""
    n = len(g.results)
    wall = sum(p["wall_s"] for p in g.passes)
    cpu = sum(p["cpu_s"] for p in g.passes)
    own = (
        None
        if any(p["run_cpu_s"] is None for p in g.passes)
        else sum(p["run_cpu_s"] for p in g.passes)
    )
    prep = [f["prep_s"] for f in g.pool.started]
    per_node = {}
    for i, node in enumerate(g.pool.nodes):
        s = stats["nodes"].get(node.node_id)
        if s is not None:
            per_node[f"node-{i}"] = {
                "episodes": sum(1 for f in g.pool.started if f["node_id"] == node.node_id),
                "max_bytes_in_flight": s["max_bytes_in_flight"],
                "budget_bytes": s["budget_bytes"],
                "layers_unpacked": len(s["unpacks"]),
            }
    unpacks = [c for s in stats["nodes"].values() for c in s["unpacks"].values()]
    return {
        "nodes": g.nodes,
        "cache_aware": g.pool.config.cache_aware,
        "episodes": n,
        "concurrency": g.concurrency,
        "gold_resolved": sum(r.reward == 1.0 for r in g.results),
        "failures": failures(g.results),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "run_cpu_s": round(own, 1) if own is not None else None,
        "episodes_per_s": round(n / wall, 3),
        "episodes_per_s_per_node": round(n / wall / g.nodes, 3),
        "episodes_per_cpu_s": round(n / cpu, 4),
        "episodes_per_run_cpu_s": round(n / own, 4) if own else None,
        "prep_p50_s": round(percentile(prep, 50), 3),
        "prep_p95_s": round(percentile(prep, 95), 3),
        "hit_rate_first_pass": g.passes[0]["hit_rate"],
        "hit_rate_second_pass": g.passes[1]["hit_rate"],
        "passes": g.passes,
        "per_node": per_node,
        "budget_never_exceeded": all(
            v["max_bytes_in_flight"] is not None
            and v["budget_bytes"] is not None
            and v["max_bytes_in_flight"] <= v["budget_bytes"]
            for v in per_node.values()
        ),
        "layers_unpacked": len(unpacks),
        "unpacks_per_layer_per_node_max": max(unpacks, default=0),
    }


async def run_cluster(
    args: argparse.Namespace,
    builder: Builder,
    tasks: list[Task],
    sizes: list[int],
    cache_aware: bool,
    episodes: int,
    with_node_loss: bool,
) -> dict[str, dict[str, Any]]:
    """One cluster with a group of nodes per node count of `sizes`, a pool per group, their
    passes interleaved (run_passes); then each group's node-loss phase (2 nodes or more), all
    pools closed, the cluster stopped and each group's leftovers counted."""
    tag = "aware" if cache_aware else "unaware"
    sim = SimCluster(args.work_dir / "clusters" / tag, sizes, args.slots, args.one_cache)
    log(f"[{tag}] starting a cluster of {sum(sizes)} sandbox nodes in groups of {sizes}")
    SPENT.append(sim.root)
    out: dict[str, dict[str, Any]] = {}
    groups: list[Group] = []
    try:
        sim.start()
        for name, n in sim.sizes.items():
            config = PoolConfig(
                store=builder.settings.store,
                slots_resource=sim.resource(name),
                cache_aware=cache_aware,
            )
            pool = SandboxPool(config, builder=builder)
            groups.append(Group(name, n, pool, args.concurrency or n * args.slots))
            await pool.start()
            # Untimed: the driver resolves each task's layers once per pool (all built already).
            for t in tasks:
                await pool.node_layers(t, "evaluation")
        meter = CpuMeter([g.name for g in groups])
        await run_passes(groups, meter, tasks, episodes, args.chunk)
        idle = await idle_cpu(meter, groups, args.idle_sample)
        for g in groups:
            out[str(g.nodes)] = {**group_report(g, await g.pool.stats()), **idle[g.name]}
        for g in groups:
            if with_node_loss and g.nodes >= 2:
                mix = task_mix(tasks, args.loss_episodes or 2 * g.concurrency, seed=99)
                loss = await node_loss(g.pool, sim, mix, g.concurrency, args.kill_after)
                out[str(g.nodes)]["node_loss"] = loss
                log(f"[{g.name}] node loss: {loss}")
    finally:
        await settle([g.pool.close() for g in groups])
        for g in groups:
            if str(g.nodes) in out:
                procs, dirs, waited = await wait_leftovers(
                    sim.marker(g.name), sim.runtime_roots(g.name), args.grace
                )
                out[str(g.nodes)].update(
                    leftover_processes_after_pool_close=procs,
                    leftover_dirs_after_pool_close=dirs,
                    leftover_wait_s=waited,
                )
        sim.stop()
    for g in groups:
        procs, dirs, _ = await wait_leftovers(
            sim.marker(g.name), sim.runtime_roots(g.name), args.grace
        )
        out[str(g.nodes)].update(leftover_processes=procs, leftover_dirs=dirs)
    return out


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", type=Path, help="SWE-bench records (.parquet...); else examples")
    ap.add_argument("--envs-dir", type=Path, help="per-instance conda exports (<id>.yml)")
    ap.add_argument("--git-mirror", type=Path, help="directory of <owner>__<name> clones")
    ap.add_argument("--repos", nargs="+", default=DEFAULT_REPOS)
    ap.add_argument("--instances", type=int, default=1, help="Verified instances per repository")
    ap.add_argument("--instance-ids", nargs="+", help="exactly these instances")
    ap.add_argument("--episodes", type=int, default=256, help="per node count, over two passes")
    ap.add_argument("--nodes", default="1,2,4", help="node counts, comma-separated")
    ap.add_argument("--slots", type=int, default=4, help="sandbox slots per node")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="episodes at once, the same at every node count: the same offered load, shared by "
        "more nodes (0: every slot of the group)",
    )
    ap.add_argument(
        "--unaware-episodes",
        type=int,
        help="episodes of the run without cache-aware placement, at the largest node count "
        "(default: half of --episodes; 0 to skip)",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=16,
        help="episodes a node count runs before the next one takes its turn",
    )
    ap.add_argument("--no-node-loss", action="store_true", help="skip the node-loss phase")
    ap.add_argument("--loss-episodes", type=int, help="episodes of it (default 2 × concurrency)")
    ap.add_argument("--kill-after", type=float, default=1.0, help="seconds after its first start")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to wait for cleanup")
    ap.add_argument("--idle-sample", type=float, default=3.0, help="seconds of idle CPU measured")
    ap.add_argument("--quick", action="store_true", help="24 episodes, nodes 1,2")
    ap.add_argument(
        "--one-cache",
        action="store_true",
        help="a diagnostic: all simulated nodes share one node cache (what separate caches cost "
        "on one machine)",
    )
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = ap.parse_args()
    if args.quick:
        args.episodes, args.nodes = 24, "1,2"
        if args.unaware_episodes is None:
            args.unaware_episodes = 24
    if args.unaware_episodes is None:
        args.unaware_episodes = args.episodes // 2
    args.work_dir = args.work_dir.expanduser().resolve()
    args.node_counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    if args.chunk < 1 or args.episodes < 2:
        ap.error("--chunk must be at least 1 and --episodes at least 2 (one per pass)")
    return args


async def main() -> dict[str, Any]:
    global RUN_CGROUP
    args = parse_args()
    RUN_CGROUP = RunCgroup()  # before Ray starts: all of its processes inside
    try:
        return await _main(args)
    finally:
        RUN_CGROUP.close()
        for tree in SPENT:
            discard_tree(str(tree))
        with contextlib.suppress(OSError):
            (args.work_dir / "clusters").rmdir()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    work = args.work_dir
    settings = BuildSettings(
        store=work / "store", cache=work / "driver-cache", git_mirror=args.git_mirror
    )
    tasks = select_tasks(args)
    log(f"{len(tasks)} tasks: {', '.join(t.id for t in tasks)}")
    builder = Builder(settings)
    began = time.monotonic()
    for t in tasks:
        built = await builder.build(t)
        if built.status == "failed":
            raise SystemExit(f"{t.id}: build failed: {built.error}")
        log(f"{t.id}: {built.status}")
    build_s = time.monotonic() - began
    # The driver's cache is not a node's (removed at the end, see SPENT).
    SPENT.append(settings.cache)

    runs = await run_cluster(
        args, builder, tasks, args.node_counts, True, args.episodes, not args.no_node_loss
    )
    unaware = None
    if args.unaware_episodes:
        n = max(args.node_counts)
        unaware = (
            await run_cluster(args, builder, tasks, [n], False, args.unaware_episodes, False)
        )[str(n)]

    base = runs[str(args.node_counts[0])] if args.node_counts[0] == 1 else None
    for r in runs.values():
        r["per_cpu_efficiency_vs_1_node"] = (
            round(r["episodes_per_cpu_s"] / base["episodes_per_cpu_s"], 3) if base else None
        )
        r["per_run_cpu_efficiency_vs_1_node"] = (
            round(r["episodes_per_run_cpu_s"] / base["episodes_per_run_cpu_s"], 3)
            if base and base["episodes_per_run_cpu_s"] and r["episodes_per_run_cpu_s"]
            else None
        )
    largest = runs[str(max(args.node_counts))]
    leftovers = [r for r in [*runs.values(), unaware] if r]
    meets = {
        "per_cpu_efficiency_4_nodes": (
            runs["4"]["per_cpu_efficiency_vs_1_node"] >= TARGET_EFFICIENCY if "4" in runs else None
        ),
        "hit_rate_second_pass_cache_aware": all(
            (r["hit_rate_second_pass"] or 0) >= TARGET_HIT_RATE for r in runs.values()
        ),
        "budget_never_exceeded": all(r["budget_never_exceeded"] for r in leftovers),
        "all_gold_resolved": all(r["gold_resolved"] == r["episodes"] for r in leftovers),
        "no_leftovers": all(
            r["leftover_processes"] == 0 and r["leftover_dirs"] == 0 for r in leftovers
        ),
    }
    return {
        "tasks": len(tasks),
        "task_ids": [t.id for t in tasks],
        "episodes_per_node_count": args.episodes,
        "slots_per_node": args.slots,
        "io_budget_per_node": IO_BUDGET,
        "run_cpu_measured": RUN_CGROUP is not None and RUN_CGROUP.path is not None,
        "build_s": round(build_s, 1),
        "by_nodes": runs,
        "per_cpu_efficiency_vs_1_node": {
            n: r["per_cpu_efficiency_vs_1_node"] for n, r in runs.items()
        },
        "per_run_cpu_efficiency_vs_1_node": {
            n: r["per_run_cpu_efficiency_vs_1_node"] for n, r in runs.items()
        },
        "hit_rate_cache_aware": {
            "nodes": largest["nodes"],
            "first_pass": largest["hit_rate_first_pass"],
            "second_pass": largest["hit_rate_second_pass"],
        },
        "hit_rate_not_cache_aware": (
            {
                "nodes": unaware["nodes"],
                "first_pass": unaware["hit_rate_first_pass"],
                "second_pass": unaware["hit_rate_second_pass"],
            }
            if unaware
            else None
        ),
        "not_cache_aware": unaware,
        "unpacks_per_layer_per_node_max": max(
            r["unpacks_per_layer_per_node_max"] for r in leftovers
        ),
        "leftover_processes": sum(r["leftover_processes"] for r in leftovers),
        "leftover_dirs": sum(r["leftover_dirs"] for r in leftovers),
        "meets_target": meets,
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
