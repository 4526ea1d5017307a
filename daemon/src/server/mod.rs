//! The control server: accepts clients on the Unix socket, checks their uid
//! with `SO_PEERCRED`, and serves each connection's requests on tokio. Opening
//! datasets runs on the blocking pool; reading samples runs on the worker pool
//! (see `stream`); this module only moves messages and fds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stoker_proto::{ClientStatus, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::Settings;
use crate::dataset::Datasets;
use crate::error::WireError;
use crate::stream::{Budget, Stream};
use stoker_data::cache::Caches;

mod admission;
use admission::Throttle;
use frames::{read_frames, send_part};
mod connection;
mod frames;
mod reports;

use connection::serve_connection;

/// How the daemon is asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// SIGTERM: stop accepting, tell every client `ShuttingDown`, give
    /// connections `[server] shutdown_grace_s` to close, then exit.
    Drain,
    /// SIGINT: the same without waiting for connections.
    Quick,
}

/// Requests read ahead of the one being handled, per connection (no request
/// waits: batches travel through the control page, so this only smooths bursts).
const MAX_BACKLOG: usize = 64;
/// At most one repeated warning of a kind per this interval per connection.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// State shared by all connections.
#[derive(Debug)]
pub struct Daemon {
    settings: RwLock<Arc<Settings>>,
    started: Instant,
    pool: Arc<rayon::ThreadPool>,
    datasets: Datasets,
    caches: Arc<Caches>,
    clients: Mutex<BTreeMap<u64, ClientStatus>>,
    streams: Mutex<BTreeMap<u64, Arc<Stream>>>,
    /// Every admitted connection: when it came, and whether it is idle.
    connected: Mutex<HashMap<u64, admission::Presence>>,
    /// Open connections: in total, and per uid.
    admitted: Mutex<(usize, HashMap<u32, usize>)>,
    /// Refused connections are logged at most once per [`WARN_EVERY`]: a
    /// refused peer reconnecting in a loop must not flood the log.
    refusals: Mutex<Throttle>,
    next_id: AtomicU64,
    /// Refused connections being told why (each waits up to `frame_timeout_s`
    /// for the peer's first message), in total and per uid; beyond
    /// [`MAX_REFUSING`] (or [`MAX_REFUSING_PER_UID`] of one uid) they are closed at once.
    refusing: Mutex<(usize, HashMap<u32, usize>)>,
    own_uid: u32,
    metrics: crate::metrics::Metrics,
    /// Shared memory all streams may hold: `[limits] max_memory_bytes` less the caches.
    memory: Arc<Budget>,
    /// Each uid's share of `memory` (`[limits] max_memory_bytes_per_uid`),
    /// while any of its streams holds some.
    uid_memory: Mutex<HashMap<u32, std::sync::Weak<Budget>>>,
    /// The worker pool's fair share between users.
    fair: Arc<crate::stream::FairGate>,
    /// Worker busy time sampled once a second, for utilisation over a window.
    load: Arc<Mutex<VecDeque<(Instant, Duration)>>>,
}

/// Span over which `stoker status` reports worker utilisation.
const LOAD_WINDOW: Duration = Duration::from_secs(10);

/// Samples [`crate::stream::counters::worker_busy`] once a second into `load` until the daemon is gone.
fn sample_load(load: std::sync::Weak<Mutex<VecDeque<(Instant, Duration)>>>) {
    while let Some(load) = load.upgrade() {
        {
            let mut samples = lock(&load);
            let now = Instant::now();
            samples.push_back((now, crate::stream::counters::worker_busy()));
            while samples.front().is_some_and(|(t, _)| now.duration_since(*t) > LOAD_WINDOW) {
                samples.pop_front();
            }
        }
        drop(load);
        std::thread::sleep(Duration::from_secs(1));
    }
}

