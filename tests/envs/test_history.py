"""Task checkouts hold only their base commit's past (githistory), proven by the history check
that validation runs inside the task's sandbox; a repository's tasks share its history packs."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from minisandbox.envs.githistory import HistoryError, PackCache, checkout_past, object_counts
from minisandbox.evaluation.validation import check_history
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks

_ID = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_ID}
    r = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"git {args}: {r.stderr}"
    return r.stdout.strip()


def linear_repo(path: Path, commits: int) -> list[str]:
    """A repository with `commits` commits on main, each changing one file; their ids."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "--initial-branch=main")
    ids = []
    for i in range(commits):
        (path / f"f{i % 7}.txt").write_text(f"version {i}\n" * 50)
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"c{i}")
        ids.append(git(path, "rev-parse", "HEAD"))
        if i == 3:
            git(path, "tag", "-a", "v0.1", "-m", "an old release")
    return ids


def test_checkout_holds_only_the_past_and_shares_packs(tmp_path: Path) -> None:
    source = tmp_path / "source"
    ids = linear_repo(source, 20)
    git(source, "tag", "v9", ids[-1])  # a tag on a later commit: must not come along
    cache = PackCache(tmp_path / "packs", coarse=4)
    plain = tmp_path / "plain"
    git(tmp_path, "clone", "-q", str(source), str(plain))
    git(plain, "checkout", "-q", "-B", "main", ids[9])
    git(plain, "remote", "remove", "origin")  # what builds did before: drop later refs
    git(plain, "tag", "-d", "v9")
    _total, unreachable = object_counts(plain)
    assert unreachable > 0, "positive control: a clone without later refs holds the future"
    dests = {}
    for n in (10, 15):
        dest = tmp_path / f"task{n}"
        checkout_past(source, ids[n - 1], dest, cache)
        dests[n] = dest
        assert git(dest, "rev-parse", "HEAD") == ids[n - 1]
        assert object_counts(dest)[1] == 0
        assert git(dest, "tag") == "v0.1"
        assert git(dest, "for-each-ref", "--format=%(refname)").split() == [
            "refs/heads/main",
            "refs/tags/v0.1",
        ]
        assert not git(dest, "remote") and not (dest / ".git/logs").exists()
        assert git(dest, "status", "--porcelain") == ""
        later = ids[n:]
        for oid in later:
            r = subprocess.run(["git", "-C", str(dest), "cat-file", "-e", oid])
            assert r.returncode != 0, f"commit {oid} from after the base is in the checkout"
    packs = {n: set(os.listdir(d / ".git/objects/pack")) for n, d in dests.items()}
    shared = packs[10] & packs[15]
    assert len(shared) >= 4, f"the two tasks share no history pack: {packs}"
    # Each object is stored about once: the unique packs are far smaller than two full copies.
    unique = {
        f: (d / ".git/objects/pack" / f).stat().st_size
        for d in dests.values()
        for f in os.listdir(d / ".git/objects/pack")
        if f.endswith(".pack")
    }
    per_task = [
        sum((d / ".git/objects/pack" / f).stat().st_size for f in packs[n] if f.endswith(".pack"))
        for n, d in dests.items()
    ]
    assert sum(unique.values()) < 0.8 * sum(per_task)


