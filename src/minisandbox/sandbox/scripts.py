"""Programs that run inside sandboxes, kept as files in helpers/ and read once per process.

Each is run as `sh -c SCRIPT sh ARGS...`: its text travels in the command line, nothing is
installed in the sandbox."""

from __future__ import annotations

import functools

from minisandbox.utils.resources import package_text


def helper(name: str) -> str:
    """The text of helpers/`name`."""
    return package_text("minisandbox.sandbox", "helpers", name)


@functools.cache
def file_helper(name: str) -> str:
    """helpers/`name` after the prelude helpers/fail.sh, which sets PATH and LC_ALL and defines
    `fail`: the exit statuses that files.CAUSES maps to errno values."""
    return helper("fail.sh") + "\n" + helper(name)
