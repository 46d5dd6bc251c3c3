"""Mounts the grader makes inside a running sandbox, from the host (helpers/mounts.py): the test
runner made read-only where it is, a file of ours bound over one of the sandbox's."""

from __future__ import annotations

import asyncio
import sys

from minisandbox.errors import SandboxFileError
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.utils.resources import package_text


async def mount_in(sb: SandboxAPI, mode: str, *args: str) -> None:
    """Run helpers/mounts.py's `mode` ("read-only" paths, or "bind-over" source target) in the
    sandbox's mount namespace.

    Raises:
        SandboxFileError: the sandbox is not running, or the kernel refused a mount (its
            message says which).
    """
    if sb.pid is None:
        raise SandboxFileError("the sandbox is not running")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        package_text("minisandbox.evaluation", "helpers", "mounts.py"),
        mode,
        str(sb.pid),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxFileError(f"{mode} {' '.join(args)}: {out.decode().strip()}")
