"""The system layer (host /etc entries, merged-/usr links, mount points): made once per node and
reused by every process while the host files it copies are unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from minisandbox.sandbox.rootfs import build_system_layer, system_layer_key

START_ONE = """
import asyncio, sys
from minisandbox import Sandbox

async def main():
    async with Sandbox() as sb:
        r = await sb.execute("cat /etc/os-release")
        sys.stdout.write(r.stdout)

asyncio.run(main())
"""


def test_the_key_follows_every_copied_entry_an_edit_in_place_included(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "ssl" / "certs").mkdir(parents=True)
    cert = etc / "ssl" / "certs" / "ca.pem"
    cert.write_text("AAAA")
    (etc / "os-release").write_text("ID=test\n")
    key = system_layer_key(None, str(etc))
    assert system_layer_key(None, str(etc)) == key
    assert system_layer_key((1000, 1000), str(etc)) != key  # the owner is part of it
    # Same size, same directory entries: only the file's times and content change.
    before = cert.stat().st_mtime_ns
    with open(cert, "r+") as f:
        f.write("BBBB")
    os.utime(cert, ns=(before + 10**9, before + 10**9))
    assert system_layer_key(None, str(etc)) != key
    key = system_layer_key(None, str(etc))
    (etc / "pip.conf").write_text("[global]\n")  # an entry appears
    assert system_layer_key(None, str(etc)) != key


def test_processes_of_a_node_share_one_system_layer(tmp_path: Path) -> None:
    root = tmp_path / "runtime"
    env = {**os.environ, "MINISANDBOX_RUNTIME": str(root)}

    def start() -> str:
        r = subprocess.run(
            [sys.executable, "-c", START_ONE], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    with open("/etc/os-release") as f:
        host = f.read()
    assert start() == host
    (layer,) = root.glob("node-system-*")
    made = layer.stat()
    assert start() == host
    assert [p.name for p in root.glob("node-system-*")] == [layer.name]
    again = layer.stat()
    assert (again.st_ino, again.st_mtime_ns) == (made.st_ino, made.st_mtime_ns)  # not remade
    assert not list(root.glob(".node-system-*"))  # no staging left


def test_a_process_uses_the_layer_another_made_and_rebuilds_a_removed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a new process: nothing memoised, and building is not allowed (it must find the
    layer made before); then, the layer removed, the next lookup makes it again."""
    from minisandbox.sandbox import startup

    root = tmp_path / "rt"
    root.mkdir(mode=0o700)
    made = startup.system_layer(root, None)
    startup.forget_system_layers()

    def no_build(path: Path, owner: object) -> Path:
        raise AssertionError(f"built again at {path}")

    monkeypatch.setattr(startup, "build_system_layer", no_build)
    assert startup.system_layer(root, None) == made
    monkeypatch.undo()
    startup.forget_system_layers()
    shutil.rmtree(made)
    assert startup.system_layer(root, None) == made and (made / "etc" / "passwd").is_file()
    startup.forget_system_layers()


def test_modes_do_not_follow_the_builder_s_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        layer = build_system_layer(tmp_path / "system-k", None)
    finally:
        os.umask(old)
    modes = {
        name: oct(os.lstat(layer / name).st_mode & 0o7777)
        for name in ("", "etc", "usr", "proc", "run/minisandbox", "etc/passwd", "etc/hosts")
    }
    assert modes == {
        "": "0o755", "etc": "0o755", "usr": "0o755", "proc": "0o755",
        "run/minisandbox": "0o755", "etc/passwd": "0o644", "etc/hosts": "0o644",
    }  # fmt: skip
    assert oct(os.lstat(layer / "tmp").st_mode & 0o7777) == "0o1777"


def test_builders_racing_for_one_layer_all_get_it_and_leave_no_staging(tmp_path: Path) -> None:
    path = tmp_path / "system-k"
    got: list[Path] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def build() -> None:
        start.wait()
        try:
            got.append(build_system_layer(path, None))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [path] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["system-k"]
    assert (path / "etc" / "passwd").read_text().startswith("root:x:0:0:")
