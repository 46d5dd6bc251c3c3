"""Attacks on the host code around the sandbox (issue: the host never acts on what a sandbox
wrote): registered into attacks.ATTACKS, run as root and as an unprivileged caller by
test_attacks.py like every other attack.

Files: what the host reads out of a sandbox is bounded (no endless device, no FIFO, a size cap,
also in the grader and in SWE-ReX's runtime), and nothing runnable with privilege leaves one
(no set-id bits, a kept upper layer private to its owner, a node cache its sandboxes' host uid
cannot reach)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from attacks import (
    AttackContext,
    AttackSkipped,
    attack,
    host_pids_with_arg,
    scratch_subdir,
    sh,
)
from minisandbox import Limits, Sandbox, SandboxConfig
from minisandbox.errors import SandboxFileError

MiB = 1024**2
T = TypeVar("T")
# The host process may grow by this much while it reads what a sandbox offers: the reads here
# are capped far below it, and the unbounded read it guards against grew by gigabytes.
MEMORY_BUDGET = 96 * MiB
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


# ------------------------------------------------------------------------------------ helpers


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


class MemoryWatch:
    """Watches this process's memory from a thread while the host reads sandbox content: an
    unbounded read can keep the event loop busy draining a pipe, so nothing in the loop could
    stop it. Past `budget`, it SIGKILLs the host processes with `kill_arg` in their argv (the
    reader inside the sandbox), so that a regression fails the attack instead of the machine.
    `grown` is the peak growth (VmHWM, reset at the start, where the kernel allows it)."""

    def __init__(self, kill_arg: str, budget: int = MEMORY_BUDGET) -> None:
        self.kill_arg, self.budget = kill_arg, budget
        self.grown = 0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._hwm = False
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
            self._hwm = True
        self.base = _status_bytes("VmRSS")
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            grown = _status_bytes("VmRSS") - self.base
            self.grown = max(self.grown, grown)
            if grown > self.budget and not self.killed:
                self.killed = True
                for pid in host_pids_with_arg(self.kill_arg):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._hwm:
            self.grown = max(self.grown, _status_bytes("VmHWM") - self.base)

    def check(self, what: str) -> None:
        assert not self.killed and self.grown <= self.budget, (
            f"{what}: the host process grew by {self.grown // MiB} MiB (budget "
            f"{self.budget // MiB} MiB){'; the reader inside was killed' if self.killed else ''}"
        )


async def _refused(what: str, aw: Awaitable[T], kill_arg: str, needle: str) -> SandboxFileError:
    """`aw` must fail with a SandboxFileError naming `needle`, soon and with little memory."""
    with MemoryWatch(kill_arg) as watch:
        try:
            value = await asyncio.wait_for(aw, 60)
        except SandboxFileError as e:
            error = e
        except asyncio.TimeoutError:
            raise AssertionError(f"{what} did not return within 60 s (blocked?)") from None
        else:
            shown = repr(value[:80]) if isinstance(value, bytes | str) else type(value).__name__
            raise AssertionError(f"{what} was not refused: it returned {shown}")
    watch.check(what)
    assert needle in str(error), f"{what}: the error does not say {needle!r}: {error}"
    assert kill_arg in str(error), f"{what}: the error does not name the path: {error}"
    return error


async def _plant_unreadables(sb: Sandbox, tag: str) -> dict[str, str]:
    """Things in the sandbox that are not regular files: path -> what the error must say."""
    script = f"""
        set -e
        ln -s /dev/zero /testbed/zero-{tag}
        ln -s /dev/urandom /tmp/random-{tag}
        mkfifo /testbed/fifo-{tag}
        ln -s /testbed/fifo-{tag} /testbed/fifo-link-{tag}
        mkdir /testbed/dir-{tag}
        """
    r = await sh(sb, script)
    assert r.exit_code == 0, f"could not plant the files (positive control): {r.output}"
    return {
        f"/testbed/zero-{tag}": "character special file",
        f"/tmp/random-{tag}": "character special file",
        f"/testbed/fifo-{tag}": "fifo",
        f"/testbed/fifo-link-{tag}": "fifo",
        f"/testbed/dir-{tag}": "Is a directory",
    }


# ------------------------------------------------------------------------ bounded reads (3)


@attack
async def attack_read_file_endless_or_blocking(ctx: AttackContext) -> None:
    """read_file of a link to /dev/zero (and /dev/urandom), a FIFO, a link to one, a directory:
    refused at once naming the path and what it is, with the host's memory flat; a file that
    keeps growing, or a large sparse one, is refused past the cap (never silently cut)."""
    tag = secrets.token_hex(4)
    limits = Limits(tmp_bytes=128 * MiB)
    async with Sandbox(SandboxConfig(limits=limits)) as sb:
        # Positive controls: regular files, through a link too, and /proc's (size 0) files.
        await sb.write_file(f"/testbed/ok-{tag}", b"x" * 1000)
        assert await sb.read_file(f"/testbed/ok-{tag}") == b"x" * 1000, "read_file is broken"
        r = await sh(sb, f"ln -s /testbed/ok-{tag} /tmp/ok-link-{tag}")
        assert r.exit_code == 0, r.output
        assert await sb.read_file(f"/tmp/ok-link-{tag}") == b"x" * 1000
        assert b"NoNewPrivs" in await sb.read_file("/proc/self/status")
        assert await sb.read_file(f"/testbed/ok-{tag}", max_bytes=1000) == b"x" * 1000
        for path, kind in (await _plant_unreadables(sb, tag)).items():
            await _refused(f"read_file({path})", sb.read_file(path), path, kind)
            await _refused(f"read_text({path})", sb.read_text(path), path, kind)
        # A file that is still growing while it is read: refused past the cap.
        grow = f"/tmp/grow-{tag}"
        r = await sh(sb, f"(cat /dev/zero > {grow} 2>/dev/null &) ; sleep 0.1")
        assert r.exit_code == 0, r.output
        for _ in range(500):
            if int((await sb.execute(["stat", "-c", "%s", grow])).stdout or 0) > 4 * MiB:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"{grow} does not grow (positive control)")
        await _refused(
            f"read_file({grow}, max_bytes=1 MiB)",
            sb.read_file(grow, max_bytes=MiB),
            grow,
            f"more than {MiB} bytes",
        )
        # A sparse 8 GiB file: the default cap (64 MiB) refuses it. What the host holds for
        # a moment is about a few times that cap, so this one gets its own budget.
        big = f"/testbed/sparse-{tag}"
        r = await sh(sb, f"truncate -s 8G {big} && stat -c %s {big}")
        assert r.stdout.strip() == str(8 << 30), f"no sparse file (positive control): {r.output}"
        with MemoryWatch(big, budget=320 * MiB) as watch:
            try:
                data = await asyncio.wait_for(sb.read_file(big), 120)
            except SandboxFileError as e:
                assert "more than" in str(e) and big in str(e), e
            else:
                raise AssertionError(f"read_file({big}) returned {len(data)} bytes of 8 GiB")
        watch.check(f"read_file({big}) with the default cap")
        assert sb.running, "the sandbox died (the reads above must leave it working)"
        assert await sb.read_file(f"/testbed/ok-{tag}") == b"x" * 1000


@attack
async def attack_swerex_read_file_dev_zero(ctx: AttackContext) -> None:
    """SWE-ReX's runtime reads files through Sandbox.read_file: the same refusals, and its
    error mapping still gives FileNotFoundError and IsADirectoryError."""
    try:
        from swerex.runtime.abstract import ReadFileRequest

        from minisandbox.integrations.swerex import MiniSandboxRuntime
    except ImportError:
        raise AttackSkipped("SWE-ReX is not installed for this caller (the swerex extra)") from None
    tag = secrets.token_hex(4)
    async with Sandbox(SandboxConfig()) as sb:
        rt = MiniSandboxRuntime(sb)
        await sb.write_file(f"/testbed/ok-{tag}", "hello\n")
        r = await rt.read_file(ReadFileRequest(path=f"/testbed/ok-{tag}"))
        assert r.content == "hello\n", f"the runtime's read_file is broken: {r}"
        try:
            await rt.read_file(ReadFileRequest(path=f"/testbed/missing-{tag}"))
        except FileNotFoundError:
            pass
        else:
            raise AssertionError("a missing file did not raise FileNotFoundError")
        planted = await _plant_unreadables(sb, tag)
        for path, kind in planted.items():
            if kind == "Is a directory":
                try:
                    await rt.read_file(ReadFileRequest(path=path))
                except IsADirectoryError:
                    continue
                raise AssertionError(
                    f"reading the directory {path} did not raise IsADirectoryError"
                )
            await _refused(
                f"the SWE-ReX runtime's read_file({path})",
                rt.read_file(ReadFileRequest(path=path)),
                path,
                kind,
            )


@attack
async def attack_eval_status_file_to_dev_zero(ctx: AttackContext) -> None:
    """A patch whose conftest.py links the grader's test-status file to /dev/zero: the real
    `evaluate` of a bundled example task must end normally, its reader refused (the exit
    status is then unknown), with the host's memory flat."""
    from minisandbox.evaluation.evaluator import _RC_PATH, Evaluator
    from minisandbox.tasks.builder import Builder, BuildSettings
    from minisandbox.tasks.examples import materialize_mirror
    from minisandbox.tasks.loaders import load_tasks

    base = Path(ctx.scratch_dir) / "files-attacks"
    base.mkdir(exist_ok=True)
    base.chmod(0o755)
    builder = Builder(
        BuildSettings(
            store=base / "store",
            cache=base / "layers",
            git_mirror=materialize_mirror(base / "mirror"),
        )
    )
    task = next(t for t in load_tasks("examples") if t.id == "examples__semverkit-1")
    conftest = (
        "import os\n"
        f"RC = {_RC_PATH!r}\n"
        "if os.path.lexists(RC):\n"
        "    os.unlink(RC)\n"
        "os.symlink('/dev/zero', RC)\n"
        "\n"
        "\n"
        "def pytest_report_header(config):\n"
        "    return 'planted: ' + RC + ' -> ' + os.readlink(RC)\n"
    )
    lines = conftest.splitlines()
    patch = task.gold_patch + (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        f"+++ b/conftest.py\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines)
    )
    result = await builder.build(task)
    assert result.status in ("built", "cached"), f"the example did not build: {result.error}"
    # The harness's grading: the guarded one refuses the conftest.py before reading anything
    # (its own results file is read the same bounded way); this attack is on the status reader.
    evaluator = Evaluator(builder, timeout=120, grading="harness")
    # Positive control, outside the watch (a first evaluation also builds its own layers and
    # imports the graders: ~150 MiB): the gold patch alone, its status file read as usual.
    control = await evaluator.evaluate(task, task.gold_patch)
    assert (control.status, control.test_exit_code) == ("resolved", 0), control
    with MemoryWatch(_RC_PATH) as watch:
        evaluated = await asyncio.wait_for(evaluator.evaluate(task, patch), 240)
    watch.check("evaluating a patch that links the test-status file to /dev/zero")
    # Positive control: the conftest ran and planted the link before the tests.
    assert f"planted: {_RC_PATH} -> /dev/zero" in evaluated.log, (
        f"the conftest did not plant the link (positive control): {evaluated.log[-2000:]}"
    )
    assert evaluated.test_exit_code is None, (
        f"the grader read an exit status through the link: {evaluated.test_exit_code}"
    )
    # The gold patch still resolves: the grade comes from the log.
    assert evaluated.status == "resolved", (evaluated.status, evaluated.reason)


