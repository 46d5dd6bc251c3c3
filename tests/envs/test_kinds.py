"""The table of layer kinds (envs/kinds.py): the one place their formats live, the keys it gives
unchanged (a changed key rebuilds every layer of the kind on every node), every stored layer of
a known kind, and the table in docs/architecture.md the same as the code's."""

from __future__ import annotations

import tempfile
from pathlib import Path

from minisandbox.envs.envlayer import env_ref
from minisandbox.envs.kinds import KINDS
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.toolchains import Interpreter
from minisandbox.envs.tools import tools_ref
from minisandbox.layers.store import LayerStore
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.specs import Task

ROOT = Path(__file__).resolve().parents[2]


def test_the_keys_of_each_kind_are_what_they_were() -> None:
    # Literals computed before the formats moved into the table: a format bumped, or a field
    # added to a key, shows here (then update them, knowing every such layer is rebuilt).
    task = Task(
        id="o__r-1",
        repo="o/r",
        base_commit="a" * 40,
        environment_setup_commit="b" * 40,
        env=EnvRecipe(python="3.11", requirements=["six==1.16.0"]),
        install=["pip install -e ."],
        test_cmd="pytest",
        fail_to_pass=["t::a"],
        pass_to_pass=["t::b"],
        gold_patch="diff --git a/setup.py b/setup.py\n",
        install_as_of="2020-01-01",
    )
    with tempfile.TemporaryDirectory() as d:
        b = Builder(BuildSettings(store=Path(d) / "s", cache=Path(d) / "c"))
        bug = task.model_copy(update={"bug_patch": "diff --git a/x b/x\n"})
        interp = Interpreter(
            executable=Path("/x/bin/python3.11"), version="3.11.7", prefix=Path("/x"), kind="uv"
        )
        keys = {
            "env": env_ref(task.environment_key("3.11.7")),
            "task": b.task_ref(task, "E"),
            "bug": b.bug_ref(bug, "R"),
            "evaldeps": b.eval_deps_ref(task, "T"),
            "tools": tools_ref("httpbin", interp),
        }
    assert keys == {
        "env": "env/v5-afe4ed6b02622a6c702281371a3f1459a0fb25f80b3ce0e15e50d95e728e6da5",
        "task": "task/4b504d7956831a2af004efcad008adaafb6f9ad90509de2cedb16d21e052febd",
        "bug": "bug/d58f78630730c80a60909b16439fa4e5212a6edb71774ab42326571803f450f4",
        "evaldeps": "evaldeps/0f35236b55e7b0f9d2d23e156ccf5c4c3a1ee014444c966856e92a3a3550bb87",
        "tools": "tools/httpbin-d766bc101522385aa88e3bea733ea252",
    }
    assert all(ref.split("/")[0] in KINDS for ref in keys.values())


def test_every_stored_layer_is_of_a_kind_of_the_table(settings: BuildSettings, built: list) -> None:
    store = LayerStore(settings.store)
    kinds = {(store.meta(i) or {}).get("kind") for i in store.layer_ids()}
    assert kinds >= {"env", "task"}, kinds
    assert kinds <= set(KINDS), kinds - set(KINDS)


def test_the_documented_table_is_the_code_s() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layer kinds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {r.split("`")[1]: r.split("|")[2].strip() for r in rows}
    assert documented == {k.name: f"{k.format}" for k in KINDS.values()}
