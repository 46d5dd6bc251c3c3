# The control shell: bwrap's command, run as `sh -c SCRIPT`. It evaluates each line the host
# writes to its stdin and replies on fd 9 only, its original stdout (the protocol is described
# in minisandbox/sandbox/channel.py). Nothing else it runs may write to the host's end.
exec 9>&1 1>/dev/null
echo R >&9
while IFS= read -r l; do eval "$l"; done
