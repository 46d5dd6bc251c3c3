#!/bin/bash
# The environment as a self-contained install, as the official images' conda environment is,
# rather than a venv of the host's interpreter. A venv is found from the path its python was
# started by (pyvenv.cfg beside it), so a link to the venv's python from another directory
# (tox-current-env's `.tox/py39/bin/python`, nox, a chain of links) ran the bare interpreter
# without the environment's packages. Python finds an install's prefix from its binary's real
# location instead: with a copy of the binary in bin/ and the standard library's entries
# linked into lib/pythonX.Y/ (beside the real site-packages), sys.prefix is /opt/venv however
# its python is reached, and `python -m venv` inside the sandbox makes venvs of it. No
# pyvenv.cfg: it would send the prefix search back to the host interpreter's directory.
# The interpreter's shared libraries (libpython) are linked into lib/, where a binary or an
# extension module that finds them relative to itself ($ORIGIN/../lib) looks; its headers
# into include/, where building an extension looks for them (sys.base_prefix/include).
# A distribution-patched interpreter that looks elsewhere for its packages (Debian's
# dist-packages) fails the check: the environment then stays a venv, with a warning in the log.
# Runs inside the build sandbox: $1 the venv, $2 the interpreter's prefix (mounted read-only).
set -euo pipefail
shopt -s nullglob dotglob
venv=$1 prefix=$2
cd "$venv/lib"
libs=(python*)
[ ${#libs[@]} = 1 ] || { echo "expected one lib/python* in $venv, found: ${libs[*]}"; exit 1; }
lib=${libs[0]}
stdlib=$prefix/lib/$lib
[ -f "$stdlib/os.py" ] || { echo "no standard library at $stdlib"; exit 1; }
real=$(readlink -f "$venv/bin/python")
for name in python python3 "$lib"; do
  rm -f "$venv/bin/$name"
  cp "$real" "$venv/bin/$name"
done
for entry in "$stdlib"/*; do
  case ${entry##*/} in
    site-packages|dist-packages|EXTERNALLY-MANAGED) ;;
    *) ln -s "$entry" "$venv/lib/$lib/${entry##*/}" ;;
  esac
done
for so in "$prefix"/lib/lib*.so*; do
  if [ -f "$so" ]; then ln -s "$so" "$venv/lib/${so##*/}"; fi
done
# The headers: a directory of links, not a link, so that packages installing headers of their
# own there (pybind11-global: include/pythonX.Y/pybind11) can; the interpreter's are read-only.
for inc in "$prefix"/include/python*; do
  mkdir -p "$venv/include/${inc##*/}"
  for h in "$inc"/*; do ln -s "$h" "$venv/include/${inc##*/}/${h##*/}"; done
done
mv "$venv/pyvenv.cfg" /tmp/pyvenv.cfg
# The proof: run directly and through a chain of two links from elsewhere, the environment's
# python is its own prefix and imports its packages (pip is seeded).
mkdir -p /tmp/standalone/a /tmp/standalone/b
ln -sfn "$venv/bin/python" /tmp/standalone/a/python
ln -sfn /tmp/standalone/a/python /tmp/standalone/b/python
check='import sys, pip; assert sys.prefix == sys.argv[1], (sys.executable, sys.prefix)'
if "$venv/bin/python" -c "$check" "$venv" && /tmp/standalone/b/python -c "$check" "$venv"; then
  echo "$venv: a self-contained $lib install"
  exit 0
fi
echo "WARNING: $real does not work as a self-contained install; $venv stays a venv" \
  "(a link to its python from another directory runs without its packages)"
find "$venv/lib/$lib" "$venv/lib" -maxdepth 1 -type l -delete
find "$venv/include" -mindepth 2 -maxdepth 2 -type l -delete 2>/dev/null || true
find "$venv/include" -mindepth 1 -maxdepth 1 -type d -empty -delete 2>/dev/null || true
rmdir "$venv/include" 2>/dev/null || true
ln -sfn "$real" "$venv/bin/python"
ln -sfn python "$venv/bin/python3"
ln -sfn python "$venv/bin/$lib"
mv /tmp/pyvenv.cfg "$venv/pyvenv.cfg"
"$venv/bin/python" -c "$check" "$venv"
