"""The manifest of a layer: what its tree holds, as canonical JSON (see store.py for where it is).

    {"format": 1, "blobs": [<sha256>, ...], "entries": [<row>, ...]}

with one row per entry of the tree, in a stable, sorted depth-first order:

    ["d", path, mode]                              a directory
    ["d", path, mode, "opaque"]                    an overlayfs opaque directory
    ["l", path, target]                            a symlink
    ["w", path]                                    an overlayfs whiteout
    ["f", path, mode, size, mtime, blob, offset]   a regular file
    ["g", path, mode, size, mtime, sha256, pack, offset]
                                                   a regular file that is the blob object at
                                                   `offset` of the git pack `pack`, a path of
                                                   this manifest's "f" rows (with its ".idx"
                                                   beside it); `sha256` is the file's content

"w" and "opaque" let a layer be the upper directory of an overlay (a task's changes on top of its
environment), deletions included. `blob` indexes "blobs" (-1 for an empty file), `offset` is where
the file starts in that blob (a pack of small files; 0 for a blob of its own). Paths are relative,
"/"-joined, "." for the root, surrogate-escaped where a name is not UTF-8 (JSON keeps them as
\\udcXX). The layer id is the sha256 of these exact bytes: this module writes them (`to_bytes`)
and must keep writing them byte for byte, or identical trees would get new ids.

A "g" row stores a file once when its layer also holds it in a repository's history (a task's
checkout: gitpack.py); it is still a regular file (kind "f") to everything but unpacking.
Rows are read into `ManifestEntry` (named fields; `from_row` / `to_row`), never by position.
Reading checks every row, so that unpacking can trust what it gets: the kinds and shapes above,
integers where integers belong, paths that stay inside the tree (no "/" at the start, no ".."),
blob indexes within "blobs", and blob names that are sha256s (they become paths).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from minisandbox.layers.errors import ManifestFormatError
from minisandbox.layers.ids import is_layer_id

FORMAT = 1

EntryKind = Literal["d", "f", "l", "w"]
DIRECTORY: EntryKind = "d"
FILE: EntryKind = "f"
SYMLINK: EntryKind = "l"
WHITEOUT: EntryKind = "w"
_OPAQUE = "opaque"
_IN_PACK = "g"
# How a directory is marked opaque on disk: user.* serves overlays mounted in a user namespace
# (bwrap's), trusted.* those mounted by the real root (only root may set it).
OPAQUE_XATTRS = ("user.overlay.opaque", "trusted.overlay.opaque")


def _int(value: object, what: str, row: list[Any]) -> int:
    if type(value) is not int:  # not isinstance: JSON's true/false must not pass for 1/0
        raise ManifestFormatError(f"{what} is not an integer in row {row!r:.200}")
    return value


def _str(value: object, what: str, row: list[Any]) -> str:
    if not isinstance(value, str):
        raise ManifestFormatError(f"{what} is not a string in row {row!r:.200}")
    return value


def _check_path(path: str) -> str:
    if path != "." and (not path or path.startswith("/") or ".." in path.split("/")):
        raise ManifestFormatError(f"bad path {path}")
    if "\0" in path:
        raise ManifestFormatError(f"bad path {path!r}")
    return path


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One row of a manifest. Fields a kind does not have keep their defaults."""

    kind: EntryKind
    path: str
    mode: int = 0  # permission bits (directories, files)
    size: int = 0  # bytes (files)
    mtime: int = 0  # whole seconds (files)
    blob: int = -1  # index into Manifest.blobs; -1 for an empty file (files)
    offset: int = 0  # where the file starts in its blob (files)
    target: str = ""  # what the link points at (symlinks)
    opaque: bool = False  # an overlayfs opaque directory (directories)
    pack: str = ""  # the git pack whose object at `offset` is this file ("g" rows)
    content: str = ""  # the sha256 of the file's bytes ("g" rows)

    @classmethod
    def directory(cls, path: str, mode: int, *, opaque: bool = False) -> ManifestEntry:
        return cls(DIRECTORY, path, mode=mode, opaque=opaque)

    @classmethod
    def file(
        cls, path: str, mode: int, size: int, mtime: int, blob: int = -1, offset: int = 0
    ) -> ManifestEntry:
        return cls(FILE, path, mode=mode, size=size, mtime=mtime, blob=blob, offset=offset)

    @classmethod
    def in_pack(
        cls, path: str, mode: int, size: int, mtime: int, content: str, pack: str, offset: int
    ) -> ManifestEntry:
        """A file whose bytes are a blob object of a git pack in the same layer."""
        return cls(
            FILE, path, mode=mode, size=size, mtime=mtime, offset=offset, pack=pack,
            content=content,
        )  # fmt: skip

    @classmethod
    def symlink(cls, path: str, target: str) -> ManifestEntry:
        return cls(SYMLINK, path, target=target)

    @classmethod
    def whiteout(cls, path: str) -> ManifestEntry:
        return cls(WHITEOUT, path)

    @classmethod
    def from_row(cls, row: object) -> ManifestEntry:
        """The entry a stored row holds; ManifestFormatError when it is not a valid row."""
        if not isinstance(row, list) or len(row) < 2:
            raise ManifestFormatError(f"not a manifest row: {row!r:.200}")
        kind, path = row[0], _check_path(_str(row[1], "path", row))
        if path == "." and kind != DIRECTORY:
            # The layer's root is a directory: a link there would make the unpacked layer a link
            # to a host path (a forged manifest verifies: its id is its own hash).
            raise ManifestFormatError(f"the root is not a directory: {row!r:.200}")
        if kind == DIRECTORY and len(row) in (3, 4):
            if len(row) == 4 and row[3] != _OPAQUE:
                raise ManifestFormatError(f"unknown directory flag in row {row!r:.200}")
            return cls.directory(path, _int(row[2], "mode", row), opaque=len(row) == 4)
        if kind == FILE and len(row) == 7:
            size, blob = _int(row[3], "size", row), _int(row[5], "blob", row)
            offset = _int(row[6], "offset", row)
            if size < 0 or offset < 0 or blob < -1 or (blob == -1 and size != 0):
                raise ManifestFormatError(f"bad size, blob or offset in row {row!r:.200}")
            mode, mtime = _int(row[2], "mode", row), _int(row[4], "mtime", row)
            return cls.file(path, mode, size, mtime, blob, offset)
        if kind == _IN_PACK and len(row) == 8:
            size, offset = _int(row[3], "size", row), _int(row[7], "offset", row)
            content, pack = _str(row[5], "sha256", row), _check_path(_str(row[6], "pack", row))
            if size <= 0 or offset < 12 or not is_layer_id(content) or not pack.endswith(".pack"):
                raise ManifestFormatError(f"bad size, sha256, pack or offset in row {row!r:.200}")
            mode, mtime = _int(row[2], "mode", row), _int(row[4], "mtime", row)
            return cls.in_pack(path, mode, size, mtime, content, pack, offset)
        if kind == SYMLINK and len(row) == 3 and "\0" not in _str(row[2], "target", row):
            return cls.symlink(path, row[2])
        if kind == WHITEOUT and len(row) == 2:
            return cls.whiteout(path)
        raise ManifestFormatError(f"not a manifest row: {row!r:.200}")

    def to_row(self) -> list[Any]:
        """The row as stored (the inverse of `from_row`)."""
        if self.kind == DIRECTORY:
            return (
                ["d", self.path, self.mode, _OPAQUE] if self.opaque else ["d", self.path, self.mode]
            )
        if self.kind == FILE and self.pack:
            return [
                _IN_PACK, self.path, self.mode, self.size, self.mtime, self.content, self.pack,
                self.offset,
            ]  # fmt: skip
        if self.kind == FILE:
            return ["f", self.path, self.mode, self.size, self.mtime, self.blob, self.offset]
        if self.kind == SYMLINK:
            return ["l", self.path, self.target]
        return ["w", self.path]


