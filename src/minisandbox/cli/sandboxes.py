"""The sandbox commands: `shell` (an interactive bash) and `exec` (one command)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from minisandbox.cli.aiorun import run_async
from minisandbox.cli.app import (
    WORKDIR_DEFAULT,
    AbsPathsOpt,
    CacheOpt,
    EnvsOpt,
    LayerOpt,
    MirrorOpt,
    NetworkOpt,
    QuietOpt,
    RoOpt,
    StoreOpt,
    UpperOpt,
    WorkdirOpt,
    fail,
    load_dataset,
    make_builder,
    positive_seconds,
    sandbox_config,
)

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.sandbox.config import SandboxConfig
    from minisandbox.sandbox.sandbox import Sandbox
    from minisandbox.sandbox.terminal import Terminal


TaskDatasetOpt = typer.Option(
    "examples", "--tasks", metavar="DATASET", help="The dataset --task comes from."
)
RawTerminalOpt = typer.Option(
    False,
    "--raw-terminal",
    help="Pass every escape sequence to your terminal: by default, window titles, clipboard "
    "writes (OSC 52) and other control strings from the sandbox are dropped.",
)


def shell(
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    task: str = typer.Option(
        None, "--task", metavar="ID", help="Open the environment of this task instead."
    ),
    tasks: str = TaskDatasetOpt,
    envs_dir: Path = EnvsOpt,
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    allow_abs: bool = AbsPathsOpt,
    quiet: bool = QuietOpt,
    raw_terminal: bool = RawTerminalOpt,
) -> None:
    """Open an interactive bash in a fresh sandbox. Everything is gone when you exit, unless you
    pass --upper DIR. With --task ID: in that task's environment (built first if needed).

    With input piped in (stdin not a terminal), bash runs it as a script instead, and the
    command exits with bash's exit status: echo 'python -V' | minisandbox shell"""
    from minisandbox.errors import MiniSandboxError

    try:
        opened = _open(
            task,
            tasks,
            envs_dir,
            store,
            cache,
            mirror,
            allow_abs,
            layer,
            upper,
            network,
            ro,
            workdir,
            quiet,
        )
        if sys.stdin.isatty():
            code = run_async(_interactive_shell(opened, raw_terminal))
        else:
            code = run_async(_piped_shell(opened, sys.stdin.buffer.read(), raw_terminal))
    except MiniSandboxError as e:
        fail(str(e))
    raise typer.Exit(code)


def _open(
    task: str | None,
    tasks: str,
    envs_dir: Path | None,
    store: Path | None,
    cache: Path | None,
    mirror: Path | None,
    allow_abs: bool,
    layer: list[Path] | None,
    upper: Path | None,
    network: bool,
    ro: list[Path] | None,
    workdir: str,
    quiet: bool = False,
) -> AbstractAsyncContextManager[Sandbox]:
    """The sandbox `shell` and `exec` run in: with a task, the agent's sandbox of that task
    (built first if needed); otherwise a fresh one from the sandbox options."""
    from minisandbox.sandbox.sandbox import Sandbox

    if task:
        from minisandbox.runtime import Runtime

        _refuse_sandbox_options(layer, upper, network, ro, workdir)
        (spec,) = load_dataset(tasks, envs_dir, [task], allow_abs)
        # A cold store builds first (minutes): say so on stderr, not a blank screen.
        on_phase = None if quiet else _phase_on_stderr
        runtime = Runtime(builder=make_builder(store, cache, mirror))
        # The agent's sandbox (the validation policy checked); this host's: a Sandbox.
        opened = runtime.sandbox(spec, purpose="agent", on_phase=on_phase)
        return cast("AbstractAsyncContextManager[Sandbox]", opened)
    return Sandbox(_layers_config(layer or [], upper, network, ro or [], workdir))


