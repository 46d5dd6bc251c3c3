"""The OpenHands SDK on minisandbox, end to end with the real packages: its agent server runs in
a task sandbox (no network but its own loopback), a RemoteConversation drives it, the agent's
LLM is a scripted OpenAI-compatible endpoint on the host (reached through the sandbox's egress
proxy, as a real provider would be), its tools change /testbed, and minisandbox grades it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
pytest.importorskip(
    "openhands.agent_server",
    reason="the OpenHands SDK is not installed: run `scripts/test-stack openhands`",
)

import httpx
from openhands.sdk import LLM, Agent, Conversation, RemoteConversation, Tool
from openhands.sdk.workspace import LocalWorkspace
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool
from pydantic import ValidationError

from minisandbox import Sandbox
from minisandbox.errors import AgentEnvironmentError
from minisandbox.integrations.openhands import (
    MiniSandboxWorkspace,
    _NamespaceSockets,
    server_paths,
)
from minisandbox.integrations.tasks import resolve_task
from minisandbox.runtime import Runtime
from minisandbox.sandbox.sync import background_loop, run_sync
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import TaskNotFoundError, load_tasks

TASK = "examples__semverkit-1"


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """An assistant turn that calls one tool."""
    return {"name": name, "arguments": arguments}


class ScriptedLLM:
    """An OpenAI-compatible chat endpoint on the host's loopback that answers each request
    with the next scripted tool call (the SDK's TestLLM keeps its script in the client
    process; the agent loop runs in the sandbox)."""

    def __init__(self, turns: list[dict[str, Any]]) -> None:
        self.turns = list(turns)
        self.requests: list[dict[str, Any]] = []  # the agent's (with tools)
        self.other: list[dict[str, Any]] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.path.endswith("/chat/completions"):
                    self.send_error(404, "not a chat completion")
                    return
                if not body.get("tools"):
                    # The server's own calls without tools (a title for the conversation).
                    script.other.append(body)
                    message: dict[str, Any] = {"role": "assistant", "content": "A title"}
                    n = len(script.other)
                else:
                    script.requests.append(body)
                    if not script.turns:
                        self.send_error(500, "no more scripted turns")
                        return
                    turn = script.turns.pop(0)
                    n = len(script.requests)
                    message = {
                        "role": "assistant",
                        "content": f"step {n}",
                        "tool_calls": [
                            {
                                "id": f"call_{n}",
                                "type": "function",
                                "function": {
                                    "name": turn["name"],
                                    "arguments": json.dumps(turn["arguments"]),
                                },
                            }
                        ],
                    }
                finish = "tool_calls" if "tool_calls" in message else "stop"
                data = json.dumps(
                    {
                        "id": f"chatcmpl-{n}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": "scripted",
                        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        # The sandbox's 127.0.0.1 is its own: the host's loopback is `localhost` there.
        self.url = f"http://localhost:{self.port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def llm(self) -> LLM:
        return LLM(usage_id="agent", model="openai/scripted", base_url=self.url, api_key="none")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def runtime(settings: BuildSettings, built: list) -> Runtime:
    return Runtime(builder=Builder(settings))


@pytest.fixture
def llm_server() -> Iterator[list[ScriptedLLM]]:
    made: list[ScriptedLLM] = []
    yield made
    for s in made:
        s.close()


def run_episode(runtime: Runtime, script: ScriptedLLM) -> tuple[MiniSandboxWorkspace, Any]:
    agent = Agent(
        llm=script.llm(),
        tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)],
    )
    ws = MiniSandboxWorkspace(task=TASK, runtime=runtime, llm_urls=[script.url])
    # (typed Any: the SDK's tracing decorators hide its methods' signatures from mypy)
    conversation: Any = Conversation(agent=agent, workspace=ws, visualizer=None)
    remote = isinstance(conversation, RemoteConversation)  # the agent loop runs in the server
    assert remote
    conversation.send_message("Fix the issue in /testbed.")
    conversation.run()
    return ws, conversation


def test_agent_server_episode_gold_patch_reward_1(
    runtime: Runtime, llm_server: list[ScriptedLLM]
) -> None:
    script = ScriptedLLM(
        [
            call("file_editor", command="create", path="/tmp/fix.patch", file_text=gold_patch()),
            call("terminal", command="cd /testbed && git apply /tmp/fix.patch && git status -s"),
            call("finish", message="applied the fix"),
        ]
    )
    llm_server.append(script)
    t0 = time.monotonic()
    ws, conversation = run_episode(runtime, script)
    try:
        took = time.monotonic() - t0
        assert str(conversation.state.execution_status.value) == "finished"
        assert len(script.requests) == 3, "every LLM call came from the agent server"
        # The terminal's output (git status: the patched file) went back to the model.
        changed = gold_patch().split("\n", 1)[0].split(" b/")[-1]
        tool_outputs = [m for m in script.requests[-1]["messages"] if m["role"] == "tool"]
        assert len(tool_outputs) == 2 and f"M {changed}" in json.dumps(tool_outputs[-1])
        patch = ws.diff()
        assert "+from packaging.version import Version" in patch
        assert "fix.patch" not in patch and "conversations" not in patch  # server files: /tmp
        conversation.close()
        ws.cleanup()
        result = ws.evaluate(patch)
        assert result.resolved and result.reward == 1.0, result.reason
        print(f"\nepisode (sandbox + agent server + 3 LLM turns): {took:.1f}s")
    finally:
        ws.cleanup()


def test_agent_server_episode_no_change_reward_0(
    runtime: Runtime, llm_server: list[ScriptedLLM]
) -> None:
    script = ScriptedLLM([call("finish", message="nothing to do")])
    llm_server.append(script)
    ws, conversation = run_episode(runtime, script)
    try:
        assert str(conversation.state.execution_status.value) == "finished"
        assert ws.diff() == ""
        result = ws.evaluate()
        assert result.empty_patch and result.reward == 0.0
    finally:
        conversation.close()
        ws.cleanup()


def test_workspace_contract_and_isolation(runtime: Runtime, tmp_path: Path) -> None:
    """Commands and files go to the sandbox; the sandbox reaches no network but `llm_urls`
    (refusals are listed); the relay port refuses requests without the session key; cleanup
    stops everything."""
    allowed = ScriptedLLM([])
    other = ScriptedLLM([])
    cap = 1 << 20
    ws = MiniSandboxWorkspace(
        task=TASK, runtime=runtime, llm_urls=[allowed.url], download_max_bytes=cap
    )
    try:
        # The server's environment is bound beside the task's own interpreter prefix (the
        # task's read-only paths are merged with the server's, not replaced).
        task_paths = run_sync(runtime.layers(resolve_task(TASK), "agent")).ro_paths
        assert task_paths
        for path in [*server_paths(sys.executable, compile_bytecode=False), *task_paths]:
            assert ws.execute_command(f"test -d '{path}'").exit_code == 0, path
        # The server's packages stay visible (a venv is no interpreter prefix, whose packages
        # sandboxes hide).
        site = Path(sysconfig.get_paths()["purelib"])
        listed = ws.execute_command(f"ls '{site / 'openhands'}'").stdout.split()
        assert "agent_server" in listed, f"the server's packages are hidden: {listed}"

        r = ws.execute_command("pwd; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout.strip()) == (3, "/testbed")
        assert "err" in r.stdout + r.stderr
        assert ws.execute_command("pwd", cwd="/tmp").stdout.strip() == "/tmp"
        assert ws.execute_command("git log -1 --format=%s").exit_code == 0
        # The agent's commands get the task's Python, not the server's environment.
        prefix = ws.execute_command("python -c 'import sys; print(sys.prefix)'").stdout.strip()
        assert prefix.startswith("/") and prefix != sys.prefix

        src = tmp_path / "up.txt"
        src.write_text("uploaded\n")
        assert ws.file_upload(src, "/testbed/up.txt").success
        assert ws.execute_command("cat up.txt").stdout == "uploaded\n"
        assert ws.file_download("/testbed/up.txt", tmp_path / "down.txt").success
        assert (tmp_path / "down.txt").read_text() == "uploaded\n"
        assert ws.file_upload(b"bytes\n", "sub/b.txt").success  # relative: to /testbed
        assert ws.execute_command("cat /testbed/sub/b.txt").stdout == "bytes\n"
        assert "up.txt" in ws.diff()
        # Downloads are read by the sandbox's own file API, capped (the agent can replace
        # the server, which would send anything): too big, or not a regular file, refused.
        ws.execute_command(f"head -c {cap + 1} /dev/zero > /tmp/big; ln -s /dev/zero /tmp/z")
        for name in ("big", "z"):
            got = ws.file_download(f"/tmp/{name}", tmp_path / name)
            assert not got.success and got.error, got
            assert not (tmp_path / name).exists()
        assert "more than" in str(ws.file_download("/tmp/big", tmp_path / "big").error)
        ws.execute_command(f"head -c {cap} /dev/zero > /tmp/fits")
        got = ws.file_download("/tmp/fits", tmp_path / "fits")
        assert got.success and (tmp_path / "fits").stat().st_size == cap

        # Loopback only inside: the host's relay port is not there.
        relay_port = int(ws.host.rsplit(":", 1)[1])
        probe = (
            "import socket, sys\n"
            "s = socket.socket()\n"
            "s.settimeout(5)\n"
            f"print(s.connect_ex(('127.0.0.1', {relay_port})))\n"
        )
        out = ws.execute_command(f'python3 -c "{probe}"').stdout.strip()
        assert out != "0", "the host's relay port is reachable from the sandbox"
        # Through the egress proxy: the allowed LLM endpoint, and not the other one.
        fetch = (
            "import urllib.request as u, sys\n"
            "try:\n    print(u.urlopen(sys.argv[1]).status)\n"
            "except Exception as e:\n    print(getattr(e, 'code', e))\n"
        )
        ws.file_upload(_write(tmp_path / "fetch.py", fetch), "/tmp/fetch.py")
        got = ws.execute_command(f"python3 /tmp/fetch.py http://localhost:{allowed.port}/v1/x")
        assert got.stdout.strip() == "501", got  # our server: no GET, but reached
        got = ws.execute_command(f"python3 /tmp/fetch.py http://localhost:{other.port}/v1/x")
        assert got.stdout.strip() == "403", got
        assert any(str(other.port) in refused for refused in ws.egress_refused)

        # The relay wants the session key (other processes of the host get nothing).
        assert httpx.get(f"{ws.host}/api/conversations/search").status_code in (401, 403)
        assert ws.alive

        # Time per command: ours (HTTP to the server in the sandbox) and the SDK's local.
        local = LocalWorkspace(working_dir=str(tmp_path))
        ours, theirs = _per_command(ws), _per_command(local)
        print(
            f"\nexecute_command: {ours * 1000:.0f} ms here, {theirs * 1000:.0f} ms LocalWorkspace"
        )
    finally:
        ws.cleanup()
        allowed.close()
        other.close()
    assert not ws.alive


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _per_command(ws: Any, n: int = 5) -> float:
    t0 = time.monotonic()
    for _ in range(n):
        assert ws.execute_command("true").exit_code == 0
    return (time.monotonic() - t0) / n


def test_misconfiguration_is_one_clear_error(runtime: Runtime) -> None:
    with pytest.raises(ValidationError, match="name the host's loopback `localhost`"):
        MiniSandboxWorkspace(task=TASK, runtime=runtime, llm_urls=["http://127.0.0.1:9/v1"])
    # The interpreter under this venv has no agent server.
    bare = str(Path(sys.base_prefix) / "bin" / "python3")
    with pytest.raises(ValidationError, match=r"server_python: .* has no OpenHands agent"):
        MiniSandboxWorkspace(task=TASK, runtime=runtime, server_python=bare)
    with pytest.raises(ValidationError, match="`host` is set when its sandbox starts"):
        MiniSandboxWorkspace(task=TASK, runtime=runtime, host="http://example.org")


def test_socket_helper_enters_only_a_running_sandbox() -> None:
    """The helper takes the namespaces of the process the sandbox vouches for (its pid is
    checked alive once /proc/<pid> is held open), never those of a pid number: a gone pid,
    or a live process that is not the running sandbox's, is refused."""
    p = subprocess.Popen(["true"])  # a pid that exists no more: one we started and reaped
    p.wait()
    with pytest.raises(AgentEnvironmentError, match=r"cannot open a connection.* is gone"):
        _NamespaceSockets(p.pid, lambda: True)
    # A live process (what a recycled pid would be), but the sandbox is not running.
    other = subprocess.Popen(["sleep", "600"])
    try:
        with pytest.raises(AgentEnvironmentError, match="it is not running"):
            _NamespaceSockets(other.pid, lambda: False)
    finally:
        other.kill()
        other.wait()


