"""SWE-agent on minisandbox, without a fork of SWE-agent.

SWE-agent's `deployment` settings are SWE-ReX's `DeploymentConfig`, a union of config classes
told apart by their `type`. `register()` adds `MiniSandboxDeploymentConfig` to that union; it
must run before SWE-agent's modules are imported, because they bind the union when they load.
The runner below does that and then hands over to SWE-agent's own CLI:

    python -m minisandbox.integrations.sweagent run \\
        --agent.model.name=... --env.deployment.type=minisandbox \\
        --env.deployment.task=examples__tablekit-1 --env.repo.repo_name=testbed ...
    python -m minisandbox.integrations.sweagent run-batch \\
        --instances.type=swe_bench --instances.deployment.type=minisandbox ...

In batch mode SWE-agent writes each instance's official image name into `deployment.image`;
our deployment maps it to the task (`resolve_task`), so SWE-bench's image names just work.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

from minisandbox.integrations.swerex import MiniSandboxDeploymentConfig

# Modules of SWE-agent that bind swerex's DeploymentConfig when they are imported.
_BINDERS = (
    "sweagent.environment.swe_env",
    "sweagent.run.batch_instances",
    "sweagent.run.run_replay",
)


def registered() -> bool:
    from swerex.deployment import config

    return MiniSandboxDeploymentConfig in typing.get_args(config.DeploymentConfig)


def register() -> None:
    """Make `type: minisandbox` a deployment SWE-agent (and anything reading swerex's
    DeploymentConfig afterwards) accepts. Idempotent."""
    from swerex.deployment import config

    if registered():
        return
    loaded = [m for m in _BINDERS if m in sys.modules]
    if loaded:
        raise RuntimeError(
            "register() must run before SWE-agent is imported (already loaded: "
            f"{', '.join(loaded)}); import minisandbox.integrations.sweagent first"
        )
    # SWE-agent's union of deployment configs, widened at run time (a type alias to mypy).
    config.DeploymentConfig = config.DeploymentConfig | MiniSandboxDeploymentConfig  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> Any:
    """SWE-agent's CLI (`sweagent run|run-batch|run-replay|...`) with minisandbox deployments."""
    register()
    try:
        from sweagent.run.run import main as sweagent_main
    except ImportError as e:
        raise SystemExit(
            f"SWE-agent is not installed ({e}). It is not on PyPI: install it from its "
            "repository (git clone https://github.com/SWE-agent/SWE-agent && pip install -e "
            "SWE-agent)"
        ) from None
    return sweagent_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