# ------------------------------------------------------------- nothing privileged leaves (4)


SETID_PROBES = """
set -u
cp /usr/bin/id /testbed/mine && echo copied
chmod 755 /testbed/mine && echo chmod-755-ok
chmod 4755 /testbed/mine 2>/dev/null && echo chmod-4755
chmod 2755 /testbed/mine 2>/dev/null && echo chmod-2755
chmod u+s /testbed/mine 2>/dev/null && echo chmod-u+s
install -m 4755 /usr/bin/id /testbed/installed 2>/dev/null && echo install-4755
/usr/bin/python3 - <<'EOF'
import os
def attempt(name, fn):
    try:
        fn()
        print(name)
    except PermissionError:
        pass
attempt("os.chmod-4755", lambda: os.chmod("/testbed/mine", 0o4755))
attempt("os.fchmod-6755", lambda: os.fchmod(os.open("/testbed/mine", os.O_RDONLY), 0o6755))
W = os.O_CREAT | os.O_WRONLY
attempt("open-creat-4755", lambda: os.close(os.open("/testbed/o", W, 0o4755)))
attempt("mknod-reg-4755", lambda: os.mknod("/testbed/n", 0o104755))
attempt("open-creat-755", lambda: os.close(os.open("/testbed/o2", W, 0o755)))
attempt("mknod-reg-644", lambda: os.mknod("/testbed/n2", 0o100644))
EOF
find /testbed -perm /6000 -type f
"""


