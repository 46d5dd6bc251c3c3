"""Attacks across tenants (issue: nothing reaches the host or another tenant): a process in the
sandbox that answers the host's control requests itself, one that stops the control shell to
stretch a command past its timeout, another host user who rewrites a layer's file, an upload
that a node's agent would extract outside its target. Registered into attacks.ATTACKS, run as
root and as an unprivileged caller by test_attacks.py like every other attack."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import tarfile
import time
from pathlib import Path

from attacks import AttackContext, AttackSkipped, attack, py, scratch_subdir, sh
from minisandbox import Sandbox, SandboxConfig
from minisandbox.cluster.messages import Upload
from minisandbox.cluster.node import NodeAgent, _Open
from minisandbox.errors import CommandTimeoutError, SandboxFileError
from minisandbox.layers.errors import CacheOwnerError
from minisandbox.layers.nodecache import NodeCache
from minisandbox.layers.store import LayerStore

# Finds the control shell (the process reading the host's requests), opens its stdin (the
# host's requests) and its fd 9 (the replies the host trusts); when both open, it stops the
# shell, takes the host's next request and answers it: output and exit status of its choice.
_FORGER = r"""
import json, os, re, signal, stat, time
def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
shell = None
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if pid > 1 and b"IFS= read -r l" in f.read() and ppid(pid) == 1:
                shell = pid
                break
    except OSError:
        pass
report = {"shell": shell, "self_fd": False}
try:  # positive control: /proc/<pid>/fd of a process of ours opens
    os.close(os.open(f"/proc/{os.getpid()}/fd/1", os.O_WRONLY))
    report["self_fd"] = True
except OSError as e:
    report["self_fd"] = str(e)
# The host's request and reply pipes: held by the control shell, or by bwrap's pid 1.
ends = {"requests": [(shell, 0), (1, 0)], "replies": [(shell, 9), (1, 1)]}
found = {}
for kind, places in ends.items():
    for pid, n in places:
        name = f"{pid}/fd/{n}"
        try:
            fd = os.open(f"/proc/{name}", os.O_RDONLY if kind == "requests" else os.O_WRONLY)
        except OSError as e:
            report[name] = e.strerror
            continue
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            report[name] = "not a pipe"
            os.close(fd)
            continue
        report[name] = "opened"
        found.setdefault(kind, fd)
report["armed"] = len(found) == 2
with open("/tmp/forger.json", "w") as f:
    json.dump(report, f)
if report["armed"]:  # at the host's signal, so that its next request is the one it forges
    while not os.path.exists("/tmp/go"):
        time.sleep(0.01)
    os.kill(shell, signal.SIGSTOP)
    open("/tmp/stopped", "w").close()
    line = b""
    while not line.endswith(b"\n"):
        line += os.read(found["requests"], 1)
    job = re.search(rb'"P ([0-9a-f]+) ', line).group(1).decode()
    out = re.search(rb">'?(/run/minisandbox/[0-9a-f]+\.o)", line).group(1).decode()
    with open(out, "w") as f:
        f.write("FORGED OUTPUT\n")
    os.write(found["replies"], f"P {job} 1\nX {job} 0\n".encode())
    report["forged"] = job
    with open("/tmp/forger.json", "w") as f:
        json.dump(report, f)
    time.sleep(0.5)
    os.kill(shell, signal.SIGCONT)
"""


@attack
async def attack_answer_the_control_channel(ctx: AttackContext) -> None:
    """A process left in the sandbox opens the control shell's stdin and fd 9 through /proc,
    stops the shell, reads the host's next request and answers it: the host must get the real
    command's output and exit status (so the control shell must not be open to it)."""
    async with Sandbox(SandboxConfig()) as sb:
        start = (
            "import sys, subprocess; subprocess.Popen([sys.executable, '-c', P['code']], "
            "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL); print(json.dumps({}))"
        )
        await py(sb, start, code=_FORGER)
        report: dict = {}
        for _ in range(200):
            r = await sb.execute("cat /tmp/forger.json 2>/dev/null")
            if r.stdout.startswith("{"):
                report = json.loads(r.stdout)
                break
            await asyncio.sleep(0.05)
        assert report.get("shell"), f"the forger did not find the control shell: {report}"
        assert report["self_fd"] is True, f"/proc/self/fd does not open (control): {report}"
        if report["armed"]:  # the forger holds both pipes: let it stop the shell first
            wait = "touch /tmp/go; while [ ! -e /tmp/stopped ]; do sleep 0.01; done"
            await sb.execute(wait, timeout=30)
        r = await sb.execute("echo REAL; exit 7", timeout=30)
        later = (await sb.execute("cat /tmp/forger.json")).stdout
        assert (r.exit_code, r.stdout) == (7, "REAL\n"), (
            f"a process in the sandbox answered the host's request itself: exit {r.exit_code}, "
            f"stdout {r.stdout!r} for `echo REAL; exit 7` ({later})"
        )
        assert "opened" not in report.values(), (
            f"the control shell's request and reply pipes are open to the sandbox: {report}"
        )


