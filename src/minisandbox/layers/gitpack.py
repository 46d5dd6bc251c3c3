"""Reading blobs out of a git pack, so that a layer stores a file once when it also holds the
file's object in a repository's pack (a task's checkout is its history's blobs at HEAD).

A layer's manifest may then say "this file is the object at `offset` of pack `P`" (a "g" row,
manifest.py) instead of naming a blob: publishing proves it by reading the object back and
comparing it with the file; unpacking reads it again and checks it against the row's sha256.
Packs here come from trees a sandbox could write, so this reader trusts nothing in them: every
offset and size is checked, delta chains are bounded, and anything odd is a `GitPackError`.

Formats: git's pack (version 2 or 3) and pack index (version 2), gitformat-pack(5).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import mmap
import struct
import zlib
from collections import OrderedDict
from collections.abc import Sequence

_BLOB = 3
_OFS_DELTA = 6
_REF_DELTA = 7
_KINDS = {1, 2, 3, 4}
MAX_DEPTH = 128  # git writes at most 4095 (pack.depth caps it); ours write 50
MAX_OBJECT_BYTES = 1 << 30
_CACHE_BYTES = 64 << 20  # resolved delta bases kept while reading one pack


class GitPackError(Exception):
    """The pack or its index is not what it claims (truncated, malformed, hostile)."""


def blob_id(data: bytes) -> bytes:
    """Git's object id (SHA-1) of `data` as a blob."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).digest()


class PackIndex:
    """A version-2 pack index: object id -> offset in its pack."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 8 + 1024 or data[:8] != b"\xfftOc\x00\x00\x00\x02":
            raise GitPackError("not a version-2 pack index")
        fanout = struct.unpack_from(">256I", data, 8)
        if any(a > b for a, b in itertools.pairwise(fanout)):
            raise GitPackError("pack index fan-out is not sorted")
        self.count = n = fanout[255]
        self._fanout = fanout
        self._ids = 8 + 1024
        self._offsets = self._ids + 24 * n  # ids (20 bytes), then CRCs (4), then offsets (4)
        self._large = self._offsets + 4 * n
        if len(data) < self._large + 40:
            raise GitPackError("pack index is truncated")
        self._data = data
        self._sorted_ids = _IdView(data, self._ids, n)

    def offset(self, oid: bytes) -> int | None:
        """Where object `oid` starts in the pack; None when the pack does not hold it."""
        if len(oid) != 20:
            return None
        lo = self._fanout[oid[0] - 1] if oid[0] else 0
        hi = self._fanout[oid[0]]
        i = bisect.bisect_left(self._sorted_ids, oid, lo, hi)
        if i >= hi or self._sorted_ids[i] != oid:
            return None
        (value,) = struct.unpack_from(">I", self._data, self._offsets + 4 * i)
        if not value & 0x80000000:
            return int(value)
        at = self._large + 8 * (value & 0x7FFFFFFF)
        if at + 8 > len(self._data) - 40:
            raise GitPackError("pack index large offset out of range")
        return int(struct.unpack_from(">Q", self._data, at)[0])


class _IdView(Sequence[bytes]):
    """The sorted object ids of an index as a sequence, for bisect (no copy of the table)."""

    def __init__(self, data: bytes, start: int, count: int) -> None:
        self._data, self._start, self._count = data, start, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> bytes:  # type: ignore[override]  # bisect never slices
        at = self._start + 20 * i
        return self._data[at : at + 20]


def _apply_delta(base: bytes, delta: bytes) -> bytes:
    """git's delta format: the source and result sizes, then copy and insert instructions."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(delta) or shift > 63:
                raise GitPackError("delta header is truncated")
            c = delta[pos]
            pos += 1
            value |= (c & 0x7F) << shift
            shift += 7
            if not c & 0x80:
                return value

    if varint() != len(base):
        raise GitPackError("delta base has the wrong size")
    size = varint()
    if size > MAX_OBJECT_BYTES:
        raise GitPackError("delta result too large")
    out = bytearray()
    n = len(delta)
    while pos < n:
        cmd = delta[pos]
        pos += 1
        if cmd & 0x80:  # copy from the base
            # Bits 0-3 say which bytes of the offset follow, bits 4-6 which of the length.
            value = 0
            for bit in range(7):
                if cmd & (1 << bit):
                    if pos >= n:
                        raise GitPackError("delta copy is truncated")
                    value |= delta[pos] << (8 * bit)
                    pos += 1
            offset, length = value & 0xFFFFFFFF, (value >> 32) or 0x10000
            if offset + length > len(base):
                raise GitPackError("delta copies past its base")
            out += base[offset : offset + length]
        elif cmd:  # insert the next `cmd` bytes
            if pos + cmd > n:
                raise GitPackError("delta insert is truncated")
            out += delta[pos : pos + cmd]
            pos += cmd
        else:
            raise GitPackError("delta instruction 0")
        if len(out) > size:
            raise GitPackError("delta result longer than it says")
    if len(out) != size:
        raise GitPackError("delta result shorter than it says")
    return bytes(out)


