# read_file's reader: `sh -c SCRIPT sh PATH LIMIT`, after fail.sh. Writes at most LIMIT bytes of
# PATH, if PATH is a regular file once symlinks are resolved (inside the sandbox). Exit 3: a
# directory; 4: another kind of file (its kind on stderr); fail.sh's statuses: PATH cannot be
# looked up or opened.
# One stat (following links, without opening: a FIFO would block) says what it is; only a
# regular file is read, and by `head -c`, which stops at LIMIT even if the file grows or is
# swapped for something endless after the stat.
kind=$(stat -L -c %F -- "$1" 2>&1) || fail "$kind"
case $kind in
    "regular file"|"regular empty file") ;;
    directory) exit 3 ;;
    *) printf '%s\n' "$kind" >&2; exit 4 ;;
esac
# Opened once before reading, so that a refusal (permission denied) is told apart from a
# failure while reading.
err=$( { : <"$1"; } 2>&1 ) || fail "$err"
exec head -c "$2" -- "$1"