@attack
async def attack_stop_the_control_shell(ctx: AttackContext) -> None:
    """A process in the sandbox stops the control shell (SIGSTOP), so no request is answered:
    a command must still fail with its own timeout, not several times it."""
    async with Sandbox(SandboxConfig()) as sb:
        r = await sh(sb, "echo alive")
        assert r.stdout == "alive\n", f"the sandbox does not run commands (control): {r}"
        stop = (
            "for p in $(grep -l 'read -r __msb_line' /proc/[0-9]*/cmdline | cut -d/ -f3); do "
            "[ $p != 1 ] && [ $(cut -d' ' -f4 /proc/$p/stat) = 1 ] && shell=$p; done; "
            "(sleep 0.5; kill -STOP $shell) >/dev/null 2>&1 & echo $shell"
        )
        r = await sh(sb, stop)
        assert r.stdout.strip().isdigit(), f"no control shell found: {r.output}"
        await asyncio.sleep(1.5)
        timeout = 3.0
        began = time.monotonic()
        try:
            r = await sb.execute("echo late", timeout=timeout)
        except CommandTimeoutError:
            pass
        else:
            raise AssertionError(f"the stopped shell answered (control): {r}")
        took = time.monotonic() - began
        # Without the bound it took timeout + 10 s (two 5 s waits for replies that never came).
        assert took < timeout + 4, f"a {timeout:g} s command failed after {took:.1f} s"


def _as_other_user(ctx: AttackContext, op: str, path: str | Path) -> dict:
    assert ctx.other_user_socket is not None
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(30)
        conn.connect(ctx.other_user_socket)
        conn.sendall((json.dumps({"op": op, "path": str(path)}) + "\n").encode())
        return json.loads(conn.makefile().readline())  # type: ignore[no-any-return]


def _pool_links(cache_root: Path, target: Path) -> list[Path]:
    """The paths in the cache's pool of `target`'s inode."""
    st = os.stat(target)
    found = []
    for dirpath, _dirs, files in os.walk(cache_root / "pool"):
        for name in files:
            other = os.stat(os.path.join(dirpath, name))
            if (other.st_ino, other.st_dev) == (st.st_ino, st.st_dev):
                found.append(Path(dirpath, name))
    return found


