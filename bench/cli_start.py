"""A whole `minisandbox exec -- true` process against `podman run --rm IMAGE true` and a bare
bwrap process, side by side, interleaved.

Each variant is timed as the wall clock of its whole process, from spawn to exit: ours (the
console script, through the node's warm process unless MINISANDBOX_WARM=0), ours over the
--layer directories, podman (and docker, when its daemon answers) with and without
`--network none`, and bwrap with all namespaces over the host's /usr. The image has the same
layers: a rootfs made offline (the layers copied in order, plus `true`, `sh` and their
libraries from the host), imported once and kept under --work-dir. Each round runs every
variant once, the order rotating.

    python bench/cli_start.py [--n 20] [--warmup 2] [--layer DIR ...] [--podman-args ARGS]
                              [--work-dir ~/.cache/minisandbox-bench/cli_start] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import append_jsonl, host_info, log, run_main, summarize_ms

from minisandbox.sandbox.bwrap import find_bwrap

TARGET_SPEEDUP = 5.0
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/cli_start")
# The top-level directories a merged-/usr host has as symlinks into /usr.
MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


class NotMeasured(Exception):
    pass


def brief(text: str) -> str:
    """A failing tool's stderr on one line (podman's ends with "See 'podman run --help'")."""
    return " | ".join(line for line in text.strip().splitlines() if line)[:300] or "(no output)"


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def timed(argv: list[str]) -> int:
    """Spawn to exit of `argv`, in ns; a failure stops the run with the process's stderr."""
    t0 = time.perf_counter_ns()
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    elapsed = time.perf_counter_ns() - t0
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace")
        raise SystemExit(f"{shlex.join(argv)} exited {r.returncode}:\n{err}")
    return elapsed


def minisandbox_cli() -> list[str]:
    beside = Path(sys.executable).parent / "minisandbox"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "minisandbox.cli"]


def bwrap_argv() -> list[str]:
    argv = [str(find_bwrap()), "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for name in MERGED:  # mirror the host: a symlink where it has one, else its directory
        host = Path("/", name)
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    return [*argv, "--proc", "/proc", "--dev", "/dev", "--", "/usr/bin/true"]


def copy_host_path(path: Path, rootfs: Path) -> None:
    """`path` at the same place in rootfs, through its parent's real directory (/lib/x is
    /usr/lib/x on a merged-/usr host); a symlink is copied as one, and its target too."""
    dest = rootfs / os.path.realpath(path.parent).lstrip("/") / path.name
    if dest.exists() or dest.is_symlink():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        dest.symlink_to(os.readlink(path))
        copy_host_path(path.parent / os.readlink(path), rootfs)
    else:
        shutil.copy2(path, dest)


def build_rootfs(layers: list[Path], rootfs: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{rootfs.name}-", dir=rootfs.parent))
    try:
        for layer in layers:  # later layers over earlier ones, as overlayfs shows them
            subprocess.run(["cp", "-a", f"{layer}/.", f"{tmp}/"], check=True)
        os.chmod(tmp, 0o755)  # (cp gave it the last layer's root, which may be 0700)
        for name in MERGED:
            host, mine = Path("/", name), tmp / name
            if host.is_symlink() and not (mine.exists() or mine.is_symlink()):
                mine.symlink_to(os.readlink(host))
                (tmp / os.readlink(host).lstrip("/")).mkdir(parents=True, exist_ok=True)
        needed = [Path("/usr/bin/true"), Path("/bin/sh")]
        for binary in list(needed):
            libs = run(["ldd", str(binary)]).stdout
            needed += [Path(p) for p in re.findall(r"(/\S+) \(0x", libs)]
        for path in needed:
            copy_host_path(path, tmp)
        tmp.rename(rootfs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_image(engine: str, layers: list[Path], work_dir: Path) -> str:
    """The image of `layers`, imported once; keyed by the layers' paths and mtimes."""
    key = json.dumps([[str(p), p.stat().st_mtime_ns] for p in layers])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    image = f"minisandbox-bench-cli:{digest}"
    if run([engine, "image", "inspect", image]).returncode == 0:
        return image
    rootfs, tar = work_dir / f"rootfs-{digest}", work_dir / f"rootfs-{digest}.tar"
    if not rootfs.exists():
        log(f"building {rootfs} from {len(layers)} layer(s)")
        build_rootfs(layers, rootfs)
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tar), "."], check=True)
    r = run([engine, "import", str(tar), image])
    if r.returncode != 0:
        raise NotMeasured(f"{engine} import failed: {brief(r.stderr)}")
    log(f"imported {image} into {engine}")
    return image