def _refuse_sandbox_options(
    layer: list[Path] | None, upper: Path | None, network: bool, ro: list[Path] | None, workdir: str
) -> None:
    """A task's sandbox is the agent's, as it is graded: the options that shape a plain sandbox
    would be silently ignored with --task, so each one given is an error that says so."""
    given = [
        name
        for name, value in (
            ("--layer", layer),
            ("--upper", upper),
            ("--network", network),
            ("--ro", ro),
            ("--workdir", workdir != WORKDIR_DEFAULT),
        )
        if value
    ]
    if given:
        fail(
            f"{', '.join(given)} cannot be combined with --task (a task's sandbox is the "
            "agent's, as graded): drop them, or drop --task for a plain sandbox"
        )


# Where an environment layer keeps its venv (envs.layout.VENV).
_LAYER_VENV = "opt/venv"


def _layers_config(
    layers: list[Path], upper: Path | None, network: bool, ro: list[Path], workdir: str
) -> SandboxConfig:
    """The sandbox options' SandboxConfig. A --layer or --ro that is not a directory is one
    line; a layer holding a venv at /opt/venv (an environment layer) has it on PATH and the
    host interpreter it was made from mounted read-only."""
    for option, paths in (("--layer", layers), ("--ro", ro)):
        for path in paths:
            if not path.is_dir():
                fail(f"{option} {path} is not a directory")
    venv_layers = [p for p in layers if os.path.lexists(p / _LAYER_VENV / "bin" / "python")]
    prefixes = [x for p in venv_layers if (x := _venv_interpreter(p, layers)) is not None]
    extra = [x for x in dict.fromkeys(prefixes) if x not in ro]
    config = sandbox_config(layers, upper, network, [*ro, *extra], workdir)
    if venv_layers:
        config = config.model_copy(update={"venv": "/" + _LAYER_VENV})
    return config


def _venv_interpreter(layer: Path, layers: list[Path]) -> Path | None:
    """The host directory the venv of `layer` needs mounted at its own path: the prefix of
    the interpreter its bin/python links to, or (a copied python) of pyvenv.cfg's `home`, or
    (a self-contained install, envs/helpers/standalone.sh) of the standard library its
    lib/pythonX.Y/os.py links to. None when the interpreter is in the layers themselves or
    under /usr (always mounted)."""
    venv = layer / _LAYER_VENV

    def outside(path: Path) -> bool:
        return path.exists() and not any(path.is_relative_to(p.resolve()) for p in layers)

    real = Path(os.path.realpath(venv / "bin" / "python"))
    home = _pyvenv_home(venv / "pyvenv.cfg")
    stdlib = [Path(os.path.realpath(p)) for p in sorted(venv.glob("lib/python*/os.py"))]
    if outside(real):
        prefix = real.parent.parent  # <prefix>/bin/python3.X
    elif home is not None and not any((p / home.relative_to("/")).exists() for p in layers):
        prefix = home.resolve().parent  # <prefix>/bin
    elif stdlib and outside(stdlib[0]):
        prefix = stdlib[0].parents[2]  # <prefix>/lib/python3.X/os.py
    else:
        return None
    if not prefix.is_dir() or prefix.is_relative_to("/usr") or prefix == Path("/"):
        return None
    return prefix


def _pyvenv_home(cfg: Path) -> Path | None:
    """pyvenv.cfg's `home =` (the interpreter's bin directory), if absolute."""
    try:
        lines = cfg.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home" and value.strip().startswith("/"):
            return Path(value.strip())
    return None


def _phase_on_stderr(task_id: str, phase: str) -> None:
    print(f"{task_id}: {phase}", file=sys.stderr, flush=True)


def _screen(fd: int, raw: bool) -> Callable[[bytes], bytes]:
    """What is written to `fd`, filtered when it is a terminal (cli.termfilter) unless `raw`."""
    if raw or not os.isatty(fd):
        return lambda data: data
    from minisandbox.cli.termfilter import TerminalFilter

    return TerminalFilter().feed