@attack
async def attack_other_user_rewrites_a_layer(ctx: AttackContext) -> None:
    """A hostile install step made a file of its layer mode 0666 and a directory 0777; another
    user of the host then appends to the unpacked file (through its layer, or its link in the
    node's pool) or adds a file: the caller's next sandbox would run what they wrote. No
    file or directory of the node cache may be writable by anyone but the caller."""
    if ctx.other_user_socket is None:
        raise AttackSkipped("needs a second host user: run the suite as root")
    base = scratch_subdir(ctx, "tenant-cache-")
    tree = base / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "data").mkdir()
    module = tree / "pkg" / "mod.py"
    module.write_text("ANSWER = 1\n")
    os.chmod(module, 0o666)
    os.chmod(tree / "data", 0o777)
    store = LayerStore(base / "store")
    layer = store.publish(tree).id
    modes = {e.path: e.mode & 0o7777 for e in store.read_manifest(layer).entries}
    assert modes.get("pkg/mod.py") == 0o666, f"the layer lost the mode 0666 (control): {modes}"
    cache = NodeCache(base / "cache", store, max_bytes=1 << 30)
    async with cache.use([layer]) as (unpacked,):
        target = unpacked / "pkg" / "mod.py"
        pooled = _pool_links(base / "cache", target)
        assert pooled, f"{target} has no link in the node's pool (control)"
        # Positive control: the other user really writes where the modes let it.
        open_file = base / "open.txt"
        open_file.write_text("")
        os.chmod(open_file, 0o666)
        answer = _as_other_user(ctx, "append", open_file)
        assert answer["ok"], f"the other user cannot write a 0666 file (control): {answer}"
        tries = [("append", target), *(("append", p) for p in pooled)]
        tries += [("create", unpacked / "data" / "planted.py"), ("create", pooled[0].parent / "x")]
        for op, path in tries:
            answer = _as_other_user(ctx, op, path)
            assert not answer["ok"], (
                f"uid {ctx.other_user_uid}, another host user, could {op} {path} in the node "
                "cache of the caller"
            )
        async with Sandbox(SandboxConfig(layers=[unpacked])) as sb:
            r = await sb.execute("cat /pkg/mod.py; ls /data")
            assert r.stdout == "ANSWER = 1\n", f"the sandbox sees a changed layer: {r.output}"
    if os.geteuid() != 0:  # a cache that another user made, for us to use: refused
        theirs = Path(ctx.other_user_socket).parent / f"their-cache-{os.getpid()}"
        assert _as_other_user(ctx, "mkdir", theirs)["ok"], "the other user cannot mkdir"
        try:
            NodeCache(theirs, store, max_bytes=1 << 30)
        except CacheOwnerError as e:
            assert str(ctx.other_user_uid) in str(e), str(e)
        else:
            raise AssertionError(f"a node cache in {theirs}, another user's, was used")


def _tar(members: list[tuple[str, bytes, str, bytes]]) -> bytes:
    """A tar of (name, type, link name, content) members, in that order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, link, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, link, len(data)
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def _upload(members: list[tuple[str, bytes, str, bytes]]) -> Upload:
    """The request a driver sends for a directory `up` of `members`."""
    return Upload(name="up", data=_tar(members), target="/testbed/up", is_dir=True)


@attack
async def attack_node_upload_writes_outside(ctx: AttackContext) -> None:
    """What a node's agent is sent as an upload is extracted on the node first: a symlink
    member followed by a regular member of the same name, or a hard link through an archive
    symlink, would overwrite a file of the node (as the agent's user) outside the upload."""
    base = scratch_subdir(ctx, "node-upload-")
    victim = base / "victim.txt"
    victim.write_text("original\n")
    sym, reg, lnk = tarfile.SYMTYPE, tarfile.REGTYPE, tarfile.LNKTYPE
    hostile = {
        "symlink, then a file of its name": [
            ("up", tarfile.DIRTYPE, "", b""),
            ("up/x", sym, str(victim), b""),
            ("up/x", reg, "", b"overwritten\n"),
        ],
        "a hard link through a symlink": [
            ("up", tarfile.DIRTYPE, "", b""),
            ("up/l", sym, str(base), b""),
            ("up/h", lnk, "up/l/victim.txt", b""),
            ("up/h", reg, "", b"overwritten\n"),
        ],
    }
    agent = NodeAgent(str(base / "store"), "no-store", 1)
    async with Sandbox(SandboxConfig()) as sb:
        agent.opened[sb.id] = _Open(sb, contextlib.AsyncExitStack())
        for what, members in hostile.items():
            try:
                await agent.call(sb.id, _upload(members))
            except SandboxFileError:
                pass
            else:
                raise AssertionError(f"the node's agent accepted an upload with {what}")
            assert victim.read_text() == "original\n", (
                f"an upload with {what} overwrote {victim}, a file of the node"
            )
        # Positive control: what the driver makes (a file, a link, a hard link) arrives.
        plain = [
            ("up", tarfile.DIRTYPE, "", b""),
            ("up/f", reg, "", b"content\n"),
            ("up/s", sym, "f", b""),
            ("up/h", lnk, "up/f", b""),
        ]
        await agent.call(sb.id, _upload(plain))
        r = await sb.execute("cat /testbed/up/f /testbed/up/s /testbed/up/h")
        assert r.stdout == "content\n" * 3, f"a plain upload did not arrive: {r.output}"
        agent.opened.pop(sb.id)
