"""The store as the driver's node sees it, read for nodes that do not see it (layers.replica).

A pool starts one on the driver's node when some node lacks the store's path; those nodes copy
the layers their sandboxes need into a store of their own, piece by piece through Ray.
"""

from __future__ import annotations

from pathlib import Path

from minisandbox.layers.replica import layer_files, read_part
from minisandbox.layers.store import LayerStore


class StoreSource:
    """Serves the files of the layers of the store at `store` (nothing else of its machine)."""

    def __init__(self, store: str) -> None:
        self.store = LayerStore(Path(store))

    def layer_files(self, layer_id: str) -> list[str]:
        return layer_files(self.store, layer_id)

    def read(self, rel: str, offset: int, size: int) -> bytes:
        return read_part(self.store, rel, offset, size)