impl Daemon {
    /// Creates the daemon state and its worker pool.
    pub fn new(settings: Settings) -> anyhow::Result<Arc<Daemon>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(settings.worker_threads)
            .thread_name(|i| format!("stoker-worker-{i}"))
            .build()?;
        let caches = Caches::new(settings.chunk_cache_bytes, settings.sample_cache_bytes, settings.cache_policy);
        // Decode buffers of all workers together: one chunk of the largest
        // size allowed, with its stored bytes, plus room for small ones; at
        // most a quarter of the memory budget (a job's cgroup), 16 MiB at least.
        let decoding = settings.limits.max_sample_bytes.saturating_mul(2).saturating_add(64 << 20);
        caches.bound_decoding(decoding.min((settings.limits.max_memory_bytes / 4).max(16 << 20)));
        let datasets = Datasets::new(settings.clone(), caches.clone());
        let load = Arc::new(Mutex::new(VecDeque::new()));
        let weak = Arc::downgrade(&load);
        if let Err(e) = std::thread::Builder::new().name("stoker-load".into()).spawn(move || sample_load(weak)) {
            tracing::warn!(error = %e, "cannot start the load sampler: `stoker status` shows utilisation since start");
        }
        let memory = Budget::new(settings.limits.max_memory_bytes.saturating_sub(caches.capacity()));
        let fair = crate::stream::FairGate::new(pool.current_num_threads());
        tracing::info!(
            budget = settings.limits.max_memory_bytes,
            source = %settings.memory_source,
            chunk_cache = settings.chunk_cache_bytes,
            sample_cache = settings.sample_cache_bytes,
            "memory budget"
        );
        let (limit, idle_release) = (settings.memory_limit.clone(), settings.cache_idle_release);
        let daemon = Arc::new(Daemon {
            uid_memory: Mutex::new(HashMap::new()),
            fair,
            settings: RwLock::new(Arc::new(settings)),
            started: Instant::now(),
            pool: Arc::new(pool),
            datasets,
            caches,
            clients: Mutex::new(BTreeMap::new()),
            streams: Mutex::new(BTreeMap::new()),
            connected: Mutex::new(HashMap::new()),
            admitted: Mutex::new((0, HashMap::new())),
            refusals: Mutex::new(Throttle::default()),
            next_id: AtomicU64::new(1),
            refusing: Mutex::new((0, HashMap::new())),
            own_uid: rustix::process::getuid().as_raw(),
            metrics: crate::metrics::Metrics::default(),
            memory,
            load,
        });
        let weak = Arc::downgrade(&daemon);
        let caches = Arc::downgrade(&daemon.caches);
        let open_streams = move || weak.upgrade().map(|d| d.stream_count());
        let watcher = std::thread::Builder::new()
            .name("stoker-memory".into())
            .spawn(move || crate::memory::watch(caches, open_streams, limit, idle_release));
        if let Err(e) = watcher {
            tracing::warn!(error = %e, "cannot start the memory watcher: caches are not shed under memory pressure");
        }
        Ok(daemon)
    }

    /// Streams open now.
    pub fn stream_count(&self) -> usize {
        lock(&self.streams).len()
    }

    /// The node-wide caches.
    pub fn caches(&self) -> &Arc<Caches> {
        &self.caches
    }

    /// The settings in force (replaced as a whole by [`Daemon::reload`]).
    pub fn settings(&self) -> Arc<Settings> {
        self.settings.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies a reloaded config: named datasets and limits take effect for
    /// new streams; open streams keep their sources. The socket path, worker
    /// threads and cache size need a restart. Returns what changed, for the log.
    pub fn reload(&self, new: Settings) -> Vec<String> {
        let old = self.settings();
        let mut changes = Vec::new();
        for (name, ds) in &new.datasets {
            match old.datasets.get(name) {
                None => changes.push(format!("dataset {name} added")),
                Some(prev) if format!("{prev:?}") != format!("{ds:?}") => {
                    changes.push(format!("dataset {name} changed"))
                }
                Some(_) => {}
            }
        }
        changes.extend(
            old.datasets.keys().filter(|n| !new.datasets.contains_key(*n)).map(|n| format!("dataset {n} removed")),
        );
        if format!("{:?}", old.limits) != format!("{:?}", new.limits) {
            changes.push("limits changed".into());
        }
        if old.allowed_uids != new.allowed_uids || old.allowed_gids != new.allowed_gids {
            changes.push("allowed users changed".into());
        }
        if (old.socket_mode, old.socket_gid) != (new.socket_mode, new.socket_gid) && old.socket == new.socket {
            // Allowed users may need another mode (0600 → 0666): set it on the
            // socket this daemon listens on, never through a path another user could swap.
            changes.push(match set_socket_access(&new.socket, new.socket_mode, new.socket_gid) {
                Ok(()) => format!("socket mode set to {:o}", new.socket_mode),
                Err(e) => format!(
                    "the socket's mode or group changed but could not be applied ({e}); restart the daemon for it"
                ),
            });
        }
        if old.allowed_roots != new.allowed_roots {
            changes.push("allowed_roots changed".into());
        }
        for (what, differs) in [
            ("socket", old.socket != new.socket),
            ("worker threads", old.worker_threads != new.worker_threads),
            ("chunk cache size", old.chunk_cache_bytes != new.chunk_cache_bytes),
            ("sample cache size", old.sample_cache_bytes != new.sample_cache_bytes),
            ("cache policy", old.cache_policy != new.cache_policy),
            ("[metrics] listen", old.metrics_listen != new.metrics_listen),
        ] {
            if differs {
                changes.push(format!("{what} changed but needs a restart to take effect"));
            }
        }
        self.datasets.reload(new.clone());
        self.memory.set_limit(new.limits.max_memory_bytes.saturating_sub(self.caches.capacity()));
        *self.settings.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        changes
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// `uid`'s share of the streams' memory: one budget per uid while its
    /// streams hold any, of `[limits] max_memory_bytes_per_uid` (0: half of
    /// the streams' budget); unbounded for root and the daemon's own uid.
    fn uid_budget(&self, uid: u32) -> Arc<Budget> {
        let mut by_uid = lock(&self.uid_memory);
        if let Some(budget) = by_uid.get(&uid).and_then(std::sync::Weak::upgrade) {
            return budget;
        }
        let privileged = uid == 0 || uid == rustix::process::geteuid().as_raw();
        let configured = self.settings().limits.max_memory_bytes_per_uid;
        let limit = match (privileged, configured) {
            (true, _) => u64::MAX,
            (false, 0) => self.memory.limit() / 2,
            (false, bytes) => bytes,
        };
        let budget = Budget::new(limit);
        by_uid.retain(|_, w| w.strong_count() > 0);
        by_uid.insert(uid, Arc::downgrade(&budget));
        budget
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds the daemon's socket at `path`, replacing a stale socket file but
/// refusing to steal one a live daemon listens on, and gives it the
/// configured mode and group.
pub fn bind(path: &Path, settings: &Settings) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    if let Some(why) = stoker_proto::socket_path_problem(path) {
        anyhow::bail!("cannot listen on {}: {why}", path.display());
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another stoker daemon is already listening on {}; stop it or pick another --socket",
                path.display()
            );
        }
        std::fs::remove_file(path).with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    let name = path.file_name().with_context(|| format!("socket path {} names no file", path.display()))?;
    let listener = bind_private(dir, name, settings)
        .with_context(|| format!("cannot listen on {} with mode {:o}", path.display(), settings.socket_mode))?;
    listener.set_nonblocking(true)?;
    Ok(UnixListener::from_std(listener)?)
}

/// Gives the socket at `path` `mode` (and `gid`): through an `O_PATH |
/// O_NOFOLLOW` descriptor checked to be a socket this user owns, so a path
/// swapped for a symlink or another file is refused, not followed.
fn set_socket_access(path: &Path, mode: u32, gid: Option<u32>) -> std::io::Result<()> {
    use rustix::fs::{FileType, Mode, OFlags};
    let fd = rustix::fs::open(path, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?;
    let st = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket || st.st_uid != rustix::process::geteuid().as_raw() {
        return Err(std::io::Error::other("it is not this daemon's socket any more"));
    }
    // The descriptor's magic link reaches the inode held, whatever the path names now.
    let at = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
    if let Some(gid) = gid {
        rustix::fs::chown(at.as_str(), None, Some(rustix::fs::Gid::from_raw(gid)))?;
    }
    rustix::fs::chmod(at.as_str(), Mode::from_raw_mode(mode))?;
    Ok(())
}

/// Binds the socket in a fresh directory only the daemon can enter, sets its
/// group and mode there (through that directory's descriptor: nothing on the
/// way is a path another user controls), and renames it into `dir` as
/// `name`. Setting them by path after `bind` would follow a symlink an
/// attacker put there: in a socket directory a user can write, a root daemon
/// would change the mode and group of a file of the attacker's choosing.
fn bind_private(
    dir: &Path,
    name: &std::ffi::OsStr,
    settings: &Settings,
) -> std::io::Result<std::os::unix::net::UnixListener> {
    use rustix::fs::{AtFlags, Mode, OFlags};
    let parent = rustix::fs::open(dir, OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let private = format!(".stoker-bind-{}-{nonce:x}", std::process::id());
    rustix::fs::mkdirat(&parent, private.as_str(), Mode::RWXU)?;
    let result = (|| {
        let own = rustix::fs::openat(
            &parent,
            private.as_str(),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&own)?;
        if st.st_uid != rustix::process::geteuid().as_raw() || st.st_mode & 0o077 != 0 {
            return Err(std::io::Error::other("the private bind directory was replaced"));
        }
        // Through the directory's descriptor: short, and no path component
        // another user can swap.
        let at = format!("/proc/self/fd/{}/s", std::os::fd::AsRawFd::as_raw_fd(&own));
        let listener = std::os::unix::net::UnixListener::bind(&at)?;
        let placed = (|| {
            if let Some(gid) = settings.socket_gid {
                let gid = Some(rustix::fs::Gid::from_raw(gid));
                rustix::fs::chownat(&own, "s", None, gid, AtFlags::SYMLINK_NOFOLLOW)?;
            }
            rustix::fs::chmodat(&own, "s", Mode::from_raw_mode(settings.socket_mode), AtFlags::empty())?;
            rustix::fs::renameat(&own, "s", &parent, name)
        })();
        if let Err(e) = placed {
            let _ = rustix::fs::unlinkat(&own, "s", AtFlags::empty());
            return Err(e.into());
        }
        Ok(listener)
    })();
    let _ = rustix::fs::unlinkat(&parent, private.as_str(), AtFlags::REMOVEDIR);
    result
}

/// Serves clients on `listener` until `shutdown` resolves, then stops
/// accepting, removes the socket file at `socket`, tells every connection
/// [`stoker_proto::ErrorKind::ShuttingDown`] and (for [`Shutdown::Drain`]) waits up to
/// `[server] shutdown_grace_s` for them to close.
pub async fn run(
    daemon: Arc<Daemon>,
    listener: UnixListener,
    socket: PathBuf,
    shutdown: impl std::future::Future<Output = Shutdown>,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    tracing::info!(socket = %socket.display(), workers = daemon.settings().worker_threads, "listening");
    let mut accept_errors = Throttle::default();
    let mut backoff = Duration::ZERO;
    let how = loop {
        tokio::select! {
            accepted = listener.accept(), if backoff.is_zero() => match accepted {
                Ok((sock, _)) => {
                    let id = daemon.id();
                    let span = tracing::info_span!("client", id);
                    connections.spawn(serve_connection(daemon.clone(), sock, id, stop_rx.clone()).instrument(span));
                }
                Err(e) => {
                    // Out of descriptors (EMFILE/ENFILE) or memory: accepting again
                    // at once would spin; back off, and say so once in a while.
                    backoff = Duration::from_millis(10);
                    if let Some(suppressed) = accept_errors.allow() {
                        tracing::warn!(error = %e, suppressed, open = connections.len(), "accept failed; backing off");
                    }
                }
            },
            () = tokio::time::sleep(backoff), if !backoff.is_zero() => {
                // Probe with one accept; a further failure doubles the wait (up to 1 s).
                match listener.accept().await {
                    Ok((sock, _)) => {
                        backoff = Duration::ZERO;
                        let id = daemon.id();
                        let span = tracing::info_span!("client", id);
                        connections.spawn(serve_connection(daemon.clone(), sock, id, stop_rx.clone()).instrument(span));
                    }
                    Err(e) => {
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        if let Some(suppressed) = accept_errors.allow() {
                            tracing::warn!(error = %e, suppressed, "accept still failing; backing off");
                        }
                    }
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            how = &mut shutdown => break how,
        }
    };
    tracing::info!(?how, connections = connections.len(), "shutting down");
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    let _ = stop_tx.send(true);
    let grace = match how {
        Shutdown::Drain => daemon.settings().shutdown_grace,
        Shutdown::Quick => Duration::from_millis(200),
    };
    let drained = tokio::time::timeout(grace, async { while connections.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(left = connections.len(), "connections still open after the grace period; closing them");
        connections.abort_all();
    }
    Ok(())
}

/// Answers a connection that will not be served with one error, after
/// reading its first message (so the reply is not lost to a reset), then closes it.
/// Refused connections told why at once; more are closed unanswered, so a
/// peer that is not allowed cannot hold the daemon's descriptors (each told
/// connection waits up to `frame_timeout_s` for the peer's first message).
const MAX_REFUSING: usize = 64;
/// Refused connections of one uid told why at a time: one refused user
/// cannot take every place and leave other refused users unanswered.
const MAX_REFUSING_PER_UID: usize = 8;

/// Tells a refused peer why (within [`MAX_REFUSING`] at a time, and
/// [`MAX_REFUSING_PER_UID`] of its uid) and closes.
async fn refuse_bounded(daemon: &Daemon, uid: u32, sock: UnixStream, error: WireError, wait: Duration) {
    {
        let mut refusing = lock(&daemon.refusing);
        let of_uid = refusing.1.get(&uid).copied().unwrap_or(0);
        if refusing.0 >= MAX_REFUSING || of_uid >= MAX_REFUSING_PER_UID {
            return; // dropped: closed unanswered
        }
        refusing.0 += 1;
        *refusing.1.entry(uid).or_default() += 1;
    }
    /// Gives the place back however the refusal ends (a shutdown drops it).
    struct Place<'a>(&'a Daemon, u32);
    impl Drop for Place<'_> {
        fn drop(&mut self) {
            let mut refusing = lock(&self.0.refusing);
            refusing.0 = refusing.0.saturating_sub(1);
            if let Some(n) = refusing.1.get_mut(&self.1) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    refusing.1.remove(&self.1);
                }
            }
        }
    }
    let _place = Place(daemon, uid);
    refuse(sock, error, wait).await;
}

async fn refuse(mut sock: UnixStream, error: WireError, wait: Duration) {
    let mut first = [0u8; 4096];
    let _ = tokio::time::timeout(wait, sock.read(&mut first)).await;
    if let Ok(frame) = stoker_proto::encode_frame(&Response::from(error)) {
        let _ = tokio::time::timeout(wait, sock.write_all(&frame)).await;
    }
    let _ = sock.shutdown().await;
}

#[cfg(test)]
mod tests;
