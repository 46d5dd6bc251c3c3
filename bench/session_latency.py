"""Round trip of `true` in a persistent shell session: ours vs SWE-ReX's LocalRuntime.

Both run in the same process and are interleaved (one of each per iteration, alternating which
goes first), so background load affects them alike. LocalRuntime has no isolation at all: it is
the floor a sandboxed session would ideally match.

About 100 ms of LocalRuntime's round trip is pexpect's `delaybeforesend` (50 ms before each of
the two lines it sends: the command, then `echo $?`). So the JSON also has LocalRuntime with that
delay switched off (`swerex_local_nodelay_*`), a stricter comparison of the mechanisms, and the
round trip of a one-shot `Sandbox.execute("true")` for context.

    python bench/session_latency.py [--n 200] [--warmup 20]

Needs swe-rex (the `bench` extra): `.venv/bin/uv pip install --python .venv/bin/python swe-rex`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Any

from _common import host_info, log, run_main, summarize_ms

from minisandbox import Sandbox, SandboxConfig

TARGET_P50_MS = 2.0
STARTUP_TIMEOUT_S = 30.0
MAX_RETRIES = 50


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="timed round trips each (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed round trips first")
    args = ap.parse_args()

    try:
        import pexpect
        from swerex.exceptions import CommandTimeoutError, NoExitCodeError
        from swerex.runtime.abstract import (
            BashAction,
            CloseBashSessionRequest,
            CreateBashSessionRequest,
        )
        from swerex.runtime.local import LocalRuntime
    except ImportError:
        raise SystemExit(
            "swe-rex is not installed: .venv/bin/uv pip install --python .venv/bin/python swe-rex"
        ) from None
    # SWE-ReX's own timeouts, which a busy machine trips: 1 s to start a session (a request
    # field, raised here), 1 s for the exit code and 0.1 s for the prompt after it (fixed). A
    # round trip that trips one is not a sample: its session is replaced and the trip redone.
    swerex_timeouts = (CommandTimeoutError, NoExitCodeError, pexpect.TIMEOUT)
    retries = {"swerex": 0, "swerex_nodelay": 0}

    sb = Sandbox(SandboxConfig())
    rex = LocalRuntime()

    async def open_session(name: str) -> None:
        for _ in range(MAX_RETRIES):
            if name in rex.sessions:  # a failed start leaves its session registered
                with contextlib.suppress(Exception):
                    await rex.close_session(CloseBashSessionRequest(session=name))
                rex.sessions.pop(name, None)
            try:
                await rex.create_session(
                    CreateBashSessionRequest(session=name, startup_timeout=STARTUP_TIMEOUT_S)
                )
            except swerex_timeouts as e:
                log(f"swerex session {name!r}: {type(e).__name__}: {e}; starting it again")
                continue
            if name == "nodelay":
                rex.sessions[name].shell.delaybeforesend = None  # type: ignore[attr-defined]
            return
        raise RuntimeError(f"swerex session {name!r} did not start in {MAX_RETRIES} tries")

    try:
        await sb.start()
        session = await sb.create_session("bench")
        # LocalRuntime's default session runs bash with the caller's environment; BashAction's
        # defaults (check="raise") fetch the exit code, as our session does.
        await open_session("default")
        action = BashAction(command="true")
        await open_session("nodelay")
        action_nodelay = BashAction(command="true", session="nodelay")

        async def ours() -> int:
            t0 = time.perf_counter_ns()
            r = await session.run("true")
            t1 = time.perf_counter_ns()
            if r.exit_code != 0:
                raise RuntimeError(f"session `true` exited {r.exit_code}: {r.output!r}")
            return t1 - t0

        async def swerex(act: Any = action, kind: str = "swerex") -> int:
            while True:
                t0 = time.perf_counter_ns()
                try:
                    obs = await rex.run_in_session(act)
                except swerex_timeouts as e:
                    retries[kind] += 1
                    if retries[kind] > MAX_RETRIES:
                        raise
                    log(f"{kind}: {type(e).__name__}: {e}; a new session, the trip again")
                    await open_session(act.session)
                    continue
                t1 = time.perf_counter_ns()
                if obs.exit_code != 0:
                    raise RuntimeError(f"swerex `true` exited {obs.exit_code}: {obs.output!r}")
                return t1 - t0

        async def swerex_nodelay() -> int:
            return await swerex(action_nodelay, "swerex_nodelay")

        async def execute() -> int:
            t0 = time.perf_counter_ns()
            r = await sb.execute("true")
            t1 = time.perf_counter_ns()
            if r.exit_code != 0:
                raise RuntimeError(f"execute `true` exited {r.exit_code}: {r.output}")
            return t1 - t0

        kinds = {
            "ours": ours,
            "swerex": swerex,
            "swerex_nodelay": swerex_nodelay,
            "execute": execute,
        }
        samples: dict[str, list[int]] = {k: [] for k in kinds}
        log(f"warm-up: {args.warmup} round trips each")
        for _ in range(args.warmup):
            for fn in kinds.values():
                await fn()
        gc.collect()
        log(f"timing {args.n} round trips each")
        names = list(kinds)
        for i in range(args.n):
            # Rotate the order: whichever runs first after a pause must not always be the same.
            k = i % len(names)
            for name in names[k:] + names[:k]:
                samples[name].append(await kinds[name]())
            if (i + 1) % 50 == 0:
                log(f"{i + 1}/{args.n}")
    finally:
        await rex.close()
        await sb.stop()

    result: dict[str, Any] = {"benchmark": "session_latency", "n": args.n}
    result |= summarize_ms("roundtrip", samples["ours"])
    result |= summarize_ms("swerex_local", samples["swerex"])
    result["ratio"] = round(result["roundtrip_p50_ms"] / result["swerex_local_p50_ms"], 3)
    result["ratio_p95"] = round(result["roundtrip_p95_ms"] / result["swerex_local_p95_ms"], 3)
    result |= summarize_ms("swerex_local_nodelay", samples["swerex_nodelay"])
    result["ratio_vs_nodelay"] = round(
        result["roundtrip_p50_ms"] / result["swerex_local_nodelay_p50_ms"], 3
    )
    result |= summarize_ms("execute", samples["execute"])
    result["swerex_retries"] = retries["swerex"]
    result["swerex_nodelay_retries"] = retries["swerex_nodelay"]
    result["target_roundtrip_p50_ms"] = TARGET_P50_MS
    result["meets_target"] = result["roundtrip_p50_ms"] <= TARGET_P50_MS and result["ratio"] <= 1.0
    result["host"] = host_info()
    return result


if __name__ == "__main__":
    run_main(main)
