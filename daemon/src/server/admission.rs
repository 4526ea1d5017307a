//! Who may connect and how many: uid and group checks against `[server]`
//! (supplementary groups read with the pid-reuse check of
//! [`stoker_data::fsaccess::Peer::groups`]), connection counts against
//! `[limits] max_connections` and `max_connections_per_uid`, and the
//! throttle that keeps a refused peer from flooding the log.

use std::sync::Arc;
use std::time::Instant;

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
        if admitted.0 >= limits.max_connections {
            return Err(Full::Daemon { open: admitted.0 });
        }
        if !privileged && of_uid >= limits.max_connections_per_uid {
            return Err(Full::Uid { uid, open: of_uid });
        }
        admitted.0 += 1;
        *admitted.1.entry(uid).or_default() += 1;
        Ok(Admission { daemon: self.clone(), uid })
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
