# The control shell: bwrap's command, run as `bash -p -c SCRIPT control-sh REQUESTS REPLIES`.
# It evaluates each line the host writes to the FIFO REQUESTS and replies on fd 9 only, the FIFO
# REPLIES (the protocol is described in minisandbox/sandbox/channel.py). Nothing else it runs may
# write to the host's end. The host spells a newline $'\n' in its one-line commands. TMOUT and the
# loop's variable are the environment's to keep: empty for the read, an unlikely name.
exec 9>"$2" <"$1" >/dev/null
echo R >&9
while IFS= TMOUT= read -r __msb_line; do eval "$__msb_line"; done
