"""The `minisandbox` command line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=(
        "Container-free sandboxes for software-engineering agents: unprivileged Linux "
        "namespaces (bubblewrap), an overlay root over read-only layers, seccomp and resource "
        "limits. No root, no daemon."
    ),
)

LayerOpt = typer.Option(
    None,
    "--layer",
    "-l",
    help="A read-only directory whose content is overlaid at / (repeatable; first is lowest).",
)
UpperOpt = typer.Option(
    None, "--upper", help="Keep everything the sandbox writes in this directory (default: discard)."
)
NetworkOpt = typer.Option(False, "--network", help="Give the sandbox the host's network.")
RoOpt = typer.Option(
    None,
    "--ro",
    help="A host directory to show read-only at its own path, e.g. a Python install (repeatable).",
)
WorkdirOpt = typer.Option("/testbed", "--workdir", "-w", help="Working directory inside.")


def _config(
    layer: list[Path] | None,
    upper: Path | None,
    network: bool,
    ro: list[Path] | None,
    workdir: str,
):  # type: ignore[no-untyped-def]
    from .config import SandboxConfig

    try:
        return SandboxConfig(
            layers=layer or [], upper=upper, network=network, ro_paths=ro or [], workdir=workdir
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _fail(message: str) -> None:
    typer.secho(f"minisandbox: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def shell(
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
) -> None:
    """Open an interactive bash in a fresh sandbox. Everything is gone when you exit, unless you
    pass --upper DIR."""
    from .errors import MiniSandboxError

    config = _config(layer, upper, network, ro, workdir)
    try:
        code = asyncio.run(_interactive_shell(config))
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _interactive_shell(config) -> int:  # type: ignore[no-untyped-def]
    import termios
    import tty

    from .sandbox import Sandbox
    from .session import open_terminal

    cols, rows = shutil.get_terminal_size()
    env = {"TERM": os.environ.get("TERM", "xterm"), "PS1": r"(sandbox) \w\$ "}
    async with Sandbox(config) as sb:
        term = await open_terminal(
            sb, ["/bin/bash", "--noprofile", "--norc", "-i"], env=env, rows=rows, columns=cols
        )
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
            term.release_peer()  # bash is up: from now on EIO means it exited
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
            term.close()
    return 0


@app.command(name="exec", context_settings={"allow_interspersed_args": False})
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
    from .errors import CommandTimeoutError, MiniSandboxError

    config = _config(layer, upper, network, ro, workdir)
    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        code = asyncio.run(_exec(config, command, timeout, stdin))
    except CommandTimeoutError as e:
        typer.secho(f"minisandbox: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(124) from None
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _exec(config, command: list[str], timeout: float | None, stdin: bytes | None) -> int:  # type: ignore[no-untyped-def]
    from .sandbox import Sandbox

    def stream(fd: int, chunk: bytes) -> None:
        out = sys.stdout.buffer if fd == 1 else sys.stderr.buffer
        out.write(chunk)
        out.flush()

    async with Sandbox(config) as sb:
        result = await sb.execute(command, timeout=timeout, stdin=stdin, on_output=stream)
    return result.exit_code


@app.command()
def demo(
    sandboxes: int = typer.Option(4, "--sandboxes", "-n", help="How many sandboxes to start."),
) -> None:
    """Start a few sandboxes side by side and show what each one can and cannot do."""
    from .errors import MiniSandboxError

    try:
        asyncio.run(_demo(sandboxes))
    except MiniSandboxError as e:
        _fail(str(e))


async def _demo(n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from .sandbox import Sandbox

    console = Console()
    table = Table(title=f"{n} sandboxes, started concurrently")
    for col in ("sandbox", "start ms", "whoami", "hostname", "sees host home", "net", "session"):
        table.add_column(col)

    async def one(i: int) -> list[str]:
        began = time.perf_counter()
        async with Sandbox(hostname=f"demo-{i}") as sb:
            started_ms = (time.perf_counter() - began) * 1000
            who = await sb.execute("whoami; hostname")
            home = os.path.expanduser("~")
            probe = await sb.execute(["ls", home])
            net = await sb.execute(
                ["bash", "-c", "exec 3<>/dev/tcp/1.1.1.1/53 && echo reachable || echo blocked"]
            )
            session = await sb.create_session()
            await session.run(f"cd /tmp && export DEMO={i}")
            state = await session.run("echo $PWD $DEMO")
            user, host = [*who.stdout.split(), "?", "?"][:2]
            return [
                sb.id,
                f"{started_ms:.0f}",
                user,
                host,
                "yes" if probe.exit_code == 0 and probe.stdout.strip() else "no",
                net.stdout.strip().splitlines()[-1] if net.stdout.strip() else "blocked",
                state.output.strip(),
            ]

    rows = await asyncio.gather(*(one(i) for i in range(n)))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(
        "Each sandbox: its own user, pid, mount, ipc, uts and network namespaces, an overlay "
        "root, a seccomp filter; nothing of your home is visible and nothing it writes "
        "reaches the host."
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
