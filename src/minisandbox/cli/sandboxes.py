"""The sandbox commands: `shell` (an interactive bash) and `exec` (one command)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from minisandbox.cli.aiorun import run_async
from minisandbox.cli.app import (
    AbsPathsOpt,
    CacheOpt,
    EnvsOpt,
    LayerOpt,
    MirrorOpt,
    NetworkOpt,
    RoOpt,
    StoreOpt,
    UpperOpt,
    WorkdirOpt,
    fail,
    load_dataset,
    make_builder,
    sandbox_config,
)

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.sandbox.config import SandboxConfig
    from minisandbox.sandbox.sandbox import Sandbox
    from minisandbox.sandbox.terminal import Terminal


def shell(
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    task: str = typer.Option(None, "--task", help="Open the environment of this task instead."),
    tasks: str = typer.Option("examples", "--tasks", help="The dataset --task comes from."),
    envs_dir: Path = EnvsOpt,
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """Open an interactive bash in a fresh sandbox. Everything is gone when you exit, unless you
    pass --upper DIR. With --task ID: in that task's environment (built first if needed)."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.sandbox.sandbox import Sandbox

    opened: AbstractAsyncContextManager[Sandbox]
    try:
        if task:
            from minisandbox.evaluation.validation import agent_sandbox

            (spec,) = load_dataset(tasks, envs_dir, [task], allow_abs)
            opened = agent_sandbox(make_builder(store, cache, mirror), spec)
        else:
            opened = Sandbox(sandbox_config(layer, upper, network, ro, workdir))
        code = run_async(_interactive_shell(opened))
    except MiniSandboxError as e:
        fail(str(e))
    raise typer.Exit(code)


async def _interactive_shell(opened: AbstractAsyncContextManager[Sandbox]) -> int:
    from minisandbox.sandbox.terminal import open_terminal

    cols, rows = shutil.get_terminal_size()
    env = {"TERM": os.environ.get("TERM", "xterm"), "PS1": r"(sandbox) \w\$ "}
    async with opened as sb:
        term = await open_terminal(
            sb, ["/bin/bash", "--noprofile", "--norc", "-i"], env=env, rows=rows, columns=cols
        )
        term.release_peer()  # bash holds the terminal: from now on EIO means it exited
        try:
            await _relay(term)
        finally:
            term.close()
    return 0


async def _relay(term: Terminal) -> None:
    """Copy the user's keystrokes to the sandbox's terminal and its output back, in raw mode
    on a terminal (and following its size), until bash exits."""
    import termios
    import tty

    loop = asyncio.get_running_loop()
    done = loop.create_future()
    stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()
    interactive = os.isatty(stdin_fd)
    saved = termios.tcgetattr(stdin_fd) if interactive else None

    def from_sandbox() -> None:
        try:
            data = os.read(term.master, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if not done.done():
                done.set_result(None)
            return
        os.write(stdout_fd, data)

    def from_user() -> None:
        data = os.read(stdin_fd, 65536)
        if not data:
            loop.remove_reader(stdin_fd)
            return
        os.write(term.master, data)

    def resize(*_: object) -> None:
        import fcntl
        import struct

        c, r = shutil.get_terminal_size()
        fcntl.ioctl(term.master, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))

    try:
        if interactive:
            tty.setraw(stdin_fd)
            loop.add_signal_handler(signal.SIGWINCH, resize)
        loop.add_reader(term.master, from_sandbox)
        loop.add_reader(stdin_fd, from_user)
        await done
    finally:
        loop.remove_reader(term.master)
        with contextlib.suppress(Exception):
            loop.remove_reader(stdin_fd)
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)


def exec_(
    command: list[str] = typer.Argument(..., help="The command and its arguments, after --."),
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    timeout: float = typer.Option(
        None, "--timeout", "-t", help="Kill the command after this many seconds (exit code 124)."
    ),
) -> None:
    """Run one command in a fresh sandbox, stream its output, and exit with its exit code.

    Example: minisandbox exec --layer ./env -- python -c 'print(1)'"""
    from minisandbox.errors import CommandTimeoutError, MiniSandboxError

    config = sandbox_config(layer, upper, network, ro, workdir)
    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        code = run_async(_exec(config, command, timeout, stdin))
    except CommandTimeoutError as e:
        typer.secho(f"minisandbox: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(124) from None
    except MiniSandboxError as e:
        fail(str(e))
    raise typer.Exit(code)


async def _exec(
    config: SandboxConfig, command: list[str], timeout: float | None, stdin: bytes | None
) -> int:
    from minisandbox.sandbox.sandbox import Sandbox

    def stream(fd: int, chunk: bytes) -> None:
        out = sys.stdout.buffer if fd == 1 else sys.stderr.buffer
        out.write(chunk)
        out.flush()

    async with Sandbox(config) as sb:
        result = await sb.execute(command, timeout=timeout, stdin=stdin, on_output=stream)
    return result.exit_code
