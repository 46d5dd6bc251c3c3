"""What `minisandbox shell` lets through from the sandbox to the user's terminal.

A program in the sandbox writes to the host's terminal: ordinary text, colours and cursor
movement are its business, but some escape sequences reach beyond the terminal's screen. An
OSC string sets the window title (which a later "report title" query would type back as
input), writes the clipboard (OSC 52: the next paste on the host runs what the sandbox chose),
sets hyperlinks or notifications; DCS, APC, PM and SOS strings carry device control and
terminal-specific commands (tmux passthrough among them). These strings are dropped, whole,
however the output is cut into chunks. Everything else passes unchanged.
"""

from __future__ import annotations

_ESC = 0x1B
_BEL = 0x07
# What ends a control string early, as in a terminal's parser: CAN and SUB abort it.
_ABORT = (0x18, 0x1A)
# ESC followed by one of these opens a control string: ] OSC, P DCS, _ APC, ^ PM, X SOS.
_STRING_OPENERS = frozenset(b"]P_^X")


class TerminalFilter:
    """Drops OSC, DCS, APC, PM and SOS strings from a byte stream fed in chunks."""

    def __init__(self) -> None:
        self._in_string: int | None = None  # the opener of the string being dropped
        self._escape = False  # the last byte seen was ESC (held back)

    def feed(self, data: bytes) -> bytes:
        """The part of `data` to show (an ESC at the end is held until the next chunk)."""
        out = bytearray()
        for byte in data:
            if self._in_string is not None:
                out += self._string_byte(byte)
            elif self._escape:
                out += self._after_escape(byte)
            elif byte == _ESC:
                self._escape = True
            else:
                out.append(byte)
        return bytes(out)

    def _after_escape(self, byte: int) -> bytes:
        self._escape = False
        if byte in _STRING_OPENERS:
            self._in_string = byte
            return b""
        if byte == _ESC:  # a terminal forgets the first: ESC ESC is one ESC
            self._escape = True
            return b""
        return bytes((_ESC, byte))

    def _string_byte(self, byte: int) -> bytes:
        if self._escape:  # ESC \ (ST) ends the string; ESC and anything else aborts it and
            self._escape = False  # starts an escape sequence, as in a terminal
            self._in_string = None
            return b"" if byte == ord("\\") else self._after_escape(byte)
        if byte == _ESC:
            self._escape = True
        elif (byte == _BEL and self._in_string == ord("]")) or byte in _ABORT:
            self._in_string = None
        return b""