def _run_as(uid: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
        env={"PATH": HOST_PATH},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
    )


@attack
async def attack_setid_bits_refused_and_kept_upper_private(ctx: AttackContext) -> None:
    """With a kept upper layer, the sandbox tries every way to make a set-id file (chmod, install
    -m, open(O_CREAT) and mknod with set-id modes) and copies up a set-id file of a lower layer.
    All attempts are refused; after stop() the kept upper holds no set-id file and is private to
    its owner (mode 0700, although the sandbox chmodded its `/` to 0755); another host uid that
    runs the copies gets no other euid."""
    work = scratch_subdir(ctx, "kept-setid-")
    upper = work / "upper"
    lower = work / "lower"
    (lower / "opt/tool").mkdir(parents=True)
    shutil.copy("/usr/bin/id", lower / "opt/tool/lower-suid")
    sandbox_uid = SandboxConfig().sandbox_owner()[0]
    if os.geteuid() == 0:
        for p in (lower, lower / "opt", lower / "opt/tool", lower / "opt/tool/lower-suid"):
            os.chown(p, sandbox_uid, sandbox_uid)
    os.chmod(lower / "opt/tool/lower-suid", 0o4755)
    for d in (lower, lower / "opt", lower / "opt/tool"):
        os.chmod(d, 0o755)
    async with Sandbox(SandboxConfig(upper=upper, layers=[lower])) as sb:
        r = await sh(sb, SETID_PROBES)
        out = r.stdout.split()
        for control in ("copied", "chmod-755-ok", "open-creat-755", "mknod-reg-644"):
            assert control in out, f"`{control}` did not happen (positive control): {r.output}"
        made = [w for w in out if "4755" in w or "2755" in w or "6755" in w or "u+s" in w]
        assert not made, f"the sandbox set set-id bits: {made}; {r.output}"
        assert not [w for w in out if w.startswith("/testbed/")], f"set-id files: {r.output}"
        # The copy-up of a lower layer's set-id file keeps the bit (overlayfs): the case that
        # the stop-time sweep is for. And the sandbox opens its `/` (the upper) to everyone.
        r = await sh(sb, "touch /opt/tool/lower-suid && chmod 755 / && stat -c %a /")
        assert r.stdout.split() == ["755"], f"could not chmod / (positive control): {r.output}"
        copied_up = upper / "opt/tool/lower-suid"
        assert copied_up.is_file(), "no copy-up (positive control)"
        assert copied_up.stat().st_mode & stat.S_ISUID, (
            "overlayfs dropped the set-id bit at copy-up: the stop-time sweep is not exercised"
        )
    for rel in ("testbed/mine", "opt/tool/lower-suid"):
        st = (upper / rel).stat()
        assert st.st_mode & stat.S_IXUSR, f"{rel} is not in the kept upper (positive control)"
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), (
            f"{upper / rel} is set-id (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}) in the "
            "kept upper: other host users could run it as that uid"
            + (" (a copied-up lower file)" if rel.startswith("opt") else "")
        )
    mode = stat.S_IMODE(upper.stat().st_mode)
    assert mode == 0o700, f"the kept upper {upper} is mode {mode:o}, not private to its owner"
    if os.geteuid() != 0:
        return  # only root can act as another host uid; the modes above are what protects
    # As root: another host uid (nobody) tries to run the copies. (The lower layer's original
    # shows what a set-id file gives it here: uid {sandbox_uid}, unless the fs is nosuid.)
    for rel in ("testbed/mine", "opt/tool/lower-suid"):
        r = _run_as(65534, [str(upper / rel), "-u"])
        assert r.returncode != 0 or r.stdout.strip() == "65534", (
            f"uid 65534 ran {upper / rel} from the kept upper as uid {r.stdout.strip()}"
        )
    # With the kept upper opened up again (a caller may chmod it), the copies still give
    # nothing: their set-id bits are gone.
    os.chmod(upper, 0o755)
    for rel in ("testbed/mine", "opt/tool/lower-suid"):
        r = _run_as(65534, [str(upper / rel), "-u"])
        assert r.returncode == 0, f"uid 65534 cannot run {rel} (positive control): {r.stderr}"
        assert r.stdout.strip() == "65534", f"{rel} ran as uid {r.stdout.strip()}"


