"""Installing as of a date: the pip installs of a repository's install commands, run through
uv with `--exclude-newer`, so that a repository at an old commit gets the dependencies it had
then rather than today's (which may have dropped what its code or tests use).

Only commands that are a plain pip install (`pip install ...`, `python -m pip install ...`) are
rewritten; anything else (`python setup.py develop`, `hash -r`) runs as given.
"""

from __future__ import annotations

import re
import shlex
from datetime import datetime, timedelta, timezone

from minisandbox.envs.layout import VENV

# "pip install", "pip3 install", "python -m pip install", "python3.10 -m pip install", with the
# rest of the command (its arguments) kept.
# Bumped when what an install as of a date resolves changes (the date rule, the rewriting): it
# is part of the repository layer's key.
AS_OF_FORMAT = 1
# A month after setuptools 64, the first with PEP 660 editable installs (August 2022).
EDITABLE_SETUPTOOLS = "2022-09-01T00:00:00Z"
_PIP_INSTALL = re.compile(r"^\s*(?:python[\d.]*\s+-m\s+)?pip[\d.]*\s+install(?=\s)")


def as_of_date(value: str) -> str:
    """`value` checked as an ISO 8601 date or date-time ("2023-05-01", "2023-05-01T12:00:00Z",
    "2023-05-01T12:00:00+02:00"), as given.

    Raises:
        ValueError: it is not one.
    """
    try:
        datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{value!r} is not an ISO 8601 date or time (e.g. 2023-05-01 or "
            '2023-05-01T12:00:00Z) nor "commit"'
        ) from None
    return value.strip()


def pip_as_of(command: str, date: str) -> str:
    """`command` with a leading pip install made a uv one that ignores packages uploaded after
    `date` (into the environment's venv); other commands unchanged.

    setuptools is the exception before EDITABLE_SETUPTOOLS: uv installs `-e .` only through a
    backend's PEP 660 hook, which older setuptools lack (pip fell back to `setup.py develop`),
    so setuptools is taken as of that date instead."""
    m = _PIP_INSTALL.match(command)
    if not m:
        return command
    date = as_of_date(date)
    options = f"--exclude-newer {shlex.quote(date)}"
    if _moment(date) < _moment(EDITABLE_SETUPTOOLS):
        options += f" --exclude-newer-package setuptools={EDITABLE_SETUPTOOLS}"
    return f"uv pip install --python {VENV}/bin/python {options}" + command[m.end() :]


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
    """`date`, or a quarter after Python `python`'s ("3.10" or "3.10.13") release when that
    is later (as an ISO 8601 UTC time); a Python not in PYTHON_RELEASES leaves it as is."""
    released = PYTHON_RELEASES.get(".".join(python.split(".")[:2]))
    if released is None:
        return date
    floor = _moment(released) + _WHEELS_LAG
    return date if _moment(date) >= floor else floor.strftime("%Y-%m-%dT%H:%M:%SZ")


# What the venv holds after the install, for the layer's metadata (`uv pip freeze`: one
# "name==version" or "name @ url" per line).
FREEZE = f"uv pip freeze --python {VENV}/bin/python"
