"""A killed test run leaves nothing behind: the session's temp directory (every test's files,
pytest's tmp_path included) goes with its janitor once the run is gone, however it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

SLEEPER = """
import tempfile, time
def test_sleeps(tmp_path):
    (tmp_path / "mine").write_text("x")
    made = tempfile.mkdtemp(prefix="msb-mine-")
    print("MADE", tmp_path, made, flush=True)
    time.sleep(600)
"""


def test_a_killed_run_leaves_nothing_in_tmp(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(TESTS)}
    # Our conftest as a plugin, for a test file outside tests/.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-s",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "test_sleeper.py",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    line = b""
    while not line.startswith(b"MADE"):
        line = proc.stdout.readline()
        assert line, "the inner run ended before its test ran"
    _, made_tmp, made_dir = line.split()
    assert Path(made_tmp.decode()).is_relative_to(tmp) and Path(made_dir.decode()).exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 120
    while any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(tmp.iterdir()), sorted(str(p) for p in tmp.rglob("*"))[:20]
