"""SkyRL's training config with minisandbox's sections (needs `skyrl`, the trainer package).

SkyRL 0.4.0 builds its config from typed dataclasses and rejects a key no dataclass declares,
so `environment.skyrl_gym.minisandbox_swe.*` (this environment's settings) and
`generator.mini_swe_agent.*` (the mini-swe-agent generator's) need subclasses of its config
classes, as its own environments' settings are fields of `SkyRLGymConfig`:

    MiniSandboxTrainConfig.from_cli_overrides([
        "environment.skyrl_gym.minisandbox_swe.timeout=120", "generator.max_turns=30", ...])

`minisandbox.integrations.skyrl_train`'s entrypoint parses the command line with it.

No `from __future__ import annotations` here: SkyRL's loader finds nested config classes from
the fields' annotations, which must be the classes themselves, not strings.
"""

from dataclasses import dataclass, field

from skyrl.train.config import (
    EnvironmentConfig,
    GeneratorConfig,
    SkyRLGymConfig,
    SkyRLTrainConfig,
)

from minisandbox.integrations.skyrl import ENV_ID, MiniSandboxSWEEnvConfig

__all__ = [
    "MiniSWEAgentConfig",
    "MiniSandboxGeneratorConfig",
    "MiniSandboxSWEEnvConfig",
    "MiniSandboxSkyRLEnvironmentConfig",
    "MiniSandboxSkyRLGymConfig",
    "MiniSandboxTrainConfig",
]


@dataclass
class MiniSandboxSkyRLGymConfig(SkyRLGymConfig):
    """SkyRL's per-environment settings plus `minisandbox_swe`'s."""

    minisandbox_swe: MiniSandboxSWEEnvConfig = field(default_factory=MiniSandboxSWEEnvConfig)
    """The `minisandbox_swe` environment's settings (its `env_config`)."""


@dataclass
class MiniSandboxSkyRLEnvironmentConfig(EnvironmentConfig):
    """SkyRL's `environment` section, with `minisandbox_swe` among the skyrl-gym settings."""

    env_class: str = ENV_ID
    """The rows' default environment (a row's `env_class` column takes precedence)."""
    skyrl_gym: MiniSandboxSkyRLGymConfig = field(default_factory=MiniSandboxSkyRLGymConfig)
    """skyrl-gym environments' settings, by environment name."""


@dataclass
class MiniSWEAgentConfig:
    """The mini-swe-agent generator's settings (`generator.mini_swe_agent`)."""

    enabled: bool = False
    """Generate with mini-swe-agent 2.x agents on task sandboxes (`MiniSWEAgentGenerator`)
    instead of SkyRL's `SkyRLGymGenerator` stepping the rows' skyrl-gym environments."""
    config: str = "swebench_backticks"
    """mini-swe-agent config: a YAML file or the name of one of its builtin configs. Its `agent`
    section (templates; `step_limit` is replaced by `generator.max_turns`), its
    `environment` section (`cwd`, `env`; task sandboxes come from
    `environment.skyrl_gym.minisandbox_swe`) and its `model` section's templates and
    `action_regex` are used; the model is always the policy being trained."""
    traj_dir: str = ""
    """Save each episode's mini-swe-agent trajectory under this directory
    (`step_<global step>/<train|eval>/<instance>_<repetition>.traj.json`); "" saves none."""


@dataclass
class MiniSandboxGeneratorConfig(GeneratorConfig):
    """SkyRL's `generator` section plus `mini_swe_agent`."""

    mini_swe_agent: MiniSWEAgentConfig = field(default_factory=MiniSWEAgentConfig)
    """The mini-swe-agent generator (off unless `generator.mini_swe_agent.enabled=true`)."""


@dataclass
class MiniSandboxTrainConfig(SkyRLTrainConfig):
    """SkyRL's root training config with minisandbox's `environment` and `generator` sections."""

    generator: MiniSandboxGeneratorConfig = field(default_factory=MiniSandboxGeneratorConfig)
    """SkyRL's generator settings plus `mini_swe_agent`."""
    environment: MiniSandboxSkyRLEnvironmentConfig = field(
        default_factory=MiniSandboxSkyRLEnvironmentConfig
    )
    """SkyRL's environment settings plus `skyrl_gym.minisandbox_swe`."""