class PackReader:
    """Objects of one pack (its bytes, e.g. an mmap) with its index (for REF_DELTA bases)."""

    def __init__(self, pack: bytes | mmap.mmap, index: PackIndex | None) -> None:
        self.pack = pack
        self.index = index
        if len(pack) < 32 or bytes(pack[:4]) != b"PACK":
            raise GitPackError("not a git pack")
        version, self.count = struct.unpack_from(">II", pack, 4)
        if version not in (2, 3):
            raise GitPackError(f"pack version {version}")
        self._end = len(pack) - 20  # the trailing checksum
        self._cache: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        self._cached = 0

    def _header(self, offset: int) -> tuple[int, int, int]:
        """(type, inflated size, where the data starts) of the object at `offset`."""
        if not 12 <= offset < self._end:
            raise GitPackError(f"object offset {offset} outside the pack")
        pos = offset
        c = self.pack[pos]
        pos += 1
        kind, size, shift = (c >> 4) & 7, c & 15, 4
        while c & 0x80:
            if pos >= self._end or shift > 63:
                raise GitPackError("object header is truncated")
            c = self.pack[pos]
            pos += 1
            size |= (c & 0x7F) << shift
            shift += 7
        if size > MAX_OBJECT_BYTES:
            raise GitPackError("object too large")
        return kind, size, pos

    def _inflate(self, pos: int, size: int) -> bytes:
        # A deflate stream is at most a little longer than what it holds (stored blocks).
        window = self.pack[pos : min(self._end, pos + size + (size >> 10) + 64)]
        d = zlib.decompressobj()
        try:
            out = d.decompress(window, size + 1)
        except zlib.error as e:
            raise GitPackError(f"object data: {e}") from None
        if not d.eof or len(out) != size:
            raise GitPackError("object data has the wrong length")
        return out

    def read(self, offset: int) -> tuple[int, bytes]:
        """(type, content) of the object at `offset`, its deltas applied."""
        chain: list[tuple[int, bytes]] = []  # (offset, delta) from the object down
        at = offset
        while True:
            if at in self._cache:
                self._cache.move_to_end(at)
                kind, data = self._cache[at]
                break
            if len(chain) > MAX_DEPTH:
                raise GitPackError("delta chain too deep (or a cycle)")
            kind, size, pos = self._header(at)
            if kind in _KINDS:
                data = self._inflate(pos, size)
                break
            if kind == _OFS_DELTA:
                c = self.pack[pos]
                pos += 1
                back = c & 0x7F
                while c & 0x80:
                    if pos >= self._end or back > self._end:
                        raise GitPackError("delta offset is truncated")
                    c = self.pack[pos]
                    pos += 1
                    back = ((back + 1) << 7) | (c & 0x7F)
                base = at - back
                if not 12 <= base < at:
                    raise GitPackError("delta base is not before its delta")
            elif kind == _REF_DELTA:
                oid = bytes(self.pack[pos : pos + 20])
                pos += 20
                found = self.index.offset(oid) if self.index is not None else None
                if found is None:
                    raise GitPackError(f"delta base {oid.hex()} is not in the pack")
                base = found
            else:
                raise GitPackError(f"object type {kind}")
            chain.append((at, self._inflate(pos, size)))
            at = base
        for at, delta in reversed(chain):
            data = _apply_delta(data, delta)
            self._remember(at, kind, data)
        return kind, data

    def _remember(self, offset: int, kind: int, data: bytes) -> None:
        if len(data) > _CACHE_BYTES // 4:
            return
        self._cache[offset] = (kind, data)
        self._cached += len(data)
        while self._cached > _CACHE_BYTES:
            _, (_, old) = self._cache.popitem(last=False)
            self._cached -= len(old)

    def file(self, offset: int, size: int, sha256: str) -> bytes:
        """The blob at `offset`, which must be `size` bytes whose sha256 is `sha256` (what a
        manifest's row says the file is); GitPackError otherwise."""
        data = self.blob(offset)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise GitPackError(f"object {offset} is not the content of the file")
        return data

    def blob(self, offset: int) -> bytes:
        """The content of the blob at `offset`; GitPackError when it is not a blob."""
        kind, data = self.read(offset)
        if kind != _BLOB:
            raise GitPackError(f"object at {offset} is not a blob")
        return data
