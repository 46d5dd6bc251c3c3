"""What SWE-bench's scripts and agents assume of a task container, as one small layer.

The official images hold a conda environment `testbed` under /opt/miniconda3; their eval scripts
start with `source /opt/miniconda3/bin/activate` and `conda activate testbed`. Our environment is
the venv at /opt/venv, so this layer provides an `activate` that defines a `conda` shell function
whose `activate` activates that venv, and `/opt/miniconda3/envs/testbed` pointing at it. The
published scripts then run unchanged. Git has the images' identity (`/etc/gitconfig`).

The layer is made once per node (its name carries a hash of its content) and, like every lower
layer, is read-only inside sandboxes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from minisandbox.utils.safefs import discard_tree

VENV = "/opt/venv"
CONDA_PREFIX = "/opt/miniconda3"

# Works under `set -u` (eval scripts use `set -uxo pipefail`).
ACTIVATE = f"""\
# Provided by minisandbox: this sandbox has no conda. The task's environment is the venv
# {VENV}; `conda activate <any name>` activates it, `conda deactivate` leaves it.
conda() {{
    case "${{1-}}" in
        activate) . {VENV}/bin/activate ;;
        deactivate) if command -v deactivate >/dev/null 2>&1; then deactivate; fi ;;
        *) echo "conda ${{1-}}: not available here (the environment is the venv {VENV})" >&2
           return 1 ;;
    esac
}}
"""


# The official images set this identity (`git config --global`, in their setup script), so
# agents and scripts can commit or stash; here as the system's config, leaving /root alone.
GITCONFIG = """\
[user]
\temail = setup@swebench.config
\tname = SWE-bench
"""


def _content_key() -> str:
    return hashlib.sha256((ACTIVATE + GITCONFIG).encode()).hexdigest()[:16]


def compat_layer(root: Path, owner: tuple[int, int] | None) -> Path:
    """The layer's directory under `root`, made (atomically) when absent."""
    final = root / f"compat-{_content_key()}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".compat-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        bin_dir = staging / CONDA_PREFIX.lstrip("/") / "bin"
        bin_dir.mkdir(parents=True, mode=0o755)
        (bin_dir / "activate").write_text(ACTIVATE)
        (staging / "etc").mkdir(mode=0o755)
        (staging / "etc" / "gitconfig").write_text(GITCONFIG)
        envs = bin_dir.parent / "envs"
        envs.mkdir(mode=0o755)
        os.symlink(VENV, envs / "testbed")
        for dirpath, dirnames, filenames in os.walk(staging):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    os.chmod(os.path.join(dirpath, name), 0o644)
            if owner is not None:
                os.chown(dirpath, *owner)
                for name in [*dirnames, *filenames]:
                    os.chown(os.path.join(dirpath, name), *owner, follow_symlinks=False)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not another process winning the race: a real failure
                raise
    finally:
        if staging.exists():
            discard_tree(staging)
    return final
