"""The errors of layers/: the store, the node cache, the pool and the I/O budget.

Each is a `MiniSandboxError` and names one condition, so that callers tell them apart by type,
never by the text of the message. Some also derive from the builtin a caller would expect
(`KeyError` for a missing layer, `FileExistsError` for an unpack destination that exists).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from minisandbox.errors import MiniSandboxError


class LayerStoreError(MiniSandboxError):
    """A layer store operation failed (bad tree, bad name, unsupported file type, ...)."""


class LayerNotFoundError(LayerStoreError, KeyError):
    """No layer with this id is in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class LayerIdError(LayerNotFoundError, ValueError):
    """Not a layer id (64 lowercase hex digits, a sha256): no layer can have it. A
    LayerNotFoundError too, as it always was."""


class RefNameError(LayerStoreError, ValueError):
    """A ref name the store cannot hold: empty, "." or "..", or too long once encoded."""


class CorruptLayerError(LayerStoreError):
    """A blob or manifest does not hash to its name, is truncated, or is missing; or a
    manifest that does hash to its id holds a row that is not a valid entry."""

    def __init__(self, layer_id: str, path: Path, reason: str) -> None:
        super().__init__(f"layer {layer_id}: {path} is corrupt ({reason})")
        self.layer_id = layer_id
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # the constructor's arguments, not the message
        return (type(self), (self.layer_id, self.path, self.reason))


class ManifestFormatError(LayerStoreError, ValueError):
    """A manifest is not one this version reads: an unknown format, or a malformed row."""


class UnsupportedTreeError(LayerStoreError):
    """A tree cannot be published: it is not a directory, or holds a file that is none of a
    regular file, a directory, a symlink or an overlay whiteout (a FIFO, a device, ...)."""


class TreeChangedError(LayerStoreError):
    """A file of the tree being published changed (or was swapped for a link) meanwhile."""


class UnpackDestinationExistsError(LayerStoreError, FileExistsError):
    """`unpack` was given a destination that already exists."""

    def __init__(self, dest: str | Path) -> None:
        FileExistsError.__init__(self, errno.EEXIST, "unpack destination exists", str(dest))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.filename,))


class LayerMetaError(LayerStoreError, TypeError):
    """An `update_meta` callback returned something other than a dict."""


class IOBudgetError(MiniSandboxError, ValueError):
    """A budget is misconfigured (a size that does not parse, a limit below 1 byte)."""


class IOBudgetStateError(MiniSandboxError):
    """The budget's shared state lost a reservation of a live process (edited by hand?)."""


class MetaLockHeldError(LayerStoreError):
    """A thread asked again for a layer's metadata lock it holds (it would wait forever)."""


class CacheOwnerError(MiniSandboxError, PermissionError):
    """A node cache (or a directory of it) belongs to another user of the host: caches are
    per user, since the owner of a cache can change what every sandbox started from it runs."""

    def __init__(self, path: str, owner: int) -> None:
        super().__init__(
            f"the node cache directory {path} belongs to uid {owner}, not to you (uid "
            f"{os.geteuid()}): each user needs a cache of their own; name another with --cache "
            "or MINISANDBOX_CACHE"
        )
        self.path = path
        self.owner = owner

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.owner))
