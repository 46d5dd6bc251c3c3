"""Predictions in SWE-bench's format, and evaluation reports in its harness's layout.

A prediction is `{"instance_id", "model_name_or_path", "model_patch"}`. A predictions file is a
JSON list of them, a JSON object keyed by instance id (SWE-agent's), or JSONL. `gold` and `empty`
stand for each task's gold patch and for no patch.

Reports are laid out as the harness's `logs/run_evaluation/<run_id>` (`run_log_dir`: under the
builder's logs directory, `BuildSettings.logs`, not the current directory): per instance
`<model>/<instance_id>/{report.json, test_output.txt, patch.diff, eval.sh, run_instance.log}`,
and a run summary as its `make_run_report` writes it. As there, an instance whose evaluation
errored (e.g. the patch does not apply) has no report.json, and an empty patch is counted apart.

Model names and instance ids become directory names: both are checked (`path_name_problem`,
`task_id_problem`) when a prediction is made, so no name can lead outside the report directory.
Each file is written whole or not at all (a temporary file renamed into place), report.json
last, so a report.json on disk always belongs to a completely written instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from minisandbox.errors import MiniSandboxError
from minisandbox.evaluation.evaluator import EvalResult, make_eval_script
from minisandbox.tasks.specs import Task, path_name_problem, task_id_problem

SPECIAL = ("gold", "empty")


class PredictionsError(MiniSandboxError):
    """A predictions file that cannot be read; the message names the file, line and field."""


class Prediction(BaseModel):
    instance_id: str
    model_name_or_path: str
    model_patch: str | None
    where: str = Field("", exclude=True, description="file and line or entry it came from")

    @field_validator("instance_id")
    @classmethod
    def _check_instance_id(cls, value: str) -> str:
        problem = task_id_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} {problem}: not usable as an instance id")
        return value

    @field_validator("model_name_or_path")
    @classmethod
    def _check_model(cls, value: str) -> str:
        problem = model_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


def model_name_problem(model: str) -> str | None:
    """Why `model` cannot name its report directory (`model_dir`), None when it can."""
    problem = path_name_problem(model_dir(model))
    if problem is None:
        return None
    return f"{model!r} {problem} once '/' is '__': it names the report directory"


def _entry(value: Any, where: str, key: str | None = None) -> Prediction:
    if not isinstance(value, dict):
        raise PredictionsError(f"{where}: expected an object, got {type(value).__name__}")
    if key is not None and "instance_id" not in value:
        value = {**value, "instance_id": key}
    for field in ("instance_id", "model_name_or_path"):
        if not isinstance(value.get(field), str) or not value[field]:
            got = "missing" if field not in value else f"got {value[field]!r}"
            raise PredictionsError(f"{where}: field {field!r}: expected a string, {got}")
    if "model_patch" not in value:
        raise PredictionsError(f"{where}: field 'model_patch' is missing")
    if value["model_patch"] is not None and not isinstance(value["model_patch"], str):
        raise PredictionsError(
            f"{where}: field 'model_patch': expected a string or null, "
            f"got {type(value['model_patch']).__name__}"
        )
    if key is not None and value["instance_id"] != key:
        raise PredictionsError(
            f"{where}: field 'instance_id' is {value['instance_id']!r}, but its key is {key!r}"
        )
    # Both name directories of the report: checked before anything uses them.
    problem = task_id_problem(value["instance_id"])
    if problem is not None:
        raise PredictionsError(
            f"{where}: field 'instance_id': {value['instance_id']!r} {problem}: not an instance id"
        )
    problem = model_name_problem(value["model_name_or_path"])
    if problem is not None:
        raise PredictionsError(f"{where}: field 'model_name_or_path': {problem}")
    return Prediction(
        instance_id=value["instance_id"],
        model_name_or_path=value["model_name_or_path"],
        model_patch=value["model_patch"],
        where=where,
    )


def load_predictions(path: Path) -> dict[str, Prediction]:
    """Predictions by instance id, in the file's order. Raises PredictionsError naming the
    file, line (JSONL) or entry (JSON) and field of the first problem, and duplicate ids."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise PredictionsError(f"{path}: a predictions file is .json or .jsonl")
    try:
        text = path.read_text()
    except OSError as e:
        raise PredictionsError(f"{path}: {e.strerror or e}") from None
    entries: list[tuple[str, Prediction]] = []
    if suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise PredictionsError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
            entries.append((where, _entry(value, where)))
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PredictionsError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
        if isinstance(data, list):
            for i, value in enumerate(data):
                where = f"{path}: entry {i}"
                entries.append((where, _entry(value, where)))
        elif isinstance(data, dict):
            for key, value in data.items():
                where = f"{path}: entry {key!r}"
                entries.append((where, _entry(value, where, key)))
        else:
            raise PredictionsError(
                f"{path}: expected a list of predictions or an object keyed by instance id"
            )
    out: dict[str, Prediction] = {}
    for where, p in entries:
        if p.instance_id in out:
            raise PredictionsError(f"{where}: a second prediction for {p.instance_id!r}")
        out[p.instance_id] = p
    return out


