//! Who may connect and how many: uid and group checks against `[server]`
//! (supplementary groups read with the pid-reuse check of
//! [`stoker_data::fsaccess::Peer::groups`]), connection counts against
//! `[limits] max_connections` and `max_connections_per_uid` (a full daemon
//! or uid makes room by closing the longest-idle connection that holds no
//! stream), and the throttle that keeps a refused peer from flooding the log.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoker_data::fsaccess::Peer;

use super::*;

impl Daemon {
    /// Whether the peer may use the daemon: root, the daemon's own uid,
    /// `allowed_uids`, or a member (primary or supplementary) of `allowed_gids`.
    pub(super) fn allows(&self, uid: u32, gid: u32, pid: u32) -> bool {
        let settings = self.settings();
        if uid == 0 || uid == self.own_uid || settings.allowed_uids.contains(&uid) {
            return true;
        }
        if settings.allowed_gids.is_empty() {
            return false;
        }
        let peer = Peer { uid, gid, pid };
        peer.groups().iter().any(|g| settings.allowed_gids.contains(g))
    }

    /// Counts a new connection against `[limits] max_connections` and
    /// `max_connections_per_uid`; refused when either is reached.
    pub(super) fn admit(self: &Arc<Self>, uid: u32) -> Result<Admission, Full> {
        let limits = &self.settings().limits;
        let mut admitted = lock(&self.admitted);
        let privileged = uid == 0 || uid == self.own_uid;
        let of_uid = admitted.1.get(&uid).copied().unwrap_or(0);
        let idle_after = self.settings().frame_timeout;
        // Full: the place of an idle connection is worth more to a new one
        // (a closed one's count goes when its task ends, just after).
        if admitted.0 >= limits.max_connections && !self.close_idle(None, &admitted.1, idle_after) {
            return Err(Full::Daemon { open: admitted.0 });
        }
        if !privileged
            && of_uid >= limits.max_connections_per_uid
            && !self.close_idle(Some(uid), &admitted.1, idle_after)
        {
            return Err(Full::Uid { uid, open: of_uid });
        }
        admitted.0 += 1;
        *admitted.1.entry(uid).or_default() += 1;
        Ok(Admission { daemon: self.clone(), uid })
    }
}

impl Daemon {
    /// Tells the connection that has been idle longest (no stream open, no
    /// request for `idle_after` or more) to close: one of `uid`'s, or for
    /// the daemon one of the uid holding the most connections. False if none
    /// is idle.
    fn close_idle(&self, uid: Option<u32>, counts: &HashMap<u32, usize>, idle_after: Duration) -> bool {
        let mut connected = lock(&self.connected);
        let victim = connected
            .iter_mut()
            .filter(|(_, p)| !p.kicked && !p.busy && p.streams == 0 && p.active.elapsed() >= idle_after)
            .filter(|(_, p)| uid.is_none_or(|u| p.uid == u))
            .max_by_key(|(_, p)| (counts.get(&p.uid).copied().unwrap_or(0), p.active.elapsed()));
        let Some((_, presence)) = victim else { return false };
        presence.kicked = true;
        presence.kick.notify_one();
        true
    }
}

/// An admitted connection, as admission sees it.
#[derive(Debug)]
pub(super) struct Presence {
    /// When it connected.
    pub(super) since: Instant,
    uid: u32,
    /// When its last request was answered (or it connected).
    active: Instant,
    /// Streams it holds open: a connection with one is never idle.
    streams: usize,
    /// Wakes the connection's task to close it.
    kick: Arc<tokio::sync::Notify>,
    /// A request is being answered.
    busy: bool,
    /// Already told to close.
    kicked: bool,
}

impl Presence {
    pub(super) fn new(uid: u32, kick: Arc<tokio::sync::Notify>) -> Presence {
        let now = Instant::now();
        Presence { since: now, uid, active: now, streams: 0, kick, busy: false, kicked: false }
    }

    /// A request is being answered: not idle, whatever came before.
    pub(super) fn busy(&mut self) {
        self.busy = true;
    }

    /// A request was answered; the connection holds `streams` streams.
    pub(super) fn active(&mut self, streams: usize) {
        self.active = Instant::now();
        self.streams = streams;
        self.busy = false;
        self.kicked = false;
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Full {
    /// `[limits] max_connections` reached.
    #[error("the daemon already serves {open} connections ([limits] max_connections); try again later")]
    Daemon {
        /// Connections open.
        open: usize,
    },
    /// `[limits] max_connections_per_uid` reached.
    #[error(
        "uid {uid} already holds {open} connections ([limits] max_connections_per_uid); close some Loaders (each \
         holds one connection)"
    )]
    Uid {
        /// The uid.
        uid: u32,
        /// Its connections open.
        open: usize,
    },
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub(super) struct Admission {
    daemon: Arc<Daemon>,
    uid: u32,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut admitted = lock(&self.daemon.admitted);
        admitted.0 = admitted.0.saturating_sub(1);
        if let Some(n) = admitted.1.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                admitted.1.remove(&self.uid);
            }
        }
    }
}

/// Lets a repeated warning through at most once per [`WARN_EVERY`], counting the rest.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    /// `Some(n)` when a warning may be logged now (`n` were suppressed since the last one).
    pub(super) fn allow(&mut self) -> Option<u64> {
        if self.last.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.suppressed))
    }
}
