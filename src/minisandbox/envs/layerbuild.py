"""The one way a layer is built: steps in a build sandbox (network on), the result moved out of
its upper directory, published to the store under a ref, once.

Every layer kind (environments, task repositories, evaluation wheels, tools environments) is a
`LayerBuild`: what to put in the upper before the sandbox starts, the steps to run in it, and
which directory of the upper becomes the layer (all of it, minus build noise, when none). The
skeleton (`LayerBuilder.build_layer`) does the rest the same way for all of them: a work
directory named after its owner, the lower layers pinned in the node cache, the build sandbox,
collecting without following a planted link, publishing, naming the ref last.

`LayerBuilder.once` builds a ref once: across coroutines and processes (a lock per ref), and a
recorded failure fails at once instead of rebuilding (until `force`). `LayerBuilder.recording()`
says which refs a call built (rather than found in the store), for that call alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisandbox.envs import workdirs
from minisandbox.envs.egress import EXTRA_HOSTS_VAR, build_policy, pip_index
from minisandbox.envs.layout import VENV
from minisandbox.envs.settings import DEFAULT_IO_BUDGET, BuildSettings
from minisandbox.envs.toolchains import Interpreter, find_interpreter
from minisandbox.errors import MiniSandboxError
from minisandbox.layers.budget import LocalIOBudget
from minisandbox.layers.nodecache import NodeCache
from minisandbox.layers.store import LayerStore
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.sandbox.config import GiB, Limits, SandboxConfig
from minisandbox.sandbox.memory import host_memory
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.utils import safefs
from minisandbox.utils.uv import uv_binary

logger = logging.getLogger(__name__)


class BuildError(MiniSandboxError):
    """A build step failed. `step` names it; `log` is the kept log file."""

    def __init__(self, task_or_env: str, step: str, log: Path, tail: str) -> None:
        super().__init__(f"{task_or_env}: step '{step}' failed (log: {log}){tail}")
        self.step, self.log = step, log
        self.tail = tail.removeprefix(":").strip()  # the error's last lines, or its reason


# What an installer or git prints when the package index or git host did not answer (a
# connection that timed out or was refused, a name that did not resolve): not the recipe's
# failure, so it is retried and never recorded.
_UNREACHABLE = re.compile(
    r"error sending request for url|operation timed out|Connection (refused|reset)"
    r"|Temporary failure in name resolution|Could not resolve host|ConnectTimeoutError"
    r"|ReadTimeoutError|Max retries exceeded with url|Failed to connect to|Network is unreachable"
)
# Attempts of a build that failed because the network did not answer, and the waits between.
NETWORK_RETRY_DELAYS = (10.0, 60.0)


def unreachable(error: BuildError) -> bool:
    """Whether `error` is the network not answering (its tail, else its log's last 64 KiB);
    not when the build's egress policy refused a host (that is the recipe's to fix)."""
    if "the build's network refused" in error.tail:
        return False
    if _UNREACHABLE.search(error.tail):
        return True
    try:
        with open(error.log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            return bool(_UNREACHABLE.search(f.read().decode("utf-8", errors="replace")))
    except OSError:
        return False


class RecordedBuildFailure(BuildError):
    """An environment whose build failed earlier, in this process or another sharing the
    store: its tasks fail at once with that error instead of each rebuilding it (minutes
    each) to fail the same way. `minisandbox build --force` retries."""

    def __init__(self, ref: str, record: dict[str, object]) -> None:
        step, log, tail = str(record["step"]), Path(str(record["log"])), str(record["tail"])
        MiniSandboxError.__init__(
            self,
            f"{ref}: step '{step}' failed (log: {log}); recorded failure of this recipe "
            f"(building {record.get('task')} at {record.get('at')}), not rebuilt; "
            f"--force retries (`minisandbox build --force`)" + (f":\n{tail}" if tail else ""),
        )
        self.step, self.log, self.tail = step, log, tail


# Host settings a build needs to reach the package index as the host does (private indexes, a
# corporate CA). Only for build sandboxes: task sandboxes get none of the host's env. Proxies
# are not among them: a build reaches the network through its own proxy (envs/egress.py), which
# uses the host's.
_BUILD_ENV_PREFIXES = ("PIP_", "UV_", "SSL_CERT_")
_BUILD_ENV_NAMES = {"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"}
_BUILD_ENV_OWN = {"UV_CACHE_DIR", "PIP_CACHE_DIR", "PIP_FIND_LINKS", "UV_FIND_LINKS"}
# Upper-layer paths that are build noise, not part of a layer.
_NOISE = (
    "run",
    "tmp",
    "root/.cache",
    "root/.config/uv",
    "root/.local/share/uv",
    "etc/hostname",
    "etc/hosts",
    "etc/resolv.conf",
)


def _host_build_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if (k in _BUILD_ENV_NAMES or k.startswith(_BUILD_ENV_PREFIXES)) and k not in _BUILD_ENV_OWN
    }
    if host_ca() is not None:  # the host's CA bundle, where the build sandbox has its copy
        env.update(dict.fromkeys(_CA_VARS, BUILD_CA))
    # Always named: pips before 10 (environments dated before April 2018) default to
    # pypi.python.org, which not every network resolves, and the user's own pip files are
    # not in the sandbox. (A build step's `pip config set global.index-url` is overridden.)
    env["PIP_INDEX_URL"] = pip_index()
    return env


# The variables that name a CA bundle (a TLS-intercepting proxy's CA), first one set wins; the
# file they name is on the host, out of the build sandbox's sight: a copy goes to BUILD_CA, on
# the sandbox's /tmp (a tmpfs, never part of a layer).
_CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
BUILD_CA = "/tmp/minisandbox-host-ca.pem"
_CA_MAX_BYTES = 16 << 20


def host_ca() -> bytes | None:
    """The CA bundle the host's environment names (None: none, or not a readable file)."""
    for var in _CA_VARS:
        path = os.environ.get(var)
        if path and os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    return f.read(_CA_MAX_BYTES)
            except OSError:
                return None
    return None


