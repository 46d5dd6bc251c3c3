# The control shell: bwrap's command, run as `bash -p -c SCRIPT control-sh REQUESTS REPLIES`.
# It evaluates each line the host writes to the FIFO REQUESTS and replies on fd 9 only, the FIFO
# REPLIES (the protocol is described in minisandbox/sandbox/channel.py). Nothing else it runs may
# write to the host's end. N holds a newline: the host spells one as "$N" in its one-line commands.
exec 9>"$2" <"$1" >/dev/null
N='
'
echo R >&9
while IFS= read -r l; do eval "$l"; done