async def test_socket_helper_closes_at_once_while_a_connection_waits(sandbox: Sandbox) -> None:
    """close() does not wait for a helper that does not answer (a connection of the relay
    waiting for its socket): that connection fails, and close returns at once."""
    assert sandbox.pid is not None
    sockets = _NamespaceSockets(sandbox.pid, lambda: sandbox.running)
    try:
        s = await asyncio.to_thread(sockets.new)  # positive control: a socket of the sandbox
        s.close()
        os.kill(sockets._helper.pid, signal.SIGSTOP)  # it will never answer
        waiting = asyncio.ensure_future(asyncio.to_thread(sockets.new))
        while not sockets._lock.locked() and not waiting.done():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await asyncio.to_thread(sockets.close)
        took = time.monotonic() - t0
        with pytest.raises(AgentEnvironmentError):
            await waiting
    finally:
        sockets.close()  # (again: harmless)
    # The helper was killed, not waited for (it would never have exited by itself).
    assert sockets._helper.returncode == -signal.SIGKILL
    assert took < 5, f"close took {took:.1f}s"


OTHER_UID = 4243  # a user of this host that is not the workspace's


def _relay_request(host: str, key: str, marker: str, uid: int | None = None) -> str:
    """What the relay at `host` answers to a request (with the session key) that makes the
    agent server create `marker` in the sandbox, sent by a process of `uid` (bash's /dev/tcp:
    no Python needed as that user)."""
    port = host.rsplit(":", 1)[1]
    body = json.dumps({"command": f"touch {marker}", "timeout": 30})
    request = (
        "POST /api/bash/start_bash_command HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"X-Session-API-Key: {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    script = 'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 9; printf %s "$2" >&3; cat <&3'
    argv = ["bash", "-c", script, "bash", port, request]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode != 9, f"could not connect to the relay: {r.stderr}"
    return r.stdout


def _wait_for_file(ws: MiniSandboxWorkspace, path: str) -> bool:
    return (
        ws.execute_command(
            f"for i in $(seq 600); do test -e {path} && exit 0; sleep 0.1; done; exit 1", timeout=90
        ).exit_code
        == 0
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user of the host needs root")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv (util-linux)")
def test_relay_refuses_other_users_of_the_host() -> None:
    """The relay carries only connections of processes of the workspace's own user: another
    user's, even with the session key (an agent that replaced the server would not check
    one), is closed before anything reaches the sandbox."""
    ws = MiniSandboxWorkspace()  # (a plain sandbox: the relay is the same)
    try:
        key = str(ws.api_key)
        # Positive control: this user's request reaches the server, which runs it inside.
        assert _relay_request(ws.host, key, "/tmp/ours").startswith("HTTP/1.1 200")
        assert _wait_for_file(ws, "/tmp/ours")
        answer = _relay_request(ws.host, key, "/tmp/theirs", uid=OTHER_UID)
        assert answer == "", f"another user got an answer: {answer[:200]!r}"
        assert ws._relay is not None
        assert any(f"user {OTHER_UID}" in why for why in ws._relay.refused)
        assert ws.execute_command("test -e /tmp/theirs").exit_code != 0
        assert ws.execute_command("true").exit_code == 0  # still ours
    finally:
        ws.cleanup()


def test_relay_caps_its_connections() -> None:
    """More connections than the relay's cap (64) at once: the surplus is closed at once,
    those within it are served, and the workspace works again once they are gone."""
    ws = MiniSandboxWorkspace()
    flood: list[socket.socket] = []
    try:
        assert ws.execute_command("true").exit_code == 0
        port, key = int(ws.host.rsplit(":", 1)[1]), f"X-Session-API-Key: {ws.api_key}"
        for _ in range(80):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=120))
        served = refused = 0
        for s in flood:
            try:
                s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{key}\r\n\r\n".encode())
                answer = s.recv(12)
            except OSError:  # (reset: the relay closed it before the request came)
                answer = b""
            if answer.startswith(b"HTTP/1.1 200"):
                served += 1
            else:
                assert answer == b"", answer
                refused += 1
        # (the workspace's own client may hold a connection of the 64)
        assert 60 <= served <= 64 and served + refused == 80, (served, refused)
        assert ws._relay is not None and len(ws._relay.refused) == refused
    finally:
        for s in flood:
            s.close()
    try:
        deadline = time.monotonic() + 120
        while ws._relay is not None and ws._relay._active > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ws.execute_command("echo ok").stdout.strip() == "ok"
        assert ws.alive
    finally:
        ws.cleanup()


def test_dataset_loads_off_the_shared_loop(runtime: Runtime, tmp_path: Path) -> None:
    """Loading the dataset (which may download it) does not hold minisandbox's background
    loop, which every other sandbox of the process shares: here a dataset file that is a
    FIFO, which keeps its reader waiting until the test writes it."""
    fifo = tmp_path / "tasks.json"
    os.mkfifo(fifo)
    failed: list[BaseException] = []

    def make() -> None:
        try:
            MiniSandboxWorkspace(task="nope", dataset=str(fifo), runtime=runtime)
        except BaseException as e:
            failed.append(e)

    maker = threading.Thread(target=make, daemon=True)
    maker.start()
    deadline = time.monotonic() + 300
    while True:  # until the workspace's loader has the FIFO open (then it is reading it)
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline and maker.is_alive(), failed
            time.sleep(0.05)
    try:
        ran = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "free"), background_loop())
        assert ran.result(timeout=60) == "free"
    finally:
        os.write(writer, b"[]")
        os.close(writer)
        maker.join(timeout=120)
    assert len(failed) == 1 and isinstance(failed[0], (TaskNotFoundError, ValidationError))
    assert "no task 'nope'" in str(failed[0])
