# A bug task's own layer: its bug patch ($1) applied to /testbed and made the repository's one
# commit, with nothing left that shows the clean code: not the old commit, not the clean blobs
# of the files the bug changes (their loose objects are removed: flatten_repo.sh made every
# object loose), not their bytecode. The test files named after it (its FAIL_TO_PASS tests'
# files) are removed as well, as SWE-smith's harness does; the patch that brings them back at
# evaluation is written to /tmp/restore-tests.patch. Run as
# `bash apply_bug.sh PATCH HIDDEN... -- OTHER...` in /testbed: HIDDEN the FAIL_TO_PASS tests'
# files, OTHER the PASS_TO_PASS tests' others; a test file that is not there fails the build
# (the task could never be graded).
set -euo pipefail
patch=$1
shift
git apply "$patch"
hidden=()
missing=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    if [ -e "$1" ]; then hidden+=("$1"); else missing+=("$1"); fi
    shift
done
[ $# -gt 0 ] && shift  # the --
for f in "$@"; do
    [ -e "$f" ] || missing+=("$f")
done
if [ ${#missing[@]} -gt 0 ]; then
    printf 'apply_bug: test files of FAIL_TO_PASS/PASS_TO_PASS not in the repository: %s\n' \
        "${missing[*]}" >&2
    exit 1
fi
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
# Bytecode compiled from the clean sources.
for f in "${changed[@]}"; do
    case $f in
        *.py)
            base=$(basename -- "$f" .py)
            dir=$(dirname -- "$f")
            rm -f -- "$dir/__pycache__/$base".*.py[co] "$dir/$base.pyc" "$dir/$base.pyo"
            ;;
    esac
done
git add -A  # with what the install left untracked (egg-info): the agent's diff stays its own
date=$(git log -1 --format=%cI)
GIT_AUTHOR_DATE=$date GIT_COMMITTER_DATE=$date \
    git -c user.name=swe-minisandbox -c user.email=swe-minisandbox@localhost \
    commit -q --no-verify --amend -m "Initial commit"
rm -rf .git/logs .git/ORIG_HEAD
# The old commit's trees too: they name the clean blobs' ids (a fix could be hashed until
# one matches) and the hidden files.
old_trees=$(git ls-tree -r -t -d "$old" | awk '{print $3}'; git rev-parse "$old^{tree}")
still=$(git ls-tree -r -t HEAD | awk '{print $3}'; git rev-parse "HEAD^{tree}")
for o in "$old" $old_trees "${clean[@]}"; do
    # A blob another file still holds is no secret: that file shows it.
    if ! grep -qx "$o" <<<"$still"; then
        rm -f ".git/objects/${o:0:2}/${o:2}"
    fi
done
