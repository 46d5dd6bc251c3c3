"""Was the test run tampered with? The grader plugin's record against the log and the exit status.

The plugin (helpers/minisandbox_grader.py) records what pytest itself saw; here the host reads
that record back (bounded, as data: the sandbox could have written anything there) and names
each disagreement. Any one makes the reward 0: a correct patch never makes the runner's own call
results, its reports, the log and the exit status tell different stories.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterable
from typing import Any

from minisandbox.evaluation.patch_rules import is_test_file
from minisandbox.tasks.specs import Task, files_in_patch

RESULTS_PATH = "/tmp/.minisandbox-grader/results.jsonl"
RESULTS_MAX_BYTES = 64 << 20
PLUGIN_MODULE = "minisandbox_grader"
PLUGIN_ADDOPT = f"-p {PLUGIN_MODULE}"
SYMPY_HOOK_MODULE = "minisandbox_grader_sympy"
_PYTEST_COMMAND = re.compile(r"(^|[\s/;&|(])(pytest|py\.test|tox)(\s|$)")
_TESTBED = "/testbed/"
_LOG_PASSED = ("PASSED", "XFAIL")
_MIXED = ("setup.cfg", "tox.ini", "pyproject.toml")


def runs_pytest(task: Task) -> bool:
    """Whether the task's test command runs pytest (directly or through tox)."""
    return task.log_parser not in ("sympy", "django") and bool(
        _PYTEST_COMMAND.search(task.test_cmd)
    )


def runs_sympy(task: Task) -> bool:
    """Whether the task's test command is sympy's own runner (`bin/test`)."""
    return task.log_parser == "sympy" and "bin/test" in task.test_cmd


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "token": (str,),
    "id": (str,),
    "replaced": (list,),
    "replaced_before": (list,),
    "exitstatus": (int,),
    "file": (str, type(None)),
    "blob": (str, type(None)),
    "inifile": (str, type(None)),
    "ini_blob": (str, type(None)),
}


def _well_formed(record: dict[str, Any]) -> bool:
    for key, types in _FIELD_TYPES.items():
        if key in record and not isinstance(record[key], types):
            return False
    lists = [record.get("replaced") or [], record.get("replaced_before") or []]
    return all(isinstance(x, str) for xs in lists for x in xs)


def parse_records(text: str) -> tuple[list[dict[str, Any]], int]:
    """The plugin's JSON lines, and how many lines were not one of its records (the sandbox
    can write that file: a line of the wrong shape is counted, never trusted)."""
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("e"), str) and _well_formed(record):
            records.append(record)
        else:
            bad += 1
    return records, bad


def _rel(path: object) -> str | None:
    if not isinstance(path, str) or not path.startswith(_TESTBED):
        return None
    return posixpath.normpath(path[len(_TESTBED) :])


def _runner_own(rel: str) -> bool:
    """A module of the runner itself (pytest's repository): the code under test there."""
    parts = rel.split("/")
    return (
        "_pytest" in parts[:-1]
        or parts[-1] in ("pytest.py", "__main__.py")
        or "pytest" in parts[:-1]
    )


def _trusted_xfail(phase: dict[str, Any]) -> bool:
    """An expected failure the tests declared: a marker, or pytest.xfail() / unittest's
    expectedFailure raised by the tests or the runner, not by the code under test."""
    if phase.get("xfail_marked") or phase.get("xfail_in_test"):
        return True
    raiser = _rel(phase.get("xfail_from"))
    return raiser is None or _runner_own(raiser) or is_test_file(raiser)


class _Tests:
    """The plugin's per-phase records, by test id."""

    def __init__(self, records: Iterable[dict[str, Any]]) -> None:
        self.phases: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            if r.get("e") == "test" and isinstance(r.get("id"), str):
                # pytest before 4 has an instance node under a class ("a.py::C::()::test"),
                # which its reports, and so the log and the dataset, leave out.
                self.phases.setdefault(r["id"].replace("::()::", "::"), []).append(r)

    def find(self, name: str) -> list[list[dict[str, Any]]]:
        """The records of the test swebench names `name` (its parser cuts an id at a space)."""
        name = name.replace("::()::", "::")
        if name in self.phases:
            return [self.phases[name]]
        return [p for tid, p in self.phases.items() if tid.startswith(name + " ")]

    @staticmethod
    def verdict(phases: list[dict[str, Any]]) -> str:
        """ "passed", "xfailed" or what failed, from the runner's own call results."""
        xfailed = False
        for p in phases:
            kind = p.get("kind")
            if kind is None:
                continue
            if p.get("wasxfail") and _trusted_xfail(p):
                xfailed = True
                continue
            if kind == "skip":
                return f"skipped in {p.get('when')}"
            return f"{p.get('exc')} in {p.get('when')}"
        return "xfailed" if xfailed else "passed"


