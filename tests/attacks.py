"""Attacks on minisandbox, each performed from inside real sandboxes (real bwrap, no mocks).

Every `attack_<name>(ctx)` builds its own sandbox(es), tries to reach the host or another
sandbox, and asserts that it failed, with a message that says what leaked. Each attack also
checks a positive control in the same sandbox, so that "the command did not run" is never
mistaken for "the attack was blocked".

The attacks run in the test process or in a subprocess under another uid (attack_harness.py),
so this module needs only the standard library, pydantic and minisandbox, and everything the
test prepares on the host travels in a JSON-serialisable AttackContext.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shlex
import signal
import socket
import stat
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import BaseModel

from minisandbox import Limits, Sandbox, SandboxConfig
from minisandbox.errors import (
    MiniSandboxError,
    SandboxFileError,
    SandboxLimitError,
    SandboxNotRunningError,
)
from minisandbox.sandbox.bwrap import find_bwrap
from minisandbox.sandbox.sandbox import ExecResult
from minisandbox.utils.safefs import discard_tree

MiB = 1024**2


class AttackContext(BaseModel):
    """Host-side facts the test prepared for one caller."""

    caller: str
    repo: str  # the project checkout: its pyproject.toml stands for any host file
    pyproject_token: str = 'name = "swe-minisandbox"'
    home_secret: str  # a file in the caller's HOME holding home_token
    home_token: str
    root_secret: str | None  # a file in host /root holding root_token (when we could make one)
    root_token: str
    scratch_dir: str  # the caller may create things here
    scratch_file: str  # owned by the sandbox's host uid, mode 666: only isolation protects it
    scratch_content: str
    env_secret_name: str  # set in the caller's environment: no sandbox process may see it
    env_secret_value: str
    host_pid: int  # a host process running as the sandbox's own host uid
    host_pid_marker: str  # in its argv
    host_pid_secret: str  # in its environment
    tcp_port: int  # a TCP server on the host's 127.0.0.1 that greets with server_banner
    abstract_socket: str  # a host abstract unix socket (name without the leading NUL), same
    server_banner: str
    # A unix socket served by a process of another host user (root runs only): send one JSON
    # line {"op": "append" | "create" | "mkdir", "path": ...}, get {"ok": bool, "error": str}.
    other_user_socket: str | None = None
    other_user_uid: int | None = None

    @property
    def pyproject(self) -> str:
        return os.path.join(self.repo, "pyproject.toml")

    def host_secrets(self) -> dict[str, str]:
        """Host path -> a string that appears only in that file."""
        found = {self.home_secret: self.home_token, self.pyproject: self.pyproject_token}
        if self.root_secret:
            found[self.root_secret] = self.root_token
        return found

    def all_tokens(self) -> list[str]:
        return [
            *self.host_secrets().values(),
            self.env_secret_value,
            self.host_pid_secret,
            self.scratch_content,
        ]


class AttackSkipped(Exception):
    """The attack cannot be tried on this machine (e.g. no setuid binary exists)."""


Attack = Callable[[AttackContext], Awaitable[None]]
ATTACKS: dict[str, Attack] = {}


def attack(fn: Attack) -> Attack:
    ATTACKS[fn.__name__.removeprefix("attack_")] = fn
    return fn


# ------------------------------------------------------------------------------------- helpers


def sandbox_host_uid() -> int:
    """The host uid the sandbox's processes (and its upper layer's files) get."""
    return SandboxConfig().root_mapped_uid if os.geteuid() == 0 else os.geteuid()


async def sh(sb: Sandbox, script: str, timeout: float = 30) -> ExecResult:
    """Run a bash script of any length. (Scripts travel on stdin: a command line with a newline
    is refused by Sandbox.execute, see test_execute_runs_multiline_command.)"""
    return await sb.execute(["/bin/bash", "-c", 'eval "$(cat)"'], stdin=script, timeout=timeout)


async def py(sb: Sandbox, script: str, timeout: float = 30, **params: object) -> dict:
    """Run a Python probe inside; it sees `params` as P and prints one JSON line last."""
    code = f"import json\nP = json.loads({json.dumps(json.dumps(params))})\n"
    code += textwrap.dedent(script)
    r = await sb.execute(
        ["/usr/bin/python3", "-c", "import sys; exec(sys.stdin.read())"],
        stdin=code,
        timeout=timeout,
    )
    lines = r.stdout.strip().splitlines()
    assert r.exit_code == 0 and lines and lines[-1].startswith("{"), (
        f"probe did not run (positive control): exit {r.exit_code}: {r.output[-2000:]}"
    )
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def assert_no_tokens(ctx: AttackContext, text: str | bytes, what: str) -> None:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    for token in ctx.all_tokens():
        assert token not in text, f"{what} leaked the host secret {token!r}: {text[-1000:]!r}"


def read_host(path: str) -> str:
    with open(path) as f:
        return f.read()


def scratch_subdir(ctx: AttackContext, prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=ctx.scratch_dir))
    os.chmod(path, 0o755)  # a root caller's sandbox uid must traverse it
    return path


def make_layer(ctx: AttackContext, files: dict[str, str]) -> Path:
    """A lower layer; owned by the sandbox's host uid so that only the overlay protects it."""
    layer = scratch_subdir(ctx, "layer-")
    for rel, content in files.items():
        path = layer / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    if os.geteuid() == 0:
        uid = sandbox_host_uid()
        for dirpath, dirnames, filenames in os.walk(layer):
            for name in [*dirnames, *filenames]:
                os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
        os.chown(layer, uid, uid)
    return layer


def host_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def host_pids_with_arg(arg: str) -> list[int]:
    """Host processes with `arg` as one of their argv words (zombies have none)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and arg in host_cmdline(int(p))]


def host_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def marker() -> str:
    """A unique argv word that `sleep` accepts: sleep 31337.<random>."""
    return f"31337.{secrets.randbelow(10**9):09d}"


def assert_gone_from_host(sb: Sandbox, pid1_start: str | None, markers: list[str]) -> None:
    """After stop(): no process, mount or runtime directory of `sb` is left on the host."""
    for m in markers:
        assert not host_pids_with_arg(m), f"sandbox process `sleep {m}` survived stop()"
    assert sb.pid is not None
    # A zombie is gone enough: the host's init reaps it when it gets to it.
    alive = start_time(sb.pid) == pid1_start and host_state(sb.pid) not in ("Z", "X")
    assert not alive, f"the sandbox's pid 1 (host pid {sb.pid}) survived stop()"
    assert sb._dir is not None
    assert not sb._dir.exists(), f"runtime dir {sb._dir} was not removed"
    with open("/proc/self/mountinfo") as f:
        assert str(sb._dir) not in f.read(), f"a mount of {sb._dir} is left on the host"


PTRACE_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def ptrace(request, pid):
    ctypes.set_errno(0)
    return libc.ptrace(request, pid, None, None), ctypes.get_errno()
out = {"control_getpid": libc.getpid() == os.getpid()}
for pid in P["pids"]:
    for name, request in (("attach", 16), ("seize", 0x4206)):
        out[f"{name}:{pid}"] = ptrace(request, pid)
print(json.dumps(out))
"""


