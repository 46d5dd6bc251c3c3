"""What a layer id and a ref name may be: the one check of each, used wherever they are read.

A layer id (like a blob's name) is a sha256 in lowercase hex: 64 characters from 0-9a-f. Every
path the store and the node cache build from an id (`layers/<id>.manifest.zst`, `layers/<id>/`,
`locks/<id>`) relies on that: an id can hold no "/" and no "..", so it cannot name a file
elsewhere. A ref name is free text, stored percent-encoded as one file name.
"""

from __future__ import annotations

from typing import TypeGuard
from urllib.parse import quote, unquote

from minisandbox.layers.errors import LayerIdError, RefNameError

LAYER_ID_LENGTH = 64
_HEX = frozenset("0123456789abcdef")
# Longer encoded names would not fit a file name (255 bytes) with the suffixes added to them.
_REF_FILENAME_MAX = 240


def is_layer_id(value: object) -> TypeGuard[str]:
    """Whether `value` is a sha256 in lowercase hex: a layer id, or the name of a blob."""
    return isinstance(value, str) and len(value) == LAYER_ID_LENGTH and set(value) <= _HEX


def check_layer_id(value: object) -> str:
    """`value` if it is a layer id (see `is_layer_id`), else LayerIdError."""
    if not is_layer_id(value):
        raise LayerIdError(f"{value!r} is not a layer id")
    return value


def ref_filename(name: str) -> str:
    """The file name that holds ref `name` (percent-encoded); RefNameError for a name the store
    cannot hold (empty, "." or "..", too long)."""
    if not name or name in (".", ".."):
        raise RefNameError(f"bad ref name {name!r}")
    encoded = quote(name, safe="-_.:@+=,")
    if len(encoded) > _REF_FILENAME_MAX:
        raise RefNameError(f"ref name too long ({len(encoded)} bytes encoded): {name[:60]}...")
    return encoded


def ref_name(filename: str) -> str:
    """The ref name a file of refs/ holds (the inverse of `ref_filename`)."""
    return unquote(filename)
