"""Files that ship in the package (helper programs, data), read once per process."""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def package_text(package: str, *parts: str) -> str:
    """The text (UTF-8) of the file at `parts` under `package`'s directory."""
    node = resources.files(package)
    for part in parts:
        node = node / part
    return node.read_text("utf-8")
