"""Adapters that put minisandbox under other stacks, each an optional extra and a thin layer
over the core: SWE-ReX / SWE-agent (`swerex`, `sweagent`), mini-swe-agent (`minisweagent`),
SkyRL (`skyrl`). `tasks` holds what they share: naming a task, opening its sandbox, scoring it."""
