"""Bounded output capture: an agent that prints gigabytes must not take down its supervisor."""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_MAX_OUTPUT = 4 * 1024 * 1024


class CappedOutput:
    """Keeps the first and the last `cap // 2` bytes of a stream and counts what fell between."""

    def __init__(
        self, cap: int | None = DEFAULT_MAX_OUTPUT, tee: Callable[[bytes], None] | None = None
    ) -> None:
        self.cap = cap
        self.tee = tee  # sees every byte, kept or not (for streaming)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def write(self, data: bytes) -> None:
        if self.tee is not None:
            self.tee(data)
        if self.cap is None:
            self.head += data
            return
        half = self.cap // 2
        if len(self.head) < half:
            take = half - len(self.head)
            self.head += data[:take]
            data = data[take:]
        if not data:
            return
        self.tail += data
        excess = len(self.tail) - (self.cap - half)
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def getvalue(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        note = f"\n[... {self.dropped} bytes of output omitted ...]\n".encode()
        return bytes(self.head) + note + bytes(self.tail)

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


def decode(data: bytes) -> str:
    """Text for callers; bytes that are not UTF-8 become backslash escapes, never an error."""
    return data.decode("utf-8", errors="backslashreplace")