@attack
async def attack_mapped_uid_writes_node_cache(ctx: AttackContext) -> None:
    """A host process running as the uid a root caller's sandboxes run as (what a set-id file
    out of a sandbox would give) must not reach the node cache: its layers are owned by that
    uid, so reaching them would mean rewriting every later sandbox's files, grading included."""
    if os.geteuid() != 0:
        raise AttackSkipped(
            "an unprivileged caller's sandboxes run as the caller itself: there is no other uid "
            "to keep out of its node cache"
        )
    from minisandbox.envs.compat import compat_layer
    from minisandbox.layers.nodecache import NodeCache
    from minisandbox.layers.store import LayerStore

    base = scratch_subdir(ctx, "cache-")
    src = base / "src"
    (src / "testbed").mkdir(parents=True)
    token = f"layer-{secrets.token_hex(8)}"
    (src / "testbed/file.txt").write_text(token + "\n")
    store = LayerStore(base / "store")
    layer_id = store.publish(src).id
    owner = SandboxConfig().layer_owner()
    assert owner is not None
    uid = owner[0]
    cache = NodeCache(base / "cache", store, max_bytes=1 << 30, owner=owner)
    compat = compat_layer(cache.root / "compat", owner)
    async with cache.use([layer_id]) as (path,):
        # Positive controls: the layer is the mapped uid's (it must be root inside), a sandbox
        # on it works and can change it in its upper, and setpriv really switches to that uid.
        assert path.stat().st_uid == uid, f"the layer is owned by {path.stat().st_uid}"
        async with Sandbox(SandboxConfig(layers=[compat, path])) as sb:
            r = await sh(sb, "cat /testbed/file.txt && echo more >> /testbed/file.txt && id -u")
            assert r.stdout.split() == [token, "0"], f"the sandbox cannot use the layer: {r}"
        own = scratch_subdir(ctx, "mapped-own-")
        os.chown(own, uid, uid)
        r = _run_as(uid, ["touch", str(own / "x")])
        assert r.returncode == 0, f"setpriv to uid {uid} does not work (positive control): {r}"
        targets = [
            ["touch", str(path / "testbed/pwned")],
            ["sh", "-c", f"echo pwned > {path}/testbed/file.txt"],
            ["ls", str(cache.root)],
            ["ls", str(path)],
            ["touch", str(compat / "pwned")],
            ["flock", "-n", str(cache.root / "evict.lock"), "true"],
            ["flock", "-n", str(cache.root / "locks" / layer_id), "true"],
        ]
        for argv in targets:
            r = _run_as(uid, argv)
            assert r.returncode != 0, (
                f"uid {uid} (the sandboxes' host uid) could `{' '.join(argv)}` in the node cache"
            )
        assert (path / "testbed/file.txt").read_text() == token + "\n", "the layer was changed"
        assert not (path / "testbed/pwned").exists()
        # Another process of root may open the cache as before (a Builder in a new process).
        again = NodeCache(base / "cache", store, max_bytes=1 << 30, owner=owner)
        assert again.cached() == [layer_id]


