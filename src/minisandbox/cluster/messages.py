"""What a driver and a node agent say to each other about one sandbox: typed messages.

Every call of `SandboxAPI` on a `RemoteSandbox` is one request model here, sent whole to the node's
`NodeAgent.call`, which runs it on the local `Sandbox` and answers with the local call's own result
model (`ExecResult`, `SessionResult`, bytes) or a `SessionReply`. A field added to the local API is
added to its request here once, and mypy sees both ends. Errors cross as the exceptions the local
call raised (Ray re-raises them on the driver).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.session import SessionResult


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Execute(_Request):
    """`execute`: a command to completion (its output comes with the result)."""

    command: str | list[str]
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout: float | None = None
    stdin: bytes | str | None = None
    merge_stderr: bool = False
    max_output: int | None = DEFAULT_MAX_OUTPUT


class ReadFile(_Request):
    path: str
    max_bytes: int


class WriteFile(_Request):
    path: str
    data: bytes
    mode: int | None = None


class Upload(_Request):
    """A file, link or directory of the driver's host as a tar whose one top entry is `name`
    (a directory: its contents go to `target`)."""

    name: str
    data: bytes
    target: str
    is_dir: bool


class IsRunning(_Request):
    pass


class CreateSession(_Request):
    name: str
    env: dict[str, str] | None = None
    max_output: int | None = DEFAULT_MAX_OUTPUT
    columns: int = 200
    rows: int = 50


class SessionRun(_Request):
    name: str
    command: str
    timeout: float | None = None
    expect: list[str] | None = None
    input: str | None = None


class SessionSend(_Request):
    name: str
    text: str
    timeout: float | None = None
    expect: list[str] | None = None


class SessionInterrupt(_Request):
    name: str
    timeout: float = 2.0


class SessionClose(_Request):
    name: str


class SessionBusy(_Request):
    name: str


SessionRequest = SessionRun | SessionSend | SessionInterrupt | SessionClose
SandboxRequest = (
    Execute
    | ReadFile
    | WriteFile
    | Upload
    | IsRunning
    | CreateSession
    | SessionRequest
    | SessionBusy
)


class SessionReply(BaseModel):
    """A session call's result (None for `close`) and whether a command still runs in it."""

    result: SessionResult | None
    busy: bool


class EvalSettings(_Request):
    """How a node grades (an Evaluator's settings: its `on_phase` stays on the driver)."""

    timeout: float
    grading: Literal["guarded", "harness"] = "guarded"


class StartFacts(BaseModel):
    """How a node started a sandbox."""

    id: str
    hits: int
    """Its layers already in the node's cache."""
    misses: int
    """Its layers the node had to unpack (or copy and unpack)."""
    prep_s: float
    """Seconds from the request to a running sandbox."""
    node_sandboxes: int
    """Sandboxes open on the node then, of every agent there (this one included)."""


class NodeInfo(BaseModel):
    """A node's facts for placement."""

    pid: int
    shared_store: bool
    """The node sees the driver's store (else it copies layers into one of its own)."""
    cache: str
    capacity: int
    node_sandboxes: int
    """Sandboxes open on the node, of every agent there."""
    waiting: int
    cached: list[str]
    """The layers its node cache holds."""
    budget_bytes: int | None


class AgentStats(BaseModel):
    """What one node agent did."""

    hits: int
    misses: int
    unpacks: dict[str, int]
    """Unpacks per layer, by this agent's process."""
    max_bytes_in_flight: int | None
    """The node's high-water mark of bytes being unpacked."""
    budget_bytes: int | None
    agent_sandboxes: int
    """Sandboxes this agent has open."""
    copied_bytes: int


__all__ = [
    "AgentStats",
    "CreateSession",
    "Execute",
    "IsRunning",
    "NodeInfo",
    "ReadFile",
    "SandboxRequest",
    "SessionBusy",
    "SessionClose",
    "SessionInterrupt",
    "SessionReply",
    "SessionRequest",
    "SessionRun",
    "SessionSend",
    "StartFacts",
    "Upload",
    "WriteFile",
]
