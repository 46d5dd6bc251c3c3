"""SWE-bench and SWE-smith rows: a .parquet file, a .jsonl file, a .json list, or a Hugging
Face dataset name ("owner/name", or "owner/name:split").

Each row is one record, and each record one task. A record with an image or an environment
and no test patch is a SWE-smith record (swesmith_records); one with a base commit, test patch
or environment commit is a SWE-bench record (swebench_records); anything else is an error.

Invariants: rows not asked for (`wanted`) are skipped before anything else about them is
checked, and the id of every row kept is checked before any path is built from it. A Hugging
Face dataset is read through the `datasets` package, an optional dependency, and has no folder
of its own: paths its records name are looked up in envs_dir only.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from minisandbox.tasks.loaders.errors import TaskFormatError
from minisandbox.tasks.loaders.fields import Record, Where
from minisandbox.tasks.loaders.formats import optional_import
from minisandbox.tasks.loaders.swebench_records import swebench_task
from minisandbox.tasks.loaders.swesmith_records import swesmith_task
from minisandbox.tasks.specs import Task


def records_to_tasks(
    records: Iterable[Record],
    source: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    wanted: set[str] | None,
    allow_abs: bool = False,
    rejected: list[TaskFormatError] | None = None,
) -> list[Task]:
    """The tasks of the wanted `records`, in order. `source` names the file or dataset in
    errors and in each task's `source`; `base_dir` is the data file's folder, if any.
    With a `rejected` list, a malformed record that has a valid id (an unknown SWE-smith
    profile, say) goes there and the others load; without, it raises.

    Raises:
        TaskFormatError: a row is not a mapping, not a SWE-bench or SWE-smith record, or a
            malformed one (naming the file, the record, its line and id, and the field).
        MissingDependencyError: a package needed to read the records is not installed.
    """
    tasks = []
    for index, line, record in records:
        where = Where(source, index, line)
        if not where.take(record, "instance_id", wanted):  # (before envs_dir/<id>.yml is read)
            continue
        try:
            kind = record_kind(record, where)
            if kind == "swesmith":
                tasks.append(swesmith_task(record, where, source, base_dir, envs_dir, allow_abs))
            else:
                tasks.append(swebench_task(record, where, source, envs_dir))
        except TaskFormatError as e:
            if rejected is None or e.instance_id is None:
                raise
            rejected.append(e)
    return tasks


# A Hugging Face dataset id (owner/name, as the Hub allows them) and an optional split.
_HF_NAME = re.compile(
    r"(?!.*\.\.)[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
    r"/[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?(?::[A-Za-z0-9_.-]+)?"
)
# Seconds to find the Hub before `datasets` is asked: offline, it retries for about 25 s.
_HUB_CONNECT_TIMEOUT = 10.0


def is_hf_name(name: str) -> bool:
    """Whether `name` can be a Hugging Face dataset ("owner/name" or "owner/name:split")."""
    return _HF_NAME.fullmatch(name) is not None


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (None: it can, or a proxy or offline mode
    decides). Only a name lookup and a TCP connect: a second, not `datasets`' retries."""
    if any(os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None  # the cache decides
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy resolves names, not us
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or 443
    try:
        socket.create_connection((host, port), timeout=_HUB_CONNECT_TIMEOUT).close()
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"
    return None


_FIX = (
    "download the dataset and pass its .parquet/.json/.jsonl file, or set HF_HUB_OFFLINE=1 to "
    "use a copy in the Hugging Face cache"
)


def _load_dataset(datasets: Any, name: str, split: str | None) -> Any:
    """`datasets.load_dataset(name, split=split)`, its failures as one TaskFormatError.

    Raises:
        TaskFormatError: the Hub cannot be reached, or the dataset or split cannot be loaded.
    """
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many kinds, OSErrors among them: one line each
        what = " ".join(str(e).split())[:300] or type(e).__name__
        raise TaskFormatError(
            f"{name}: could not load this Hugging Face dataset"
            f"{f' (split {split})' if split else ''}: {type(e).__name__}: {what}; check the "
            f"name, or {_FIX}"
        ) from None


def record_kind(record: dict[str, Any], where: Where) -> Literal["swebench", "swesmith"]:
    """SWE-smith records have an image or environment and no test patch; SWE-bench records
    have a base commit / test patch.

    Raises:
        TaskFormatError: the record is neither.
    """
    if ("image_name" in record or "environment" in record) and "test_patch" not in record:
        return "swesmith"
    if {"base_commit", "test_patch", "environment_setup_commit"} & record.keys():
        return "swebench"
    raise where.error(
        "neither a SWE-bench record (instance_id, repo, base_commit, test_patch, FAIL_TO_PASS, "
        "...) nor a SWE-smith record (instance_id, repo, patch, FAIL_TO_PASS, image_name or "
        "environment)"
    )


def load_hf(
    name: str,
    envs_dir: Path | None,
    wanted: set[str] | None,
    allow_abs: bool,
    rejected: list[TaskFormatError] | None = None,
) -> list[Task]:
    """The tasks of Hugging Face dataset `name` ("owner/name" or "owner/name:split"; the
    split defaults to "test", or to the only one). Each task's source is "hf:<name>:<split>".

    Raises:
        MissingDependencyError: the `datasets` package is not installed.
        TaskFormatError: no split is given and the dataset has several, none named "test";
            or a record is malformed; or the dataset could not be loaded (the Hub cannot be
            reached, there is no such dataset or split).
    """
    unreachable = _hub_unreachable()  # before `datasets` is imported: seconds, offline
    if unreachable is not None:
        raise TaskFormatError(
            f"{name}: taken for a Hugging Face dataset (it is no file here), but the Hub "
            f"cannot be reached ({unreachable}): {_FIX}"
        )
    datasets = optional_import(
        "datasets",
        f"{name!r} is not a file, so it is taken for a Hugging Face dataset name; loading one "
        "needs the `datasets` package (pip install datasets). Or download the dataset and "
        "pass its local .parquet/.json/.jsonl file.",
    )
    dataset_name, _, split = name.partition(":")
    loaded = _load_dataset(datasets, dataset_name, split or None)
    if not split:
        splits = list(loaded.keys())
        if "test" in splits:
            split = "test"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise TaskFormatError(
                f"{dataset_name}: has splits {', '.join(splits)}; choose one as "
                f"'{dataset_name}:<split>'"
            )
        loaded = loaded[split]
    source = f"hf:{dataset_name}:{split}"
    records = ((i, None, dict(r)) for i, r in enumerate(loaded))
    return records_to_tasks(records, source, None, envs_dir, wanted, allow_abs, rejected)