def check_pytest_run(
    task: Task,
    text: str | None,
    *,
    log_results: dict[str, str],
    test_exit_code: int | None,
    base_blobs: dict[str, str],
    patched: set[str] | frozenset[str] = frozenset(),
    parse: Callable[[str], dict[str, str]] | None = None,
    test_blobs: dict[str, str | None] | None = None,
) -> list[str]:
    """Every way the plugin's record (`text`, None when there is none) disagrees with the log's
    parsed results, the exit status, or the base commit (`base_blobs`: path → git blob id of
    each file of the checkout before the patch; `patched`: the paths the patch changed, whose
    runner sections were compared already; `parse`: the task's log parser, which names the
    plugin's tests as it names the log's; `test_blobs`: the blob ids of the files the test
    patch writes, as it writes them). Empty when the run is what it looks like."""
    if not log_results and test_exit_code not in (0, 1):
        return []  # nothing ran to speak of: unresolved already, and no claim to check
    records, bad = parse_records(text or "")
    starts = [r for r in records if r["e"] == "start"]
    if not starts:
        return ["runtime: the grader's pytest plugin did not run (pytest started without it)"]
    out = _run_problems(records, starts, bad, test_exit_code)
    # The eval script resets the test files and applies the test patch: those files must be
    # what that makes of them (`test_blobs`; a file the test patch deletes is absent).
    from_tests = set(files_in_patch(task.test_patch))
    tests_state = {f: base_blobs.get(f) for f in task.test_files} | dict(test_blobs or {})
    config = next((r for r in records if r["e"] == "config"), {})
    out += _config_problems(records, config, base_blobs, patched, tests_state)
    files = {*base_blobs, *from_tests}
    out += _test_problems(task, _Tests(records), log_results, parse, files)
    return list(dict.fromkeys(out))


def _run_problems(
    records: list[dict[str, Any]],
    starts: list[dict[str, Any]],
    bad: int,
    test_exit_code: int | None,
) -> list[str]:
    """One writer, one session that ended, with the test command's exit status."""
    out = []
    token = starts[0].get("token")
    if len(starts) > 1 or bad or records[0] is not starts[0]:
        out.append("runtime: the grader's record was written by something other than its plugin")
    if any(r.get("token") != token for r in records):
        out.append("runtime: the grader's record holds lines of another writer")
    ends = [r for r in records if r["e"] == "end"]
    if not ends:
        return [*out, "runtime: pytest never finished its session (the process exited early)"]
    status = ends[-1].get("exitstatus")
    # Only this way round: a command that fails after pytest passed (coverage's fail-under)
    # claims nothing; one that succeeds over a failed session was made to.
    if test_exit_code == 0 and status != 0:
        out.append(
            f"runtime: pytest's session ended with status {status} but the test command "
            f"exited {test_exit_code}"
        )
    for name in ends[-1].get("replaced") or []:
        out.append(f"runtime: the runner's {name} was replaced in memory during the run")
    for why in starts[0].get("replaced_before") or []:
        out.append(f"runtime: the runner's {why} (changed before pytest started)")
    return out


def _config_problems(
    records: list[dict[str, Any]],
    config: dict[str, Any],
    base_blobs: dict[str, str],
    patched: set[str] | frozenset[str],
    tests_state: dict[str, str | None],
) -> list[str]:
    """The ini file, every plugin and hook from the checkout and every test module must be the
    base commit's (the test files: as the test patch makes them)."""
    out = []
    ini = _rel(config.get("inifile"))
    # A setup.cfg / tox.ini / pyproject.toml the patch changed had its runner sections compared
    # (patch_rules.config_refusal); any other change since the base commit was not the patch's.
    compared = ini in patched and posixpath.basename(ini or "") in _MIXED
    if ini is not None and not compared and base_blobs.get(ini) != config.get("ini_blob"):
        out.append(f"runtime: pytest read a configuration the base commit does not have ({ini})")
    for r in records:
        if r["e"] == "hookimpl" and r.get("generated"):
            out.append(f"runtime: a hook of {r.get('hook')} has no source file ({r.get('file')})")
            continue
        if r["e"] not in ("plugin", "hookimpl", "module"):
            continue
        rel = _rel(r.get("file"))
        if rel is None or _runner_own(rel):
            continue
        if rel in tests_state:
            expected = tests_state[rel]
        elif r["e"] == "module":
            continue  # a module beside the tests: the code under test's, the patch's to change
        else:
            expected = base_blobs.get(rel)
        if expected != r.get("blob"):
            what = {"plugin": "a plugin", "hookimpl": "a hook", "module": "a test module"}
            out.append(
                f"runtime: pytest loaded {what[r['e']]} that is not the base commit's or the "
                f"test patch's ({rel})"
            )
    return out


