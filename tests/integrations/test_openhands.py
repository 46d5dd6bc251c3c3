"""The OpenHands SDK on minisandbox, end to end with the real packages: its agent server runs in
a task sandbox (no network but its own loopback), a RemoteConversation drives it, the agent's
LLM is a scripted OpenAI-compatible endpoint on the host (reached through the sandbox's egress
proxy, as a real provider would be), its tools change /testbed, and minisandbox grades it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

from minisandbox.integrations.openhands import MiniSandboxWorkspace
from minisandbox.runtime import Runtime
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks

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
    ws = MiniSandboxWorkspace(task=TASK, runtime=runtime, llm_urls=[allowed.url])
    try:
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
        assert "up.txt" in ws.diff()

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


def test_socket_helper_cannot_enter_a_gone_sandbox() -> None:
    """A pid that is no sandbox's: the helper fails, and says so."""
    from minisandbox.errors import AgentEnvironmentError
    from minisandbox.integrations.openhands import _NamespaceSockets

    p = subprocess.Popen(["true"])  # a pid that exists no more: one we started and reaped
    p.wait()
    helper = _NamespaceSockets(p.pid)
    try:
        with pytest.raises(AgentEnvironmentError, match="cannot open a connection"):
            helper.new()
    finally:
        helper.close()
