"""The warm process (cli/warm.py): `minisandbox exec` run in a fork of a process that has the CLI
imported, exactly as it runs in the caller's own process: streams, working directory,
environment, exit status, signals; a caller that dies takes its command with it; another host
user cannot reach it."""

from __future__ import annotations

import marshal
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import CLI

OTHER_UID = 4243
WAIT = 120.0  # generous: only a hang reaches it


def _env(runtime: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "MINISANDBOX_RUNTIME": str(runtime),
        "MINISANDBOX_WARM": "require",
        **extra,
    }


def _socket(env: dict[str, str]) -> Path:
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from minisandbox.cli.warm import socket_path; print(socket_path())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(r.stdout.strip())


def _wait_for(what: str, done: object) -> None:
    deadline = time.monotonic() + WAIT
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {WAIT} s"
        time.sleep(0.05)


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A warm process of this caller, in a runtime directory of the test's own."""
    runtime = tmp_path / "rt"
    env = _env(runtime)
    path = _socket(env)
    server = subprocess.Popen(
        [sys.executable, "-c", f"from minisandbox.cli.warmserver import serve; serve('{path}')"],
        env=env,
        cwd="/",
        start_new_session=True,
    )
    try:
        _wait_for("the warm process listens", lambda: path.exists() or server.poll() is not None)
        assert server.poll() is None, f"the warm process ended ({server.returncode})"
        yield env, path
    finally:
        server.kill()
        server.wait()


def _cli(env: dict[str, str], *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, capture_output=True, text=True, timeout=WAIT, check=False, **kw
    )  # type: ignore[call-overload, no-any-return]


def test_exec_runs_in_the_warm_process_as_in_its_own(
    warm: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, _path = warm
    layer = tmp_path / "layer"
    (layer / "data").mkdir(parents=True)
    (layer / "data" / "hello").write_text("from the layer\n")
    # The caller's working directory (a relative --layer), environment and stdin; its exit
    # status and both streams.
    script = "cat /data/hello; cat; echo err >&2; exit 7"
    r = _cli(
        {**env, "MSB_WARM_VAR": "x"},
        "exec",
        "--layer",
        "layer",
        "--",
        "sh",
        "-c",
        script,
        cwd=tmp_path,
        input="piped in\n",
    )
    assert (r.returncode, r.stdout, r.stderr) == (7, "from the layer\npiped in\n", "err\n")
    here = _cli({**env, "MINISANDBOX_WARM": "0"}, "exec", "--layer", "layer", "--", "sh", "-c",
                script, cwd=tmp_path, input="piped in\n")  # fmt: skip
    assert (here.returncode, here.stdout, here.stderr) == (r.returncode, r.stdout, r.stderr)
    # An error of the CLI's own: one line, exit 2, as in the caller's process.
    bad = _cli(env, "exec", "--layer", "missing", "--", "true", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("minisandbox: --layer missing"), bad


def test_without_a_warm_process_require_fails_and_auto_starts_one(tmp_path: Path) -> None:
    env = _env(tmp_path / "rt")
    path = _socket(env)
    r = _cli(env, "exec", "--", "true")
    assert r.returncode == 2 and f"no usable warm process at {path}" in r.stderr, r
    auto = {**env, "MINISANDBOX_WARM": "1"}
    assert _cli(auto, "exec", "--", "true").returncode == 0  # here, and one is started
    try:
        _wait_for("the started warm process listens", path.exists)
        assert _cli(env, "exec", "--", "sh", "-c", "exit 4").returncode == 4
    finally:
        _stop_warm(path)


def _stop_warm(path: Path) -> None:
    """Kill the warm process that holds `path`'s lock (found by its command line)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(path).encode() in cmdline and b"serve" in cmdline:
                os.kill(int(pid), signal.SIGKILL)


def _sandboxes_of(runtime: Path) -> list[str]:
    """The runtime directories of live CLI processes under `runtime` (p<pid>-...)."""
    return [p.name for p in runtime.glob("p*-*") if p.is_dir()]


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_the_caller_s_ctrl_c_and_death_reach_its_command(
    warm: tuple[dict[str, str], Path], how: str
) -> None:
    env, path = warm
    runtime = path.parent
    client = subprocess.Popen(
        [*CLI, "exec", "--", "sh", "-c", "echo started; exec sleep 600"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    assert client.stdout.readline() == "started\n"
    assert _sandboxes_of(runtime), "the worker's sandbox directory (control)"
    client.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
    code = client.wait(timeout=WAIT)
    if how == "sigint":
        assert code == 130, client.stderr.read() if client.stderr else ""
    # Either way the worker stops its sandbox and ends (or its janitor removes what is left).
    _wait_for("the command's sandbox is gone", lambda: not _sandboxes_of(runtime))


def _request(argv: list[str]) -> bytes:
    return marshal.dumps(
        {
            "argv": argv,
            "cwd": "/",
            "env": {"PATH": "/usr/bin:/bin"},
            "umask": 0o022,
            "streams": [None, None, None],
            "fds": [],
        }
    )


_OTHER_CLIENT = """
import marshal, os, socket, struct, sys
path, marker = sys.argv[1], sys.argv[2]
os.chdir(os.path.dirname(path))  # (a short address: pytest's paths pass AF_UNIX's limit)
req = marshal.dumps({"argv": ["minisandbox", "exec", "--", "true"], "cwd": "/",
    "env": {"PATH": "/usr/bin:/bin"}, "umask": 18, "streams": [None, None, None], "fds": []})
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(os.path.basename(path))
except OSError as e:
    print("refused", e.errno)
    sys.exit(0)
try:
    s.sendall(struct.pack("!II", len(req), 0) + req)
    print("answer", repr(s.recv(100)))
except OSError as e:  # the warm process hung up at once
    print("closed", e.errno)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second host user: run as root")
def test_another_host_user_cannot_reach_the_warm_process(
    warm: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """uid 4243 connects to the caller's warm process: with the runtime directory traversable
    (a private_root may be 0755), the socket is the caller's alone (0600); with the socket
    opened to everyone, the warm process still runs nothing for another uid (its peer
    credentials are checked). Positive control: the same request from the caller runs."""
    _, path = warm
    os.chmod(path.parent, 0o755)
    for parent in path.parents:
        if parent == Path("/"):
            break
        if not os.stat(parent).st_mode & 0o001:
            os.chmod(parent, os.stat(parent).st_mode | 0o001)
    script = tmp_path / "other_client.py"
    script.write_text(_OTHER_CLIENT)
    os.chmod(tmp_path, 0o755)

    def as_other() -> str:
        r = subprocess.run(
            ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
             "/usr/bin/python3", str(script), str(path), "x"],
            capture_output=True, text=True, timeout=WAIT, cwd="/", env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert as_other().startswith("refused 13")  # EACCES: the socket is 0600
    os.chmod(path, 0o666)
    answer = as_other()
    assert answer in ("answer b''", "closed 32", "closed 104"), (
        f"uid {OTHER_UID} was served by the caller's warm process: {answer}"
    )
    # Positive control: the caller's own request over the same socket runs and answers.
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(f"/proc/self/fd/{os.open(path.parent, os.O_PATH)}/{path.name}")
        req = _request(["minisandbox", "exec", "--", "true"])
        s.sendall(struct.pack("!II", len(req), 0) + req)
        got = b""
        while b"X " not in got:
            chunk = s.recv(100)
            assert chunk, f"no status for the caller's own request: {got!r}"
            got += chunk
    assert got.startswith(b"A\nX 0"), got
