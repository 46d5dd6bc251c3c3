"""System packages a task's official image installs, and whether this host has them.

SWE-bench's specs install some system packages with apt before the build (graphviz for sphinx
7.2+, locales for old django, TeX and ffmpeg for matplotlib). A sandbox has no apt of its own: its
/usr is the host's, read-only. The loader keeps those commands out of the build (the recipe's
`skipped`); the builder names the packages this host lacks, so that a test failing for want of
`dot` is not a mystery. The check reads dpkg's database, so it answers on Debian-family hosts
only; elsewhere it says nothing.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable

_APT_INSTALL = re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\b(?P<args>[^;&|<>#\n]*)")
_OPTION_WITH_VALUE = {"-o", "--option", "-t", "--target-release", "-c", "--config-file"}


def apt_packages(commands: Iterable[str]) -> list[str]:
    """The packages `apt-get install` / `apt install` commands name (options left out)."""
    out: list[str] = []
    for command in commands:
        for m in _APT_INSTALL.finditer(command):
            try:
                words = shlex.split(m.group("args"))
            except ValueError:
                words = m.group("args").split()
            skip = False
            for word in words:
                if skip or word.startswith("-"):
                    skip = word in _OPTION_WITH_VALUE  # its value is the next word
                    continue
                name = re.split(r"[=/]", word, maxsplit=1)[0]  # pkg=1.2, pkg/bookworm
                if name and name not in out:
                    out.append(name)
    return out


def missing_on_host(packages: list[str]) -> list[str] | None:
    """Those of `packages` dpkg does not have installed; None where there is no dpkg."""
    if not packages or shutil.which("dpkg-query") is None:
        return None if packages else []
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *packages],
        capture_output=True,
        text=True,
        check=False,
    )
    installed = {
        line.split()[0].split(":")[0]
        for line in r.stdout.splitlines()
        if line.endswith(" installed")
    }
    return [p for p in packages if p not in installed]
