"""Prints a repository's build requirements (pyproject.toml's, else setuptools), one a line, plus
wheel. Runs inside the build sandbox with the environment's python, in the repository; any
Python 3 an environment uses (3.5 on), standard library and pip's vendored TOML reader only
(pips before 19 vendor none: then the build-system table's `requires` is read by pattern)."""

import os
import re


def _loads(text):
    try:
        from pip._vendor import tomli as reader
    except ImportError:
        try:
            from pip._vendor import toml as reader
        except ImportError:
            reader = None
    if reader is not None:
        return reader.loads(text)
    section = re.search(r"(?ms)^\[build-system\][ \t]*$(.*?)(?=^\[|\Z)", text)
    found = section and re.search(r"(?ms)^requires\s*=\s*\[(.*?)\]", section.group(1))
    if not found:
        return {}
    names = re.findall(r"\"([^\"]*)\"|'([^']*)'", found.group(1))
    return {"build-system": {"requires": [a or b for a, b in names]}}


requires = None
if os.path.exists("pyproject.toml"):
    with open("pyproject.toml", encoding="utf-8") as fh:
        requires = _loads(fh.read()).get("build-system", {}).get("requires")
if requires is None:
    requires = ["setuptools>=40.8.0"]
print("\n".join([*requires, "wheel"]))
