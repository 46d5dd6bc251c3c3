#!/bin/bash
# Runs inside a task's agent sandbox: can an agent read the fix somewhere outside /testbed?
# Usage: check_leaks.sh LINES_FILE  (lines the gold patch adds, one per line)
# Keeps the lines the base tree (/testbed) does not hold, then searches every readable file
# outside /testbed (and /proc, /sys, /dev, the channel) for them. Prints "PATH<TAB>LINE" per
# finding on stdout, "lines N" (how many were searched for) on stderr.
set -u
lines=$1
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null LC_ALL=C
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# grep -F -o prints each match as the pattern itself: the lines the base tree already holds.
git -C /testbed grep -h -o -I -F -f "$lines" >"$work/present" 2>/dev/null || true
grep -v -x -F -f "$work/present" "$lines" >"$work/rare" || true
echo "lines $(wc -l <"$work/rare")" >&2
[ -s "$work/rare" ] || exit 0
here=$(dirname "$lines")
find / \( -path /proc -o -path /sys -o -path /dev -o -path /testbed -o -path /run/minisandbox \
  -o -path "$here" -o -path "$work" \) -prune -o -type f -readable -size -100M -print0 2>/dev/null |
  xargs -0 -r grep -H -I -o -F -f "$work/rare" 2>/dev/null |
  sed 's/:/\t/' | sort -u | head -n 200
exit 0