def test_history_that_cannot_be_cut_is_a_clear_error(tmp_path: Path) -> None:
    source = tmp_path / "source"
    ids = linear_repo(source, 5)
    cache = PackCache(tmp_path / "packs")
    with pytest.raises(HistoryError, match=f"commit {'0' * 40} is not in {source}"):
        checkout_past(source, "0" * 40, tmp_path / "a", cache)
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "2", f"file://{source}", str(shallow))
    with pytest.raises(HistoryError, match="shallow"):
        checkout_past(shallow, ids[-1], tmp_path / "b", cache)
    # A mirror lacking a blob its history needs (a filtered clone, a damaged copy).
    lacking = tmp_path / "lacking"
    shutil.copytree(source, lacking)
    blob = git(lacking, "rev-parse", f"{ids[1]}:f1.txt")
    (lacking / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # loose: never repacked
    with pytest.raises(HistoryError, match=f"lacks object {blob}.*complete clone"):
        checkout_past(lacking, ids[-1], tmp_path / "c", PackCache(tmp_path / "packs2"))


def test_relative_locations_work_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store or pack cache named relative to the current directory (`--work-dir work`): git
    runs in the mirror, so a relative path handed to it would name a directory there."""
    source = tmp_path / "source"
    ids = linear_repo(source, 6)
    monkeypatch.chdir(tmp_path)
    checkout_past(source, ids[-1], tmp_path / "task", PackCache(Path("packs")))
    assert git(tmp_path / "task", "rev-parse", "HEAD") == ids[-1]
    assert any(p.suffix == ".pack" for p in (tmp_path / "packs").iterdir())
    settings = BuildSettings(
        store=Path("work/store"), cache=Path("work/cache"), git_mirror=Path("m")
    )
    assert settings.store == tmp_path / "work/store" and settings.cache.is_absolute()
    assert settings.git_mirror == tmp_path / "m"
    monkeypatch.setenv("MINISANDBOX_STORE", "env/store")
    assert BuildSettings().store == tmp_path / "env/store"
    # The CLI's options too (`minisandbox build --store work/store`).
    from minisandbox.cli.app import make_builder

    builder = make_builder(Path("cli/store"), Path("cli/cache"), Path("m"))
    assert builder.settings.store == tmp_path / "cli/store"
    assert builder.settings.cache == tmp_path / "cli/cache"


def test_built_task_holds_no_future_and_validation_proves_it(tmp_path: Path) -> None:
    """An example task whose mirror holds the fix as a later commit, a branch, a tag and a
    dangling blob: the built task's sandbox holds none of it (checked as an agent's git sees
    it), while the same check finds all of it in the mirror itself (positive control)."""
    task = next(t for t in load_tasks("examples") if t.gold_patch)
    mirror = tmp_path / "mirror"
    materialize_mirror(tmp_path / "examples")
    name = task.repo.replace("/", "__")
    shutil.copytree(tmp_path / "examples" / name, mirror / name, symlinks=True)
    repo = mirror / name
    (tmp_path / "gold.patch").write_text(task.gold_patch)
    git(repo, "checkout", "-q", "-b", "fix")
    git(repo, "apply", str(tmp_path / "gold.patch"))
    git(repo, "commit", "-q", "-am", "the fix")
    git(repo, "tag", "v-fixed")
    git(repo, "checkout", "-q", "main")
    subprocess.run(
        ["git", "-C", str(repo), "hash-object", "-w", "--stdin"],
        input=b"dangling",
        check=True,
        capture_output=True,
    )
    settings = BuildSettings(store=tmp_path / "store", cache=tmp_path / "cache", git_mirror=mirror)
    builder = Builder(settings)

    async def run() -> tuple:
        result = await builder.build(task)
        assert result.status == "built", result.error
        clean = await check_history(builder, task)
        async with builder.sandbox(task) as sb:
            await sb.upload(repo, "/tmp/mirror")
            await sb.write_file("/tmp/gold.patch", task.gold_patch)
            script = Path(__file__).parents[2] / "src/minisandbox/data/check_history.sh"
            await sb.upload(script, "/tmp/check.sh")
            from minisandbox.tasks.specs import files_in_patch

            r = await sb.execute(
                [
                    "bash",
                    "/tmp/check.sh",
                    "/tmp/mirror",
                    "/tmp/gold.patch",
                    *files_in_patch(task.gold_patch),
                ]
            )
            return clean, r

    clean, dirty = asyncio.run(run())
    assert clean.problems == [] and clean.objects > 0 and clean.unreachable_objects == 0
    found = dirty.stdout
    assert "refs/heads/fix" in found and "v-fixed" in found, found
    assert "unreachable objects" in found and "the gold patch's version" in found, found


def test_checkout_from_a_url_goes_through_a_local_cache(tmp_path: Path) -> None:
    """Without a mirror, the repository is cloned (bare) once into the builder's git cache, a
    missing base commit is fetched into it, and checkouts are cut from it."""
    task = load_tasks("examples")[0].model_copy(update={"source": "url-test"})
    materialize_mirror(tmp_path / "examples")
    served = tmp_path / "served" / task.repo
    served.parent.mkdir(parents=True)
    shutil.copytree(tmp_path / "examples" / task.repo.replace("/", "__"), served, symlinks=True)
    settings = BuildSettings(
        store=tmp_path / "store",
        cache=tmp_path / "cache",
        git_mirror=None,
        git_url_template=f"file://{tmp_path / 'served'}/{{repo}}",
    )
    result = asyncio.run(Builder(settings).build(task))
    assert result.status == "built", result.error
    bare = tmp_path / "git-cache" / f"{task.repo.replace('/', '__')}.git"
    assert (bare / "HEAD").is_file(), "the repository was not cached locally"
    # A base commit the cache lacks is fetched: a new commit in the served repository.
    (served / "NEW.txt").write_text("new\n")
    git(served, "add", "-A")
    git(served, "commit", "-q", "-m", "later")
    newer = task.model_copy(
        update={"id": "url-test-2", "base_commit": git(served, "rev-parse", "HEAD")}
    )
    result = asyncio.run(Builder(settings).build(newer))
    assert result.status == "built", result.error
    missing = task.model_copy(update={"id": "url-test-3", "base_commit": "1" * 40})
    result = asyncio.run(Builder(settings).build(missing))
    assert result.status == "failed" and "checkout" in (result.error or "")


def test_base_on_a_cut_point_and_moved_tags(tmp_path: Path) -> None:
    """A base commit that is also a shared cut point still gets its tags; a tag moved in the
    source after an earlier task was built leaves nothing unreachable in a later one."""
    source = tmp_path / "source"
    ids = linear_repo(source, 20)
    cache = PackCache(tmp_path / "packs", coarse=4)
    checkout_past(source, ids[14], tmp_path / "t15", cache)  # makes the cut at depth 8
    checkout_past(source, ids[7], tmp_path / "t8", cache)  # depth 8: that very cut
    assert git(tmp_path / "t8", "tag") == "v0.1" and object_counts(tmp_path / "t8")[1] == 0
    git(source, "tag", "-d", "v0.1")
    git(source, "tag", "-a", "v0.1", "-m", "re-released", ids[5])
    for n in (15, 17):
        dest = tmp_path / f"moved{n}"
        checkout_past(source, ids[n - 1], dest, cache)
        assert object_counts(dest)[1] == 0, f"task {n}: the old tag object is unreachable"
        peeled = git(dest, "rev-parse", "v0.1^{commit}")
        assert peeled == ids[5]


def test_gold_version_in_the_past_is_not_a_leak(tmp_path: Path) -> None:
    """A fix that restores an earlier version of a file: that blob is in the base commit's own
    history, which an agent may read; only a gold blob outside HEAD's history is a leak."""
    script = Path(__file__).parents[2] / "src/minisandbox/data/check_history.sh"
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "--initial-branch=main")
    (repo / "a.py").write_text("good = True\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "good")
    (repo / "a.py").write_text("good = False\n")
    git(repo, "commit", "-q", "-am", "the bug")
    (tmp_path / "revert.patch").write_text(
        "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-good = False\n+good = True\n"
    )
    (tmp_path / "new.patch").write_text(
        "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-good = False\n+good = 'fixed'\n"
    )

    def check(patch: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script), str(repo), str(tmp_path / patch), "a.py"],
            capture_output=True,
            text=True,
            env={**os.environ, **_ID},
        )

    r = check("revert.patch")
    assert "gold" not in r.stdout and "in HEAD's own history" in r.stderr, (r.stdout, r.stderr)
    # The same check finds a gold version that only a later commit holds (positive control).
    git(repo, "checkout", "-q", "-b", "fix")
    (repo / "a.py").write_text("good = 'fixed'\n")
    git(repo, "commit", "-q", "-am", "the fix")
    git(repo, "checkout", "-q", "main")
    git(repo, "branch", "-D", "fix")  # unreachable now, as a pruned-away future would be
    r = check("new.patch")
    assert "the gold patch's version of a.py" in r.stdout, (r.stdout, r.stderr)
