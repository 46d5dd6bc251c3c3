"""The integrations on a sandbox pool, chosen by their config option (`cluster`): SWE-ReX's
deployment, SkyRL's rollout and environment. The same calls as on one machine; the sandboxes are
RemoteSandboxes on the test cluster's nodes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")
pytest.importorskip("swerex", reason="SWE-ReX is not installed (extra: swerex)")
skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (extra: skyrl)")

from cluster_helpers import Nodes  # noqa: E402
from swerex.exceptions import CommandTimeoutError  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from minisandbox.cluster import RemoteSandbox  # noqa: E402
from minisandbox.cluster.shared import shared_pool  # noqa: E402
from minisandbox.integrations.skyrl import ENV_ID, run_rollout  # noqa: E402
from minisandbox.integrations.swerex import MiniSandboxDeploymentConfig  # noqa: E402
from minisandbox.sandbox.sync import run_sync  # noqa: E402
from minisandbox.tasks.builder import Builder, BuildSettings  # noqa: E402
from minisandbox.tasks.specs import Task  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def store_env(settings: BuildSettings, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Made by name or config, the integrations find the store in the environment."""
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))
    yield


def pool_starts(builder: Builder) -> int:
    stats = run_sync(run_sync(shared_pool("auto", builder=builder)).stats())
    return int(stats["hits"] + stats["misses"])


async def test_swerex_deployment_on_the_pool(
    nodes: Nodes, store_env: None, tasks: list[Task], tmp_path: Path
) -> None:
    task = next(t for t in tasks if t.id == "examples__tablekit-1")
    d = MiniSandboxDeploymentConfig(task=task.id, cluster=nodes.cluster.address).get_deployment()
    await d.start()
    try:
        assert isinstance(d.task_sandbox.sandbox, RemoteSandbox)
        rt = d.runtime
        await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"]))
        o = await rt.run_in_session(BashAction(command="cd /testbed && export X=7", timeout=30))
        o = await rt.run_in_session(BashAction(command="echo $PWD $X", timeout=30))
        assert o.output.strip() == "/testbed 7"
        # A timeout leaves the session busy on the node; the interrupt is sent there.
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(command="sleep 30", timeout=0.5))
        assert (await rt.run_in_session(BashInterruptAction())).exit_code == 0
        o = await rt.run_in_session(BashAction(command="echo back", timeout=30))
        assert o.output.strip() == "back"
        # Files, and an upload of a directory of this host.
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "a.txt").write_text("from the driver")
        await rt.upload(UploadRequest(source_path=str(tmp_path / "up"), target_path="/tmp/up"))
        read = await rt.read_file(ReadFileRequest(path="/tmp/up/a.txt"))
        assert read.content == "from the driver"
        await rt.write_file(WriteFileRequest(path="/tmp/gold.patch", content=task.gold_patch))
        await rt.run_in_session(BashAction(command="git apply /tmp/gold.patch", timeout=30))
        result = await d.evaluate()
        assert result.reward == 1.0, result.reason
    finally:
        await d.stop()


def test_skyrl_rollout_and_environment_on_the_pool(
    nodes: Nodes, settings: BuildSettings, store_env: None, tasks: list[Task]
) -> None:
    from minisweagent.models.test_models import DeterministicModel, make_output

    task = next(t for t in tasks if t.id == "examples__datekit-1")
    builder = Builder(settings)
    before = pool_starts(builder)
    apply = f"git apply <<'EOF_PATCH'\n{task.gold_patch}\nEOF_PATCH"
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
    model = DeterministicModel(outputs=[make_output("", [{"command": c}]) for c in (apply, submit)])
    config = {
        "agent": {"system_template": "sys", "instance_template": "{{task}}", "step_limit": 5},
        "environment": {"timeout": 60, "cluster": "auto"},
    }
    r = run_rollout({"instance_id": task.id}, model, config, builder=builder)
    assert r.reward == 1.0 and r.error is None, r.error
    assert r.result is not None and r.result.test_results
    # SkyRL's gym environment, made by name, with the same option.
    env = skyrl_gym.make(
        ENV_ID, env_config={"timeout": 60, "cluster": "auto"}, extras={"task": task.id}
    )
    try:
        env.init([{"role": "user", "content": "fix it"}])
        assert isinstance(env.env.task_sandbox.sandbox, RemoteSandbox)
        env.step(f"```bash\n{apply}\n```")
        out = env.step(f"```bash\n{submit}\n```")
        assert out["done"] and out["reward"] == 1.0, out["metadata"]
    finally:
        env.close()
    # Both episodes' sandboxes and evaluations started on the pool's nodes.
    assert pool_starts(builder) >= before + 4