async def _interactive_shell(opened: AbstractAsyncContextManager[Sandbox], raw: bool) -> int:
    from minisandbox.sandbox.terminal import open_terminal

    cols, rows = shutil.get_terminal_size()
    env = {"TERM": os.environ.get("TERM", "xterm"), "PS1": r"(sandbox) \w\$ "}
    async with opened as sb:
        term = await open_terminal(
            sb, ["/bin/bash", "--noprofile", "--norc", "-i"], env=env, rows=rows, columns=cols
        )
        term.release_peer()  # bash holds the terminal: from now on EIO means it exited
        try:
            await _relay(term, _screen(sys.stdout.fileno(), raw))
        finally:
            term.close()
    return 0


# A piped-in script runs as long as it takes, as an interactive shell would (a command's
# default timeout is Limits.command_timeout).
_NO_TIMEOUT = 10 * 365 * 24 * 3600.0


async def _piped_shell(
    opened: AbstractAsyncContextManager[Sandbox], script: bytes, raw: bool
) -> int:
    """Run `script` (the piped-in input) with a non-interactive bash: no prompt, no line
    editing; its output streamed (filtered where it goes to a terminal); bash's exit status
    returned."""
    async with opened as sb:
        result = await sb.execute(
            ["/bin/bash", "--noprofile", "--norc", "-s"],
            stdin=script,
            timeout=_NO_TIMEOUT,
            on_output=_streamer(raw),
        )
    return result.exit_code


def _streamer(raw: bool) -> Callable[[int, bytes], None]:
    """An `on_output` that writes a command's streams to ours, each through `_screen`."""
    screens = {1: _screen(sys.stdout.fileno(), raw), 2: _screen(sys.stderr.fileno(), raw)}

    def stream(fd: int, chunk: bytes) -> None:
        out = sys.stdout.buffer if fd == 1 else sys.stderr.buffer
        out.write(screens[fd](chunk))
        out.flush()

    return stream


async def _relay(term: Terminal, screen: Callable[[bytes], bytes]) -> None:
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
        shown = screen(data)
        while shown:  # a terminal may take less than all of it
            shown = shown[os.write(stdout_fd, shown) :]

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
    command: list[str] = typer.Argument(
        ..., metavar="COMMAND", help="The command and its arguments, after --."
    ),
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    timeout: float = typer.Option(
        None,
        "--timeout",
        "-t",
        metavar="SECONDS",
        callback=positive_seconds,
        help="Kill the command after this many seconds (exit code 124).",
    ),
    task: str = typer.Option(
        None, "--task", metavar="ID", help="Run it in this task's environment instead."
    ),
    tasks: str = TaskDatasetOpt,
    envs_dir: Path = EnvsOpt,
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    allow_abs: bool = AbsPathsOpt,
    quiet: bool = QuietOpt,
    raw_terminal: bool = RawTerminalOpt,
) -> None:
    """Run one command in a fresh sandbox, stream its output, and exit with its exit code.
    With --task ID: in that task's environment (built first if needed), as an agent sees it.

    Examples: minisandbox exec --layer ./env -- python -c 'print(1)';
    minisandbox exec --task examples__semverkit-1 -- python -m pytest -q"""
    from minisandbox.errors import CommandTimeoutError, MiniSandboxError

    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        opened = _open(
            task,
            tasks,
            envs_dir,
            store,
            cache,
            mirror,
            allow_abs,
            layer,
            upper,
            network,
            ro,
            workdir,
            quiet,
        )
        code = run_async(_exec(opened, command, timeout, stdin, raw_terminal))
    except CommandTimeoutError as e:
        typer.secho(f"minisandbox: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(124) from None
    except MiniSandboxError as e:
        fail(str(e))
    raise typer.Exit(code)


async def _exec(
    opened: AbstractAsyncContextManager[Sandbox],
    command: list[str],
    timeout: float | None,
    stdin: bytes | None,
    raw: bool,
) -> int:
    async with opened as sb:
        result = await sb.execute(command, timeout=timeout, stdin=stdin, on_output=_streamer(raw))
    return result.exit_code
