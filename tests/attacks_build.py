"""Attacks on the host code around the sandbox (issue: the host never acts on what a sandbox
wrote): registered into attacks.ATTACKS, run as root and as an unprivileged caller by
test_attacks.py like every other attack.

Build attacks: a task whose install commands (a hostile repository's setup.py, in real life)
or whose environment build (a hostile dependency's sdist) plant symlinks to host directories
in the build sandbox's upper layer, then the real Builder finishes the build on the host.
Every attack builds with a private store, node cache and examples mirror under the caller's
scratch directory (the same filesystem as its victim directories, so that a rename could
move them)."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

from attacks import AttackContext, attack, scratch_subdir
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def _builder(ctx: AttackContext) -> Builder:
    """One store per caller, shared by its build attacks (the plain environment is built once)."""
    base = Path(ctx.scratch_dir) / "build-attacks"
    base.mkdir(exist_ok=True)
    base.chmod(0o755)
    return Builder(
        BuildSettings(
            store=base / "store",
            cache=base / "layers",
            git_mirror=materialize_mirror(base / "mirror"),
        )
    )


def _task(name: str, install: list[str], env: EnvRecipe | None = None) -> Task:
    """A bundled example's repository with its own install commands; no requirements, and no
    packaging files left for the wheelhouse step to fetch build requirements for (fast, and
    needing the package index only for the venv's seed packages)."""
    base = load_tasks("examples")[0]
    return base.model_copy(
        update={
            "id": f"attack-{name}-{secrets.token_hex(4)}",
            "env": env or EnvRecipe(python=PYTHON),
            "install": [*install, "rm -f pyproject.toml setup.py setup.cfg"],
        }
    )


def _victim(ctx: AttackContext, sub: str) -> tuple[Path, Path, str]:
    """A host directory `<victim>/<sub>` holding a secret file: (victim, secret file, token)."""
    victim = scratch_subdir(ctx, "build-victim-")
    (victim / sub).mkdir(parents=True)
    token = f"build-victim-{secrets.token_hex(8)}"
    secret = victim / sub / "secret.txt"
    secret.write_text(token)
    return victim, secret, token


def _layer_paths(builder: Builder, layer: str) -> list[list]:
    return list(builder.store.manifest(layer)["entries"])


@attack
async def attack_build_cleanup_through_planted_symlink(ctx: AttackContext) -> None:
    """The install step links /root/.config to a host directory; the builder's clean-up of
    build noise (`root/.config/uv`) must not delete that host directory's `uv` through it."""
    victim, secret, token = _victim(ctx, "uv")
    builder = _builder(ctx)
    task = _task("noise", [f"ln -s {victim} /root/.config"])
    result = await builder.build(task)
    assert secret.is_file() and secret.read_text() == token, (
        f"the build deleted the host directory {victim / 'uv'} through the planted link "
        f"/root/.config -> {victim} (build: {result.status}, {result.error})"
    )
    # Positive control: the install ran and planted the link, which the layer keeps as a link.
    assert result.status == "built", result.error
    assert result.task_layer is not None
    links = [e for e in _layer_paths(builder, result.task_layer) if e[0] == "l"]
    assert ["l", "root/.config", str(victim)] in links, (
        f"the install did not plant /root/.config -> {victim} (positive control): {links}"
    )


@attack
async def attack_build_moves_host_dir_into_env_layer(ctx: AttackContext) -> None:
    """During the environment build, a process in the build sandbox swaps /opt for a link to a
    host directory once pip is done (a hostile dependency's sdist can leave a daemon that does
    so; here the recipe's pip options do it, the same sandbox process at the same moment). The
    builder must refuse to collect /opt/venv through the link: the host directory stays where
    it is, no layer holds it, and the build fails naming the step and the path."""
    victim, secret, token = _victim(ctx, "venv")
    builder = _builder(ctx)
    swap = f"--help >/dev/null; mv /opt /opt.real && ln -s {victim} /opt; echo"
    env = EnvRecipe(python=PYTHON, requirements=["pip"], pip_options=[swap])
    task = _task("envswap", ["true"], env)
    result = await builder.build(task)
    assert secret.is_file() and secret.read_text() == token, (
        f"the build moved the host directory {victim / 'venv'} away "
        f"(build: {result.status}, layers {result.env_layer})"
    )
    for layer in builder.store.list():
        names = [e[1] for e in _layer_paths(builder, layer.id)]
        assert not [n for n in names if n.endswith("secret.txt")], (
            f"layer {layer.id} ({(layer.meta or {}).get('kind')}) holds the host directory "
            f"{victim / 'venv'}: {[n for n in names if 'secret' in n]}"
        )
    assert builder.store.resolve(builder.env_ref(task)) is None, "a layer was published"
    # Positive control: the swap happened (the build got as far as collecting /opt/venv, and
    # failed there because /opt was the planted link) and the error says so.
    assert result.status == "failed", result
    assert result.error and "'collect'" in result.error and "/opt/venv" in result.error, (
        f"the build did not fail at collecting /opt/venv (positive control): {result.error}"
    )
    assert "symlink" in result.error or "not a directory" in result.error, result.error


_EGRESS_PROBE = r"""
import json, socket, urllib.request
PORT, NAME, BANNER = {port}, {name!r}, {banner!r}
out = {{}}
try:
    s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
    out["tcp"] = "ok:" + s.recv(100).decode()
except OSError as e:
    out["tcp"] = str(e)
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect("\0" + NAME)
    out["abstract"] = "ok:" + s.recv(100).decode()
except OSError as e:
    out["abstract"] = str(e)
tables = ""
for table in ("tcp", "tcp6", "unix"):
    try:
        tables += open("/proc/net/" + table).read()
    except OSError:
        pass
out["proc_net"] = (":%04X " % PORT) in tables or NAME in tables
proxy = urllib.request.build_opener(urllib.request.ProxyHandler(
    {{"http": "http://127.0.0.1:3128", "https": "http://127.0.0.1:3128"}}))
for key, url in (
    ("via_proxy_loopback", "http://127.0.0.1:%d/" % PORT),
    ("via_proxy_localhost", "http://localhost:%d/" % PORT),
    ("via_proxy_metadata", "http://169.254.169.254/latest/meta-data/"),
):
    try:
        out[key] = "ok:" + proxy.open(url, timeout=10).read(200).decode(errors="replace")
    except Exception as e:
        out[key] = repr(e)[:200]
try:  # positive control: the package index, through the build's proxy
    out["pypi"] = urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=120).status
except Exception as e:
    out["pypi"] = repr(e)[:300]
with open("/testbed/egress-probe.json", "w") as f:
    json.dump(out, f)
"""


@attack
async def attack_build_reaches_host_services(ctx: AttackContext) -> None:
    """A task's install step (a hostile setup.py) connects to a TCP service bound only to the
    host's 127.0.0.1, to a host abstract unix socket, lists the host's sockets in /proc/net,
    and asks the build's proxy for the host's loopback and the cloud metadata address. None
    may work; the package index must (through the proxy)."""
    probe = _EGRESS_PROBE.format(
        port=ctx.tcp_port, name=ctx.abstract_socket, banner=ctx.server_banner
    )
    builder = _builder(ctx)
    script = f"/usr/bin/python3 - <<'PROBE'\n{probe}\nPROBE"
    task = _task("egress", [script])
    result = await builder.build(task)
    assert result.status == "built" and result.task_layer, f"the build failed: {result.error}"
    out = json.loads(builder.store.read_file(result.task_layer, "testbed/egress-probe.json"))
    assert out["pypi"] == 200, f"the build cannot reach the package index (control): {out}"
    for key in ("tcp", "abstract", *(k for k in out if k.startswith("via_proxy"))):
        assert ctx.server_banner not in str(out[key]) and not str(out[key]).startswith("ok:"), (
            f"a build step reached a host service ({key}): {out[key]}"
        )
    assert not out["proc_net"], f"a build step sees the host's sockets in /proc/net: {out}"
