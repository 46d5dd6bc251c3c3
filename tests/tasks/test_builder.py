"""Building real environments (uv venvs from PyPI) and task layers (git checkouts), then
starting sandboxes from them. Needs the package index, as every build does."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import give_to_sandbox
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task


def test_rebuild_is_cached_and_layers_are_shared(settings: BuildSettings, built: list) -> None:
    builder = Builder(settings)
    tasks = load_tasks("examples")
    again = asyncio.run(builder.build(tasks[0]))
    assert again.status == "cached"
    assert (again.env_layer, again.task_layer) == (built[0].env_layer, built[0].task_layer)
    # A second task with the same recipe reuses the environment layer: no second venv build.
    twin = tasks[0].model_copy(update={"id": "twin", "install": ["true"]})
    result = asyncio.run(builder.build(twin))
    assert result.status == "built" and result.env_layer == built[0].env_layer
    assert result.task_layer != built[0].task_layer
    assert result.built_layers == [builder.task_ref(twin, built[0].env_layer)]


def test_concurrent_builds_each_report_their_own_layers(
    settings: BuildSettings, built: list
) -> None:
    """Builds running at once in one builder: each result names the layers it built, not the
    ones another build made meanwhile (nor the ones it found in the store)."""
    builder = Builder(settings)
    task = load_tasks("examples")[0]
    twins = [
        task.model_copy(update={"id": f"twin-{i}", "install": [f"echo {i} > /tmp/twin"]})
        for i in range(3)
    ]

    async def both() -> list:
        return await asyncio.gather(*(builder.build(t) for t in [*twins, task]))

    *results, cached = asyncio.run(both())
    for twin, r in zip(twins, results, strict=True):
        assert r.status == "built", r.error
        assert r.built_layers == [builder.task_ref(twin, built[0].env_layer)], r.built_layers
    assert cached.status == "cached" and cached.built_layers == []


async def test_task_sandbox_has_repo_venv_and_tests(settings: BuildSettings, built: list) -> None:
    builder = Builder(settings)
    task = load_tasks("examples")[0]
    async with builder.sandbox(task) as sb:  # cold: unpacks into the node cache
        pass
    began = time.monotonic()
    async with builder.sandbox(task) as sb:
        warm_ms = (time.monotonic() - began) * 1000
        r = await sb.execute(
            "git rev-parse HEAD; git status --porcelain; git remote; which python; pwd"
        )
        assert r.stdout.split() == [task.base_commit, "/opt/venv/bin/python", "/testbed"]
        await sb.write_file("/tmp/test.patch", task.test_patch)
        await sb.execute("git apply /tmp/test.patch")
        before = await sb.execute(f"{task.test_cmd}")
        assert before.exit_code != 0
        for name in task.fail_to_pass:
            assert f"FAILED {name}" in before.stdout
        await sb.write_file("/tmp/gold.patch", task.gold_patch)
        assert (await sb.execute("git apply /tmp/gold.patch")).exit_code == 0
        after = await sb.execute(f"{task.test_cmd}")
        assert after.exit_code == 0, after.stdout
        assert (await sb.execute("pip --version")).exit_code == 0  # pip seeded for agents
    assert warm_ms < 2000  # measured properly in bench/prep_time.py


def test_bad_inputs_fail_naming_the_step(settings: BuildSettings, built: list) -> None:
    builder = Builder(settings)
    task = load_tasks("examples")[0]
    missing = task.model_copy(update={"id": "missing-commit", "base_commit": "0" * 40})
    r = asyncio.run(builder.build(missing))
    assert r.status == "failed" and "checkout" in r.error and "is not in" in r.error
    assert r.log and Path(r.log).is_file()
    broken_env = EnvRecipe(python=task.env.python, requirements=["no-such-package-xyz==9.9.9"])
    broken = task.model_copy(update={"id": "bad-requirement", "env": broken_env})
    r = asyncio.run(builder.build(broken))
    assert r.status == "failed" and "'requirements'" in r.error
    assert "no-such-package-xyz" in Path(r.log).read_text()
    bad_install = task.model_copy(update={"id": "bad-install", "install": ["exit 3"]})
    r = asyncio.run(builder.build(bad_install))
    assert r.status == "failed" and "'install'" in r.error


def test_two_processes_build_one_environment_once(home: Path, settings: BuildSettings) -> None:
    """Two processes ask for the same new environment at once: it is built once."""
    store = home / "store2"
    code = (
        "import asyncio, json, sys\n"
        "from pathlib import Path\n"
        "from minisandbox.tasks.builder import Builder, BuildSettings\n"
        "from minisandbox.tasks.loaders import load_tasks\n"
        "s = BuildSettings(store=Path(sys.argv[1]), cache=Path(sys.argv[2]),"
        " git_mirror=Path(sys.argv[3]))\n"
        "t = load_tasks('examples')[2]\n"
        "r = asyncio.run(Builder(s).build(t))\n"
        "print(json.dumps(r.model_dump()))\n"
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(store),
                str(home / f"layers{i}"),
                str(settings.git_mirror),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert results[0]["env_layer"] == results[1]["env_layer"] is not None
    env_builds = [ref for r in results for ref in r["built_layers"] if ref.startswith("env/")]
    task_builds = [ref for r in results for ref in r["built_layers"] if ref.startswith("task/")]
    assert len(env_builds) == 1 and len(task_builds) == 1, results


def test_layers_hold_no_trace_of_the_build_host(settings: BuildSettings, built: list) -> None:
    """A task layer is the checkout plus the install's delta: not the build sandbox's mount
    points (the host's interpreter and uv paths, /etc/hosts), nor bytecode that the
    environment layer should already hold."""
    builder = Builder(settings)
    for result in built:
        paths = [e[1] for e in builder.store.manifest(result.task_layer)["entries"]]
        top = {p.split("/")[0] for p in paths if p != "."}
        assert top <= {"testbed", "opt", "root", "etc"}, top
        assert not [p for p in paths if p in ("etc/hosts", "etc/resolv.conf", "etc/hostname")]
        assert not [p for p in paths if p.startswith(("root/.pyenv", "usr", "work"))]
        assert not [p for p in paths if "/pip/" in p and p.endswith(".pyc")]


def test_examples_mirror_made_by_concurrent_builders(tmp_path: Path) -> None:
    # Builders of the bundled tasks make their repositories on first use, several at once.
    from concurrent.futures import ThreadPoolExecutor

    from minisandbox.tasks.examples import materialize_mirror

    mirror = tmp_path / "examples-mirror"
    with ThreadPoolExecutor(6) as pool:
        done = list(pool.map(lambda _: materialize_mirror(mirror), range(6)))
    assert done == [mirror] * 6
    repos = sorted(p.name for p in mirror.iterdir())
    names = ("datekit", "semverkit", "tablekit")
    assert repos == [f"minisandbox-examples__{n}" for n in names]


# ------------------------------------------------- repairing the store, sweeping killed builds


@pytest.fixture(scope="module")
def private(home: Path, settings: BuildSettings) -> tuple[BuildSettings, Task]:
    """A store of its own (these tests damage it), with a quick task: no requirements, no
    install step (the repository's checkout is what the task layer holds)."""
    base = home / "repair"
    own = BuildSettings(store=base / "store", cache=base / "layers", git_mirror=settings.git_mirror)
    task = load_tasks("examples")[0]
    task = task.model_copy(
        update={"id": "repair", "env": EnvRecipe(python=task.env.python), "install": []}
    )
    r = asyncio.run(Builder(own).build(task))
    assert r.status == "built", r.error
    return own, task


def _testbed_blob(builder: Builder, layer: str) -> tuple[str, Path]:
    """The blob of the checkout's history pack (the same bytes in every rebuild; the
    checkout's files are objects of it)."""
    doc = builder.store.manifest(layer)
    entry = next(
        e for e in doc["entries"]
        if e[0] == "f" and e[1].startswith("testbed/.git/objects/pack/") and e[1].endswith(".pack")
    )  # fmt: skip
    sha = doc["blobs"][entry[5]]
    return sha, builder.store.blob_path(sha)


def _damage(path: Path) -> None:
    os.chmod(path, 0o644)
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")


def test_forced_rebuild_repairs_a_corrupt_blob(private: tuple, tmp_path: Path) -> None:
    settings, task = private
    builder = Builder(settings)
    layers = builder.built_layers(task)
    assert layers
    sha, blob = _testbed_blob(builder, layers[-1])
    _damage(blob)
    r = asyncio.run(builder.build(task, force=True))
    assert r.status == "built" and r.task_layer, r.error
    # The rebuilt layer holds the same checkout bytes, so the same blob (the positive control:
    # the rebuild did reuse it) and it is sound again.
    assert sha in builder.store.manifest(r.task_layer)["blobs"]
    builder.store.unpack(r.task_layer, tmp_path / "task")
    assert [p for p in builder.store.verify() if sha in p] == []


def test_verify_repair_then_build_rebuilds(private: tuple, tmp_path: Path) -> None:
    """A blob deleted and another corrupted: `cache verify --repair` drops the refs of the
    layers using them, the next plain build rebuilds them, and a sandbox starts on a node that
    had not unpacked them yet."""
    from conftest import run_cli

    settings, task = private
    builder = Builder(settings)
    layers = builder.built_layers(task)
    assert layers
    _sha, task_blob = _testbed_blob(builder, layers[-1])
    os.unlink(task_blob)
    env_doc = builder.store.manifest(layers[0])
    _damage(builder.store.blob_path(env_doc["blobs"][0]))
    r = run_cli("cache", "verify", "--repair", "--store", str(settings.store))
    out = r.stdout.decode()
    assert r.returncode == 1 and "missing" in out and "corrupt" in out, out
    for ref in (builder.env_ref(task), builder.task_ref(task, layers[0])):
        assert f"ref {ref}: dropped" in out, out
    fresh = settings.model_copy(update={"cache": tmp_path / "fresh-node"})
    builder = Builder(fresh)
    assert not builder.built_layers(task)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error
    assert {ref.split("/")[0] for ref in result.built_layers} == {"env", "task"}

    async def start() -> str:
        async with builder.sandbox(task) as sb:
            return (await sb.execute("git rev-parse HEAD")).stdout.strip()

    assert asyncio.run(start()) == task.base_commit
    assert builder.store.verify() == []


def test_cache_gc_sweeps_the_work_dirs_of_killed_builds(layer_dir: Path) -> None:
    """A killed build leaves its work directory (a sandbox-written upper: mode-000 dirs,
    links to host dirs). `cache gc` removes those of dead builders, without following a link,
    and keeps those of live ones and of other machines."""
    from conftest import run_cli
    from minisandbox import Sandbox, SandboxConfig
    from minisandbox.envs.workdirs import _host
    from minisandbox.utils.procfs import start_time as _start_time

    victim = layer_dir / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("host file\n")
    tmp = layer_dir / "build-tmp"
    tmp.mkdir()
    tmp.chmod(0o755)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp / f"task-{_host()}.{gone.pid}.1.0123abcd"
    me = os.getpid()
    live = tmp / f"env-{_host()}.{me}.{_start_time(me)}.4567abcd"
    elsewhere = tmp / f"env-another-host.{gone.pid}.1.89abcdef"
    for d in (dead, live, elsewhere):
        d.mkdir(mode=0o755)
        (d / "upper").mkdir()
        give_to_sandbox(d / "upper")

    async def write(upper: Path) -> None:
        async with Sandbox(SandboxConfig(upper=upper)) as sb:
            r = await sb.execute(
                f"mkdir -p /a/b && echo x > /a/b/f && chmod 000 /a && ln -s {victim} /link"
                f" && ln -s {victim} /a2"
            )
            assert r.exit_code == 0, r.output

    asyncio.run(write(dead / "upper"))
    (layer_dir / "store").mkdir()  # an empty store: gc refuses one that is not there
    r = run_cli("cache", "gc", "--store", str(layer_dir / "store"))
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    assert "1 stale build directory;" in out and str(dead) in out, out
    assert not dead.exists()
    assert live.is_dir() and elsewhere.is_dir()
    assert (victim / "keep.txt").read_text() == "host file\n"


async def test_collecting_refuses_links_planted_in_the_upper(layer_dir: Path) -> None:
    """The evaluation-wheel and tools layers are collected from their build's upper as the
    environment's is (the env case is attacks_build.py's): a sandbox that swapped a directory
    on the way, or the directory itself, for a link to a host directory fails the build at
    'collect', and the host directory stays put."""
    from minisandbox import Sandbox, SandboxConfig
    from minisandbox.envs.layerbuild import BuildError, _collect
    from minisandbox.envs.layout import EVAL_WHEELHOUSE, TOOLS_ROOT

    victim = layer_dir / "victim"
    (victim / "eval-wheelhouse").mkdir(parents=True)
    (victim / "eval-wheelhouse" / "keep.whl").write_text("host file\n")
    (victim / "httpbin").mkdir()
    for case, path, plant in (
        ("parent", EVAL_WHEELHOUSE, f"mkdir -p /opt && ln -s {victim} /opt/minisandbox"),
        (
            "itself",
            f"{TOOLS_ROOT}/httpbin",
            f"mkdir -p {TOOLS_ROOT} && ln -s {victim}/httpbin {TOOLS_ROOT}/httpbin",
        ),
    ):
        work = layer_dir / case
        (work / "upper").mkdir(parents=True)
        give_to_sandbox(work / "upper")
        async with Sandbox(SandboxConfig(upper=work / "upper")) as sb:
            r = await sb.execute(plant)
            assert r.exit_code == 0, r.output
        layer = work / "layer"
        (layer / path.lstrip("/")).parent.mkdir(parents=True)
        with pytest.raises(BuildError) as err:
            _collect(work / "upper", path, layer, "t", layer_dir)
        assert err.value.step == "collect" and path in str(err.value), err.value
        assert not list((layer / path.lstrip("/")).parent.iterdir())
    assert (victim / "eval-wheelhouse" / "keep.whl").read_text() == "host file\n"
    assert (victim / "httpbin").is_dir()


# ------------------------------------------------- failed environments, recorded per recipe

_BUILD_IN_A_PROCESS = (
    "import asyncio, sys\n"
    "from pathlib import Path\n"
    "from minisandbox.tasks.builder import Builder, BuildSettings\n"
    "from minisandbox.tasks.specs import Task\n"
    "s = BuildSettings(store=Path(sys.argv[1]), cache=Path(sys.argv[2]),"
    " git_mirror=Path(sys.argv[3]))\n"
    "task = Task.model_validate_json(sys.argv[4])\n"
    "print(asyncio.run(Builder(s).build(task)).model_dump_json())\n"
)


def _own_store(home: Path, settings: BuildSettings, name: str) -> BuildSettings:
    base, mirror = home / name, settings.git_mirror
    return BuildSettings(store=base / "store", cache=base / "layers", git_mirror=mirror)


def _with_env(task: Task, task_id: str, env: EnvRecipe) -> Task:
    return task.model_copy(update={"id": task_id, "env": env, "install": []})


def test_an_index_that_does_not_answer_is_retried_and_never_recorded(
    home: Path,
    settings: BuildSettings,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The network not answering is not the recipe's failure: the build is tried again after
    a wait, and when it still fails nothing is recorded (the next build tries again). A recipe
    that really fails is recorded (test_a_failed_environment_fails_its_other_tasks_at_once)."""
    from minisandbox.envs import layerbuild

    monkeypatch.setattr(layerbuild, "NETWORK_RETRY_DELAYS", (0.1,))
    own = _own_store(home, settings, "unreachable")
    example = load_tasks("examples")[0]
    # Nothing listens on the build sandbox's own loopback port 9: connection refused.
    dead = EnvRecipe(
        python=example.env.python,
        requirements=["six==1.16.0"],
        pip_options=["--index-url", "http://127.0.0.1:9/simple"],
    )
    task = _with_env(example, "unreachable-1", dead)
    builder = Builder(own)
    r1 = asyncio.run(builder.build(task))
    assert r1.status == "failed" and r1.step == "requirements", r1.error
    assert layerbuild.unreachable(layerbuild.BuildError("x", r1.step, Path(r1.log or ""), ""))
    assert builder.store.failure(builder.env_ref(task)) is None
    retried = [r for r in caplog.records if "the network did not answer" in r.getMessage()]
    assert len(retried) == 1, [r.getMessage() for r in caplog.records]
    r2 = asyncio.run(Builder(own).build(task))
    assert r2.status == "failed" and not r2.recorded_failure, r2.error


def test_a_failed_environment_fails_its_other_tasks_at_once(
    home: Path, settings: BuildSettings
) -> None:
    """A recipe that cannot install fails once: the next task sharing it, in another process,
    fails with the same step, log and error tail without building (its log is not rewritten),
    until a forced build tries again; another recipe is unaffected."""
    own = _own_store(home, settings, "failrec")
    example = load_tasks("examples")[0]
    broken = EnvRecipe(python=example.env.python, requirements=["no-such-package-xyz==9.9.9"])
    first, second = (_with_env(example, f"broken-{i}", broken) for i in (1, 2))
    builder = Builder(own)
    r1 = asyncio.run(builder.build(first))
    assert r1.status == "failed" and r1.step == "requirements" and not r1.recorded_failure
    tail = r1.error.split(":\n", 1)[1]
    assert "no-such-package-xyz" in tail, r1.error  # the error's tail, not only the log's path
    ref = builder.env_ref(first)
    record = builder.store.failure(ref)
    assert record is not None and record["tail"] == tail and record["task"] == "broken-1"
    log = Path(r1.log)
    stamp = log.stat().st_mtime_ns

    out = subprocess.run(
        [sys.executable, "-c", _BUILD_IN_A_PROCESS, str(own.store), str(own.cache),
         str(own.git_mirror), second.model_dump_json()],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    r2 = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"first build {r1.seconds:.2f} s, the task sharing it {r2['seconds']:.2f} s")
    assert r2["status"] == "failed" and r2["recorded_failure"], r2
    assert r2["step"] == "requirements" and r2["log"] == r1.log and r2["built_layers"] == []
    assert r2["error"].endswith(f":\n{tail}") and "--force retries" in r2["error"], r2["error"]
    assert "broken-1" in r2["error"]  # names the recorded failure
    assert log.stat().st_mtime_ns == stamp  # nothing ran again

    # A record of other builder code (before a fix of how environments are built) is not
    # trusted: the environment is tried again.
    builder.store.record_failure(ref, {**record, "builder": "0" * 16})
    r3 = asyncio.run(Builder(own).build(second))
    assert r3.status == "failed" and not r3.recorded_failure and r3.step == "requirements"
    assert log.stat().st_mtime_ns != stamp
    stamp = log.stat().st_mtime_ns
    # --force tries again (and fails again here, recording it anew).
    assert builder.store.failure(ref)["task"] == "broken-2"
    r4 = asyncio.run(Builder(own).build(first, force=True))
    assert r4.status == "failed" and not r4.recorded_failure, r4.error
    assert log.stat().st_mtime_ns != stamp
    assert builder.store.failure(ref)["task"] == "broken-1"

    # Another recipe builds as ever in the store holding that record.
    good = _with_env(example, "good", EnvRecipe(python=example.env.python))
    r5 = asyncio.run(Builder(own).build(good))
    assert r5.status == "built", r5.error
    assert builder.store.failure(builder.env_ref(good)) is None


def test_a_forced_build_clears_a_recorded_failure(
    home: Path, settings: BuildSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sound recipe that failed for a passing reason (the package index unreachable: uv
    offline) stays failed for its tasks until `force`, which builds it and clears the
    record; then its tasks use the layer."""
    own = _own_store(home, settings, "failrec-force")
    example = load_tasks("examples")[0]
    recipe = EnvRecipe(python=example.env.python, requirements=["six==1.16.0"])
    first, second = (_with_env(example, f"flaky-{i}", recipe) for i in (1, 2))
    monkeypatch.setenv("UV_OFFLINE", "1")  # passed to build sandboxes (host build settings)
    r1 = asyncio.run(Builder(own).build(first))
    assert r1.status == "failed" and not r1.recorded_failure, r1
    monkeypatch.delenv("UV_OFFLINE")
    builder = Builder(own)
    r2 = asyncio.run(builder.build(second))
    assert r2.status == "failed" and r2.recorded_failure and r2.step == r1.step, r2
    forced = asyncio.run(builder.build(second, force=True))
    assert forced.status == "built" and builder.env_ref(second) in forced.built_layers, forced
    assert builder.store.failure(builder.env_ref(second)) is None
    again = asyncio.run(Builder(own).build(first))
    assert again.status == "cached" and again.env_layer == forced.env_layer, again
