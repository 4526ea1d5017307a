//! The daemon's dealings with systemd: readiness and status notifications,
//! watchdog pings, and the caches handed to its fd store at a clean stop and
//! taken back at the next start.

use sd_notify::NotifyState;

/// Loads the caches a previous daemon of this unit left in systemd's fd
/// store, then asks systemd to drop its copy (the memory is freed once
/// loaded). Anything else passed in is closed.
pub(super) fn restore_caches(caches: &stoker_data::cache::Caches, inherited: Vec<(std::os::fd::OwnedFd, String)>) {
    use stoker_data::cache::snapshot::FD_NAME;
    for (fd, name) in inherited {
        if name != FD_NAME {
            tracing::warn!(name = %name, "ignoring a file descriptor passed by systemd");
            continue;
        }
        let started = std::time::Instant::now();
        match caches.import(fd) {
            Ok(c) => tracing::info!(
                entries = c.entries,
                bytes = c.bytes,
                stale = c.stale,
                seconds = started.elapsed().as_secs_f64(),
                "caches restored from systemd's fd store (stale: entries of files changed since, not restored)"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot restore the caches from systemd's fd store: starting cold"),
        }
        notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(FD_NAME)]);
    }
}

/// At a clean stop under systemd with an fd store (`FileDescriptorStoreMax=`
/// ≥ 1, which sets `$FDSTORE`), hands the caches to systemd in a sealed
/// memfd so the next daemon of the unit (a restart or upgrade of the same
/// version) starts warm.
pub(super) fn store_caches(caches: &stoker_data::cache::Caches) {
    use stoker_data::cache::snapshot::FD_NAME;
    let wanted = std::env::var("FDSTORE").ok().and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n > 0);
    if !wanted || std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    let started = std::time::Instant::now();
    match caches.export() {
        Ok((fd, c)) if c.entries > 0 => {
            use std::os::fd::AsFd;
            let sent =
                sd_notify::notify_with_fds(false, &[NotifyState::FdStore, NotifyState::FdName(FD_NAME)], &[fd.as_fd()]);
            match sent {
                Ok(()) => tracing::info!(
                    entries = c.entries,
                    bytes = c.bytes,
                    seconds = started.elapsed().as_secs_f64(),
                    "caches handed to systemd's fd store for the next start"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot hand the caches to systemd's fd store"),
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot write the caches for systemd's fd store"),
    }
}

/// Tells systemd (when `$NOTIFY_SOCKET` is set) how the daemon is doing.
pub(super) fn notify(state: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Pings systemd's watchdog at half its interval while the control loop runs
/// (the pings come from a task on the same runtime that serves clients).
pub(super) async fn watchdog() {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let mut tick = tokio::time::interval(std::time::Duration::from_micros(usec / 2));
    loop {
        tick.tick().await;
        notify(&[NotifyState::Watchdog]);
    }
}
