"""Python environments as layers: interpreters, pinned installs, SWE-bench's conda shim, the
tools layers of test services, and the repository history layers are built from."""
