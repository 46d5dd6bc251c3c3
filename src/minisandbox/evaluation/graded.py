"""What a run already graded: reused when the same run is started again, as SWE-bench's harness
skips the instances of a run id that have their report.

Beside each instance's report.json goes `graded.json`: the result, and the key of what decided
it (the task, the patch, the grading and the timeout). A later run with the same run id reuses a
result only when its key is the same and report.json is there (an instance whose evaluation
errored has none, as in the harness, and is graded again); anything else is graded again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.evaluation.predictions import model_dir, write_file
from minisandbox.tasks.specs import Task

GRADED_FILE = "graded.json"
_MAX_BYTES = 256 * 1024 * 1024  # a result holds the test log, itself capped far below this


class Graded(BaseModel):
    key: str
    result: EvalResult


def grading_key(task: Task, patch: str | None, grading: str, timeout: float) -> str:
    """What decides a verdict, hashed: the task as loaded, the patch, the grading, the timeout."""
    what = {
        "task": task.model_dump(mode="json"),
        "patch": patch,
        "grading": grading,
        "timeout": timeout,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _instance_dir(report_dir: Path, model: str, instance_id: str) -> Path:
    return report_dir / model_dir(model) / instance_id


def save_graded(report_dir: Path, model: str, key: str, result: EvalResult) -> None:
    """Record `result` (after its report is written) for a later run of the same id.

    Raises:
        OSError: naming the file (disk full, quota, read-only filesystem, permission).
    """
    path = _instance_dir(report_dir, model, result.instance_id) / GRADED_FILE
    write_file(path, Graded(key=key, result=result).model_dump_json())


def load_graded(report_dir: Path, model: str, instance_id: str, key: str) -> EvalResult | None:
    """The result this run recorded for `instance_id` under `key`, or None: none recorded, its
    key differs, its report.json is missing, or the file cannot be read (then it is graded
    again)."""
    out = _instance_dir(report_dir, model, instance_id)
    if not (out / "report.json").is_file():
        return None
    try:
        fd = os.open(out / GRADED_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
        if len(data) > _MAX_BYTES:
            return None
        graded = Graded.model_validate_json(data)
    except (OSError, ValidationError, ValueError):
        return None
    if graded.key != key or graded.result.instance_id != instance_id:
        return None
    return graded.result
