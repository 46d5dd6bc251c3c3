"""Tools environments: the venvs test services run from, a layer kind fed by a table.

A service runs from a tools environment the task's own venv does not see: a uv venv of pinned
packages at `TOOLS_ROOT/<name>`, built once from a host interpreter of our choosing (not the
task's: the task may need a Python too old for the service), published to the layer store as
`tools/<name>-<key>`, and added to the task's sandbox as one more read-only lower layer with its
interpreter's prefix bound read-only. Which service runs from which environment is data
(`SERVICE_TOOLS`); what runs the services is evaluation.services.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from pathlib import Path

from minisandbox.envs.kinds import format_of
from minisandbox.envs.layerbuild import LayerBuild, LayerBuilder
from minisandbox.envs.layout import TOOLS_ROOT
from minisandbox.envs.toolchains import Interpreter, ToolchainNotFoundError, find_interpreter
from minisandbox.errors import ToolsEnvironmentError
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.utils.hashing import content_digest

# Tried in order for the tools environments; the pins below are known to install on each.
TOOLS_PYTHONS = ("3.12", "3.11", "3.13", "3.10")
_TOOLS_FORMAT = format_of("tools")  # (envs/kinds.py)

# httpbin (the PyPI package of httpbin.org's code) and its whole dependency closure, pinned.
HTTPBIN_REQUIREMENTS = (
    "httpbin==0.10.4",
    "flask==3.1.3",
    "werkzeug==3.1.9",
    "blinker==1.9.0",
    "brotlicffi==1.2.1.0",
    "cffi==2.1.1",
    "click==8.5.1",
    "decorator==5.3.1",
    "greenlet==3.5.6",
    "itsdangerous==2.2.0",
    "jinja2==3.1.6",
    "markupsafe==3.0.4",
    "pycparser==3.12",
    "six==1.17.0",
    # Certificates for the public names it answers as (evaluation.services).
    "trustme==1.2.1",
    "cryptography==50.0.2",
    "idna==3.20",
)
# The tools environments, by their pinned requirements (installed --no-deps: complete closures).
TOOLS: dict[str, tuple[str, ...]] = {"httpbin": HTTPBIN_REQUIREMENTS}
# The services that run from each tools environment (a service absent here needs none).
SERVICE_TOOLS: dict[str, str] = {"httpbin": "httpbin", "web": "httpbin"}


@functools.cache  # discovery runs programs: once per process
def tools_interpreter() -> Interpreter:
    """The host interpreter tools environments are built with.

    Raises:
        ToolsEnvironmentError: the host has none of TOOLS_PYTHONS.
    """
    for version in TOOLS_PYTHONS:
        with contextlib.suppress(ToolchainNotFoundError):
            return find_interpreter(version)
    raise ToolsEnvironmentError(
        f"test services need a Python {' or '.join(TOOLS_PYTHONS)} on the host: "
        f"uv python install {TOOLS_PYTHONS[0]}"
    )


def tools_ref(name: str, interp: Interpreter) -> str:
    spec = {
        "format": _TOOLS_FORMAT,
        "service": name,
        "python": interp.version,
        "requirements": list(TOOLS[name]),
    }
    return f"tools/{name}-{content_digest(spec)[:32]}"


async def tools_layers(lb: LayerBuilder, services: Iterable[str]) -> tuple[list[str], list[Path]]:
    """The tools layers of the named services (built when missing) and the host paths they
    need mounted (the tools interpreter's prefix)."""
    wanted = list(dict.fromkeys(SERVICE_TOOLS[s] for s in services if s in SERVICE_TOOLS))
    if not wanted:
        return [], []
    interp = tools_interpreter()
    return [await tools_layer(lb, name, interp) for name in wanted], [interp.prefix]


async def tools_layer(lb: LayerBuilder, name: str, interp: Interpreter) -> str:
    """The layer id of tools environment `name`, built and published once per store.

    Raises:
        BuildError: a step failed, or the venv was behind a planted link.
    """
    ref = tools_ref(name, interp)
    existing = lb.store.resolve(ref)  # the usual case, without taking the build lock
    if existing:
        return existing
    venv = f"{TOOLS_ROOT}/{name}"
    logs = lb.log_dir(ref)

    async def run(sb: Sandbox) -> None:
        await lb.step(sb, ref, logs, "venv", f"uv venv --python {interp.executable} {venv}")
        await sb.write_file("/tmp/requirements.txt", "\n".join(TOOLS[name]))
        await lb.step(
            sb,
            ref,
            logs,
            "requirements",
            f"uv pip install --python {venv}/bin/python --link-mode copy "
            "--compile-bytecode --no-deps -r /tmp/requirements.txt",
        )

    build = LayerBuild(
        ref=ref,
        kind="tools",
        what=ref,
        interp=interp,
        logs=logs,
        run=run,
        meta={"service": name},
        collect=venv,  # refuses a planted link
    )
    return await lb.once(ref, False, lambda: lb.build_layer(build))
