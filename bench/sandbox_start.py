"""Sandbox start-up latency: start -> first command (`true`) -> stop, repeated.

The sandbox gets a realistic lower layer: a relocatable venv with numpy and pandas at /opt/venv,
built once with uv and cached. In the same run, and interleaved with it, the same cycle without
any layer gives the baseline, so the JSON shows what the layer itself costs.

    python bench/sandbox_start.py [--n 50] [--work-dir ~/.cache/minisandbox-bench]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main, summarize_ms

from minisandbox import Sandbox, SandboxConfig

VENV_INSIDE = "/opt/venv"
CHECK_IMPORTS = (
    "import numpy, pandas; print('numpy', numpy.__version__, 'pandas', pandas.__version__)"
)
TARGET_START_P50_MS = 20.0


def find_uv() -> str:
    # The project's venv ships uv next to its python (scripts/bootstrap installs it).
    beside = Path(sys.executable).parent / "uv"
    if beside.exists():
        return str(beside)
    found = shutil.which("uv")
    if found is None:
        raise SystemExit("uv not found: install it (`pip install uv`) to build the venv layer")
    return found


def base_python() -> Path:
    """The interpreter the layer's venv is made from. Its bin/python symlinks there, so the
    sandbox needs sys.base_prefix bound at its own path (ro_paths)."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    path = Path(sys.base_prefix) / "bin" / name
    if not path.exists():
        raise SystemExit(f"cannot find the base interpreter {path}")
    return path


def tree_size(root: Path) -> tuple[int, int]:
    """(apparent bytes, number of files) under root, not following symlinks."""
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size
            files += name in filenames
    return total, files


