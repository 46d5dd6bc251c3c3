"""The one way to find uv: PATH, then beside this interpreter (a venv with uv installed), then
the `uv` package's own binary."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from minisandbox.errors import UvNotFoundError


def find_uv() -> Path | None:
    """The uv binary (resolved), or None when there is none."""
    found = shutil.which("uv")
    if found:
        return Path(found).resolve()
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.resolve()
    try:
        from uv import find_uv_bin

        return Path(find_uv_bin()).resolve()
    except (ImportError, FileNotFoundError):
        return None


def uv_binary() -> Path:
    """The uv binary.

    Raises:
        UvNotFoundError: there is none (building environments needs it).
    """
    found = find_uv()
    if found is None:
        raise UvNotFoundError("building environments needs uv: pip install uv")
    return found
