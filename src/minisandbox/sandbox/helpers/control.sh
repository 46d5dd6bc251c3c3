# The control shell: bwrap's command, run as `sh -c SCRIPT`. It evaluates each line the host
# writes to its stdin and replies on fd 9 only, its original stdout (the protocol is described
# in minisandbox/sandbox/channel.py). Nothing else it runs may write to the host's end.
# N holds a newline: the host spells one as "$N" inside its one-line commands.
exec 9>&1 1>/dev/null
N='
'
echo R >&9
while IFS= read -r l; do eval "$l"; done
