"""Write (or check) the SWE-bench install specs that the loaders ship as data.

swebench 4.1.0 carried, in `swebench.harness.constants`, how each Python repository's versions
are installed (MAP_REPO_VERSION_TO_SPECS_PY) and where a repository keeps the requirements file
or conda environment file a spec names (MAP_REPO_TO_REQS_PATHS, MAP_REPO_TO_ENV_YML_PATHS).
swebench 5.x dropped them; records without an environment export still need them, whichever
swebench is installed, so they are kept as data (swebench is MIT-licensed; the file says where
it comes from).

    .venv/bin/python scripts/swebench_specs.py          # rewrite the data file (swebench 4.1.0)
    .venv/bin/python scripts/swebench_specs.py --check  # exit 1 when it differs from swebench's
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

OUT = (
    Path(__file__).resolve().parents[1]
    / "src/minisandbox/tasks/loaders/data/swebench_specs.json"
)
VERSION = "4.1.0"


def table() -> str:
    installed = importlib.metadata.version("swebench")
    if installed != VERSION:
        raise SystemExit(f"swebench {installed} is installed: pip install 'swebench=={VERSION}'")
    constants = importlib.import_module("swebench.harness.constants")
    data = {
        "source": {
            "package": f"swebench {VERSION} (https://github.com/SWE-bench/SWE-bench, MIT license)",
            "module": "swebench.harness.constants",
            "tables": [
                "MAP_REPO_VERSION_TO_SPECS_PY",
                "MAP_REPO_TO_REQS_PATHS",
                "MAP_REPO_TO_ENV_YML_PATHS",
            ],
            "written_by": "scripts/swebench_specs.py",
        },
        "specs": constants.MAP_REPO_VERSION_TO_SPECS_PY,
        "reqs_paths": constants.MAP_REPO_TO_REQS_PATHS,
        "env_yml_paths": constants.MAP_REPO_TO_ENV_YML_PATHS,
    }
    # Strict JSON: a value JSON cannot hold fails here, not in the loader.
    return json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"


def main(argv: list[str]) -> int:
    text = table()
    if "--check" in argv:
        current = OUT.read_text() if OUT.is_file() else ""
        return 0 if current == text else 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