def assert_ptrace_refused(result: dict, pids: list[int], what: str) -> None:
    assert result["control_getpid"], "ctypes calls into libc do not work (positive control)"
    for pid in pids:
        for name in ("attach", "seize"):
            ret, err = result[f"{name}:{pid}"]
            assert (ret, err) == (-1, errno.EPERM), (
                f"PTRACE_{name.upper()} of {what} (pid {pid}) gave {ret}, errno {err}, not EPERM"
            )


# ----------------------------------------------------------------------- host files: reading


def _read_paths(ctx: AttackContext) -> list[str]:
    """Ways to name each host secret from inside: as is, with `..`, through /proc roots."""
    paths = []
    for host in ctx.host_secrets():
        rel = host.lstrip("/")
        paths += [
            host,
            "../" * 8 + rel,
            "/testbed/../../../" + rel,
            "/proc/1/root/" + rel,
            "/proc/self/root/../../" + rel,
            "/proc/1/cwd/../../" + rel,
        ]
    return paths


@attack
async def attack_read_host_files_from_shell(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        control = await sh(sb, "echo control > /tmp/c && cat /tmp/c")
        assert control.stdout == "control\n", f"cat does not work inside: {control}"
        for path in _read_paths(ctx):
            r = await sb.execute(["cat", "--", path])
            assert_no_tokens(ctx, r.output, f"`cat {path}` inside")
            assert r.exit_code != 0, f"`cat {path}` succeeded inside: {r.stdout[:200]!r}"
        # Nothing of the host's files anywhere in the sandbox's own places either.
        patterns = ["-e", ctx.home_token, "-e", ctx.root_token, "-e", ctx.scratch_content]
        places = ["/root", "/testbed", "/tmp", "/etc", "/run", "/home", "/var"]
        hits = await sb.execute(["grep", "-rlF", *patterns, *places])
        assert not hits.stdout.strip(), f"host secrets found inside: {hits.stdout}"


@attack
async def attack_read_host_files_through_read_file(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        await sb.write_file("/tmp/control.txt", "control\n")
        assert await sb.read_file("/tmp/control.txt") == b"control\n", "read_file does not work"
        r = await sb.execute(["ln", "-s", "/tmp/control.txt", "/testbed/inside-link"])
        assert r.exit_code == 0, r.output
        assert await sb.read_file("inside-link") == b"control\n", "symlinks inside do not work"
        paths = _read_paths(ctx)
        for i, host in enumerate(ctx.host_secrets()):
            # A symlink made inside that points at the host path.
            r = await sb.execute(["ln", "-s", host, f"/testbed/link{i}"])
            assert r.exit_code == 0, r.output
            paths += [f"/testbed/link{i}", f"link{i}"]
        for path in paths:
            try:
                data = await sb.read_file(path)
            except MiniSandboxError as e:
                assert_no_tokens(ctx, str(e), f"the error of read_file({path!r})")
            else:
                assert_no_tokens(ctx, data, f"read_file({path!r})")
                raise AssertionError(f"read_file({path!r}) returned {data[:200]!r}")


@attack
async def attack_escape_ro_path_with_dotdot(ctx: AttackContext) -> None:
    """A host directory bound read-only: neither writable, nor a way out with `..`."""
    # Not under /tmp, where a root caller cannot read ro_paths at all (see
    # test_ro_path_under_tmp_is_readable): that would hide the attack behind another bug.
    outside_tmp = "/var/tmp" if os.access("/var/tmp", os.W_OK) else ctx.scratch_dir
    base = Path(tempfile.mkdtemp(prefix="msb-attack-ro-", dir=outside_tmp))
    try:
        os.chmod(base, 0o755)
        ro = base / "ro"
        ro.mkdir(mode=0o755)
        (ro / "inside.txt").write_text("visible\n")
        token = secrets.token_hex(8)
        (base / "sibling.txt").write_text(token)
        os.chmod(base / "sibling.txt", 0o644)
        async with Sandbox(SandboxConfig(ro_paths=[ro])) as sb:
            r = await sb.execute(["cat", f"{ro}/inside.txt"])
            assert r.stdout == "visible\n", f"the ro path is not visible (positive control): {r}"
            for path in (f"{ro}/../sibling.txt", f"{ro}/../../{base}/sibling.txt"):
                r = await sb.execute(["cat", "--", path])
                assert token not in r.stdout, f"`cat {path}` read a host file next to the ro path"
            q = shlex.quote(str(ro))
            r = await sh(sb, f"echo pwned > {q}/inside.txt || echo pwned > {q}/new.txt")
            assert r.exit_code != 0, "writing into a read-only bound host dir succeeded"
        assert read_host(str(ro / "inside.txt")) == "visible\n", "the ro bound host file changed"
        assert not (ro / "new.txt").exists(), "a file appeared in the ro bound host dir"
    finally:
        discard_tree(base)


# ----------------------------------------------------------------------- host files: writing


@attack
async def attack_write_outside_upper(ctx: AttackContext) -> None:
    layer = make_layer(ctx, {"testbed/data.txt": "original\n", "testbed/gone.txt": "keep\n"})
    usr_probe = f"/usr/bin/minisandbox-pwned-{secrets.token_hex(4)}"
    async with Sandbox(SandboxConfig(layers=[layer])) as sb:
        # The host scratch file and home secret, by their host paths: the writes land inside.
        for target in (ctx.scratch_file, ctx.home_secret):
            q = shlex.quote(target)
            r = await sh(sb, f'mkdir -p "$(dirname {q})" && echo pwned > {q}')
            assert r.exit_code == 0, f"could not even write {target} inside: {r.output}"
            assert (await sb.read_file(target)) == b"pwned\n"
        # A file of the lower layer: changed inside, copied up, the layer itself untouched.
        r = await sh(sb, "echo modified > /testbed/data.txt && rm /testbed/gone.txt")
        assert r.exit_code == 0, f"could not modify the lower file inside: {r.output}"
        assert (await sb.read_file("/testbed/data.txt")) == b"modified\n"
        assert sb.upper_dir is not None
        assert (sb.upper_dir / "testbed/data.txt").read_text() == "modified\n", (
            "the change to a lower file is not in the upper layer"
        )
        # The read-only host /usr.
        r = await sh(sb, f"touch {usr_probe} || echo pwned >> /usr/lib/os-release")
        assert r.exit_code != 0, f"writing into /usr succeeded: {r.output}"
    assert read_host(ctx.scratch_file) == ctx.scratch_content, "the host scratch file changed"
    assert read_host(ctx.home_secret) == ctx.home_token, "the host home secret changed"
    assert (layer / "testbed/data.txt").read_text() == "original\n", "the lower layer changed"
    assert (layer / "testbed/gone.txt").exists(), "a file of the lower layer was deleted"
    assert not os.path.lexists(usr_probe), f"{usr_probe} appeared on the host"


@attack
async def attack_write_file_through_symlink_and_dotdot(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        await sb.execute(["ln", "-s", ctx.scratch_file, "/testbed/wlink"])
        await sb.execute(["ln", "-s", ctx.home_secret, "/testbed/hlink"])
        targets = [
            "/testbed/wlink",
            "wlink",
            "hlink",
            "../" * 8 + ctx.scratch_file.lstrip("/"),
            "/testbed/../../.." + ctx.home_secret,
            ctx.scratch_file,
        ]
        for target in targets:
            # Through a symlink the write may fail (its target's directory does not exist
            # inside): blocked as well. Either way the host file must not change.
            with contextlib.suppress(SandboxFileError):
                await sb.write_file(target, "pwned\n")
        # Positive control: the plain writes happened, inside.
        assert (await sb.read_file(ctx.scratch_file)) == b"pwned\n"
        assert (await sb.read_file(ctx.home_secret)) == b"pwned\n"
    assert read_host(ctx.scratch_file) == ctx.scratch_content, "the host scratch file changed"
    assert read_host(ctx.home_secret) == ctx.home_token, "the host home secret changed"


@attack
async def attack_upload_symlink_to_host_secret(ctx: AttackContext) -> None:
    src = scratch_subdir(ctx, "upload-")
    (src / "ok.txt").write_text("ok\n")
    secrets_ = list(ctx.host_secrets())
    for i, host in enumerate(secrets_):
        os.symlink(host, src / f"leak{i}")
    async with Sandbox(SandboxConfig()) as sb:
        await sb.upload(src, "/testbed/up")
        await sb.upload(src / "leak0", "/testbed/single-leak")
        assert (await sb.read_file("/testbed/up/ok.txt")) == b"ok\n", "upload did not work"
        r = await sb.execute(["readlink", "/testbed/up/leak0"])
        assert r.stdout.strip() == secrets_[0], f"the symlink was not copied as is: {r.output}"
        for path in [f"/testbed/up/leak{i}" for i in range(len(secrets_))] + ["single-leak"]:
            r = await sb.execute(["cat", "--", path])
            assert_no_tokens(ctx, r.output, f"`cat {path}` of an uploaded symlink")
            with contextlib.suppress(MiniSandboxError):
                assert_no_tokens(ctx, await sb.read_file(path), f"read_file({path})")


@attack
async def attack_plant_symlinks_in_channel_dir(ctx: AttackContext) -> None:
    """The host creates FIFOs and files in /run/minisandbox: a process inside that swaps
    symlinks (to host files) in for them, as fast as it can, must get nowhere. The directory is
    read-only inside, so every swap fails and every request keeps working. (Names are random
    per request, and the directory cannot be listed inside: the swapper learns them from the
    descriptors of running commands, as fast as it can.)"""
    created = Path(ctx.scratch_dir) / f"created-by-sandbox-{secrets.token_hex(4)}"
    src = scratch_subdir(ctx, "upload-")
    (src / "f.txt").write_text("f\n")
    async with Sandbox(SandboxConfig()) as sb:
        # Counts the channel files it saw (/tmp/seen) and those it replaced (/tmp/swapped).
        swapper = """
            cd /run/minisandbox || exit 1
            seen=0 swapped=0
            while :; do
                # The directory cannot be listed: names come from what commands hold open.
                for name in * $(readlink /proc/[0-9]*/fd/* 2>/dev/null | sed -n \
                        's,^/run/minisandbox/,,p' | sort -u); do
                    [ -e "$name" ] && [ ! -L "$name" ] || continue
                    seen=$((seen + 1))
                    target=$([ $((seen % 2)) = 0 ] && echo "$T1" || echo "$T2")
                    if ln -sf "$target" "$name" 2>/dev/null; then
                        swapped=$((swapped + 1))
                    fi
                    # Whole files or none: a reader never sees one half written.
                    echo "$seen" > /tmp/seen.new && mv /tmp/seen.new /tmp/seen
                    echo "$swapped" > /tmp/swapped.new && mv /tmp/swapped.new /tmp/swapped
                done
            done
            """
        env = {"T1": ctx.scratch_file, "T2": str(created)}
        r = await sb.execute(
            [
                "/bin/bash",
                "-c",
                'setsid bash -c "$(cat)" </dev/null >/dev/null 2>&1 & echo started',
            ],
            stdin=swapper,
            env=env,
        )
        assert r.stdout == "started\n", f"the swapper did not start: {r.output}"
        session = await sb.create_session()

        async def count(name: str) -> int:
            r = await sb.execute(f"cat /tmp/{name} 2>/dev/null || echo 0")
            return int(r.stdout)

        # At least 25 rounds, and on until the swapper has seen a channel file (a busy machine
        # may not schedule it for a while): progress decides, not time. Every request must
        # work throughout: the swapper cannot touch what they use.
        rounds = 0
        while rounds < 25 or not await count("seen"):
            rounds += 1
            r = await sb.execute("cat", stdin="pwned\n")
            assert r.stdout == "pwned\n", f"a command failed under the swapper: {r}"
            await sb.write_file("/testbed/x", "pwned\n")
            await sb.upload(src, "/testbed/up")
            assert (await session.run("echo pwned")).output == "pwned\n"
        swapped = await count("swapped")
        await sb.execute(["pkill", "-f", "swapped"])
        assert swapped == 0, f"the sandbox replaced {swapped} channel files"
        assert (await sb.read_file("/testbed/up/f.txt")) == b"f\n"
    assert read_host(ctx.scratch_file) == ctx.scratch_content, "the host scratch file changed"
    assert not os.path.lexists(created), f"the supervisor created {created} on the host"


# ------------------------------------------------------------------------- host processes


@attack
async def attack_see_signal_ptrace_host_process(ctx: AttackContext) -> None:
    hostpid = ctx.host_pid
    assert ctx.host_pid_marker in host_cmdline(hostpid), "the host secret process is not running"
    async with Sandbox(SandboxConfig()) as sb:
        r = await sh(sb, "ls /proc; echo ---; ps -eo pid=,args=")
        pids, ps = r.stdout.split("---")
        assert "ps -eo" in ps, f"ps does not work inside (positive control): {r.output}"
        assert str(hostpid) not in pids.split(), f"host pid {hostpid} is visible in /proc inside"
        assert ctx.host_pid_marker not in ps, f"ps inside shows the host process: {ps}"
        assert len(ps.strip().splitlines()) < 10, f"ps inside lists more than the sandbox: {ps}"
        for cmd in (f"kill -9 {hostpid}", f"kill -0 {hostpid}", f"cat /proc/{hostpid}/environ"):
            r = await sh(sb, cmd)
            assert r.exit_code != 0, f"`{cmd}` inside succeeded"
            assert_no_tokens(ctx, r.output, f"`{cmd}` inside")
        # A sibling in the sandbox, same uid: only the seccomp filter stops ptrace there.
        r = await sh(sb, "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $!")
        sibling = int(r.stdout)
        result = await py(sb, PTRACE_PROBE, pids=[hostpid, sibling, 1])
        assert_ptrace_refused(result, [hostpid], "the host process")
        assert_ptrace_refused(result, [sibling], "a sandbox process")
    assert ctx.host_pid_marker in host_cmdline(hostpid), "the host process was killed"
    assert host_state(hostpid) != "T", "the host process was stopped"


ENVIRON_SCAN = """
import os
found, readable, errors = {}, [], {}
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().decode(errors="replace")
    except OSError as e:
        errors[pid] = e.errno
        continue
    readable.append(pid)
    found[pid] = [s for s in P["secrets"] if s in env]
print(json.dumps({"found": found, "readable": readable, "errors": errors, "me": os.getpid()}))
"""


@attack
async def attack_read_other_environ(ctx: AttackContext) -> None:
    """Nothing of the caller's environment (nor of the host secret process's) reaches any
    process of the sandbox, pid 1 (bwrap's reaper) included."""
    assert os.environ.get(ctx.env_secret_name) == ctx.env_secret_value, "the env secret is unset"
    secret_strings = [ctx.env_secret_value, ctx.host_pid_secret]
    async with Sandbox(SandboxConfig()) as sb:
        session = await sb.create_session()
        await session.run("sleep 300 &")
        await sh(sb, "setsid sleep 300 >/dev/null 2>&1 </dev/null &")
        result = await py(sb, ENVIRON_SCAN, secrets=secret_strings)
        assert len(result["readable"]) >= 3, f"the scan read almost nothing: {result}"
        leaks = {pid: s for pid, s in result["found"].items() if s}
        assert not leaks, f"secrets in /proc/<pid>/environ inside: {leaks}"
        r = await sh(sb, f"cat /proc/1/environ /proc/{ctx.host_pid}/environ; env; set")
        assert_no_tokens(ctx, r.output, "environ of pid 1, of the host pid, `env`, `set`")
        # From the host: every process of the sandbox's pid namespace.
        assert sb.pid is not None
        ns = os.readlink(f"/proc/{sb.pid}/ns/pid")
        checked = 0
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().decode(errors="replace")
            except OSError:
                continue
            checked += 1
            for s in secret_strings:
                assert s not in env, f"host pid {pid} of the sandbox has the secret: {env!r}"
        assert checked >= 3, "could read no sandbox process's environ from the host"


# -------------------------------------------------------------------------------- network

NET_PROBE = """
import socket
def attempt(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        return "ok:" + s.recv(200).decode(errors="replace")
    except OSError as e:
        return f"error:{e.errno}:{e}"
    finally:
        s.close()
out = {
    "tcp": attempt(socket.AF_INET, ("127.0.0.1", P["port"])),
    "abstract": attempt(socket.AF_UNIX, "\\0" + P["abstract"]),
}
# Control: sockets do work inside, to a listener of the sandbox's own.
own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen()
c = socket.create_connection(own.getsockname(), timeout=3)
out["own_listener"] = own.accept()[0] is not None
if P["dns"]:
    try:
        out["dns"] = str(socket.getaddrinfo("example.com", 443))
    except OSError as e:
        out["dns"] = f"error:{e}"
print(json.dumps(out))
"""


@attack
async def attack_network_off(ctx: AttackContext) -> None:
    params = {"port": ctx.tcp_port, "abstract": ctx.abstract_socket}
    async with Sandbox(SandboxConfig(network=False)) as sb:
        out = await py(sb, NET_PROBE, dns=True, **params)
        assert out["own_listener"], "sockets do not work inside at all (positive control)"
        assert out["tcp"].startswith("error:"), f"reached the host's TCP server: {out['tcp']}"
        assert out["abstract"].startswith("error:"), f"reached the host's abstract socket: {out}"
        assert out["dns"].startswith("error:"), f"DNS resolution worked: {out['dns']}"
        r = await sb.execute(["getent", "hosts", "example.com"], timeout=30)
        assert r.exit_code != 0 and not r.stdout.strip(), f"getent resolved a name: {r}"
    # Control: with the network on, the very same probe reaches both host servers.
    async with Sandbox(SandboxConfig(network=True)) as sb:
        out = await py(sb, NET_PROBE, dns=False, **params)
        assert out["tcp"] == "ok:" + ctx.server_banner, f"network=True cannot reach it: {out}"
        assert out["abstract"] == "ok:" + ctx.server_banner, f"network=True: {out}"


# ------------------------------------------------------------------------ terminal injection

TIOCSTI_IN_SESSION = """
import fcntl, json, os, struct, termios
out = {"isatty": os.isatty(0)}
out["winsize"] = list(struct.unpack("HHHH", fcntl.ioctl(0, termios.TIOCGWINSZ, b"\\0" * 8)))
errs = set()
for ch in "touch /tmp/injected\\n":
    try:
        fcntl.ioctl(0, termios.TIOCSTI, ch.encode())
        errs.add(0)
    except OSError as e:
        errs.add(e.errno)
out["tiocsti"] = sorted(errs)
print(json.dumps(out))
"""

TIOCSTI_ON_OWN_PTY = """
import fcntl, os, pty, termios
pid, fd = pty.fork()
if pid == 0:  # the pty is this child's controlling terminal
    try:
        fcntl.ioctl(0, termios.TIOCGWINSZ, b"\\0" * 8)
    except OSError:
        os._exit(200)
    try:
        fcntl.ioctl(0, termios.TIOCSTI, b"x")
        os._exit(0)
    except OSError as e:
        os._exit(e.errno)
_, status = os.waitpid(pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status)}))
"""


@attack
async def attack_tiocsti(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        await sb.write_file("/tmp/tiocsti.py", TIOCSTI_IN_SESSION)
        session = await sb.create_session()
        res = await session.run("python3 /tmp/tiocsti.py", timeout=30)
        out = json.loads(res.output.strip().splitlines()[-1])
        assert out["isatty"] and out["winsize"][0] > 0, f"no tty in the session: {out}"
        assert out["tiocsti"] == [errno.EPERM], f"TIOCSTI in a session: errnos {out['tiocsti']}"
        check = await session.run("test -e /tmp/injected; echo $?", timeout=10)
        assert check.output.strip().endswith("1"), "injected input ran in the session"
        out = await py(sb, TIOCSTI_ON_OWN_PTY)
        assert out["code"] != 200, "TIOCGWINSZ failed on the new pty (positive control)"
        assert out["code"] == errno.EPERM, f"TIOCSTI on a pty in execute: exit {out['code']}"


# ------------------------------------------------------------------------------ privileges


@attack
async def attack_setuid_binary(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        r = await sh(sb, "find /usr/bin /usr/sbin /usr/lib /usr/libexec -perm -4000 -type f")
        binaries = r.stdout.split()[:8]
        if not binaries:
            raise AttackSkipped("no setuid binary under /usr on this machine")
        status = (await sb.read_file("/proc/self/status")).decode()
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), "no_new_privs is not set"
        for cap in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
            assert re.search(rf"^{cap}:\s+0+$", status, re.M), f"{cap} is not empty: {status}"
        for binary in binaries:
            # The loader prints the auxiliary vector unless the exec is "secure" (setuid took).
            r = await sb.execute(
                ["timeout", "5", "env", "LD_SHOW_AUXV=1", binary, "--version"], merge_stderr=True
            )
            euid = re.search(r"^AT_EUID:\s+(\d+)", r.stdout, re.M)
            secure = re.search(r"^AT_SECURE:\s+(\d+)", r.stdout, re.M)
            assert euid and secure, f"{binary} ran as a secure (setuid) exec: {r.stdout[-500:]}"
            assert (euid[1], secure[1]) == ("0", "0"), f"{binary} got euid {euid[1]}"
        r = await sh(sb, "mkdir -p /tmp/m && /usr/bin/mount -t tmpfs none /tmp/m")
        assert r.exit_code != 0, "the setuid mount mounted a tmpfs"
        r = await sh(sb, "/usr/bin/su -c 'grep ^Cap /proc/self/status' root </dev/null")
        assert not re.search(r"^CapEff:\s+0*[1-9a-f]", r.stdout, re.M), f"su gained caps: {r}"


def _status_fields(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _host_descendants(pid: int) -> list[int]:
    """The host pids under `pid` (children of every thread, recursively)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                found += kids
                todo += kids
    return found


@attack
async def attack_keep_host_credentials(ctx: AttackContext) -> None:
    """What runs in the sandbox holds no part of the caller's credentials: every uid and gid
    is the sandbox's host uid and gid (a root caller's drop to its mapped uid did all of its
    steps), a root caller's supplementary groups (group 0) are gone, and no capability is
    left, not even in the bounding set that an exec as the namespace's root would draw on.
    A root caller starts it holding supplementary groups (root's 0, disk's 6), as a login
    would give it."""
    sb = Sandbox(SandboxConfig())
    held = os.getgroups()
    if sb.as_root:
        os.setgroups([0, 6])
    try:
        await sb.start()
    finally:
        if sb.as_root:
            os.setgroups(held)
    try:
        await check_credentials(sb)
    finally:
        await sb.stop()


async def check_credentials(sb: Sandbox) -> None:
    """The checks of attack_keep_host_credentials on a started sandbox."""
    r = await sb.execute(["cat", "/proc/self/status"])
    assert r.exit_code == 0, f"cat does not run (positive control): {r}"
    inside = _status_fields(r.stdout)
    assert inside["Uid"].split() == ["0"] * 4, f"not root inside: {inside['Uid']}"
    assert inside["Gid"].split() == ["0"] * 4, f"not group 0 inside: {inside['Gid']}"
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(inside[cap], 16) == 0, f"{cap} {inside[cap]} inside the sandbox"
    if sb.as_root:
        assert inside["Groups"] == "", f"supplementary groups inside: {inside['Groups']}"
    assert sb.pid is not None
    seen = 0
    for pid in _host_descendants(sb.pid):
        with open(f"/proc/{pid}/status") as f:
            host = _status_fields(f.read())
        if host["Name"] == "bwrap":  # its own pid 1 (the host's to trust)
            continue
        seen += 1
        assert host["Uid"].split() == [str(sb.sandbox_uid)] * 4, f"host uids {host['Uid']}"
        assert host["Gid"].split() == [str(sb.sandbox_gid)] * 4, f"host gids {host['Gid']}"
        assert int(host["CapBnd"], 16) == 0, f"bounding set {host['CapBnd']} on the host"
        assert host["NoNewPrivs"] == "1", f"no_new_privs not set on the host: {host}"
        if sb.as_root:
            assert host["Groups"] == "", f"host root's groups kept: {host['Groups']}"
    assert seen, "no process of the sandbox found from the host (positive control)"


UNSHARE_PROBE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(flags):
    ctypes.set_errno(0)
    return libc.unshare(flags), ctypes.get_errno()
out = {"control": call(0)}
for name, flag in (("user", 0x10000000), ("mount", 0x20000), ("net", 0x40000000),
                   ("pid", 0x20000000), ("uts", 0x04000000), ("cgroup", 0x02000000)):
    out[name] = call(flag)
print(json.dumps(out))
"""


@attack
async def attack_nested_namespaces(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        r = await sb.execute(["unshare", "--version"])
        assert r.exit_code == 0, "unshare does not run (positive control)"
        for cmd in (["unshare", "-U", "true"], ["unshare", "-Ur", "id"], ["unshare", "-m", "true"]):
            r = await sb.execute(cmd)
            assert r.exit_code != 0, f"`{' '.join(cmd)}` succeeded: {r.output}"
        out = await py(sb, UNSHARE_PROBE)
        assert out.pop("control") == [0, 0], "ctypes unshare(0) failed (positive control)"
        for name, (ret, err) in out.items():
            assert (ret, err) == (-1, errno.EPERM), f"unshare(CLONE_NEW{name.upper()}): {ret} {err}"


MOUNT_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("/tmp/m", exist_ok=True)
def mount(src, target, fstype, flags):
    ctypes.set_errno(0)
    fs = fstype.encode() if fstype else None
    return libc.mount(src.encode(), target.encode(), fs, flags, None), ctypes.get_errno()
print(json.dumps({
    "tmpfs": mount("none", "/tmp/m", "tmpfs", 0),
    "proc": mount("proc", "/tmp/m", "proc", 0),
    "bind": mount("/usr", "/tmp/m", None, 4096),          # MS_BIND
    "remount_usr_rw": mount("/usr", "/usr", None, 32 | 4096),  # MS_REMOUNT | MS_BIND
}))
"""


@attack
async def attack_mount(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig()) as sb:
        before = (await sb.read_file("/proc/self/mountinfo")).decode()
        assert " /usr " in before, "cannot read mountinfo (positive control)"
        for cmd in (
            "mount -t tmpfs none /tmp/m",
            "mount -t proc proc /tmp/m",
            "mount --bind /usr /tmp/m",
            "mount -o remount,rw /usr",
            "umount /proc",
        ):
            r = await sh(sb, f"mkdir -p /tmp/m && {cmd}")
            assert r.exit_code != 0, f"`{cmd}` succeeded"
        out = await py(sb, MOUNT_PROBE)
        for name, (ret, err) in out.items():
            assert (ret, err) == (-1, errno.EPERM), f"mount(2) {name}: {ret}, errno {err}"
        after = (await sb.read_file("/proc/self/mountinfo")).decode()
        assert sorted(after.splitlines()) == sorted(before.splitlines()), "the mounts changed"


EXE_PROBE = """
import os
out = {}
for path in ("/proc/self/exe", "/proc/1/exe", "/proc/2/exe", "/usr/bin/python3"):
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_TRUNC, and nothing is written: just opening
        os.close(fd)
        out[path] = "opened"
    except OSError as e:
        out[path] = e.errno
print(json.dumps(out))
"""


@attack
async def attack_write_proc_self_exe(ctx: AttackContext) -> None:
    binaries = [os.path.realpath("/usr/bin/python3"), str(find_bwrap())]
    before = {b: sha256(b) for b in binaries}
    async with Sandbox(SandboxConfig()) as sb:
        out = await py(sb, EXE_PROBE)
        for path, result in out.items():
            assert result != "opened", f"{path} (a host binary) could be opened for writing"
        r = await sh(sb, "cat /proc/self/exe > /dev/null && echo readable")
        assert "readable" in r.stdout, "cannot even read /proc/self/exe (positive control)"
    assert {b: sha256(b) for b in binaries} == before, "a host binary changed"


@attack
async def attack_write_kernel_settings(ctx: AttackContext) -> None:
    host_pattern = read_host("/proc/sys/kernel/core_pattern")
    host_name = socket.gethostname()
    async with Sandbox(SandboxConfig()) as sb:
        r = await sb.execute(["cat", "/proc/sys/kernel/core_pattern"])
        assert r.stdout == host_pattern, "cannot read core_pattern (positive control)"
        for path, value in (
            ("/proc/sys/kernel/core_pattern", "$(cat /proc/sys/kernel/core_pattern)"),
            ("/proc/sys/vm/drop_caches", "1"),
            ("/proc/sys/vm/overcommit_memory", "$(cat /proc/sys/vm/overcommit_memory)"),
            ("/proc/sys/kernel/modprobe", "$(cat /proc/sys/kernel/modprobe)"),
            ("/proc/sysrq-trigger", "h"),  # harmless (help to the log) if it got through
        ):
            if not os.path.exists(path):
                continue  # e.g. a kernel without magic sysrq
            r = await sh(sb, f'echo "{value}" > {path}')
            assert r.exit_code != 0, f"writing {path} from inside succeeded"
        # The UTS namespace is the sandbox's own: whatever happens, not the host's name.
        await sh(sb, "echo pwned > /proc/sys/kernel/hostname; hostname pwned")
    assert read_host("/proc/sys/kernel/core_pattern") == host_pattern, "core_pattern changed"
    assert socket.gethostname() == host_name, "the host's hostname changed"


# ---------------------------------------------------------------------------- supervisor


@attack
async def attack_stop_the_reaper(ctx: AttackContext) -> None:
    """Freeze pid 1 (bwrap's reaper) and everything else: stop() must still finish fast."""
    m = marker()
    sb = Sandbox(SandboxConfig())
    await sb.start()
    try:
        assert sb.pid is not None
        pid1_start = start_time(sb.pid)
        result = await py(sb, PTRACE_PROBE, pids=[1])
        assert_ptrace_refused(result, [1], "pid 1 (bwrap)")
        r = await sh(sb, "kill -STOP 1; grep ^State /proc/1/status")
        assert "T (stopped)" not in r.stdout, "pid 1 was stopped"
        r = await sh(sb, f"setsid sleep {m} >/dev/null 2>&1 </dev/null & echo started")
        assert r.stdout == "started\n"
        await sh(sb, "(sleep 0.3; kill -STOP -1) >/dev/null 2>&1 </dev/null &")
        await asyncio.sleep(1.0)
        victims = host_pids_with_arg(m)
        assert victims, "the marker process is not running (positive control)"
        assert host_state(victims[0]) == "T", "kill -STOP -1 did not stop it (positive control)"
        began = time.monotonic()
        await asyncio.wait_for(sb.stop(), 10)
        assert time.monotonic() - began < 5, "stop() took more than 5 s"
        assert_gone_from_host(sb, pid1_start, [m])
    finally:
        await sb.stop()


@attack
async def attack_sigterm_ignoring_double_fork(ctx: AttackContext) -> None:
    m = marker()
    sb = Sandbox(SandboxConfig())
    await sb.start()
    try:
        assert sb.pid is not None
        pid1_start = start_time(sb.pid)
        await py(
            sb,
            """
            import os, signal
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stays ignored across exec
                    fd = os.open("/dev/null", os.O_RDWR)
                    for i in (0, 1, 2):
                        os.dup2(fd, i)
                    os.execv("/bin/sleep", ["sleep", P["marker"]])
                os._exit(0)
            os.wait()
            print("{}")
            """,
            marker=m,
        )
        for _ in range(50):
            if host_pids_with_arg(m):
                break
            await asyncio.sleep(0.1)
        victims = host_pids_with_arg(m)
        assert victims, "the double-forked process is not running (positive control)"
        with open(f"/proc/{victims[0]}/status") as f:
            ignored = int(re.search(r"^SigIgn:\s+(\w+)$", f.read(), re.M)[1], 16)  # type: ignore[index]
        assert ignored & (1 << (signal.SIGTERM - 1)), "the marker process does not ignore SIGTERM"
        await asyncio.wait_for(sb.stop(), 10)
        assert_gone_from_host(sb, pid1_start, [m])
    finally:
        await sb.stop()


CONTROLLER = """
import asyncio, sys
from minisandbox import Sandbox
async def main():
    sb = Sandbox()
    await sb.start()
    cmd = f"setsid sleep {sys.argv[1]} >/dev/null 2>&1 </dev/null &"
    await sb.execute(["/bin/sh", "-c", cmd])
    print("READY", sb._dir, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@attack
async def attack_controller_sigkilled(ctx: AttackContext) -> None:
    """The process driving the sandbox dies by SIGKILL: its sandbox and files go too."""
    m = marker()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CONTROLLER, m, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
        assert line[:1] == ["READY"], f"the controller did not start a sandbox: {line}"
        runtime_dir = Path(line[1])
        for _ in range(50):
            if host_pids_with_arg(m):
                break
            await asyncio.sleep(0.1)
        assert host_pids_with_arg(m), "the marker process is not running (positive control)"
        assert runtime_dir.is_dir(), "the runtime dir does not exist (positive control)"
        proc.kill()
        await proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (host_pids_with_arg(m) or runtime_dir.exists()):
            await asyncio.sleep(0.1)
        assert not host_pids_with_arg(m), "a sandbox process outlived its SIGKILLed controller"
        assert not runtime_dir.exists(), f"{runtime_dir} outlived its SIGKILLed controller"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in host_pids_with_arg(m):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------- resources

FORK_PROBE = """
import os, time
kids, err = [], None
for _ in range(P["tries"]):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:  # hold the slot for a while, quietly
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        time.sleep(P["hold"])
        os._exit(0)
    kids.append(pid)
print(json.dumps({"forked": len(kids), "errno": err}))
"""


async def _host_can_spawn() -> None:
    proc = await asyncio.create_subprocess_exec("true")
    assert await asyncio.wait_for(proc.wait(), 10) == 0, "the host cannot spawn processes"


@attack
async def attack_fork_bomb(ctx: AttackContext) -> None:
    async with (
        Sandbox(SandboxConfig()) as neighbour,
        Sandbox(SandboxConfig(limits=Limits(processes=64))) as bomb,
    ):
        out = await py(bomb, FORK_PROBE, tries=1000, hold=20)
        assert out["errno"] == errno.EAGAIN, f"fork never failed: {out}"
        assert out["forked"] < 64, f"forked {out['forked']} processes past the limit of 64"
        await _host_can_spawn()
        r = await neighbour.execute("echo alive", timeout=10)
        assert r.stdout == "alive\n", "the neighbour sandbox stopped working"
        out = await py(neighbour, FORK_PROBE, tries=100, hold=0, timeout=20)
        assert out["forked"] == 100, f"the bomb used up the neighbour's processes: {out}"
        # A real, endless fork bomb, for a couple of seconds.
        await bomb.stop()
        async with Sandbox(SandboxConfig(limits=Limits(processes=64))) as bomb2:
            assert bomb2.pid is not None
            pid1_start = start_time(bomb2.pid)
            await sh(bomb2, "b() { b | b & }; b", timeout=10)
            await asyncio.sleep(2)
            await _host_can_spawn()
            r = await neighbour.execute("echo alive", timeout=10)
            assert r.stdout == "alive\n", "the neighbour sandbox stopped working"
            began = time.monotonic()
            await asyncio.wait_for(bomb2.stop(), 10)
            assert time.monotonic() - began < 5, "stopping a fork bomb took more than 5 s"
            assert_gone_from_host(bomb2, pid1_start, [])


@attack
async def attack_memory_hog(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig(limits=Limits(memory_bytes=512 * MiB))) as sb:
        out = await py(
            sb,
            """
            small = bytearray(64 << 20)  # positive control
            try:
                big = bytearray(2 << 30)
                result = f"allocated {len(big)}"
            except MemoryError:
                result = "MemoryError"
            print(json.dumps({"small": len(small), "big": result}))
            """,
        )
        assert out["small"] == 64 << 20, "could not allocate 64 MiB (positive control)"
        assert out["big"] == "MemoryError", "allocated 2 GiB under a 512 MiB limit"
        r = await sb.execute("echo alive")
        assert r.stdout == "alive\n", "the sandbox died"
    await _host_can_spawn()


@attack
async def attack_tmp_filler(ctx: AttackContext) -> None:
    async with Sandbox(SandboxConfig(limits=Limits(tmp_bytes=32 * MiB))) as sb:
        r = await sh(sb, "head -c 64M /dev/zero > /tmp/fill; echo rc=$?; stat -c %s /tmp/fill")
        assert "No space left on device" in r.stderr, f"no ENOSPC: {r.output}"
        size = int(r.stdout.split()[-1])
        assert 16 * MiB <= size <= 32 * MiB, f"wrote {size} bytes to a 32 MiB /tmp"


@attack
async def attack_upper_filler(ctx: AttackContext) -> None:
    sb = Sandbox(SandboxConfig(limits=Limits(upper_bytes=64 * MiB)))
    await sb.start()
    try:
        upper = sb.upper_dir
        assert upper is not None and upper.is_dir()
        fill = """
            import os, time
            os.makedirs("/root/fill", exist_ok=True)
            for i in range(75):  # 300 MiB in 4 MiB chunks
                with open(f"/root/fill/{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                time.sleep(0.05)
            print("{}")
            """
        stopped: BaseException | None = None
        try:
            await py(sb, fill, timeout=60)
            for _ in range(100):  # the watchdog polls: it may notice a little later
                await sb.execute("true")
                await asyncio.sleep(0.1)
        except (SandboxLimitError, SandboxNotRunningError) as e:
            stopped = e
        assert stopped is not None, "the sandbox wrote 300 MiB to a 64 MiB upper and ran on"
        with contextlib.suppress(SandboxLimitError, SandboxNotRunningError):
            await sb.execute("true")
            raise AssertionError("the sandbox still runs commands after the limit")
        await sb.stop()
        assert not upper.exists(), f"the temporary upper {upper} was not removed"
    finally:
        await sb.stop()


# -------------------------------------------------------------------------- two sandboxes


@attack
async def attack_cross_sandbox(ctx: AttackContext) -> None:
    m = marker()
    async with Sandbox(SandboxConfig()) as a, Sandbox(SandboxConfig()) as b:
        token = secrets.token_hex(8)
        await a.write_file("/root/a-secret", token)
        await a.write_file("/tmp/a-secret", token)
        await sh(a, f"setsid sleep {m} >/dev/null 2>&1 </dev/null &")
        assert (await a.read_file("/root/a-secret")).decode() == token
        victims = host_pids_with_arg(m)
        assert victims, "a's marker process is not running (positive control)"
        assert a.upper_dir is not None
        for path in ("/root/a-secret", "/tmp/a-secret", f"{a.upper_dir}/root/a-secret"):
            r = await b.execute(["cat", path])
            assert token not in r.stdout, f"b read a's {path}"
        r = await b.execute(["ps", "-eo", "pid=,args="])
        assert "ps -eo" in r.stdout, "ps does not run in b (positive control)"
        assert m not in r.stdout, f"b sees a's processes: {r.stdout}"
        for pid in victims:
            r = await b.execute(["kill", "-9", str(pid)])
            assert r.exit_code != 0, f"b could signal a's process (host pid {pid})"
        # Everything b may signal, which takes b's own control shell down with it.
        with contextlib.suppress(MiniSandboxError):
            await b.execute(["kill", "-9", "-1"], timeout=5)
        assert host_pids_with_arg(m) == victims, "b killed a's process"
        r = await a.execute("echo alive")
        assert r.stdout == "alive\n", "a stopped working"


# ------------------------------------------------------------ found while writing these attacks


@attack
async def attack_kept_upper_symlink_steers_supervisor(ctx: AttackContext) -> None:
    """A kept upper layer is written by the sandbox: a symlink it plants there must not make
    the next sandbox's supervisor create directories on the host (Sandbox._precreate)."""
    base = scratch_subdir(ctx, "kept-")
    target = scratch_subdir(ctx, "target-")  # a host dir the sandbox wants to write into
    upper = base / "upper"
    async with Sandbox(SandboxConfig(upper=upper)) as sb:
        r = await sh(sb, f"cd / && rm -rf /testbed && ln -s {shlex.quote(str(target))} /testbed")
        assert r.exit_code == 0, f"could not plant the symlink: {r.output}"
    assert os.readlink(upper / "testbed") == str(target), "the symlink is not in the upper"
    with contextlib.suppress(MiniSandboxError, OSError):
        async with Sandbox(SandboxConfig(upper=upper, workdir="/testbed/planted")) as sb:
            await sb.execute("true")
    assert not os.listdir(target), (
        f"the supervisor followed the sandbox's symlink and created {os.listdir(target)} in the "
        f"host dir {target}"
    )


@attack
async def attack_setuid_file_planted_in_upper(ctx: AttackContext) -> None:
    """A sandbox can make setuid files in its upper layer, which lives on the host: other host
    users must not be able to run them (they would become the sandbox's host uid)."""
    async with Sandbox(SandboxConfig()) as sb:
        r = await sh(sb, "cp /usr/bin/id /testbed/suid && chmod 755 /testbed/suid")
        assert r.exit_code == 0, f"positive control: {r.output}"
        r = await sh(sb, "chmod 4755 /testbed/suid")
        if r.exit_code != 0:  # seccomp refuses set-id modes (attacks_files.py tries them all)
            assert "Operation not permitted" in r.stderr, r.output
            return
        assert sb.upper_dir is not None
        path = sb.upper_dir / "testbed/suid"
        st = path.stat()
        if not st.st_mode & stat.S_ISUID or os.statvfs(path).f_flag & os.ST_NOSUID:
            return  # no setuid bit on the host, or a nosuid filesystem: harmless
        closed = [p for p in [path, *path.parents] if not p.stat().st_mode & stat.S_IXOTH]
        assert closed, (
            f"{path} is setuid uid {st.st_uid} and every directory above it lets other host users "
            f"through: any local user can run it and become uid {st.st_uid}"
        )


@attack
async def attack_forge_command_result(ctx: AttackContext) -> None:
    """No process in the sandbox may forge the supervisor's view of a command's outcome: here a
    process left behind by one command reports "exit 0" for the next one (think of an agent's
    leftover process and the grader's test run), through the control shell's reply pipe."""
    forger = """
        me=$(basename "$(readlink /proc/$$/fd/1)" .o)
        (
            for _ in $(seq 200); do
                for f in /run/minisandbox/*.o; do
                    rid=$(basename "$f" .o)
                    if [ "$rid" -gt "$me" ] 2>/dev/null; then
                        { echo "X $rid 0" >&9; } 2>/dev/null
                        { echo "X $rid 0" > /proc/2/fd/9; } 2>/dev/null
                        exit
                    fi
                done
                sleep 0.05
            done
        ) >/dev/null 2>&1 </dev/null &
        """
    async with Sandbox(SandboxConfig()) as sb:
        r = await sb.execute(["/bin/bash", "-c", 'eval "$(cat)"'], stdin=forger)
        assert r.exit_code == 0, f"could not start the forger: {r.output}"
        r = await sb.execute("sleep 1; echo real-output; exit 3")
        assert (r.exit_code, r.stdout) == (3, "real-output\n"), (
            f"a process in the sandbox forged the next command's result through the control "
            f"channel: exit {r.exit_code}, stdout {r.stdout!r} (it printed real-output, exit 3)"
        )


# The attacks on the host code around the sandbox live beside this file, one module per area;
# importing them registers them (they import this module's helpers, so they come last).
import attacks_build  # noqa: E402, F401
import attacks_cli  # noqa: E402, F401
import attacks_files  # noqa: E402, F401
import attacks_hostpython  # noqa: E402, F401
import attacks_limits  # noqa: E402, F401
import attacks_sessions  # noqa: E402, F401
import attacks_tenants  # noqa: E402, F401
