"""Prints a repository's build requirements (pyproject.toml's, else setuptools), one a line, plus
wheel. Runs inside the build sandbox with the environment's python, in the repository; any
Python 3 an environment uses (3.5 on), standard library and pip's vendored TOML reader only."""

import os

requires = None
if os.path.exists("pyproject.toml"):
    try:
        from pip._vendor import tomli as reader
    except ImportError:
        from pip._vendor import toml as reader
    with open("pyproject.toml", encoding="utf-8") as fh:
        requires = reader.loads(fh.read()).get("build-system", {}).get("requires")
if requires is None:
    requires = ["setuptools>=40.8.0"]
print("\n".join([*requires, "wheel"]))
