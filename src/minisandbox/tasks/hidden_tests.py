"""Where a bug task's hidden tests are kept for its evaluation: the patch that brings back its
FAIL_TO_PASS test files (hidden from the agent, as SWE-smith's harness hides them), stored as a
layer of one file that no sandbox ever mounts, tagged `tests/<id>`.

As a layer, identical patches are stored once: the bugs of a repository hide a few test files
between them (boltons: 266 bugs, a dozen distinct patches). In each bug layer's metadata they
took ~20 KB apiece, more than the bug layer itself.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from minisandbox.layers.store import LayerStore

LAYER_KEY = "restore_tests_layer"  # in a bug layer's meta: the layer holding the patch
_FILE = "restore-tests.patch"


def publish_restore(store: LayerStore, patch: str, force: bool = False) -> dict[str, Any]:
    """Store `patch` (once for identical ones; `force` rewrites a corrupt copy, as a forced
    rebuild does) and return what the bug layer's metadata keeps of it (nothing for an empty
    patch)."""
    if not patch:
        return {}
    with tempfile.TemporaryDirectory(dir=store.root / "tmp") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        path = tree / _FILE
        path.write_bytes(patch.encode())  # (UTF-8, whatever the locale)
        # Fixed modes and times: the same patch is the same tree, and so the same layer.
        os.chmod(path, 0o644)
        os.utime(path, (0, 0))
        os.chmod(tree, 0o755)
        layer = store.publish(tree, meta={"kind": "hidden-tests"}, verify_existing=force)
    store.tag(f"tests/{layer.id}", layer.id)
    return {LAYER_KEY: layer.id}


def restore_patch(store: LayerStore, bug_meta: dict[str, Any]) -> str:
    """The patch that brings back a bug task's hidden tests, from its bug layer's metadata.

    Raises:
        CorruptLayerError, LayerNotFoundError: the layer holding it is missing or corrupt
            (`build --force` of the task makes it again).
    """
    layer = bug_meta.get(LAYER_KEY)
    return store.read_file(layer, _FILE).decode() if layer else ""


def tests_present(store: LayerStore, bug_layer: str) -> bool:
    """Whether the hidden tests a bug layer's metadata names are in the store (a gc, or a
    check that dropped them as broken, may have removed them: the bug layer is then made
    again rather than left unable to be graded)."""
    layer = (store.meta(bug_layer) or {}).get(LAYER_KEY)
    return not layer or store.exists(layer)
