"""What `minisandbox shell` passes from the sandbox to the user's terminal: window titles,
clipboard writes (OSC 52) and other control strings are dropped, everything else (text,
colours) is not; --raw-terminal passes them all. Unit cases over every way a stream can be cut
into chunks, then the real CLI on a real pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from conftest import CLI
from minisandbox.cli.termfilter import TerminalFilter

ESC = b"\x1b"
CLIPBOARD = ESC + b"]52;c;cm0gLXJmIH4K" + b"\x07"  # "rm -rf ~" into the host's clipboard
TITLE = ESC + b"]0;owned" + ESC + b"\\"
DCS = ESC + b"Ptmux;" + ESC + ESC + b"]52;c;eA==\x07" + ESC + b"\\"
RED = ESC + b"[31mred" + ESC + b"[0m"


def _filtered(data: bytes, cuts: list[int]) -> bytes:
    f = TerminalFilter()
    out, last = b"", 0
    for cut in [*cuts, len(data)]:
        out += f.feed(data[last:cut])
        last = cut
    return out


@pytest.mark.parametrize(
    ("stream", "shown"),
    [
        (b"a" + CLIPBOARD + b"b", b"ab"),
        (TITLE + RED + b"\n", RED + b"\n"),
        # tmux's passthrough: the doubled ESC aborts the DCS in a terminal and opens an OSC.
        (b"x" + DCS + b"y", b"x" + ESC + b"\\y"),
        (
            ESC + b"_apc" + ESC + b"\\" + ESC + b"^pm" + ESC + b"\\" + ESC + b"Xsos" + ESC + b"\\",
            b"",
        ),
        # A string aborted by CAN, or by an escape sequence (which is then kept).
        (ESC + b"]0;t\x18after", b"after"),
        (ESC + b"]0;t" + ESC + b"[1mbold", ESC + b"[1mbold"),
        (ESC + ESC + b"[2J", ESC + b"[2J"),
        (b"plain \xe2\x82\xac text\r\n", b"plain \xe2\x82\xac text\r\n"),
    ],
)
def test_strings_dropped_however_the_stream_is_cut(stream: bytes, shown: bytes) -> None:
    assert _filtered(stream, []) == shown
    for i in range(len(stream) + 1):
        assert _filtered(stream, [i]) == shown, f"cut at {i}"
    assert _filtered(stream, list(range(len(stream)))) == shown, "byte by byte"


_PRINT = (
    r"printf 'A\033]52;c;cm0gLXJmIH4K\007B\033]0;owned\033\\C\033[31mred\033[0m\n'; exit" + "\n"
)


def _on_a_terminal(args: list[str], *, piped: bool, timeout: float = 120) -> bytes:
    """Run the CLI with its stdout (and, unless `piped`, stdin) on a new pseudo-terminal;
    everything it wrote there."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*CLI, *args],
            stdin=subprocess.PIPE if piped else slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        slave = -1
        if piped:
            assert proc.stdin is not None
            proc.stdin.write(_PRINT.encode())
            proc.stdin.close()
        out = b""
        deadline = time.monotonic() + timeout
        typed = piped
        while time.monotonic() < deadline:
            if not typed and b"(sandbox)" in out:  # typed before: raw mode would discard it
                os.write(master, _PRINT.encode())
                typed = True
            ready, _, _ = select.select([master], [], [], 1)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed
                break
            if not chunk:
                break
            out += chunk
        proc.kill()
        proc.wait()
        return out
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


@pytest.mark.parametrize("piped", [False, True], ids=["interactive", "piped"])
def test_shell_drops_clipboard_and_title_on_a_terminal(piped: bool) -> None:
    out = _on_a_terminal(["shell"], piped=piped)
    assert b"A" in out and b"B" in out and ESC + b"[31mred" in out, f"output lost: {out!r}"
    # (The typed command is echoed, as text: only the sequences themselves must not pass.)
    assert ESC + b"]52;" not in out and ESC + b"]0;" not in out, f"strings passed: {out!r}"


def test_raw_terminal_passes_them() -> None:
    out = _on_a_terminal(["shell", "--raw-terminal"], piped=True)
    assert ESC + b"]52;c;cm0gLXJmIH4K" in out and ESC + b"]0;owned" in out, out
