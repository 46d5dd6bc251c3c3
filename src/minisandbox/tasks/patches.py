"""Reversing a unified diff: a SWE-smith task's gold patch is its bug patch, reversed."""

from __future__ import annotations

import re

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)", re.DOTALL)
# Header lines whose two forms swap when the diff is reversed.
_SWAPS = (
    ("new file mode ", "deleted file mode "),
    ("rename from ", "rename to "),
    ("copy from ", "copy to "),
    ("old mode ", "new mode "),
)


def _other_side(name: str) -> str:
    """`a/x` <-> `b/x` (git's prefixes); other names (/dev/null, unprefixed) unchanged."""
    path, tab, rest = name.partition("\t")
    if path.startswith("a/"):
        path = "b/" + path[2:]
    elif path.startswith("b/"):
        path = "a/" + path[2:]
    return path + tab + rest


def _header(line: str) -> str:
    """One header line of a file's diff, reversed."""
    body = line.rstrip("\n")
    nl = line[len(body) :]
    if body.startswith("diff --git "):
        m = re.fullmatch(r"diff --git (a/.+) (b/.+)", body)
        if m:
            return f"diff --git {_other_side(m[2])} {_other_side(m[1])}{nl}"
    if body.startswith("index "):
        m = re.fullmatch(r"index ([0-9a-f]+)\.\.([0-9a-f]+)(.*)", body)
        if m:
            return f"index {m[2]}..{m[1]}{m[3]}{nl}"
    for left, right in _SWAPS:
        if body.startswith(left):
            return right + body[len(left) :] + nl
        if body.startswith(right):
            return left + body[len(right) :] + nl
    return line


def reverse_patch(patch: str) -> str:
    """The unified diff that undoes `patch` (git's extended headers included). Hunk bodies
    are read by their line counts, so a changed line that starts with "--" is never taken
    for a file header."""
    out: list[str] = []
    lines = re.findall(r"[^\n]*\n|[^\n]+$", patch)  # "\n" only: str.splitlines also splits
    # at form feeds and other separators a source line may hold, which would miscount hunks
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _HUNK.match(line)
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            out += [f"--- {_other_side(new)}", f"+++ {_other_side(old)}"]
            i += 2
            continue
        if m:
            left, right = int(m[2] or 1), int(m[4] or 1)
            rest = f",{m[4]}" if m[4] is not None else ""
            back = f",{m[2]}" if m[2] is not None else ""
            out.append(f"@@ -{m[3]}{rest} +{m[1]}{back} @@{m[5]}")
            i += 1
            while i < len(lines) and (left > 0 or right > 0 or lines[i].startswith("\\")):
                body = lines[i]
                tag = body[:1]
                if tag == "-":
                    out.append("+" + body[1:])
                    left -= 1
                elif tag == "+":
                    out.append("-" + body[1:])
                    right -= 1
                else:  # context (or "\ No newline at end of file", which stays with its line)
                    out.append(body)
                    if tag != "\\":
                        left, right = left - 1, right - 1
                i += 1
            continue
        out.append(_header(line))
        i += 1
    return "".join(out)
