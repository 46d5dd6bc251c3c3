"""The CLI's first hour (issue 13): clean errors for bad input, --version, plain flags in
--help, readable cache sizes and --json, tables that do not cut ids, a light --help."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import CLI, run_cli
from minisandbox.cli.cache import human_size
from minisandbox.tasks.loaders import TaskFormatError, load_tasks


def _one_clean_error(stderr: bytes) -> str:
    text = stderr.decode()
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("minisandbox: "), text
    return lines[0]


BAD_FILES = {
    "empty.parquet": b"",
    "corrupt.parquet": b"PAR1 this is not really parquet\n",
    "empty.json": b"",
    "blank.json": b"  \n\n",
    "invalid.json": b"{bad",
    "latin1.json": b'["\xff\xfe"]',
    "empty.jsonl": b"",
    "blank.jsonl": b"\n\n",
    "invalid.jsonl": b'{"a": 1}\n{bad\n',
    "invalid.yaml": b"tasks: [\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_task_file_is_one_line_exit_2(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(BAD_FILES[name])
    r = run_cli("tasks", str(path))
    assert r.returncode == 2
    line = _one_clean_error(r.stderr)
    assert str(path) in line
    assert ": " in line.removeprefix(f"minisandbox: {path}: ")  # the problem, then the fix


@pytest.mark.parametrize("command", ["build", "eval"])
def test_bad_task_file_is_one_line_in_build_and_eval(tmp_path: Path, command: str) -> None:
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet")
    extra = ["-p", "gold"] if command == "eval" else []
    r = run_cli(command, str(path), *extra, "--store", str(tmp_path / "store"))
    assert r.returncode == 2
    assert "not a readable Parquet file" in _one_clean_error(r.stderr)


def test_directory_without_tasks(tmp_path: Path) -> None:
    r = run_cli("tasks", str(tmp_path))
    assert r.returncode == 2
    assert "without task files" in _one_clean_error(r.stderr)
    (tmp_path / "data.jsonl").write_text("")
    r = run_cli("tasks", str(tmp_path))
    assert r.returncode == 2
    assert "data.jsonl" in _one_clean_error(r.stderr)


def test_unreadable_file_is_a_task_format_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("tasks.json", "tasks.jsonl", "tasks.yaml"):
        path = tmp_path / name
        path.write_text("[]")

        def refuse(*args: object, **kwargs: object) -> str:
            raise PermissionError(13, "Permission denied")

        with monkeypatch.context() as m:
            m.setattr(Path, "read_text", refuse)
            m.setattr(Path, "open", refuse)
            with pytest.raises(TaskFormatError, match="cannot read it: Permission denied"):
                load_tasks(path)


def test_version() -> None:
    from minisandbox import __version__

    for flag in ("--version", "-V"):
        r = run_cli(flag)
        assert (r.returncode, r.stdout.decode()) == (0, f"minisandbox {__version__}\n")


HELP_COMMANDS = [
    [],
    ["shell"],
    ["exec"],
    ["demo"],
    ["tasks"],
    ["build"],
    ["eval"],
    ["cache"],
    ["cache", "ls"],
    ["cache", "du"],
    ["cache", "verify"],
    ["cache", "gc"],
]


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "minisandbox")
def test_help_shows_flags_without_bool(command: list[str]) -> None:
    r = run_cli(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert b"--help" in r.stdout and b"<bool>" not in r.stdout


def test_human_size() -> None:
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(252_080_601) == "240.4 MiB"
    assert human_size(100 * 2**30) == "100.0 GiB"
    assert human_size(3 * 2**50) == "3,072.0 TiB"


def _cache(settings, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
    }
    return subprocess.run(
        [*CLI, "cache", *args], capture_output=True, text=True, env=env, check=False, timeout=120
    )


def test_cache_sizes_and_json(settings, built) -> None:  # type: ignore[no-untyped-def]
    du = _cache(settings, "du")
    assert du.returncode == 0 and "GiB" in du.stdout and " MB" not in du.stdout
    assert "of 100.0 GiB" in du.stdout or settings.cache_max_bytes != 100 * 2**30
    du_json = json.loads(_cache(settings, "du", "--json").stdout)
    assert du_json["store"]["layers"] >= 3
    assert du_json["node_cache"]["max_bytes"] == settings.cache_max_bytes

    ls = _cache(settings, "ls", "--json")
    layers = json.loads(ls.stdout)
    assert ls.returncode == 0 and isinstance(layers, list) and len(layers) >= 3
    assert {"env", "task"} <= {layer["kind"] for layer in layers}
    assert all(isinstance(layer["size_bytes"], int) and layer["id"] for layer in layers)

    verify = _cache(settings, "verify", "--json")
    assert verify.returncode == 0
    assert json.loads(verify.stdout)["ok"] is True

    gc = _cache(settings, "gc", "--json")
    assert gc.returncode == 0
    assert json.loads(gc.stdout)["removed_layers"] == []


@pytest.mark.parametrize("columns", ["80", "60"])
def test_tasks_table_never_cuts_ids(columns: str) -> None:
    env = {**os.environ, "COLUMNS": columns}
    r = subprocess.run(
        [*CLI, "tasks", "examples"], capture_output=True, text=True, env=env, check=False
    )
    assert r.returncode == 0, r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= int(columns)
    for task in load_tasks("examples"):
        assert task.id in r.stdout
    assert "…" not in r.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["tasks", "--help"]])
def test_help_and_version_do_not_import_the_sandbox_package(args: list[str]) -> None:
    r = subprocess.run(
        [*CLI[:1], "-X", "importtime", *CLI[1:], *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()}
    assert not {m for m in imported if m.startswith("minisandbox.sandbox")}
    assert not {m for m in imported if m.startswith(("minisandbox.tasks", "minisandbox.layers"))}
    if args[0].startswith("--"):  # (typer itself imports pydantic for a command's help)
        assert "pydantic" not in imported


def test_os_error_still_names_the_runtime_directory() -> None:
    import errno

    from minisandbox.cli.oserrors import explain_os_error

    line = explain_os_error(OSError(errno.ENOSPC, "No space left on device"))
    assert "MINISANDBOX_RUNTIME" in line