def special_predictions(kind: str, tasks: list[Task]) -> dict[str, Prediction]:
    """`gold`: each task's gold patch; `empty`: no patch. The model is named after the kind."""
    return {
        t.id: Prediction(
            instance_id=t.id,
            model_name_or_path=kind,
            model_patch=t.gold_patch if kind == "gold" else "",
        )
        for t in tasks
    }


def model_dir(model: str) -> str:
    return model.replace("/", "__")  # as the harness names it


def run_log_dir(logs: Path, run_id: str) -> Path:
    """The evaluation logs of run `run_id`, laid out as the harness's
    `logs/run_evaluation/<run_id>` but under `logs` (`BuildSettings.logs`, with the build logs),
    so that no run writes into the current directory."""
    return logs / "run_evaluation" / run_id


def write_file(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary file beside it, renamed into place.

    Raises:
        OSError: naming `path` (disk full, quota, read-only filesystem, permission); `path` is
            then unchanged and no temporary file is left.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        # A failed write() or close() names no file: name the one we were writing.
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def write_instance_report(
    report_dir: Path, task: Task, prediction: Prediction, result: EvalResult
) -> Path:
    """The harness's per-instance files; report.json only when the evaluation completed.

    report.json goes last, so that it is on disk only when everything else is (swebench counts
    an instance with a report.json as evaluated).

    Raises:
        PredictionsError: the model name or instance id cannot name a directory.
        OSError: a file could not be written (the error names it).
    """
    problem = model_name_problem(prediction.model_name_or_path) or task_id_problem(task.id)
    if problem is not None:  # Prediction and Task check these: a model_construct()ed one?
        raise PredictionsError(f"report of {task.id!r}: {problem}")
    out = report_dir / model_dir(prediction.model_name_or_path) / task.id
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(e.filename or out)) from None
    report = out / "report.json"
    try:
        report.unlink(missing_ok=True)  # a stale one from an earlier run would count
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(report)) from None
    write_file(out / "patch.diff", prediction.model_patch or "")
    write_file(out / "test_output.txt", result.log)
    try:
        write_file(out / "eval.sh", make_eval_script(task))
    except MiniSandboxError:
        pass  # the evaluation failed on it too; its reason is in run_instance.log
    lines = [
        f"instance: {task.id}",
        f"model: {prediction.model_name_or_path}",
        f"status: {result.status}",
        f"reward: {result.reward}",
        f"reason: {result.reason}",
        f"swebench_resolved: {result.swebench_resolved}",
        f"patch applied: {result.patch_applied} ({result.apply_command or '-'})",
        f"test exit code: {result.test_exit_code}",
        f"timed out: {result.timed_out}",
        f"duration: {result.duration_s} s",
        "",
        result.apply_output,
    ]
    write_file(out / "run_instance.log", "\n".join(lines) + "\n")
    if result.status != "error":
        write_file(report, json.dumps(result.swebench_report(prediction.model_patch), indent=4))
    return out


def run_report(
    tasks: list[Task], predictions: dict[str, Prediction], results: dict[str, EvalResult]
) -> dict[str, Any]:
    """The run summary of the harness's `make_run_report`, from the results (what it would
    compute from the report directory). `tasks` is the dataset (after any id filter)."""
    completed, resolved, unresolved, errors, empty, incomplete = (set[str]() for _ in range(6))
    for t in tasks:
        p = predictions.get(t.id)
        if p is None or t.id not in results:
            incomplete.add(t.id)
            continue
        if p.model_patch in ("", None):
            empty.add(t.id)
            continue
        r = results[t.id]
        if r.status == "error":
            errors.add(t.id)
            continue
        completed.add(t.id)
        (resolved if r.resolved else unresolved).add(t.id)
    return {
        "total_instances": len(tasks),
        "submitted_instances": len(predictions),
        "completed_instances": len(completed),
        "resolved_instances": len(resolved),
        "unresolved_instances": len(unresolved),
        "empty_patch_instances": len(empty),
        "error_instances": len(errors),
        "completed_ids": sorted(completed),
        "incomplete_ids": sorted(incomplete),
        "empty_patch_ids": sorted(empty),
        "submitted_ids": sorted(predictions),
        "resolved_ids": sorted(resolved),
        "unresolved_ids": sorted(unresolved),
        "error_ids": sorted(errors),
        "schema_version": 2,
        # The harness adds these (about Docker) when it has no Docker client: none here.
        "unstopped_instances": 0,
        "unstopped_containers": [],
        "unremoved_images": [],
    }
