"""Helpers shared by the benchmark scripts. Run a benchmark as `python bench/<name>.py`: the
script's own directory is then first on sys.path, so `import _common` works."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries exactly one JSON object."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated like numpy's default."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(prefix: str, samples_ns: Sequence[int]) -> dict[str, float]:
    """p50 and p95 of nanosecond samples, as `<prefix>_p50_ms` and `<prefix>_p95_ms`."""
    ms = [s / 1e6 for s in samples_ns]
    return {
        f"{prefix}_p50_ms": round(percentile(ms, 50), 3),
        f"{prefix}_p95_ms": round(percentile(ms, 95), 3),
    }


def dataset_records(dataset: Path) -> list[dict[str, Any]]:
    """The instance ids and repositories of a SWE-bench file (.parquet, .jsonl, .json): only the
    two columns needed to pick tasks, since loading all tasks converts every recipe."""
    if dataset.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(dataset, columns=["instance_id", "repo"]).to_pylist()
    if dataset.suffix == ".jsonl":
        return [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    return list(json.loads(dataset.read_text()))


def portable(value: Any, places: dict[Path | None, str]) -> Any:
    """`value` with each of `places`' directories (this machine's) named by its placeholder in
    every string, longest first: results under bench/results/ name no machine's paths."""
    pairs = sorted(((str(p), name) for p, name in places.items() if p), key=lambda x: -len(x[0]))

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            for path, name in pairs:
                v = v.replace(path, name)
            return v
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(value)


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """What the numbers depend on. The load average shows whether other work shared the CPUs."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "as_root": os.geteuid() == 0,
        "swebench": _version("swebench"),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_main(main: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> None:
    """Run `main` and print its result as one JSON line on the real stdout.

    Anything else that writes to sys.stdout meanwhile (rich log handlers in third-party code
    print there) goes to stderr instead, so the output stays machine-readable."""
    real_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        result = asyncio.run(main())
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()


def append_jsonl(path: Path | None, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `path` (a bench's --out), making its directory."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")
