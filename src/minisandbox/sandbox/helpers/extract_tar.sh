# upload's unpacker: `sh -c SCRIPT sh DIR ARCHIVE`, after fail.sh. Creates DIR, then extracts
# ARCHIVE (a file in the channel directory) into it, owned by the sandbox's root.
err=$(mkdir -p -- "$1" 2>&1) || fail "$err"
err=$(tar -x --no-same-owner -C "$1" -f "$2" 2>&1) || fail "$err"
