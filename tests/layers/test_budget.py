"""The node-wide I/O budget, with real processes sharing one state directory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minisandbox.errors import MiniSandboxError
from minisandbox.layers.budget import IOBudgetError, LocalIOBudget, parse_size
from minisandbox.layers.errors import IOBudgetStateError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512m") == 512 * 1024**2
    assert parse_size("1.5K") == 1536
    assert parse_size(" 3 MB ") == 3 * 1024**2
    assert parse_size(7) == 7
    for bad in ("", "G", "two", "1X", "-1G"):
        with pytest.raises(IOBudgetError):
            parse_size(bad)


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISANDBOX_IO_BUDGET", raising=False)
    assert LocalIOBudget.from_env(tmp_path) is None
    monkeypatch.setenv("MINISANDBOX_IO_BUDGET", "2G")
    budget = LocalIOBudget.from_env(tmp_path)
    assert budget is not None and budget.limit == 2 * 1024**3


async def test_oversized_request_runs_alone(tmp_path: Path) -> None:
    budget = LocalIOBudget(tmp_path, 100)
    async with budget.reserve(500):  # larger than the limit: admitted, since nothing else runs
        assert budget.in_flight() == 500
        waiter = asyncio.ensure_future(_enter(budget, 1))
        await asyncio.sleep(0.2)
        assert not waiter.done()  # nothing joins it
    await asyncio.wait_for(waiter, 5)
    assert budget.in_flight() == 0


async def _enter(budget: LocalIOBudget, n: int) -> None:
    async with budget.reserve(n):
        pass


async def test_a_vanished_ticket_is_an_error_of_its_own(tmp_path: Path) -> None:
    """A waiter whose ticket is gone from the shared state (edited by hand) stops waiting."""
    budget = LocalIOBudget(tmp_path, 10)
    async with budget.reserve(10):
        waiter = asyncio.ensure_future(_enter(budget, 5))
        await asyncio.sleep(0.05)
        assert budget.waiting() == 1
        (tmp_path / "io-budget.json").unlink()
        with pytest.raises(IOBudgetStateError) as err:
            await asyncio.wait_for(waiter, 5)
        assert isinstance(err.value, MiniSandboxError)
    assert budget.in_flight() == 0 and budget.waiting() == 0


async def test_cancelled_waiter_leaves_no_ticket(tmp_path: Path) -> None:
    budget = LocalIOBudget(tmp_path, 10)
    async with budget.reserve(10):
        waiter = asyncio.ensure_future(_enter(budget, 5))
        await asyncio.sleep(0.05)
        assert budget.waiting() == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.waiting() == 0
    assert budget.in_flight() == 0


WORKER = textwrap.dedent(
    """
    import asyncio, fcntl, json, os, random, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.budget import LocalIOBudget

    state, log, limit, rounds = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), 6
    budget = LocalIOBudget(state, limit)
    rng = random.Random(os.getpid())

    def record(delta):
        # The shared ledger: its own flock, independent of the budget's.
        with open(log, "r+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            data = json.load(fh)
            data["now"] += delta
            data["max"] = max(data["max"], data["now"])
            data["entries"] += delta > 0
            fh.seek(0); fh.truncate(); json.dump(data, fh)

    async def main():
        for _ in range(rounds):
            n = rng.randint(1, limit)
            async with budget.reserve(n):
                record(n)
                await asyncio.sleep(rng.uniform(0.005, 0.03))
                record(-n)

    if sys.argv[5] == "sync":
        for _ in range(rounds):
            n = rng.randint(1, limit)
            with budget.reserve_blocking(n):
                record(n)
                time.sleep(rng.uniform(0.005, 0.03))
                record(-n)
    else:
        asyncio.run(main())
    """
)


def test_budget_never_exceeded_across_processes(tmp_path: Path) -> None:
    limit = 1000
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"now": 0, "max": 0, "entries": 0}))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                SRC,
                str(tmp_path / "state"),
                str(ledger),
                str(limit),
                "sync" if i % 3 == 0 else "async",
            ]
        )
        for i in range(8)
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    result = json.loads(ledger.read_text())
    assert result["entries"] == 8 * 6
    assert result["now"] == 0
    assert 0 < result["max"] <= limit
    assert LocalIOBudget(tmp_path / "state", limit).in_flight() == 0


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.budget import LocalIOBudget
    with LocalIOBudget(Path(sys.argv[2]), 100).reserve_blocking(100):
        print("holding", flush=True)
        time.sleep(60)
    """
)


async def test_killed_holder_is_reclaimed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, SRC, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        budget = LocalIOBudget(tmp_path, 100)
        assert budget.in_flight() == 100
        waiter = asyncio.ensure_future(_enter(budget, 60))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        started = time.monotonic()
        await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - started < 2
        assert budget.in_flight() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_peak_is_the_most_reserved_at_once(tmp_path: Path) -> None:
    budget = LocalIOBudget(tmp_path, 10)
    assert budget.peak() == 0
    async with budget.reserve(3):
        async with budget.reserve(4):
            assert budget.peak() == 7
        async with budget.reserve(2):
            pass
    # Seen by another instance on the same state (another process of the node).
    assert LocalIOBudget(tmp_path, 10).peak() == 7
