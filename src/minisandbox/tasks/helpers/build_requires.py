"""Prints a repository's build requirements (pyproject.toml's, else setuptools), one a line, plus
wheel. Runs inside the build sandbox with the environment's python, in the repository; any
Python 3 an environment uses (3.5 on), standard library and pip's vendored TOML reader only
(tomli from pip 21.2, toml from 20.1, pytoml from 10; pip 9 vendors none: then the
build-system table's `requires` array is read by pattern)."""

import os
import re

_TOKEN = re.compile(r"\"((?:[^\"\\\n]|\\.)*)\"|'([^'\n]*)'|#[^\n]*|(\])")


def _by_pattern(text):
    header = re.search(r"(?m)^[ \t]*\[build-system\][ \t]*(?:#.*)?$", text)
    if header is None:
        return {}
    body = text[header.end() :]
    following = re.search(r"(?m)^[ \t]*\[", body)  # the next table
    body = body[: following.start()] if following else body
    key = re.search(r"(?m)^[ \t]*requires[ \t]*=[ \t]*\[", body)
    if key is None:
        return {"build-system": {}}
    requires = []
    for m in _TOKEN.finditer(body, key.end()):
        if m.group(3):  # the array's end (a "]" inside a string or comment was consumed)
            break
        if m.group(1) is not None:
            requires.append(m.group(1).replace('\\"', '"').replace("\\\\", "\\"))
        elif m.group(2) is not None:
            requires.append(m.group(2))
    return {"build-system": {"requires": requires}}


def _loads(text):
    for name in ("tomli", "toml", "pytoml"):
        try:
            reader = __import__("pip._vendor." + name, fromlist=["loads"])
        except ImportError:
            continue
        return reader.loads(text)
    return _by_pattern(text)


requires = None
if os.path.exists("pyproject.toml"):
    with open("pyproject.toml", encoding="utf-8") as fh:
        requires = _loads(fh.read()).get("build-system", {}).get("requires")
if requires is None:
    requires = ["setuptools>=40.8.0"]
print("\n".join([*requires, "wheel"]))
