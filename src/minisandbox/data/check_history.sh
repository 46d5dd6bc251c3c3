#!/bin/bash
# Runs inside a task sandbox: does the repository at $1 hold anything from after its HEAD?
# Usage: check_history.sh REPO [GOLD_PATCH FILE...]  (FILEs: the paths the gold patch touches)
# Prints one line per problem on stdout (none: the repository holds only its past), and
# "objects N unreachable M" on stderr.
set -u
repo=$1
gold=${2:-}
shift $(($# < 2 ? $# : 2))
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null LC_ALL=C
cd "$repo" 2>/dev/null || { echo "no repository at $repo"; exit 0; }
head=$(git rev-parse --verify -q HEAD) || { echo "$repo has no HEAD"; exit 0; }
git for-each-ref --format='%(refname) %(objectname) %(*objectname)' |
  while read -r name oid peeled; do
    target=${peeled:-$oid}
    case $name in
      refs/heads/*) [ "$oid" = "$head" ] || echo "branch $name points at $oid, not HEAD $head" ;;
      refs/tags/*) git merge-base --is-ancestor "$target" "$head" 2>/dev/null ||
        echo "tag $name points at $target, not an ancestor of HEAD" ;;
      *) echo "ref $name is neither HEAD's branch nor a tag" ;;
    esac
  done
gitdir=$(git rev-parse --absolute-git-dir)
for extra in logs ORIG_HEAD FETCH_HEAD refs/stash objects/info/alternates; do
  [ -e "$gitdir/$extra" ] && echo ".git/$extra exists"
done
remotes=$(git remote)
[ -z "$remotes" ] || echo "remotes configured: $(echo $remotes)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git cat-file --batch-all-objects --batch-check='%(objectname)' | sort -u >"$tmp/all"
git rev-list --objects --all --reflog | cut -d' ' -f1 | sort -u >"$tmp/reachable"
comm -23 "$tmp/all" "$tmp/reachable" >"$tmp/unreachable"
n=$(wc -l <"$tmp/unreachable")
[ "$n" = 0 ] || echo "$n unreachable objects, e.g. $(head -1 "$tmp/unreachable")"
echo "objects $(wc -l <"$tmp/all") unreachable $n" >&2
# The files as the gold patch leaves them, hashed outside the repository (nothing written to
# its object database): none of those blobs may be in it, unless HEAD's own history holds them.
if [ -n "$gold" ] && [ -s "$gold" ]; then
  mkdir "$tmp/gold"
  for f in "$@"; do
    mkdir -p "$tmp/gold/$(dirname -- "$f")"
    git show "HEAD:$f" >"$tmp/gold/$f" 2>/dev/null || rm -f -- "$tmp/gold/$f"
  done
  if ! (cd "$tmp/gold" && { git apply "$gold" 2>/dev/null ||
    patch -s -p1 --batch -i "$gold" >/dev/null 2>&1; }); then
    echo "the gold patch does not apply to HEAD's files: its blobs could not be looked for"
  fi
  for f in "$@"; do
    [ -f "$tmp/gold/$f" ] || continue
    blob=$(git hash-object --no-filters "$tmp/gold/$f")
    grep -qx "$blob" "$tmp/all" || continue
    git show "HEAD:$f" 2>/dev/null | cmp -s - "$tmp/gold/$f" && continue
    # In HEAD's own history (a fix that restores an earlier version): the past, not a leak.
    [ -s "$tmp/past" ] || git rev-list --objects HEAD | cut -d' ' -f1 | sort -u >"$tmp/past"
    if grep -qx "$blob" "$tmp/past"; then
      echo "note: the gold patch's version of $f is in HEAD's own history" >&2
    else
      echo "the gold patch's version of $f (blob $blob) is in the repository"
    fi
  done
fi
exit 0
