"""The one content hash: layers, refs and records are named by a digest of what they are made of."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def content_digest(spec: Any) -> str:
    """sha256 hex of `spec` as canonical JSON (sorted keys, no spaces, ASCII): equal specs,
    equal digests, whatever the order their dicts were built in."""
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()
