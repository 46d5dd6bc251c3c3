"""Content-addressed layers: the shared store, each node's cache of unpacked layers, and the I/O
budget that bounds unpacking."""
