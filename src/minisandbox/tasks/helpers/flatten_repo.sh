# The repository layer of bug tasks (SWE-smith's): /testbed's history becomes one root commit
# of its tree, as SWE-smith's mirrors have, with every object loose. A bug layer can then hide
# the clean version of what its bug changes by removing single object files (apply_bug.sh).
# Run as `bash flatten_repo.sh` in /testbed.
set -euo pipefail
date=$(git log -1 --format=%cI)
tracked=$(mktemp)
git ls-files -z >"$tracked"     # what the commit tracks, ignored patterns or not
rm -rf .git
git -c init.defaultBranch=main init -q
git config gc.auto 0            # never pack: a pack would hold the clean objects together
git config core.logAllRefUpdates false
xargs -0 -r git add -f -- <"$tracked"
rm -f "$tracked"
GIT_AUTHOR_DATE=$date GIT_COMMITTER_DATE=$date \
    git -c user.name=swe-minisandbox -c user.email=swe-minisandbox@localhost \
    commit -q --no-verify -m "Initial commit"
