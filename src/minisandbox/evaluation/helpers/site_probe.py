"""What the task's Python imports from where, before the patch: printed as one JSON object.
Run inside the sandbox by the environment's python (3.6 and later), from /testbed.

- "purelib": its site-packages (where the grader's plugin goes);
- "path": the directories of sys.path inside /testbed, relative ("" for the root; the current
  directory counts, as `python -m pytest` puts it first);
- "modules": the top-level names importable from outside /testbed (the standard library's and
  the installed ones), which a new module of a patch must not shadow.
"""

import json
import os
import pkgutil
import sys
import sysconfig

TESTBED = "/testbed"
inside, outside = [], []
for entry in ["", *sys.path]:
    path = os.path.abspath(entry or os.getcwd())
    if path == TESTBED or path.startswith(TESTBED + os.sep):
        rel = os.path.relpath(path, TESTBED)
        inside.append("" if rel == "." else rel)
    else:
        outside.append(path)
modules = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
for info in pkgutil.iter_modules(outside):
    modules.add(info[1])
print(
    json.dumps(
        {
            "purelib": sysconfig.get_paths()["purelib"],
            "path": sorted(set(inside)),
            "modules": sorted(modules),
        }
    )
)
