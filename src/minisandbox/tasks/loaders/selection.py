"""Which tasks of a source are kept: the `instance_ids` a caller asks for, every one of which
must be found, and ids that are unique within the source."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minisandbox.tasks.loaders.errors import TaskFormatError, TaskNotFoundError
from minisandbox.tasks.specs import Task


def wanted_ids(instance_ids: Sequence[str] | None) -> set[str] | None:
    """The ids to keep, or None for all of them. A lone string is one id."""
    if instance_ids is None:
        return None
    if isinstance(instance_ids, str):  # a lone id would otherwise be split into characters
        return {instance_ids}
    return set(instance_ids)


def check_found(wanted: set[str] | None, found: Iterable[str], source: str) -> None:
    """Check that every wanted id was found.

    Raises:
        TaskNotFoundError: some were not; its `missing` lists them all, sorted.
    """
    if wanted is None:
        return
    missing = sorted(wanted - set(found))
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        raise TaskNotFoundError(
            f"{source}: no task with id {shown}", missing=missing, source=source
        )


def check_unique(tasks: list[Task], source: str) -> None:
    """Check that no two tasks share an id.

    Raises:
        TaskFormatError: a task repeats an earlier task's id (naming the second one).
    """
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        if task.id in seen:
            raise TaskFormatError(
                f"{source}: task {index} (id {task.id!r}): field 'id': duplicate task id",
                path=source,
                index=index,
                instance_id=task.id,
                field="id",
            )
        seen.add(task.id)
