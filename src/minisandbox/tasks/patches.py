"""Reading unified diffs: which files one changes; reversing one (a SWE-smith task's gold patch
is its bug patch, reversed)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

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


class PatchedFile(BaseModel):
    """One file a unified diff changes, as its headers name it (git's extended ones included)."""

    path: str
    """The path the change writes: the new name (the old one of a deleted file)."""
    old_path: str | None = None
    """A rename's or copy's source (a rename also removes it)."""
    change: Literal["create", "modify", "delete", "rename", "copy"] = "modify"
    mode: str | None = None
    """The new mode when the diff sets one ("120000": a symbolic link)."""


_GIT_HEADER = re.compile(r"^diff --git (\"(?:[^\"\\]|\\.)*\"|\S+) (\"(?:[^\"\\]|\\.)*\"|\S+)$")
_FILE_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def unquote_path(name: str) -> str:
    """A path as git writes it in a header: C-quoted ("a/x\\ty") when it holds a special
    character, with octal escapes for the bytes of non-ASCII ones; a tab ends an unquoted one."""
    if not (len(name) >= 2 and name[0] == name[-1] == '"'):
        return name.split("\t")[0]
    out = bytearray()
    body, i = name[1:-1], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "01234567" and re.fullmatch(r"[0-7]{3}", body[i + 1 : i + 4]):
                out.append(int(body[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            out.append(_ESCAPES.get(nxt, ord(nxt)) if ord(nxt) < 128 else 92)
            i += 2
            continue
        out += c.encode()
        i += 1
    return out.decode(errors="surrogateescape")


def _side(name: str, prefix: str) -> str | None:
    """A header's path without its first component, as `git apply -p1` strips it (`a/`, `b/`,
    or a mnemonic prefix: `i/`, `w/`, `c/`, `o/`)."""
    path = unquote_path(name.strip())
    if path == "/dev/null":
        return None
    head, sep, rest = path.partition("/")
    return rest if sep and len(head) == 1 and rest else path


def _git_names(line: str) -> tuple[str | None, str | None] | None:
    """The two names of a `diff --git` line; unquoted names with spaces are split where the
    two halves name the same path, as git does."""
    if m := _GIT_HEADER.match(line):
        return _side(m[1], "a/"), _side(m[2], "b/")
    rest = line[len("diff --git ") :]
    for i in range(len(rest)):
        if rest[i] == " " and len(rest[:i]) > 2 and rest[:i][1] == "/":
            old, new = rest[:i], rest[i + 1 :]
            if len(new) > 2 and new[1] == "/" and old[2:] == new[2:]:
                return _side(old, "a/"), _side(new, "b/")
    return None


# long: one pass over the lines, each kind of header line a branch
def patched_files(patch: str) -> list[PatchedFile]:
    """Every file `patch` changes, in order, from its headers: `diff --git` names, `---` /
    `+++`, git's rename / copy / new / deleted / mode lines. Hunk bodies are skipped by their
    line counts, so a changed line that starts with "--- " is never taken for a header."""
    out: list[PatchedFile] = []
    cur: dict[str, str | None] = {}

    def flush() -> None:
        if cur.get("path") or cur.get("old"):
            change = cur.get("change") or "modify"
            path = cur.get("path") or cur.get("old") or ""
            old = cur.get("from") if change in ("rename", "copy") else None
            out.append(PatchedFile(path=path, old_path=old, change=change, mode=cur.get("mode")))
        cur.clear()

    left = right = 0
    for line in patch.split("\n"):  # not splitlines: a source line may hold a form feed
        if left > 0 or right > 0:
            tag = line[:1]
            if tag in (" ", ""):
                left, right = left - 1, right - 1
            elif tag == "-":
                left -= 1
            elif tag == "+":
                right -= 1
            continue
        if line.startswith("diff --git "):
            flush()
            if names := _git_names(line):
                cur["old"], cur["path"] = names
        elif m := _FILE_HUNK.match(line):
            left = int(m[1]) if m[1] is not None else 1
            right = int(m[2]) if m[2] is not None else 1
        elif line.startswith("--- "):
            if "path" in cur and "minus" in cur:  # a second plain diff without a git header
                flush()
            cur["minus"] = "1"
            cur["old"] = _side(line[4:], "a/") or cur.get("old")
            if _side(line[4:], "a/") is None:
                cur["change"] = "create"
        elif line.startswith("+++ "):
            new = _side(line[4:], "b/")
            if new is None:
                cur["change"] = "delete"
                cur["path"] = cur.get("old")
            else:
                cur["path"] = new
        elif line.startswith(("rename from ", "copy from ")):
            cur["from"] = unquote_path(line.split(" from ", 1)[1])
            cur["change"] = line.split(" ", 1)[0]
        elif line.startswith(("rename to ", "copy to ")):
            cur["path"] = unquote_path(line.split(" to ", 1)[1])
        elif line.startswith("new file mode "):
            cur["change"], cur["mode"] = "create", line.rsplit(" ", 1)[1]
        elif line.startswith("deleted file mode "):
            cur["change"] = "delete"
            cur["path"] = cur.get("old") or cur.get("path")
        elif line.startswith("new mode "):
            cur["mode"] = line.rsplit(" ", 1)[1]
    flush()
    return out
