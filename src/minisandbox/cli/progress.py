"""Progress on stderr of the commands that work through many instances (build, eval)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported when progress is shown, so that --help stays fast
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


class Progress:
    """Progress on stderr (stdout is for results, `--json`'s included), one entry per
    instance: on a terminal, a live row per instance in flight (its phase and time) under an
    overall bar, and a line as each one finishes; elsewhere (a pipe, a log file) a line per
    phase and per finished instance. Nothing when `quiet`."""

    def __init__(self, what: str, total: int, quiet: bool) -> None:
        from rich.console import Console

        self.total, self.quiet, self.finished = total, quiet, 0
        self.console = Console(stderr=True, highlight=False)
        self._began: dict[str, float] = {}
        self._rows: dict[str, TaskID] = {}
        self._live: RichProgress | None = None
        if not quiet and self.console.is_terminal:
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._overall = self._live.add_task(what, total=total, count=f"0/{total}")

    def __enter__(self) -> Progress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._live is not None:
            self._live.stop()

    def phase(self, task_id: str, phase: str) -> None:
        """`task_id` is now at `phase` (an `on_phase` hook of the builder and evaluator)."""
        if self.quiet:
            return
        self._began.setdefault(task_id, time.monotonic())
        text = f"{task_id}: {phase}"
        if self._live is None:
            self.console.print(text, markup=False, soft_wrap=True)
        elif task_id in self._rows:
            self._live.update(self._rows[task_id], description=text)
        else:
            self._rows[task_id] = self._live.add_task(text, total=None, count="")

    def done(self, task_id: str, verdict: str) -> None:
        """`task_id` finished with `verdict` (its first line is shown)."""
        if self.quiet:
            return
        self.finished += 1
        now = time.monotonic()
        seconds = now - self._began.pop(task_id, now)  # 0 when no phase came first
        first = verdict.splitlines()[0] if verdict else ""
        text = f"[{self.finished}/{self.total}] {task_id}: {first} ({seconds:.1f} s)"
        if self._live is None:
            self.console.print(text, markup=False, soft_wrap=True)
            return
        row = self._rows.pop(task_id, None)
        if row is not None:
            self._live.remove_task(row)
        self._live.console.print(text, markup=False, soft_wrap=True)
        self._live.update(
            self._overall, advance=1, count=f"{self.finished}/{self.total}", refresh=True
        )
