"""Repositories with git submodules (astropy before 4.0 builds through its astropy_helpers
submodule): a task's checkout has them in place and initialised, as the official harness's has
after `git submodule update --init`, each holding only the past of its recorded commit."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from minisandbox.envs.githistory import HistoryError, PackCache, Submodule, add_submodule
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.repos import _github_repo


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def _commit(repo: Path, name: str, text: str) -> str:
    (repo / name).write_text(text)
    _git(repo, "add", name)
    _git(repo, "commit", "-q", "-m", name)
    return _git(repo, "rev-parse", "HEAD")


def test_a_submodule_is_checked_out_initialised_and_only_its_past(home: Path) -> None:
    base = home / "submodules"
    mirror = base / "mirror"
    helpers = mirror / "acme__helpers"
    helpers.mkdir(parents=True)
    _git(helpers, "init", "-q")
    pinned = _commit(helpers, "helpers.py", "VERSION = 1\n")
    later = _commit(helpers, "helpers.py", "VERSION = 2  # after the pinned commit\n")

    main = mirror / "acme__withsub"
    main.mkdir()
    _git(main, "init", "-q")
    _commit(main, "setup.py", "print('hi')\n")
    # What `git submodule add` records (without its clone): a .gitmodules entry and a gitlink.
    (main / ".gitmodules").write_text(
        '[submodule "helpers"]\n\tpath = helpers\n\turl = https://github.com/acme/helpers.git\n'
    )
    _git(main, "add", ".gitmodules")
    _git(main, "update-index", "--add", "--cacheinfo", f"160000,{pinned},helpers")
    _git(main, "commit", "-q", "-m", "helpers at v1")
    base_commit = _git(main, "rev-parse", "HEAD")

    example = load_tasks("examples")[0]
    task = example.model_copy(
        update={
            "id": "withsub",
            "repo": "acme/withsub",
            "source": None,
            "base_commit": base_commit,
            "pre_install": [],
            "install": [],
        }
    )
    own = BuildSettings(store=base / "store", cache=base / "layers", git_mirror=mirror)
    builder = Builder(own)
    result = asyncio.run(builder.build(task))
    assert result.status == "built", result.error

    async def look() -> list[str]:
        async with builder.sandbox(task) as sb:
            out = []
            for cmd in (
                "git submodule status",
                "cat helpers/helpers.py",
                f"git -C helpers cat-file -e {later} && echo LEAK || echo absent",
                "git status --porcelain",
            ):
                r = await sb.execute(["bash", "-c", cmd])
                assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
                out.append(r.stdout.rstrip("\n"))
            return out

    status, text, later_commit, dirty = asyncio.run(look())
    # " " = initialised at the recorded commit ("-" would make ah_bootstrap.py fetch it).
    assert status.startswith(f" {pinned} helpers"), status
    assert text == "VERSION = 1"
    assert later_commit == "absent"  # the submodule's own future is not there either
    assert dirty == ""


def test_a_submodule_path_or_url_that_leads_elsewhere_is_refused(tmp_path: Path) -> None:
    """.gitmodules comes with the repository: a path out of the checkout, through a link, or
    over files, is refused; so is a URL that is neither GitHub's nor https (a local path, ssh,
    an option), before anything is fetched."""
    dest = tmp_path / "checkout"
    (dest / "real").mkdir(parents=True)
    (dest / "link").symlink_to(tmp_path)
    (dest / "full").mkdir()
    (dest / "full" / "f").write_text("x")
    cache = PackCache(tmp_path / "packs")
    for path, why in [
        ("../escape", "not inside the checkout"),
        ("/abs", "not inside the checkout"),
        ("a/.git/hooks", "not inside the checkout"),
        ("link/sub", "is a symlink"),
        ("full", "not an empty directory"),
    ]:
        sub = Submodule("s", path, "https://github.com/acme/helpers.git", "0" * 40)
        with pytest.raises(HistoryError, match=why):
            add_submodule(dest, sub, tmp_path, cache)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "sub").exists()

    for url in ("/srv/private.git", "file:///srv/private.git", "ssh://h/x.git", "-uploadpack=x"):
        assert _github_repo(url, "acme/withsub") is None
    assert _github_repo("../helpers.git", "acme/withsub") == "acme/helpers"
    assert _github_repo("../../etc/x", "acme/withsub") is None
