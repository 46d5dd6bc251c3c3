"""Usage errors in one line: what was wrong, and what to type instead.

click prints a usage error as four lines (usage, a hint, a blank, the error); here it is one,
like every other error of the CLI. An unknown option that a neighbouring tool has (SWE-bench's
harness, SWE-smith, mini-swe-agent) is answered with ours.
"""

from __future__ import annotations

import typer

# Options of neighbouring tools, and what to type here instead.
NEIGHBOURS = {
    "--dataset_name": "the dataset is the first argument (a parquet/JSON/JSONL file or `examples`)",
    "--dataset": "the dataset is the first argument (a parquet/JSON/JSONL file or `examples`)",
    "--subset": "the dataset is the first argument (a parquet/JSON/JSONL file or `examples`)",
    "--split": "pass the split's own file as the first argument (e.g. a test.parquet)",
    "--predictions_path": "use --predictions (-p)",
    "--max_workers": "use --jobs (-j)",
    "--workers": "use --jobs (-j)",
    "--run_id": "use --run-id",
    "--instance_ids": "use --instance-ids (-i), once per id",
    "--ids": "use --instance-ids (-i), once per id",
    "--report_dir": "use --report",
    "--cache_level": "not needed: layers are content-addressed and built once",
    "--force_rebuild": "use `minisandbox build --force`",
    "--clean": "use `minisandbox cache gc`",
    "--namespace": "not needed: there are no images to pull",
    "--open_file_limit": "not needed",
}


def _usage_error_type() -> type[Exception]:
    """click's UsageError, wherever this typer keeps click (0.29 vendors it privately)."""
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "UsageError" and issubclass(cls, Exception):
            return cls
    raise RuntimeError("typer.BadParameter is no UsageError")  # pragma: no cover


UsageError = _usage_error_type()


def usage_line(e: Exception) -> str:
    """One line for a usage error: the (sub)command, the problem, the fix (or where help is)."""
    ctx = getattr(e, "ctx", None)
    path = (getattr(ctx, "command_path", None) or "minisandbox").split()
    command = " ".join(["minisandbox", *path[1:]])
    where = " ".join(path[1:]) + ": " if len(path) > 1 else ""
    name = getattr(e, "option_name", None)
    message = e.format_message() if hasattr(e, "format_message") else str(e)
    message = " ".join(message.split())
    if isinstance(name, str) and name in NEIGHBOURS:
        return f"{where}no option {name}: {NEIGHBOURS[name]}"
    if isinstance(name, str) and "_" in name:
        dashed = name.replace("_", "-")
        known = {o for p in getattr(getattr(ctx, "command", None), "params", []) for o in p.opts}
        if dashed in known:
            return f"{where}no option {name}: use {dashed}"
    return f"{where}{message} (see `{command} --help`)"
