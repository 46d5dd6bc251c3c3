"""Where built layers put things inside a sandbox: the paths every layer kind agrees on."""

from __future__ import annotations

# The environment layer: a self-contained Python install (see helpers/standalone.sh).
VENV = "/opt/venv"
# Wheels of the repository's build requirements, fetched at build time: evaluation reinstalls
# the package offline (SWE-bench's eval scripts run `pip install -e .`) with pip's usual build
# isolation, from these, so the same setuptools builds it as at build time (another one can
# change how an editable install is made, and tests that inspect sys.path with it).
WHEELHOUSE = "/opt/minisandbox/wheelhouse"
# When the gold patch changes the package's dependencies, the official harness installs the new
# ones from PyPI while evaluating (its eval script reinstalls the package). Evaluation here has no
# network, so the wheels the patched package needs are fetched at build time into a layer that
# only evaluation sandboxes mount: an agent never sees which packages the fix brings.
EVAL_WHEELHOUSE = "/opt/minisandbox/eval-wheelhouse"
# The tools environments of test services (envs.tools): one venv per tools environment below.
TOOLS_ROOT = "/opt/minisandbox-tools"
# Where a task's repository is.
TESTBED = "/testbed"
