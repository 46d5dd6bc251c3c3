"""Candidate bugs for one repository with SWE-smith's own procedural generators (no LLM, no
Docker, no network): phase 1 of swesmith_generate.py, run in an environment with `swesmith`.

    python bench/swesmith_candidates.py <owner__repo.commit8> <checkout> [--max N]

`checkout` is the repository at the profile's commit. Prints one JSON object: the profile's
facts and the candidates (instance_id, patch), ids as SWE-smith forms them
(`<owner>__<repo>.<commit8>.<modifier>__<hash>`). SWE-smith's command-line generator deletes the
checkout it is given, so the library is called directly, with the same filters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_name", help="the SWE-smith profile key, owner__repo.commit8")
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--max", type=int, default=0, help="at most this many (0: all)")
    parser.add_argument("--seed", type=int, default=24, help="SWE-smith's default seed")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # swesmith prints as it imports
        from swesmith.bug_gen.adapters import get_entities_from_file
        from swesmith.bug_gen.procedural import MAP_EXT_TO_MODIFIERS
        from swesmith.bug_gen.utils import generate_patch_fast
        from swesmith.profiles import registry

        profile = registry.get(args.repo_name)
        random.seed(args.seed)
        entities: list = []
        root = args.checkout
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != ".git"]
            for name in sorted(files):
                ext = Path(name).suffix
                if ext in profile.exts and not profile._is_test_path(folder, name):
                    get_entities_from_file[ext](entities, os.path.join(folder, name), -1)
        found: dict[str, str] = {}
        for modifier in MAP_EXT_TO_MODIFIERS[".py"]:
            for entity in entities:
                if not modifier.can_change(entity):
                    continue
                bug = modifier.modify(entity)
                patch = bug and generate_patch_fast(entity, bug, str(root))
                if patch:
                    found.setdefault(
                        f"{profile.repo_name}.{modifier.name}__{bug.get_hash()}", patch
                    )
    candidates = [{"instance_id": i, "patch": p} for i, p in found.items()]
    if args.max:
        candidates = candidates[: args.max]
    facts = {
        "repo_name": profile.repo_name,
        "mirror_name": profile.mirror_name,
        "image_name": profile.image_name,
        "owner": profile.owner,
        "repo": profile.repo,
        "commit": profile.commit,
        "python": getattr(profile, "python_version", "3.10"),
        "install": list(getattr(profile, "install_cmds", [])),
        "test_cmd": profile.test_cmd,
        "entities": len(entities),
    }
    print(json.dumps({"profile": facts, "candidates": candidates}))


if __name__ == "__main__":
    main()
