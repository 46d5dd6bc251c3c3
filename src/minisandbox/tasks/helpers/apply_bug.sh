# A bug task's own layer: its bug patch ($1) applied to /testbed and made the repository's one
# commit, with nothing left that shows the clean code: not the old commit, not the clean blobs
# of the files the bug changes (their loose objects are removed: flatten_repo.sh made every
# object loose), not their bytecode. The test files named after it (its FAIL_TO_PASS tests'
# files) are removed as well, as SWE-smith's harness does; the patch that brings them back at
# evaluation is written to /tmp/restore-tests.patch. Run as `bash apply_bug.sh PATCH FILE...`
# in /testbed.
set -euo pipefail
patch=$1
shift
git apply "$patch"
hidden=()
for f in "$@"; do
    if [ -e "$f" ]; then hidden+=("$f"); fi
done
if [ ${#hidden[@]} -gt 0 ]; then
    # Each file created from nothing, as it is at HEAD.
    empty=$(git hash-object -t tree /dev/null)
    git diff --binary "$empty" HEAD -- "${hidden[@]}" >/tmp/restore-tests.patch
    git rm -q -- "${hidden[@]}"
else
    : >/tmp/restore-tests.patch
fi
old=$(git rev-parse HEAD)
mapfile -d '' changed < <(git diff --name-only -z HEAD)  # modified or deleted by the bug
clean=()
for f in "${changed[@]}"; do
    if o=$(git rev-parse -q --verify "HEAD:$f"); then clean+=("$o"); fi
done
git add -A
date=$(git log -1 --format=%cI)
GIT_AUTHOR_DATE=$date GIT_COMMITTER_DATE=$date \
    git -c user.name=swe-minisandbox -c user.email=swe-minisandbox@localhost \
    commit -q --no-verify --amend -m "Initial commit"
rm -rf .git/logs .git/ORIG_HEAD
still=$(git ls-tree -r HEAD | awk '{print $3}')
for o in "$old" "${clean[@]}"; do
    # A blob another file still holds is no secret: that file shows it.
    if ! grep -qx "$o" <<<"$still"; then
        rm -f ".git/objects/${o:0:2}/${o:2}"
    fi
done
for f in "${changed[@]}"; do
    case $f in
        *.py) rm -f -- "$(dirname -- "$f")/__pycache__/$(basename -- "$f" .py)".*.pyc ;;
    esac
done