def engine_args(engine: str, image: str, user_args: list[str]) -> tuple[list[str], list[str]]:
    """The extra `run` options this host needs, found by trying `true` once (untimed), and why."""
    extra, notes = list(user_args), list[str]()
    for _ in range(3):
        r = run([engine, "run", "--rm", *extra, image, "true"])
        if r.returncode == 0:
            return extra, notes
        err = r.stderr.strip()
        if engine == "podman" and "hybrid mode" in err and "--runtime" not in extra:
            if shutil.which("runc") is None:
                raise NotMeasured(f"crun refuses hybrid cgroups, no runc on PATH: {brief(err)}")
            extra += ["--runtime", "runc"]
            notes.append("crun: 'cgroups in hybrid mode not supported': --runtime runc")
        elif "setrlimit" in err and "--ulimit" not in extra:
            extra += ULIMITS
            notes.append("default rlimits not settable (no CAP_SYS_RESOURCE): --ulimit")
        else:
            break
    raise NotMeasured(f"`{engine} run` fails ({r.returncode}): {brief(err)}")


def prepare_engine(engine: str, args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    if shutil.which(engine) is None:
        raise NotMeasured(f"{engine} not installed")
    probe = run([engine, "version"], timeout=30)
    if probe.returncode != 0:
        raise NotMeasured(f"`{engine} version` fails: {brief(probe.stderr)}")
    image = ensure_image(engine, args.layer, work_dir)
    user = shlex.split(args.podman_args) if engine == "podman" else []
    extra, notes = engine_args(engine, image, user)
    version = run([engine, "--version"]).stdout.strip()
    return {"image": image, "extra": extra, "notes": notes, "version": version}


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--layer", type=Path, action="append", default=[], help="a layer directory")
    ap.add_argument(
        "--podman-args",
        default="",
        help='more `podman run` options, shlex-split: --podman-args="--pull never"',
    )
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--out", type=Path, help="also append the JSON as one line to this file")
    args = ap.parse_args()
    args.layer = [p.expanduser().resolve() for p in args.layer]
    work_dir = args.work_dir.expanduser().resolve()
    work_dir.mkdir(parents=True, exist_ok=True)

    cli = minisandbox_cli()
    variants = {"ours": [*cli, "exec", "--", "true"]}
    if args.layer:
        layer_opts = [x for p in args.layer for x in ("--layer", str(p))]
        variants["ours_layers"] = [*cli, "exec", *layer_opts, "--", "true"]
    result: dict[str, Any] = {"benchmark": "cli_start", "n": args.n}
    for engine in ("podman", "docker"):
        try:
            e = prepare_engine(engine, args, work_dir)
        except NotMeasured as why:
            log(f"{engine}: not measured: {why}")
            result[engine] = f"not measured: {why}"
            continue
        run_argv = [engine, "run", "--rm", *e["extra"]]
        variants[engine] = [*run_argv, e["image"], "true"]
        variants[f"{engine}_nonet"] = [*run_argv, "--network", "none", e["image"], "true"]
        result |= {f"{engine}_version": e["version"], f"{engine}_image": e["image"]}
        result |= {f"{engine}_extra_args": e["extra"], f"{engine}_notes": e["notes"]}
    variants["bwrap"] = bwrap_argv()
    for name, argv in variants.items():
        log(f"{name}: {shlex.join(argv)}")

    names = list(variants)
    samples: dict[str, list[int]] = {name: [] for name in names}
    for i in range(args.warmup + args.n):
        k = i % len(names)  # rotate, so that no variant always follows the same one
        for name in names[k:] + names[:k]:
            elapsed = timed(variants[name])
            if i >= args.warmup:
                samples[name].append(elapsed)
        if (i + 1) % 5 == 0:
            log(f"{i + 1}/{args.warmup + args.n} rounds")

    for name in names:
        result |= summarize_ms(name, samples[name])

    def ratio(a: str, b: str) -> None:
        if f"{a}_p50_ms" in result and f"{b}_p50_ms" in result:
            result[f"{a}_over_{b}"] = round(result[f"{a}_p50_ms"] / result[f"{b}_p50_ms"], 3)

    ours_names = ["ours", "ours_layers"] if args.layer else ["ours"]
    for ours in ours_names:
        for other in ("podman", "podman_nonet", "docker", "docker_nonet"):
            ratio(other, ours)
        ratio(ours, "bwrap")
    result["layers"] = [p.name for p in args.layer]  # layer ids: no host paths in results
    result["minisandbox_warm"] = os.environ.get("MINISANDBOX_WARM", "auto")
    result["target_speedup"] = TARGET_SPEEDUP
    speedups = [result.get(f"podman_over_{ours}", 0.0) for ours in ours_names]
    met = all(s >= TARGET_SPEEDUP for s in speedups)
    result["meets_target"] = met if "podman_p50_ms" in result else None  # (podman not measured)
    result["host"] = host_info()
    append_jsonl(args.out, result)
    return result


if __name__ == "__main__":
    run_main(main)