def build_layer(work_dir: Path, packages: list[str]) -> Path:
    """A layer directory holding `opt/venv`; built once per (interpreter, packages).

    `uv venv --relocatable` makes scripts and activate find the venv from their own location,
    so a venv built under the cache works at /opt/venv inside. Packages are copied (not
    hard-linked to uv's cache) so the layer stands alone, and byte-compiled as a prepared
    image would be."""
    python = base_python()
    key = hashlib.sha256(json.dumps([str(python), sorted(packages)]).encode()).hexdigest()[:12]
    layer = work_dir / f"layer-{key}"
    done = work_dir / f"layer-{key}.done"  # outside the layer, or it would show up inside
    if done.exists() and (layer / "opt/venv/bin/python").exists():
        log(f"using cached layer {layer}")
        return layer
    work_dir.mkdir(parents=True, exist_ok=True)
    uv = find_uv()
    # Build next to the final place, then rename: an interrupted build never looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".layer-{key}-", dir=work_dir))
    try:
        venv = tmp / "opt" / "venv"
        log(f"building layer {layer}: uv venv + uv pip install {' '.join(packages)}")
        began = time.monotonic()
        # uv's own output goes to stderr: stdout is reserved for the JSON result.
        subprocess.run(
            [uv, "venv", "--relocatable", "--python", str(python), str(venv)],
            check=True,
            stdout=sys.stderr,
        )
        install = ["pip", "install", "--link-mode", "copy", "--compile-bytecode"]
        subprocess.run(
            [uv, *install, "--python", str(venv / "bin" / "python"), *packages],
            check=True,
            stdout=sys.stderr,
        )
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700; the sandbox's uid must traverse `/`
        if layer.exists():
            shutil.rmtree(layer)
        tmp.rename(layer)
        done.touch()
        log(f"layer built in {time.monotonic() - began:.1f} s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return layer


async def check_layer(config: SandboxConfig) -> str:
    """Import numpy and pandas from the layer's venv inside a sandbox (once, not timed)."""
    async with Sandbox(config) as sb:
        r = await sb.execute([f"{VENV_INSIDE}/bin/python", "-c", CHECK_IMPORTS], timeout=120)
    if r.exit_code != 0:
        raise SystemExit(f"importing numpy/pandas inside the sandbox failed: {r.output}")
    return r.stdout.strip()


async def cycle(config: SandboxConfig) -> tuple[int, int, int]:
    """One start -> `true` -> stop; returns the three durations in ns."""
    t0 = time.perf_counter_ns()
    sb = Sandbox(config)
    try:
        await sb.start()
        t1 = time.perf_counter_ns()
        r = await sb.execute("true")
        t2 = time.perf_counter_ns()
    finally:
        await sb.stop()
    t3 = time.perf_counter_ns()
    if r.exit_code != 0:
        raise RuntimeError(f"`true` exited {r.exit_code}: {r.output}")
    return t1 - t0, t2 - t1, t3 - t2


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=50, help="timed cycles per variant (default 50)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed cycles first (default 3)")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path("~/.cache/minisandbox-bench").expanduser(),
        help="where the venv layer is built and cached",
    )
    ap.add_argument(
        "--extra-packages",
        nargs="*",
        default=[],
        help="more packages for the layer, to make it larger (e.g. scipy)",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-layer cycles")
    args = ap.parse_args()

    # numpy + pandas + scipy: a ~300 MB+ layer, like a real task environment.
    packages = ["numpy", "pandas", "scipy", *args.extra_packages]
    layer = build_layer(args.work_dir.expanduser().resolve(), packages)
    layer_bytes, layer_files = tree_size(layer)
    base = Path(sys.base_prefix)
    # /usr is bound anyway; binding a system interpreter's prefix again would be redundant.
    ro = [] if base.is_relative_to("/usr") else [base]
    with_layer = SandboxConfig(layers=[layer], ro_paths=ro, venv=VENV_INSIDE)
    bare = SandboxConfig()
    log(f"layer: {layer_bytes / 1e6:.0f} MB in {layer_files} files; checking imports inside")
    check = await check_layer(with_layer)
    log(f"inside: {check}")

    variants = {"layer": with_layer} if args.no_baseline else {"layer": with_layer, "bare": bare}
    samples: dict[str, list[tuple[int, int, int]]] = {k: [] for k in variants}
    info_before = host_info()
    gc.collect()
    for i in range(args.warmup + args.n):
        # Alternate the order so that neither variant always runs right after the other.
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            result = await cycle(variants[name])
            if i >= args.warmup:
                samples[name].append(result)
        if (i + 1) % 10 == 0:
            log(f"{i + 1}/{args.warmup + args.n} cycles")

    def stats(name: str, suffix: str) -> dict[str, float]:
        rows = samples[name]
        out: dict[str, float] = {}
        # "start" is what an episode waits for: from Sandbox() to the first command's result.
        out |= summarize_ms(f"start{suffix}", [r[0] + r[1] for r in rows])
        out |= summarize_ms(f"setup{suffix}", [r[0] for r in rows])
        out |= summarize_ms(f"first_command{suffix}", [r[1] for r in rows])
        out |= summarize_ms(f"stop{suffix}", [r[2] for r in rows])
        out |= summarize_ms(f"cycle{suffix}", [sum(r) for r in rows])
        return out

    result: dict[str, Any] = {
        "benchmark": "sandbox_start",
        "n": args.n,
        "layer_bytes": layer_bytes,
        "layer_files": layer_files,
        "layer_packages": packages,
        "layer_check": check,
    }
    result |= stats("layer", "")
    if "bare" in samples:
        result |= stats("bare", "_no_layer")
        result["start_ratio_layer_vs_no_layer"] = round(
            result["start_p50_ms"] / result["start_no_layer_p50_ms"], 3
        )
    result["target_start_p50_ms"] = TARGET_START_P50_MS
    result["meets_target"] = result["start_p50_ms"] <= TARGET_START_P50_MS
    result["host"] = host_info() | {"loadavg_1m_before": info_before["loadavg_1m"]}
    return result


if __name__ == "__main__":
    run_main(main)
