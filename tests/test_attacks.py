"""The attack suite: every attack of tests/attacks.py, from inside real sandboxes, as an
unprivileged caller and as a root caller. Each must fail.

The host side is prepared here, once per session: secret files (in the caller's HOME, in
/root, plus the project's own pyproject.toml), a scratch file the sandboxes must not change, a
host process with a secret in its environment, a loopback TCP server and an abstract unix
socket, and a secret in our own environment.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from attack_harness import (
    CALLERS,
    HOST_PATH,
    UNPRIVILEGED_UID,
    RunnerUnavailable,
    UidRunner,
    find_python,
    run_in_process,
)
from attacks import ATTACKS, AttackContext, host_cmdline
from minisandbox import Sandbox, SandboxConfig
from minisandbox.utils.safefs import discard_tree

REPO = Path(__file__).resolve().parent.parent
IS_ROOT = os.geteuid() == 0
ENV_SECRET_NAME = "MINISANDBOX_ATTACK_ENV_SECRET"


class HostServers:
    """A TCP server on 127.0.0.1 and an abstract unix socket; both greet with `banner`."""

    def __init__(self) -> None:
        token = secrets.token_hex(8)
        self.banner = f"host-banner-{token}"
        self.abstract = f"minisandbox-attack-{token}"
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.abstract)
        self.unix.listen()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            for s in (self.tcp, self.unix):
                sel.register(s, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    conn, _addr = key.fileobj.accept()  # type: ignore[union-attr]
                    with conn:
                        conn.sendall(self.banner.encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.tcp.close()
        self.unix.close()


@pytest.fixture(scope="session")
def host_servers() -> Iterator[HostServers]:
    servers = HostServers()
    yield servers
    servers.close()


# The other host user's agent: does to a path what the attack asks, as that user.
_OTHER_USER_AGENT = r"""
import json, os, socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
server.listen()
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        ask = json.loads(conn.makefile().readline())
        try:
            if ask["op"] == "append":
                with open(ask["path"], "a") as f:
                    f.write("tampered by another user\n")
            elif ask["op"] == "mkdir":
                os.mkdir(ask["path"])
                os.chmod(ask["path"], 0o777)
            else:
                os.close(os.open(ask["path"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            answer = {"ok": True, "error": ""}
        except OSError as e:
            answer = {"ok": False, "error": f"{type(e).__name__}: {e.strerror}"}
        conn.sendall((json.dumps(answer) + "\n").encode())
"""
OTHER_UID = UNPRIVILEGED_UID + 1


def _as_other_user() -> list[str]:
    return ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--"]


@pytest.fixture(scope="session")
def other_user() -> Iterator[tuple[str, int] | None]:
    """A process of a second host user (OTHER_UID), serving `_OTHER_USER_AGENT` on a socket
    every caller can reach: (socket path, uid), or None when we cannot switch users."""
    if not IS_ROOT:
        yield None
        return
    try:
        python = find_python(OTHER_UID)
    except RunnerUnavailable:
        yield None
        return
    base = Path(tempfile.mkdtemp(prefix="msb-other-user-"))
    os.chmod(base, 0o755)
    os.chown(base, OTHER_UID, OTHER_UID)
    path = str(base / "agent.sock")
    proc = subprocess.Popen(
        [*_as_other_user(), python, "-I", "-c", _OTHER_USER_AGENT, path],
        env={"PATH": HOST_PATH},
        cwd="/",
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n", "no agent"
        yield path, OTHER_UID
    finally:
        proc.kill()
        proc.wait()
        discard_tree(base)


@pytest.fixture(scope="session")
def env_secret() -> Iterator[str]:
    """A secret in our environment before any sandbox exists: no sandbox process may see it."""
    value = f"env-secret-{secrets.token_hex(8)}"
    old = os.environ.get(ENV_SECRET_NAME)
    os.environ[ENV_SECRET_NAME] = value
    yield value
    if old is None:
        os.environ.pop(ENV_SECRET_NAME, None)
    else:
        os.environ[ENV_SECRET_NAME] = old


@pytest.fixture(scope="session")
def uid_runner() -> Iterator[Callable[[], UidRunner]]:
    """The unprivileged uid's runner, built on first use (only a root test process needs it).
    Skips when this machine cannot switch uid or has no Python for it; fails when it could but
    building the venv broke (silently skipping half the suite in CI would hide that)."""
    built: list[UidRunner] = []
    failure: list[tuple[bool, str]] = []  # (skip?, why), remembered: built once at most

    def get() -> UidRunner:
        if not built and not failure:
            try:
                built.append(UidRunner(REPO, UNPRIVILEGED_UID))
            except RunnerUnavailable as e:
                failure.append((True, f"cannot run attacks as uid {UNPRIVILEGED_UID}: {e}"))
            except Exception as e:
                failure.append((False, f"building the uid {UNPRIVILEGED_UID} runner failed: {e!r}"))
        if failure:
            skip, why = failure[0]
            if skip:
                pytest.skip(why)
            pytest.fail(why, pytrace=False)
        return built[0]

    yield get
    for runner in built:
        runner.close()


def _secret_file(directory: Path, token: str, uid: int | None) -> str:
    path = directory / "secret.txt"
    path.write_text(token)
    os.chmod(path, 0o600)
    if uid is not None:
        os.chown(directory, uid, uid)
        os.chown(path, uid, uid)
    return str(path)


def _spawn_secret_process(uid: int | None, marker: str, secret: str) -> subprocess.Popen[bytes]:
    """`sleep <marker>` running as `uid` (None: as us) with `secret` in its environment."""
    prefix = (
        [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    )
    proc = subprocess.Popen(
        [*prefix, "sleep", marker],
        env={"PATH": HOST_PATH, "MINISANDBOX_HOST_PROCESS_SECRET": secret},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while marker not in host_cmdline(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker in host_cmdline(proc.pid), "the host secret process did not start"
    return proc


@pytest.fixture(scope="session")
def contexts(
    host_servers: HostServers,
    env_secret: str,
    uid_runner: Callable[[], UidRunner],
    other_user: tuple[str, int] | None,
) -> Iterator[Callable[[str], AttackContext]]:
    """Builds, once per caller, the host-side facts of its attacks; removes them at the end."""
    built: dict[str, AttackContext] = {}
    dirs: list[Path] = []
    procs: list[subprocess.Popen[bytes]] = []
    root_secret: list[tuple[str, str]] = []
    if IS_ROOT and os.path.isdir("/root"):
        token = f"root-secret-{secrets.token_hex(8)}"
        directory = Path(tempfile.mkdtemp(prefix=".minisandbox-attack-", dir="/root"))
        dirs.append(directory)
        root_secret.append((_secret_file(directory, token, None), token))

    def get(caller: str) -> AttackContext:
        if caller in built:
            return built[caller]
        home_token = f"home-secret-{secrets.token_hex(8)}"
        if caller == "unprivileged" and IS_ROOT:
            runner = uid_runner()
            uid: int | None = runner.uid
            home_dir = runner.home  # removed with the runner
            scratch = runner.make_dir("scratch-")
            sandbox_uid = uid
        else:
            uid = None
            home_dir = Path(tempfile.mkdtemp(prefix=".minisandbox-attack-", dir=Path.home()))
            scratch = Path(tempfile.mkdtemp(prefix="minisandbox-attack-"))
            os.chmod(scratch, 0o755)
            dirs.extend([home_dir, scratch])
            sandbox_uid = SandboxConfig().sandbox_owner()[0]
        scratch_content = f"scratch-{secrets.token_hex(8)}"
        scratch_file = scratch / "host-file.txt"
        scratch_file.write_text(scratch_content)
        os.chmod(scratch_file, 0o666)  # only isolation stands between it and the sandbox
        if IS_ROOT:
            os.chown(scratch_file, sandbox_uid, sandbox_uid)
        marker = f"31339.{secrets.randbelow(10**9):09d}"
        proc_secret = f"host-process-secret-{secrets.token_hex(8)}"
        # It runs as the sandbox's own host uid: only the pid namespace protects it.
        proc = _spawn_secret_process(sandbox_uid if IS_ROOT else None, marker, proc_secret)
        procs.append(proc)
        root_path, root_token = root_secret[0] if root_secret else (None, "no-root-secret")
        built[caller] = AttackContext(
            caller=caller,
            repo=str(REPO),
            home_secret=_secret_file(home_dir, home_token, uid),
            home_token=home_token,
            root_secret=root_path,
            root_token=root_token,
            scratch_dir=str(scratch),
            scratch_file=str(scratch_file),
            scratch_content=scratch_content,
            env_secret_name=ENV_SECRET_NAME,
            env_secret_value=env_secret,
            host_pid=proc.pid,
            host_pid_marker=marker,
            host_pid_secret=proc_secret,
            tcp_port=host_servers.port,
            abstract_socket=host_servers.abstract,
            server_banner=host_servers.banner,
            other_user_socket=other_user[0] if other_user else None,
            other_user_uid=other_user[1] if other_user else None,
        )
        return built[caller]

    yield get
    for proc in procs:
        proc.kill()
        proc.wait()
    for directory in dirs:
        discard_tree(directory)


# The slowest attacks (10-60 s each, on a loaded machine) that do not depend on who the caller
# is run as root by default (CI's caller) and as the unprivileged caller in the slow set.
SLOW_UNPRIVILEGED = {
    "sigkill_during_start",
    "eval_status_file_to_dev_zero",
    "upper_inode_flood",
    "upper_outrun_slow_scan",
    "build_cleanup_through_planted_symlink",
    "report_outside_report_dir_via_model_name",
}


def _cases() -> list:
    return [
        pytest.param(
            name,
            caller,
            marks=[pytest.mark.slow]
            if caller == "unprivileged" and name in SLOW_UNPRIVILEGED
            else [],
            id=f"{name}-{caller}",
        )
        for name in ATTACKS
        for caller in CALLERS
    ]


@pytest.mark.parametrize(("name", "caller"), _cases())
def test_attack(
    name: str,
    caller: str,
    contexts: Callable[[str], AttackContext],
    uid_runner: Callable[[], UidRunner],
) -> None:
    if caller == "root" and not IS_ROOT:
        pytest.skip("the root caller needs euid 0")
    ctx = contexts(caller)
    if caller == "unprivileged" and IS_ROOT:
        outcome = uid_runner().run(name, ctx)
    else:
        outcome = run_in_process(name, ctx)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    if not outcome.ok:
        pytest.fail(f"{name} as the {caller} caller:\n{outcome.error}", pytrace=False)


# ------------------------------------------------------ bugs found while writing the attacks


async def test_execute_runs_multiline_command() -> None:
    """A command string with a newline (a heredoc, a script) is plain bash."""
    async with Sandbox() as sb:
        r = await sb.execute("echo a\necho b")
        assert r.stdout == "a\nb\n"


async def test_nested_workdir_starts_without_a_layer_providing_it() -> None:
    async with Sandbox(SandboxConfig(workdir="/testbed/sub")) as sb:
        r = await sb.execute("pwd")
        assert r.stdout == "/testbed/sub\n"


async def test_generated_etc_files_are_readable() -> None:
    """/etc/passwd, group, hosts and hostname are generated for each sandbox: its root must be
    able to read them (`localhost` lookups, `whoami`, prompts), whoever the caller is."""
    async with Sandbox() as sb:
        for name in ("passwd", "group", "hosts", "hostname"):
            r = await sb.execute(["cat", f"/etc/{name}"])
            assert r.exit_code == 0, f"/etc/{name}: {r.stderr.strip()}"
        r = await sb.execute(["getent", "hosts", "localhost"])
        assert "127.0.0.1" in r.stdout or "::1" in r.stdout, f"localhost does not resolve: {r}"


async def test_ro_path_under_tmp_is_readable() -> None:
    """A read-only host dir under /tmp (a venv built there, say) must be readable inside."""
    base = Path(tempfile.mkdtemp(prefix="msb-ro-under-tmp-"))
    try:
        os.chmod(base, 0o755)
        (base / "f.txt").write_text("visible\n")
        async with Sandbox(SandboxConfig(ro_paths=[base])) as sb:
            r = await sb.execute(["cat", f"{base}/f.txt"])
            assert r.stdout == "visible\n", r.stderr
    finally:
        discard_tree(base)


PLANTED_RUNTIME_PROBE = """
import asyncio
from minisandbox import Sandbox
from minisandbox.sandbox.runtime import process_dir
async def main():
    async with Sandbox() as sb:
        await sb.execute("true")
    print(process_dir().parent)
asyncio.run(main())
"""


@pytest.mark.skipif(not IS_ROOT, reason="needs root: another uid plants the runtime directory")
@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_runtime_root_planted_by_another_user(planted: str) -> None:
    """/tmp/minisandbox-0 is a predictable name in a world-writable directory: whatever another
    local user put there first must not steer root's sandboxes (chmod through a symlink, or a
    runtime directory whose entries that user can rename and replace)."""
    attacker = UNPRIVILEGED_UID + 1
    fake_tmp = Path(tempfile.mkdtemp(prefix="msb-fake-tmp-"))
    try:
        os.chmod(fake_tmp, 0o1777)  # like /tmp
        victim = fake_tmp / "victim-dir"
        victim.mkdir(mode=0o755)
        os.chmod(victim, 0o755)
        planted_root = fake_tmp / "minisandbox-0"
        if planted == "symlink":
            planted_root.symlink_to(victim)
        else:
            planted_root.mkdir()
        os.chown(planted_root, attacker, attacker, follow_symlinks=False)
        env = {k: v for k, v in os.environ.items() if k != "MINISANDBOX_RUNTIME"}
        env["TMPDIR"] = str(fake_tmp)
        r = subprocess.run(
            [sys.executable, "-c", PLANTED_RUNTIME_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert oct(victim.stat().st_mode & 0o7777) == "0o755", (
            f"root chmod-ed {victim} through the planted symlink {planted_root}"
        )
        assert not list(victim.iterdir()), f"root created {list(victim.iterdir())} in {victim}"
        if r.returncode == 0:
            used = Path(r.stdout.split()[-1])
            assert used.stat().st_uid in (0, os.geteuid()), (
                f"root kept its sandboxes in {used}, owned by uid {used.stat().st_uid}, who "
                "can rename and replace everything in it"
            )
    finally:
        discard_tree(fake_tmp)


def test_attack_registry_is_complete() -> None:
    """Every attack the issue lists is in the registry (guards against a lost decorator)."""
    expected = {
        "read_host_files_from_shell",
        "read_host_files_through_read_file",
        "write_outside_upper",
        "write_file_through_symlink_and_dotdot",
        "upload_symlink_to_host_secret",
        "see_signal_ptrace_host_process",
        "read_other_environ",
        "network_off",
        "tiocsti",
        "setuid_binary",
        "nested_namespaces",
        "mount",
        "write_proc_self_exe",
        "write_kernel_settings",
        "stop_the_reaper",
        "fork_bomb",
        "memory_hog",
        "tmp_filler",
        "upper_filler",
        "sigterm_ignoring_double_fork",
        "controller_sigkilled",
        "cross_sandbox",
        # The host code around the sandbox (attacks_*.py).
        "build_cleanup_through_planted_symlink",
        "build_moves_host_dir_into_env_layer",
        "report_outside_report_dir_via_model_name",
        "dataset_reads_host_files_by_path",
        "instance_id_paths_and_newlines",
        "read_file_endless_or_blocking",
        "swerex_read_file_dev_zero",
        "eval_status_file_to_dev_zero",
        "setid_bits_refused_and_kept_upper_private",
        "mapped_uid_writes_node_cache",
        "upper_inode_flood",
        "upper_outrun_slow_scan",
        "total_memory_unenforced",
        "sigkill_during_start",
        "kept_upper_work_dir",
        "session_shell_ignores_sigint",
        "timeout_setsid_child",
        "timeout_double_fork_setsid",
        "answer_the_control_channel",
        "stop_the_control_shell",
        "other_user_rewrites_a_layer",
        "node_upload_writes_outside",
        "build_reaches_host_services",
        "read_packages_of_the_task_interpreter",
        "read_host_usr_python_packages",
    }
    assert expected <= set(ATTACKS), f"missing: {expected - set(ATTACKS)}"