async def install_host_ca(sb: SandboxAPI) -> None:
    """Put the host's CA bundle (if it names one) where the build's env says it is."""
    ca = host_ca()
    if ca is not None:
        await sb.write_file(BUILD_CA, ca)


@dataclass
class LayerBuild:
    """One layer to build: everything `LayerBuilder.build_layer` needs to know about its kind."""

    ref: str
    """The store ref the layer is published under (its content key)."""
    kind: str
    """"env", "task", "evaldeps", "tools": its work directory's prefix and meta["kind"]."""
    what: str
    """Who a failure is reported against (the ref, or the task being built)."""
    interp: Interpreter
    """The interpreter mounted read-only in the build sandbox (and recorded in the meta)."""
    logs: Path
    """The directory of the steps' logs."""
    run: Callable[[Sandbox], Awaitable[dict[str, Any] | None]]
    """The steps, in the build sandbox; may return more metadata for the layer."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The layer's metadata (kind, interpreter and logs are added)."""
    collect: str | None = None
    """The directory (absolute, in the sandbox) that becomes the layer; None: the whole upper,
    minus build noise and the build's empty mount points."""
    lower: list[str] = field(default_factory=list)
    """Layer ids the build runs on (pinned in the node cache for its duration)."""
    prepare: Callable[[Path], None] | None = None
    """Fills the upper directory before the sandbox starts (a checkout), in a thread."""


# The refs published in the current `recording()` (per asyncio task: concurrent builds each
# see only their own; a coroutine they await or gather adds to theirs).
_RECORDING: ContextVar[list[str] | None] = ContextVar("minisandbox_built_refs", default=None)


