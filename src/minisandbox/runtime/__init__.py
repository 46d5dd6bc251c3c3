"""The Runtime: a store and node cache (the builder) and where sandboxes run (a backend: this
host, or a Ray cluster's nodes), with one entry point for every sandbox of a task
(`Runtime.sandbox(task, purpose=...)`) and for grading (`Runtime.evaluate`)."""

from minisandbox.runtime.runtime import Backend, LocalBackend, Runtime

__all__ = ["Backend", "LocalBackend", "Runtime"]
