#!/bin/bash
# Slurm Prolog: makes sure the node-wide stoker daemon runs before a job starts.
#
#   slurm.conf:  Prolog=/etc/slurm/prolog.d/*     PrologFlags=Alloc
#   install -m 0755 config/slurm/prolog.sh /etc/slurm/prolog.d/50-stoker.sh
#
# slurmd runs it as root on every node of a job (PrologFlags=Alloc: at allocation, so
# batch scripts can use the daemon too). Jobs find the daemon at the default socket
# /run/stoker/stoker.sock without configuration.
#
# It always exits 0: a prolog that fails drains the node and requeues the job, which is
# too harsh for a data daemon; a job that cannot reach it gets a clear error from its
# Loader instead, and this script says why in syslog (tag "stoker-prolog").
set -uo pipefail

STOKER=${STOKER:-/usr/local/bin/stoker}
STOKER_CONFIG=${STOKER_CONFIG:-/etc/stoker/stoker.toml}
SOCKET=${STOKER_SOCKET:-/run/stoker/stoker.sock}
# Used only without the systemd unit:
STOKER_USER=${STOKER_USER:-stoker}
STOKER_LOG=${STOKER_LOG_FILE:-/var/log/stoker.log}
WAIT_S=${STOKER_WAIT_S:-30}

say() { logger -t stoker-prolog -- "$*" 2>/dev/null || echo "stoker-prolog: $*" >&2; }

# Already answering: nothing to do (the common case, and cheap).
if "$STOKER" status --socket "$SOCKET" >/dev/null 2>&1; then
    exit 0
fi

if command -v systemctl >/dev/null 2>&1 && systemctl cat stoker.service >/dev/null 2>&1; then
    # Preferred: the unit (config/systemd/stoker.service) owns restarts, limits, logs.
    if ! systemctl start stoker.service; then
        say "systemctl start stoker.service failed; see journalctl -u stoker"
        exit 0
    fi
else
    # No unit installed: start it directly, detached from slurmd (own session, stdio
    # to a log file), as the unprivileged user. It stays until the epilog or an admin
    # stops it. /run/stoker comes from config/systemd/stoker.tmpfiles or is made here.
    install -d -m 0755 -o "$STOKER_USER" -g "$STOKER_USER" "$(dirname "$SOCKET")" || {
        say "cannot create $(dirname "$SOCKET") for user $STOKER_USER"
        exit 0
    }
    if [ "$(id -u)" -eq 0 ] && [ "$STOKER_USER" != root ]; then
        as_user=(setpriv --reuid="$STOKER_USER" --regid="$STOKER_USER" --init-groups --)
    else
        as_user=()
    fi
    setsid "${as_user[@]}" "$STOKER" serve --config "$STOKER_CONFIG" --socket "$SOCKET" \
        </dev/null >>"$STOKER_LOG" 2>&1 &
fi

if ! "$STOKER" status --wait "$WAIT_S" --socket "$SOCKET" >/dev/null 2>&1; then
    say "the stoker daemon did not answer on $SOCKET within $WAIT_S s; see journalctl -u stoker or $STOKER_LOG"
fi
exit 0