@attack
async def attack_forged_layer_root_is_not_a_directory(ctx: AttackContext) -> None:
    """Whoever can write to the shared store can add a layer: its id is the hash of its manifest,
    so a forged manifest verifies. Its root must still be a directory: a root row that is a
    symlink (to the host's /) or a file would make the node cache's copy of the layer a link to
    host files, which every sandbox on that layer then mounts as its root."""
    import hashlib

    import zstandard

    from minisandbox.errors import MiniSandboxError
    from minisandbox.layers.manifest import FORMAT
    from minisandbox.layers.nodecache import NodeCache
    from minisandbox.layers.store import LayerStore

    base = scratch_subdir(ctx, "forged-")
    store = LayerStore(base / "store")
    src = base / "src"
    (src / "testbed").mkdir(parents=True)
    (src / "testbed" / "ok.txt").write_text("ok\n")
    good = store.publish(src).id
    cache = NodeCache(base / "cache", store, max_bytes=1 << 30, owner=SandboxConfig().layer_owner())
    async with cache.use([good]) as (path,):  # positive control: a real layer unpacks
        assert (path / "testbed" / "ok.txt").read_text() == "ok\n" and not path.is_symlink()
    forged_roots = {
        "link to /": ["l", ".", "/"],
        "link to the secret": ["l", ".", str(Path(ctx.home_secret).parent)],
        "empty file": ["f", ".", 0o644, 0, 0, -1, 0],
    }
    for what, root in forged_roots.items():
        doc = {"format": FORMAT, "blobs": [], "entries": [root]}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        layer_id = hashlib.sha256(raw).hexdigest()
        store.manifest_path(layer_id).parent.mkdir(parents=True, exist_ok=True)
        store.manifest_path(layer_id).write_bytes(zstandard.ZstdCompressor().compress(raw))
        unpacked: Path | None = None
        try:
            async with cache.use([layer_id]) as (unpacked,):
                pass
        except MiniSandboxError:
            pass  # refused: what must happen
        target = cache.root / "layers" / layer_id
        assert not target.is_symlink() and not target.is_file(), (
            f"a forged layer whose root is a {what} was unpacked as {target} -> "
            f"{os.readlink(target) if target.is_symlink() else 'a file'}"
        )
        assert unpacked is None, f"a forged layer whose root is a {what} was handed out"
