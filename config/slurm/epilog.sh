#!/bin/bash
# Slurm Epilog for the node-wide stoker daemon started by prolog.sh.
#
#   slurm.conf:  Epilog=/etc/slurm/epilog.d/*
#   install -m 0755 config/slurm/epilog.sh /etc/slurm/epilog.d/50-stoker.sh
#
# The choice: by default the daemon is LEFT RUNNING. Idle, it costs a few MB and no CPU,
# its chunk cache stays warm for the next job on the same data, and no job can lose its
# daemon to another job's epilog. Set STOKER_EPILOG_STOP=idle (e.g. in the script, or
# in slurmd's environment) to stop it when no stream is open any more and no client but
# this check is connected; that needs python3 to read `stoker status --json`.
#
# Like the prolog it always exits 0 (a failing epilog drains the node).
set -uo pipefail

STOKER=${STOKER:-/usr/local/bin/stoker}
SOCKET=${STOKER_SOCKET:-/run/stoker/stoker.sock}
MODE=${STOKER_EPILOG_STOP:-never}

say() { logger -t stoker-epilog -- "$*" 2>/dev/null || echo "stoker-epilog: $*" >&2; }

[ "$MODE" = idle ] || exit 0

if ! command -v python3 >/dev/null 2>&1; then
    say "STOKER_EPILOG_STOP=idle needs python3 to read the daemon's status; leaving it running"
    exit 0
fi

# The query prints its own pid first (the shell execs into it), so that its own
# connection is not mistaken for a job's.
if ! status=$(sh -c 'echo $$; exec "$0" status --json --socket "$1"' "$STOKER" "$SOCKET" 2>/dev/null); then
    exit 0 # not running: nothing to stop
fi
# Prints the daemon's pid when it is idle, nothing otherwise.
idle_pid=$(printf '%s\n' "$status" | python3 -c '
import json, sys
me = int(sys.stdin.readline())
report = json.load(sys.stdin)
others = [c for c in report["clients"] if c["pid"] != me]
if not others and not report["streams"]:
    print(report["pid"])
') || { say "cannot read the daemon's status; leaving it running"; exit 0; }

[ -n "$idle_pid" ] || exit 0
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet stoker.service; then
    systemctl stop stoker.service || say "systemctl stop stoker.service failed"
else
    # SIGTERM drains: a client that connects in between hears ShuttingDown.
    kill -TERM "$idle_pid" 2>/dev/null || say "cannot signal the daemon (pid $idle_pid)"
fi
exit 0