def _test_problems(
    task: Task,
    tests: _Tests,
    log_results: dict[str, str],
    parse: Callable[[str], dict[str, str]] | None,
    files: set[str],
) -> list[str]:
    """Reports that say passed over a failure; tests the log passes that pytest did not.
    `files`: the checkout's, after the test patch."""
    out = []
    for tid, phases in tests.phases.items():
        for p in phases:
            if p.get("kind") in ("error", "skip") and p.get("outcome") == "passed":
                out.append(
                    f"runtime: {tid} raised {p.get('exc')} in {p.get('when')} but was reported "
                    "as passed"
                )
                break
    # The plugin's tests named by the log's own parser (it rewrites ids: paths in parameters
    # cut to their last part, escapes): "STATUS id" lines as pytest -rA writes them, and "id
    # STATUS" as pytest -v does (SWE-smith's parser reads those).
    seen: dict[str, str] = {}
    if parse is not None:
        lines = []
        for tid, phases in tests.phases.items():
            verdict = tests.verdict(phases)
            status = {"passed": "PASSED", "xfailed": "XFAIL"}.get(verdict, "FAILED")
            lines += [f"{status} {tid}", f"{tid} {status}"]
        seen = parse("\n".join(lines))
    for name in [*task.fail_to_pass, *task.pass_to_pass]:
        # A name that is no pytest id ("[100%]": a progress mark a dataset took for a test), or
        # one of a file the checkout does not have (pytest's own tests run pytest on files they
        # make: their inner runs' lines are in the log, and in the dataset) names nothing this
        # session runs: there is nothing to compare.
        if log_results.get(name) not in _LOG_PASSED or "::" not in name:
            continue
        if name.split("::", 1)[0] not in files:
            continue
        found = [tests.verdict(p) for p in tests.find(name)]
        if name not in tests.phases and found:
            # A name the parser cut at a space stands for every id it is a prefix of (and the
            # log keeps the last of them): one of those must have passed.
            if not any(v in ("passed", "xfailed") for v in found):
                out.append(f"runtime: the log says {name} passed, but pytest saw {found[0]}")
            continue
        verdicts = found
        if name in seen:
            verdicts.append("passed" if seen[name] in _LOG_PASSED else "failed")
        if not verdicts:
            out.append(f"runtime: the log says {name} passed, but pytest never ran it")
            continue
        failing = [v for v in verdicts if v not in ("passed", "xfailed")]
        if failing:
            out.append(f"runtime: the log says {name} passed, but pytest saw {failing[0]}")
    return out


_SYMPY_LOG = {"pass": "ok", "xfail": "f", "skip": "s"}


def check_sympy_run(
    task: Task,
    text: str | None,
    *,
    log_results: dict[str, str],
    test_exit_code: int | None,
    parse: Callable[[str], dict[str, str]] | None = None,
) -> list[str]:
    """The sympy hook's record (helpers/minisandbox_grader_sympy.py) against the log: every
    process that loaded the runner ended through its exit handlers, none replaced the runner's
    functions, the runner's own verdict agrees with the exit status, and every FAIL_TO_PASS /
    PASS_TO_PASS test the log passes was passed by the runner itself."""
    if not log_results and test_exit_code not in (0, 1):
        return []
    records, bad = parse_records(text or "")
    by_token: dict[object, list[dict[str, Any]]] = {}
    for r in records:
        by_token.setdefault(r.get("token"), []).append(r)
    if not records:
        return ["runtime: the grader's sympy hook did not run (the runner started without it)"]
    out = []
    if bad or any(rs[0]["e"] != "start" for rs in by_token.values()):
        out.append("runtime: the grader's record was written by something other than its hook")
    for rs in by_token.values():
        ends = [r for r in rs if r["e"] == "end"]
        if not ends:
            out.append("runtime: a test process ended before its exit handlers ran (os._exit)")
        for name in (ends[-1].get("replaced") or []) if ends else []:
            out.append(f"runtime: sympy's runner's {name} was replaced in memory during the run")
    finishes = [r for r in records if r["e"] == "finish"]
    if not finishes:
        out.append("runtime: sympy's runner never reached its summary")
    elif test_exit_code == 0 and not all(r.get("ok") for r in finishes):
        out.append("runtime: sympy's runner found failures but the test command exited 0")
    verdicts: dict[str, set[str]] = {}
    for r in records:
        if r["e"] == "test" and isinstance(r.get("id"), str):
            verdicts.setdefault(r["id"], set()).add(str(r.get("kind")))
    seen: dict[str, str] = {}
    if parse is not None:
        lines = [
            f"{t} {_SYMPY_LOG.get(next(iter(k)), 'F') if len(k) == 1 else 'F'}"
            for t, k in verdicts.items()
        ]
        seen = parse("\n".join(lines))
    for name in [*task.fail_to_pass, *task.pass_to_pass]:
        if log_results.get(name) not in _LOG_PASSED:
            continue
        kinds = verdicts.get(name)
        if not kinds and name not in seen:
            out.append(f"runtime: the log says {name} passed, but sympy's runner never ran it")
        # sympy names a test by its function: one of another file may share it (and fail).
        elif (kinds and "pass" not in kinds) or seen.get(name, "PASSED") not in _LOG_PASSED:
            out.append(
                f"runtime: the log says {name} passed, but sympy's runner saw "
                f"{', '.join(sorted(kinds or {'a failure'}))}"
            )
    return list(dict.fromkeys(out))