def check_format(doc: object) -> dict[str, Any]:
    """`doc` if it is a manifest document of the format this version reads (only that is
    checked); ManifestFormatError otherwise."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ManifestFormatError(f"unknown manifest format {found}")
    return doc


def check_document(doc: object) -> dict[str, Any]:
    """`doc` if it is a manifest of this format whose blobs are sha256s and whose entries are a
    list (rows unread: see `Manifest.from_document`); ManifestFormatError otherwise."""
    doc = check_format(doc)
    blobs, entries = doc.get("blobs"), doc.get("entries")
    if not isinstance(blobs, list) or not all(is_layer_id(b) for b in blobs):
        raise ManifestFormatError("the blobs of the manifest are not a list of sha256s")
    if not isinstance(entries, list):
        raise ManifestFormatError("the entries of the manifest are not a list")
    return doc


@dataclass(frozen=True)
class Manifest:
    """A layer's manifest: its blobs (sha256s) and its entries, in stored order."""

    blobs: tuple[str, ...]
    entries: tuple[ManifestEntry, ...]

    @classmethod
    def build(cls, blobs: Iterable[str], entries: Iterable[ManifestEntry]) -> Manifest:
        return cls(tuple(blobs), tuple(entries))

    @classmethod
    def from_document(cls, doc: object) -> Manifest:
        """The manifest a decoded JSON document holds, every row checked (see the module
        docstring); ManifestFormatError when anything is not as it must be."""
        checked = check_document(doc)
        blobs = tuple(checked["blobs"])
        entries = tuple(ManifestEntry.from_row(row) for row in checked["entries"])
        stored = set()
        for e in entries:
            if e.blob >= len(blobs):
                raise ManifestFormatError(f"{e.path}: blob {e.blob} of {len(blobs)}")
            if e.kind == FILE and not e.pack:
                stored.add(e.path)
        for e in entries:
            # A pack and its index are stored files of this layer: unpacking writes them first.
            if e.pack and not {e.pack, e.pack.removesuffix(".pack") + ".idx"} <= stored:
                raise ManifestFormatError(f"{e.path}: no stored pack {e.pack} with its index")
        return cls(blobs, entries)

    def rows(self) -> list[list[Any]]:
        return [e.to_row() for e in self.entries]

    def to_bytes(self) -> bytes:
        """The canonical bytes whose sha256 is the layer id. Key order, separators and
        escaping are part of the format: never change them."""
        doc = {"format": FORMAT, "blobs": list(self.blobs), "entries": self.rows()}
        # ensure_ascii keeps non-UTF-8 names (lone surrogates) encodable, and the bytes canonical.
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()

    def files(self) -> list[ManifestEntry]:
        """Every regular file, those in a git pack ("g" rows) included."""
        return [e for e in self.entries if e.kind == FILE]
