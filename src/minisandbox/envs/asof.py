"""Installing as of a date, so that a repository at an old commit gets the dependencies it had
then rather than today's (which may have dropped what its code or tests use).

Every `pip install` of the install commands (`pip install`, `python -m pip install`, at the start
of a line or after `&&`, `||`, `;`) runs as `uv pip install --exclude-newer <date>` into the
environment's venv; anything else that installs (a Makefile, `VAR=1 pip install`) still meets the
date through the environment: UV_EXCLUDE_NEWER for uv, PIP_UPLOADED_PRIOR_TO for pip (25.1 and
later; an older pip ignores it, which the layer's recorded freeze would show).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone

from minisandbox.envs.layout import VENV

# Bumped when what an install as of a date resolves changes (the date rule, the rewriting): it
# is part of the repository layer's key.
AS_OF_FORMAT = 3
# A month after setuptools 64, the first with PEP 660 editable installs (August 2022).
EDITABLE_SETUPTOOLS = "2022-09-01T00:00:00Z"
# uv builds a setup.py-only source distribution through setuptools' PEP 517 backend, which
# came in 40.8.0 (February 2019): an install dated before then takes setuptools as of a month
# later, or no such sdist builds at all ("only setuptools<=40.4.3 is available").
PEP517_SETUPTOOLS = "2019-03-01T00:00:00Z"
# "pip install", "pip3 install", "python -m pip install", "python3.10 -m pip install" where a
# command starts; the rest (its arguments) is kept.
_PIP_INSTALL = re.compile(
    r"(?m)(^|&&|\|\||;)(\s*)(?:python[\d.]*\s+-m\s+)?pip[\d.]*\s+install(?=\s)"
)
# What uv and pip both read: a date, or a date and time with an optional zone.
_ISO = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:\d{2})?)?"
)


def as_of_date(value: str) -> str:
    """`value`, an ISO 8601 date or date-time ("2023-05-01", "2023-05-01T12:00:00Z",
    "2023-05-01T12:00:00+02:00"), as the UTC time uv and pip are given ("...T10:00:00Z"; a
    date alone, or a time without a zone, is taken as UTC, so every host reads it alike).

    Raises:
        ValueError: it is not one.
    """
    value = value.strip()
    try:
        if not _ISO.fullmatch(value):
            raise ValueError
        return _moment(value).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        raise ValueError(
            f"{value!r} is not an ISO 8601 date or time (e.g. 2023-05-01 or "
            '2023-05-01T12:00:00Z) nor "commit"'
        ) from None


# What pip installs become: uv, as of the date. Where uv cannot do what pip did, what pip did:
# a build backend without PEP 660's build_editable hook (a build-system table pinning
# `setuptools~=62.6`, as pylint 2.15's) gets the editable install without build isolation on
# the environment's own setuptools (pip ran `setup.py develop`), made new enough for the hook;
# anything else uv refuses (pip-only options such as `--no-use-pep517`, an editable on Python
# 3.6, whose setuptools never had the hook) is left to the environment's own pip, undated, as
# before. Exported: a rewritten command may run in a child shell (`bash -c '...'`).
_PIP_INSTALL_FUNCTION = """pip_install_as_of() {{
  local out
  if out=$({uv} "$@" 2>&1); then printf '%s\\n' "$out"; return 0; fi
  printf '%s\\n' "$out"
  case "$out" in
    *"has no attribute 'build_editable'"*)
      echo "+ its build backend has no PEP 660 hook: without build isolation, as pip did"
      local isolation=--no-build-isolation
      case " $* " in *" --no-build-isolation "*) isolation= ;; esac
      if {uv} 'setuptools>=64' wheel && {uv} $isolation "$@"; then return 0; fi ;;
  esac
  echo "+ uv cannot install this as pip did: with the environment's own pip (not dated)"
  python -m pip install "$@"
}}
export -f pip_install_as_of"""


def install_env(date: str) -> str:
    """The shell lines that come before the install commands: any installer meets `date`
    through the environment, and pip_as_of's commands find their function."""
    quoted = shlex.quote(as_of_date(date))
    options = " ".join(exclude_newer(date, EDITABLE_SETUPTOOLS))
    uv = f"uv pip install --python {VENV}/bin/python {options}"
    return (
        f"export UV_EXCLUDE_NEWER={quoted} PIP_UPLOADED_PRIOR_TO={quoted}\n"
        + _PIP_INSTALL_FUNCTION.format(uv=uv)
    )


def pip_as_of(command: str, date: str) -> str:
    """`command` with each pip install made `pip_install_as_of` (install_env's function): a uv
    install into the environment's venv that ignores packages uploaded after `date`; other
    commands unchanged.

    setuptools is the exception before EDITABLE_SETUPTOOLS: uv installs `-e .` only through a
    backend's PEP 660 hook, which older setuptools lack (pip fell back to `setup.py develop`),
    so setuptools is taken as of that date instead."""
    as_of_date(date)  # a bad date is an error here too
    return _PIP_INSTALL.sub(lambda m: f"{m[1]}{m[2]}pip_install_as_of", command)


def exclude_newer(
    date: str, setuptools_from: str = PEP517_SETUPTOOLS, later: Mapping[str, str] | None = None
) -> list[str]:
    """uv's options for an install as of `date`: nothing uploaded later, except setuptools,
    taken as of `setuptools_from` when that is later (what uv's builds need of it), and each
    package of `later` (name -> time) as of its own time when that is later."""
    date = as_of_date(date)
    options = ["--exclude-newer", date]
    exceptions = {"setuptools": setuptools_from, **(later or {})}
    for name, since in sorted(exceptions.items()):
        if _moment(date) < _moment(since):
            options += ["--exclude-newer-package", f"{name}={as_of_date(since)}"]
    return options


def _moment(value: str) -> datetime:
    """An ISO 8601 date or time as an aware datetime (a date alone, or no zone: UTC)."""
    moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


# When each Python's x.y.0 came out. A repository's commit can predate the Python its
# environment uses (SWE-smith builds most on 3.10): the index as of the commit has nothing that
# supports it yet, so the date is taken no earlier than a quarter after that release, once
# packages have published wheels for it.
PYTHON_RELEASES = {
    "3.6": "2016-12-23",
    "3.7": "2018-06-27",
    "3.8": "2019-10-14",
    "3.9": "2020-10-05",
    "3.10": "2021-10-04",
    "3.11": "2022-10-24",
    "3.12": "2023-10-02",
    "3.13": "2024-10-07",
    "3.14": "2025-10-07",
}
_WHEELS_LAG = timedelta(days=90)


def not_before_python(date: str, python: str) -> str:
    """`date` (as_of_date's UTC time), or a quarter after Python `python`'s ("3.10" or
    "3.10.13") release when that is later; a Python not in PYTHON_RELEASES leaves it as is.

    Raises:
        ValueError: `date` is not an ISO 8601 date or time.
    """
    date = as_of_date(date)
    released = PYTHON_RELEASES.get(".".join(python.split(".")[:2]))
    if released is None:
        return date
    floor = _moment(released) + _WHEELS_LAG
    return date if _moment(date) >= floor else floor.strftime("%Y-%m-%dT%H:%M:%SZ")


# What the venv holds after the install, for the layer's metadata (`uv pip freeze`: one
# "name==version" or "name @ url" per line).
FREEZE = f"uv pip freeze --python {VENV}/bin/python"