class LayerBuilder:
    """Builds layers into a store, each once; `build_layer` is the skeleton every kind uses."""

    # The code whose digest a recorded failure carries (a fix to it retries the build).
    code_files: tuple[str, ...] = tuple(
        str(Path(__file__).with_name(name))
        for name in ("layerbuild.py", "envlayer.py", "relax.py", "toolchains.py")
    )

    def __init__(self, settings: BuildSettings | None = None) -> None:
        self.settings = settings or BuildSettings()
        self.store = LayerStore(self.settings.store)
        owner = SandboxConfig().layer_owner()
        # Unpacking on this node, across all its processes, is bounded by the I/O budget:
        # $MINISANDBOX_IO_BUDGET bytes in flight, 2 GiB when unset.
        budget = LocalIOBudget.from_env(self.settings.cache / "io-budget") or LocalIOBudget(
            self.settings.cache / "io-budget", DEFAULT_IO_BUDGET
        )
        self.cache = NodeCache(
            self.settings.cache,
            self.store,
            max_bytes=self.settings.cache_max_bytes,
            budget=budget,
            owner=owner,
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._interpreters: dict[str, Interpreter] = {}
        self._swept = False
        self._forced: set[str] = set()  # refs a `force` build remade in this builder

    def find_interpreter(self, python: str) -> Interpreter:
        """The host interpreter for a requested version; discovery runs programs (uv,
        interpreters): once per version, not once per start."""
        if python not in self._interpreters:
            self._interpreters[python] = find_interpreter(python)
        return self._interpreters[python]

    # ---------------------------------------------------------------- once per ref

    @contextlib.asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[None]:
        """One build of `name` at a time: across coroutines (an asyncio lock) and across
        processes on this machine (flock on a file beside the store's build area)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            locks = self.settings.store.parent / "build-locks"
            locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{name.replace('/', '_')}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing drops the lock

    def forcing(self, ref: str, force: bool) -> bool:
        """Whether a `force` build would still rebuild `ref` (once per builder)."""
        return force and ref not in self._forced

    async def once(
        self,
        ref: str,
        force: bool,
        make: Callable[[], Awaitable[str]],
        *,
        record_for: str | None = None,
    ) -> str:
        """The layer `ref` names: the stored one, else (or with `force`, once per builder) the
        one `make()` builds and publishes, under the ref's build lock, so it is built once.

        With `record_for` (the task asking), a failed step is recorded in the store against
        `ref`: later requests, from any process, raise it at once (RecordedBuildFailure)
        instead of building again, until a `force` build; a successful build clears it.

        Raises:
            BuildError: `make()` failed at a step, or (RecordedBuildFailure) did before.
        """
        async with self._lock(ref):
            force = self.forcing(ref, force)
            existing = self.store.resolve(ref)
            if existing and not force:
                return existing
            if record_for is not None and not force:
                known = self._recorded_failure(ref)
                if known is not None:
                    raise known
            if force:
                self._forced.add(ref)
            if record_for is None:
                return await _retrying(make)
            try:
                layer = await _retrying(make)
            except BuildError as e:
                if not unreachable(e):  # the network's failure is not the recipe's
                    await asyncio.to_thread(self._record_failure, ref, record_for, e)
                raise
            await asyncio.to_thread(self.store.clear_failure, ref)
            return layer

    def _record_failure(self, ref: str, task_id: str, error: BuildError) -> None:
        """Record in the store why building `ref` failed: its step, log and the error's tail
        (the log may be on another machine), and which builder code failed."""
        self.store.record_failure(
            ref,
            {
                "ref": ref,
                "task": task_id,
                "step": error.step,
                "log": str(error.log),
                "tail": error.tail,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                "builder": _builder_code(self.code_files),
            },
        )

    def _recorded_failure(self, ref: str) -> RecordedBuildFailure | None:
        """The recorded failure of `ref`, unless another version of the builder recorded it:
        a fix to how environments are built must not be hidden behind old failures."""
        record = self.store.failure(ref)
        if record is None or record.get("builder") != _builder_code(self.code_files):
            return None
        if not all(isinstance(record.get(k), str) for k in ("step", "log", "tail")):
            return None
        return RecordedBuildFailure(ref, record)

    @staticmethod
    @contextlib.contextmanager
    def recording() -> Iterator[list[str]]:
        """The refs that `publish` names while the block runs, in this asyncio task and what
        it awaits (the layers built, not found in the store); nested recordings each see
        theirs."""
        refs: list[str] = []
        token = _RECORDING.set(refs)
        try:
            yield refs
        finally:
            _RECORDING.reset(token)

    # ---------------------------------------------------------------- the skeleton

    async def build_layer(self, build: LayerBuild, force: bool = False) -> str:
        """Build `build` in a build sandbox and publish it; returns the layer id. `force`
        re-hashes the blobs the layer reuses (see `publish`).

        Raises:
            BuildError: a step failed, or the collected directory is missing or behind a link.
        """
        with self.work_dir(f"{build.kind}-") as work:
            upper = work / "upper"
            upper.mkdir()
            if build.prepare is not None:
                await asyncio.to_thread(build.prepare, upper)
            async with self.cache.use(build.lower) as paths:
                config = self.build_config(build.interp, upper=upper, layers=paths)
                async with Sandbox(config) as sb:
                    await install_host_ca(sb)
                    extra = await build.run(sb) or {}
            if build.collect is None:
                tree = _clean_upper(upper, config.ro_paths)
            else:
                tree = work / "layer"
                _collect(upper, build.collect, tree, build.what, build.logs)
            meta = {"kind": build.kind, **build.meta, **extra}
            return await self.publish(build.ref, tree, meta, build.interp, build.logs, force)

    async def publish(
        self,
        ref: str,
        tree: Path,
        meta: dict[str, Any],
        interp: Interpreter,
        logs: Path,
        force: bool = False,
    ) -> str:
        """Store a built tree as a layer and name it `ref` (last: a ref never names a layer
        that is not fully there). A forced build re-hashes the blobs it reuses and rewrites
        corrupt ones: rebuilding is how a damaged layer is repaired."""
        meta = {**meta, "interpreter": interp.model_dump(mode="json"), "logs": str(logs)}
        layer = await asyncio.to_thread(self.store.publish, tree, meta=meta, verify_existing=force)
        self.store.tag(ref, layer.id)
        recording = _RECORDING.get()
        if recording is not None:
            recording.append(ref)
        return layer.id

    def build_config(
        self, interp: Interpreter, *, upper: Path | None, layers: list[Path] | None = None
    ) -> SandboxConfig:
        """A build sandbox: a network namespace of its own with a proxy to the package indexes
        and git hosts (envs/egress.py), the interpreter and uv mounted, generous limits;
        `upper`: where its writes go (None: a temporary one)."""
        uv = uv_binary()
        return SandboxConfig(
            layers=layers or [],
            upper=upper,
            egress=build_policy(),
            ro_paths=sorted({interp.prefix, uv.parent}),
            venv=VENV,
            env={
                # The system's CA store (a copy of the host's is in the sandbox) rather than
                # uv's bundled one: behind a corporate proxy only the former knows its CA.
                "UV_NATIVE_TLS": "1",
                **_host_build_env(),
                # Whatever the host asks: uv's bytecode compiler fails on Python 3.6 (builds
                # compile with the interpreter's own compileall instead).
                "UV_COMPILE_BYTECODE": "0",
                "UV_CACHE_DIR": "/tmp/uv-cache",
                "PIP_CACHE_DIR": "/tmp/pip-cache",
                "PATH": f"{VENV}/bin:{uv.parent}:/usr/local/bin:/usr/bin:/bin",
            },
            limits=Limits(
                # /tmp is memory: at most a quarter of the host's (a hostile build may fill it).
                tmp_bytes=min(16 * GiB, max(2 * GiB, host_memory() // 4)),
                total_memory_bytes=host_memory() // 2,
                upper_bytes=64 * GiB,
                upper_inodes=8_000_000,
                command_timeout=3600,
            ),
        )

    async def step(self, sb: Sandbox, what: str, logs: Path, step: str, command: str) -> None:
        """Run one logged build step (bash), its output in `<logs>/<step>.log`.

        Raises:
            BuildError: the step exited non-zero (its last lines in the message).
        """
        result = await sb.execute(["/bin/bash", "-c", command], merge_stderr=True)
        log = logs / f"{step}.log"
        refused = sb.egress_refused
        note = (
            f"\n[the build's network refused: {', '.join(refused)}; {EXTRA_HOSTS_VAR} allows "
            "more hosts]"
            if refused
            else ""
        )
        log.write_text(f"$ {command}\n{result.stdout}\n[exit code {result.exit_code}]{note}\n")
        if result.exit_code != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-15:]) + note
            raise BuildError(what, step, log, f":\n{tail}" if tail else "")

    def log_dir(self, name: str) -> Path:
        path = self.settings.logs / name.replace("/", "_")
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def work_dir(self, prefix: str) -> Iterator[Path]:
        """A work directory under build-tmp/, named after its owner (workdirs), swept of what
        killed builds left on this builder's first build."""
        root = workdirs.build_tmp(self.settings)
        root.mkdir(parents=True, exist_ok=True)
        if not self._swept:
            self._swept = True
            workdirs.sweep_build_tmp(root)
        path = root / f"{prefix}{workdirs.work_name()}"
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            # Sandbox-written uppers: removed by descriptors, never through a planted link.
            safefs.remove_tree(path)


def _clean_upper(upper: Path, ro_paths: list[Path]) -> Path:
    """The upper as a layer: without build noise, and without the empty mount points of the
    build's host paths (a layer must not depend on where the builder's host keeps them). The
    build wrote this tree: cleaned by descriptors that refuse symlinks (a planted
    `/root/.config -> /host/dir` must not steer a delete)."""
    for noise in _NOISE:
        with contextlib.suppress(safefs.UnsafePathError):  # behind a link: not here
            safefs.remove(upper, noise)
    for host_path in ro_paths:
        safefs.rmdir_empty_chain(upper, str(host_path).lstrip("/"))
    return upper


def _collect(upper: Path, path: str, layer_dir: Path, what: str, logs: Path) -> None:
    """Move the directory a build made at `path` (absolute inside the sandbox) from its upper
    into `layer_dir`, refusing a symlink on the way: a build process can swap `/opt` for a link
    to a host directory, which a plain rename would move into the layer.

    Raises:
        BuildError: step 'collect', when `path` is missing, not a directory, or behind a link.
    """
    rel = path.lstrip("/")
    (layer_dir / rel).parent.mkdir(parents=True, exist_ok=True)
    try:
        safefs.move_dir(upper, rel, layer_dir, rel)
    except (safefs.UnsafePathError, FileNotFoundError, NotADirectoryError) as e:
        log = logs / "collect.log"
        reason = e if isinstance(e, safefs.UnsafePathError) else f"{upper / rel} is missing"
        log.write_text(f"collecting {path} from {upper}: {reason}\n")
        raise BuildError(what, "collect", log, f": {path}: {reason}") from None


async def _retrying(make: Callable[[], Awaitable[str]]) -> str:
    """`make()`, again after a wait when it failed because the network did not answer."""
    for delay in NETWORK_RETRY_DELAYS:
        try:
            return await make()
        except BuildError as e:
            if not unreachable(e):
                raise
            logger.warning("%s; the network did not answer: trying again in %.0f s", e, delay)
            await asyncio.sleep(delay)
    return await make()


@functools.cache
def _builder_code(files: tuple[str, ...]) -> str:
    """A digest of the code that builds environments: failures it records name it."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]
