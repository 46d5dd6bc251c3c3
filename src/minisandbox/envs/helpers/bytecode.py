"""Compile an environment's site-packages to bytecode, the same bytes for the same files in every
environment of one Python version, so that the layer store keeps each package's .pyc once.

Run inside the build sandbox by the venv's own python (3.6 and later), with PYTHONHASHSEED=0
(frozenset constants are marshalled in hash order) and -S (no .pth file imports anything into
the process the compiling forks start from):

    python -S bytecode.py SITE_PACKAGES...

A .pyc holds its source's mtime: every file gets the same one (2000-01-01) first. And marshal
marks an object as shared by its reference count, which depends on what the compiling process
compiled before: each top-level entry is compiled in a fork of this same, fresh process, so its
bytes do not depend on which other packages the environment holds.
"""

import compileall
import os
import sys

EPOCH = 946684800  # 2000-01-01, as the checkouts' files (envs/githistory.py)


def settle_mtimes(site, pyc_only=False):
    for root, dirs, files in os.walk(site):
        for name in dirs + files:
            if pyc_only and not name.endswith(".pyc"):
                continue
            try:
                os.utime(os.path.join(root, name), (EPOCH, EPOCH), follow_symlinks=False)
            except OSError:  # (one file that cannot be touched does not stop the rest)
                pass


def compile_entry(path):
    if os.path.isdir(path) and not os.path.islink(path):
        ok = compileall.compile_dir(path, maxlevels=64, quiet=1)
    elif path.endswith(".py"):
        ok = compileall.compile_file(path, quiet=1)
    else:
        return True
    # The .pyc files too: the node's file pool shares identical files only at equal mtimes
    # (their validity rests on the source mtime inside them, not on their own).
    settle_mtimes(path if os.path.isdir(path) else os.path.dirname(path), pyc_only=True)
    return ok


def main(sites):
    entries = []
    for site in sites:
        settle_mtimes(site)
        entries += [os.path.join(site, n) for n in sorted(os.listdir(site)) if n != "__pycache__"]
    running = set()
    failed = 0
    width = max(1, os.cpu_count() or 1)
    for path in entries:
        if len(running) >= width:
            pid, status = os.wait()
            running.discard(pid)
            failed += status != 0
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                ok = compile_entry(path)
            finally:
                sys.stdout.flush()
            os._exit(0 if ok else 1)
        running.add(pid)
    while running:
        pid, status = os.wait()
        running.discard(pid)
        failed += status != 0
    # A file that does not compile (a Python 2 test fixture in a package) is left as it is, as
    # `python -m compileall` leaves it; its import fails the same with or without bytecode.
    total = len(entries)
    sys.stderr.write(f"bytecode: {failed} of {total} entries had a file that did not compile\n")


if __name__ == "__main__":
    main(sys.argv[1:])
