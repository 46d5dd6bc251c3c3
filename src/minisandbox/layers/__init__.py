"""Content-addressed layers: the shared store, each node's cache of unpacked layers, and the I/O
budget that bounds unpacking.

store.py is the store's API (LayerStore, LayerRef); its parts are ids.py (layer ids, ref names),
manifest.py (the manifest format), publish.py, blobs.py, unpack.py, maintenance.py (check, gc,
du), layout.py (paths, atomic writes, the metadata lock) and errors.py. nodecache.py and pool.py
are a node's cache of unpacked layers, budget.py its I/O budget."""
