"""The bundled example tasks (source "examples"): small real repositories shipped with the
package (minisandbox/tasks/examples), each with a bug, a gold patch and pytest tests.

Their recipe uses the Python minor version running this code, so they build wherever
minisandbox runs; their base commits are fixed (the repositories are committed with a fixed
author, date and message). Their ids are unique by construction.
"""

from __future__ import annotations

from minisandbox.tasks.specs import Task


def example_tasks(wanted: set[str] | None) -> list[Task]:
    """The bundled tasks whose id is wanted (all when `wanted` is None), in their order.

    Raises:
        OSError: (not caught) an example's files cannot be read, a broken install.
    """
    # imported only when asked for: the examples module is written separately
    from minisandbox.tasks.examples import load_examples

    tasks: list[Task] = load_examples()
    return [t for t in tasks if wanted is None or t.id in wanted]
