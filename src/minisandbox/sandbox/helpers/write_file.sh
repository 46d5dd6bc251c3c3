# write_file's writer: `sh -c SCRIPT sh PATH [MODE] <DATA`, after fail.sh. Creates PATH's
# parent directories, then creates or replaces PATH with DATA, then sets its octal MODE if one
# is given (the host refuses set-id bits).
err=$(mkdir -p -- "$(dirname -- "$1")" 2>&1) || fail "$err"
err=$(cat 2>&1 >"$1") || fail "$err"
if [ -n "${2:-}" ]; then
    err=$(chmod "$2" -- "$1" 2>&1) || fail "$err"
fi
