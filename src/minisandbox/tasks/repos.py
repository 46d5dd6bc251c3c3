"""Where a task's repository comes from, and its checkout holding only its past.

A repository is read from the git mirror (`BuildSettings.git_mirror`, one clone per repository
named `<owner>__<name>`), the bundled examples, or the machine's bare clone cache (cloned once,
then fetched only for a commit it lacks). Checkouts are cut from there by githistory: no object,
ref, reflog or remote from after the base commit, submodules at their recorded commits.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
from pathlib import Path

from minisandbox.envs import githistory, relax
from minisandbox.envs.layerbuild import BuildError
from minisandbox.envs.settings import BuildSettings
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.tasks.repo_recipes import RecipeResolveError, RepoTree, resolve
from minisandbox.tasks.specs import Task
from minisandbox.utils import safefs


class RepoSources:
    """Local git repositories of tasks' repositories, and checkouts cut from them."""

    def __init__(self, settings: BuildSettings) -> None:
        self.settings = settings

    def checkout(self, task: Task, dest: Path, logs: Path) -> None:
        """The repository at its base commit holding only its past (see `githistory`): no
        object, ref, reflog or remote from after it, so an agent cannot find the fix."""
        name = task.repo.replace("/", "__")
        log = logs / "checkout.log"
        source = self.source(task, log, commits=[task.base_commit])
        try:
            githistory.checkout_past(
                source, task.base_commit, dest, githistory.PackCache(self._packs_dir(name))
            )
        except githistory.HistoryError as e:
            log.write_text(f"{task.repo} at {task.base_commit}: {e}\n")
            raise BuildError(task.id, "checkout", log, f": {task.repo}: {e}") from None
        try:
            subs = githistory.submodules(dest)
        except githistory.HistoryError as e:
            raise BuildError(task.id, "checkout", log, f": {task.repo}: .gitmodules: {e}") from None
        for sub in subs:
            # As the official harness's clone has them once its install ran `git submodule
            # update --init` (with the network, which evaluation here does not have).
            repo = _github_repo(sub.url, task.repo)
            if repo is None and not sub.url.startswith("https://"):
                raise BuildError(
                    task.id,
                    "checkout",
                    log,
                    f": submodule {sub.path}: URL {sub.url!r} is neither on GitHub nor https; "
                    "only those are fetched (put a clone in the git mirror as <owner>__<name>)",
                )
            sub_name = (repo or hashlib.sha256(sub.url.encode()).hexdigest()[:16]).replace(
                "/", "__"
            )
            # A GitHub submodule is fetched like any repository (the mirror, or the URL
            # template), whatever protocol its .gitmodules names.
            source = self.source(
                task,
                log,
                commits=[sub.commit],
                repo=repo or sub_name,
                url=None if repo else sub.url,
            )
            try:
                githistory.add_submodule(
                    dest, sub, source, githistory.PackCache(self._packs_dir(sub_name))
                )
            except githistory.HistoryError as e:
                log.write_text(f"{task.repo} at {task.base_commit}, submodule {sub.path}: {e}\n")
                raise BuildError(
                    task.id, "checkout", log, f": {task.repo}: submodule {sub.path}: {e}"
                ) from None
        owner = SandboxConfig().layer_owner()
        if owner is not None:  # a root caller's sandbox root (an unprivileged uid) must own it
            safefs.chown_tree(dest, *owner)

    def source(
        self,
        task: Task,
        log: Path,
        commits: list[str],
        repo: str | None = None,
        url: str | None = None,
    ) -> Path:
        """A local git repository of `repo` (the task's by default) holding `commits`: the
        mirror's, the bundled examples' or the machine's bare clone cache (cloned from `url`,
        by default the repository's GitHub URL).

        Raises:
            BuildError: at step "checkout", when there is no mirror or the clone fails.
        """
        s = self.settings
        repo = repo or task.repo
        name = repo.replace("/", "__")
        if s.git_mirror is not None and (s.git_mirror / name).is_dir():
            return s.git_mirror / name
        if task.source == "examples" and repo == task.repo:  # they come with the package
            from minisandbox.tasks.examples import materialize_mirror

            return materialize_mirror(s.store.parent / "examples-mirror") / name
        if s.git_mirror is not None:
            raise BuildError(
                task.id, "checkout", log, f": no mirror of {repo} at {s.git_mirror / name}"
            )
        url = url or s.git_url_template.format(repo=repo)
        return self._git_cache(task.id, url, name, log, commits)

    def _packs_dir(self, name: str) -> Path:
        """The repository's history packs, shared by its tasks' checkouts (githistory)."""
        return self.settings.store.parent / "git-packs" / name

    def _git_cache(self, task_id: str, url: str, name: str, log: Path, commits: list[str]) -> Path:
        """A local bare clone of `url` (fetched once per machine, then only what a new commit
        needs): checkouts are cut from it, never cloned whole."""
        cache = self.settings.store.parent / "git-cache" / f"{name}.git"
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache.parent / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            env = {**os.environ, **githistory.GIT_ENV}  # never a password prompt
            # (command, the commit it looks for: fetched when missing)
            steps: list[tuple[list[str], str | None]] = []
            if not (cache / "HEAD").exists():
                steps.append((["git", "clone", "--quiet", "--bare", "--", url, str(cache)], None))
            steps += [
                (["git", "-C", str(cache), "cat-file", "-e", f"{c}^{{commit}}"], c) for c in commits
            ]
            with log.open("a") as out:
                for cmd, commit in steps:
                    out.write(f"$ {' '.join(cmd)}\n")
                    out.flush()
                    r = subprocess.run(
                        cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env
                    )
                    if r.returncode != 0 and commit is not None:
                        cmd = ["git", "-C", str(cache), "fetch", "--quiet", "--", url, commit]
                        out.write(f"$ {' '.join(cmd)}\n")
                        out.flush()
                        r = subprocess.run(
                            cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env
                        )
                    if r.returncode != 0:
                        raise BuildError(
                            task_id, "checkout", log, f": `{' '.join(cmd[:4])}` failed"
                        )
        finally:
            os.close(fd)
        return cache

    def commit_date(self, task: Task, logs: Path) -> str:
        """The committer date of the task's base commit (ISO 8601), read from its source.

        Raises:
            BuildError: at step "resolve", when the repository cannot be read at that commit.
        """
        log = logs / "resolve-date.log"
        source = self.source(task, log, commits=[task.base_commit])
        try:
            date = githistory.commit_date(source, task.base_commit)
        except githistory.HistoryError as e:
            date, error = "", str(e)
        else:
            error = "no date"
        if not date:
            log.write_text(f"{error}\n")
            raise BuildError(
                task.id,
                "resolve",
                log,
                f": cannot read the date of {task.repo} at {task.base_commit} in {source}: "
                f"{error[-300:]}",
            )
        return date

    def resolve_recipe(self, task: Task, logs: Path) -> Task:
        """`task` with its recipe's `from_repository` read from the repository at its
        environment commit (its base commit when it has none): tasks.repo_recipes.

        Raises:
            BuildError: at step "resolve", when the repository cannot be read there or does
                not give what the recipe leaves to it.
        """
        commit = task.environment_setup_commit or task.base_commit
        log = logs / "resolve-recipe.log"
        source = self.source(task, log, commits=[commit])
        try:
            tree = RepoTree(
                githistory.blobs_at(source, commit),
                lambda path: githistory.read_at(source, commit, path),
                githistory.commit_date(source, commit) or None,
            )
            recipe = resolve(task.env, tree)
        # (what a repository's files say is input: anything a parser raises is its error)
        except (
            githistory.HistoryError,
            RecipeResolveError,
            ValueError,
            TypeError,
            RecursionError,
        ) as e:
            log.write_text(f"{e}\n")
            raise BuildError(
                task.id,
                "resolve",
                log,
                f": the recipe of {task.repo} at {commit} cannot be resolved: {str(e)[-300:]}",
            ) from None
        log.write_text(recipe.model_dump_json(indent=1) + "\n")
        return task.model_copy(update={"env": recipe})

    def imports_at(self, task: Task, logs: Path) -> tuple[frozenset[str] | None, str | None]:
        """What the repository imports at its environment commit, and that commit's date
        (relax.py's priorities and date bound); (None, None) without such a commit.

        Raises:
            BuildError: at step "resolve", when the repository cannot be read at that commit.
        """
        commit = task.environment_setup_commit
        if not commit:
            return None, None
        log = logs / "resolve-source.log"
        source = self.source(task, log, commits=[commit])
        try:
            found = githistory.python_imports_at(source, commit)
            date = githistory.commit_date(source, commit) or None
        except githistory.HistoryError as e:
            log.write_text(f"{e}\n")
            raise BuildError(
                task.id,
                "resolve",
                log,
                f": cannot read {task.repo} at its environment commit {commit} in {source}: "
                f"{str(e)[-300:]}",
            ) from None
        return relax.imported_names([found]), date


_GITHUB = re.compile(
    r"^(?:https://github\.com/|git@github\.com:|git://github\.com/)([\w-]+/[\w.-]+?)(?:\.git)?/?$"
)


def _github_repo(url: str, parent: str) -> str | None:
    """The GitHub repository ("owner/name") a submodule URL names, on GitHub or relative to
    its superproject's (`../name.git`); None for any other URL."""
    if url.startswith("../"):
        name = url[3:].removesuffix("/").removesuffix(".git")
        ok = re.fullmatch(r"[\w.-]+", name) and name not in (".", "..")
        return f"{parent.split('/')[0]}/{name}" if ok else None
    m = _GITHUB.match(url)
    return m.group(1) if m else None
