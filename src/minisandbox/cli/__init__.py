"""The `minisandbox` command line.

- `main`: the typer app with every command, the one-line error exit;
- `app`: the app, the options commands share, the builder;
- `sandboxes`: `shell` and `exec`; `demo`; `tasks`; `build` (and `build_all`, which `eval`
  uses); `evaluate`: `eval`; `cache`: the `cache` commands;
- `warm`: a process per node and user that keeps all of this imported, so that a short command
  (`exec`) costs a fork of it instead of a second of imports (`warm` is the caller's side,
  `warmserver` the warm process's);
- `progress`: per-instance progress on stderr; `aiorun`: asyncio.run made to end;
- `oserrors`: an OSError (disk full, quota, permission) explained by the place it hit.

This module imports nothing heavy: the console script's first step is `warm.run_warm`, which
needs only the standard library's socket, os and json.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # (not typing's: the warm path imports nothing it does not use)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["main"]


def main() -> None:
    """The `minisandbox` command: through the node's warm process where it can take the command
    (`warm`), else in this process (`minisandbox.cli.main`)."""
    from minisandbox.cli import warm

    code = warm.run_warm(sys.argv)
    if code is not None:
        sys.exit(code)
    from minisandbox.cli.main import main as run_here

    try:
        run_here()
    finally:
        warm.after_run_here()


def __getattr__(name: str) -> Any:
    if name == "app":  # (the app, for callers that took it from here)
        from minisandbox.cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
