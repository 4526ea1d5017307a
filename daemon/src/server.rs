//! The control server: accepts clients on the Unix socket, checks their uid
//! with `SO_PEERCRED`, and serves each connection's requests on tokio. Opening
//! datasets runs on the blocking pool; reading samples runs on the worker pool
//! (see `stream`); this module only moves messages and fds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use stoker_proto::{
    BatchLayout, CacheStatus, ClientStatus, DatasetInfo, DatasetSkips, ErrorKind, OpenStream, Request, Response,
    StatusReport, StreamInfo, WorkerStatus,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::config::Settings;
use crate::dataset::Datasets;
use crate::ring::{ControlPage, Ring};
use crate::stream::{Budget, Fetched, Shm, Stream, StreamMeta};
use stoker_data::cache::Caches;
use stoker_data::sampler::{Sampler, Shuffle};

/// An error reply: kind plus a message for the user.
type Reply<T> = Result<T, (ErrorKind, String)>;

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
    connected: Mutex<HashMap<u64, Instant>>,
    /// Open connections: in total, and per uid.
    admitted: Mutex<(usize, HashMap<u32, usize>)>,
    /// Refused connections are logged at most once per [`WARN_EVERY`]: a
    /// refused peer reconnecting in a loop must not flood the log.
    refusals: Mutex<Throttle>,
    next_id: AtomicU64,
    own_uid: u32,
    metrics: crate::metrics::Metrics,
    /// Shared memory all streams may hold: `[limits] max_memory_bytes` less the caches.
    memory: Arc<Budget>,
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
        let datasets = Datasets::new(settings.clone(), caches.clone());
        let load = Arc::new(Mutex::new(VecDeque::new()));
        let weak = Arc::downgrade(&load);
        if let Err(e) = std::thread::Builder::new().name("stoker-load".into()).spawn(move || sample_load(weak)) {
            tracing::warn!(error = %e, "cannot start the load sampler: `stoker status` shows utilisation since start");
        }
        let memory = Budget::new(settings.limits.max_memory_bytes.saturating_sub(caches.capacity()));
        Ok(Arc::new(Daemon {
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
            own_uid: rustix::process::getuid().as_raw(),
            metrics: crate::metrics::Metrics::default(),
            memory,
            load,
        }))
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

    /// Whether the peer may use the daemon: root, the daemon's own uid,
    /// `allowed_uids`, or a member (primary or supplementary) of `allowed_gids`.
    fn allows(&self, uid: u32, gid: u32, pid: u32) -> bool {
        let settings = self.settings();
        if uid == 0 || uid == self.own_uid || settings.allowed_uids.contains(&uid) {
            return true;
        }
        if settings.allowed_gids.is_empty() {
            return false;
        }
        settings.allowed_gids.contains(&gid) || peer_groups(pid).iter().any(|g| settings.allowed_gids.contains(g))
    }

    /// Counts a new connection against `[limits] max_connections` and
    /// `max_connections_per_uid`; `None` when either is reached.
    fn admit(self: &Arc<Self>, uid: u32) -> Result<Admission, String> {
        let limits = &self.settings().limits;
        let mut admitted = lock(&self.admitted);
        let privileged = uid == 0 || uid == self.own_uid;
        let of_uid = admitted.1.get(&uid).copied().unwrap_or(0);
        if admitted.0 >= limits.max_connections {
            return Err(format!(
                "the daemon already serves {} connections ([limits] max_connections); try again later",
                admitted.0
            ));
        }
        if !privileged && of_uid >= limits.max_connections_per_uid {
            return Err(format!(
                "uid {uid} already holds {of_uid} connections ([limits] max_connections_per_uid); close some \
                 Loaders (each holds one connection)"
            ));
        }
        admitted.0 += 1;
        *admitted.1.entry(uid).or_default() += 1;
        Ok(Admission { daemon: self.clone(), uid })
    }

    /// The status report as `viewer` may see it: root and the daemon's uid see
    /// everything, other users only their own clients, streams and datasets.
    /// The connection asking (`asker`) is not listed unless it has streams
    /// open: a status query is not a client.
    fn status(&self, viewer: u32, asker: u64) -> StatusReport {
        let all = viewer == 0 || viewer == self.own_uid;
        let visible: HashMap<u64, u32> =
            lock(&self.clients).values().filter(|c| all || c.uid == viewer).map(|c| (c.id, c.uid)).collect();
        let open: Vec<Arc<Stream>> =
            lock(&self.streams).values().filter(|s| visible.contains_key(&s.meta().client_id)).cloned().collect();
        let streams: Vec<_> = open.iter().map(|s| s.status()).collect();
        let connected = lock(&self.connected).clone();
        let clients = lock(&self.clients)
            .values()
            .filter(|c| visible.contains_key(&c.id))
            .filter(|c| c.id != asker || streams.iter().any(|s| s.client_id == asker))
            .map(|c| {
                let own = || streams.iter().filter(|s| s.client_id == c.id);
                let connected_s = connected.get(&c.id).map_or(0.0, |t| t.elapsed().as_secs_f64());
                let wait_s = own().map(|s| s.wait_s).sum();
                ClientStatus {
                    streams: own().count() as u64,
                    connected_s,
                    wait_s,
                    stall_percent: crate::stream::percent(wait_s, connected_s),
                    ..c.clone()
                }
            })
            .collect();
        let datasets = self
            .datasets
            .status()
            .into_iter()
            .filter_map(|(mut d, source)| {
                let readers = open.iter().filter(|s| std::ptr::addr_eq(Arc::as_ptr(&s.source()), Arc::as_ptr(&source)));
                let (n, ring_bytes) = readers.fold((0u64, 0u64), |(n, b), s| (n + 1, b.saturating_add(s.shm_bytes())));
                (d.streams, d.ring_bytes) = (n, ring_bytes);
                (all || n > 0).then_some(d)
            })
            .collect();
        let visible_datasets: std::collections::HashSet<&str> = streams.iter().map(|s| s.dataset.as_str()).collect();
        StatusReport {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            worker_threads: self.pool.current_num_threads() as u64,
            clients,
            chunk_cache: cache_status(self.caches.chunks.stats()),
            sample_cache: cache_status(self.caches.samples.stats()),
            skipped: self
                .datasets
                .skips()
                .into_iter()
                .filter(|(dataset, _)| all || visible_datasets.contains(dataset.as_str()))
                .map(|(dataset, skipped)| DatasetSkips { dataset, skipped })
                .collect(),
            datasets,
            workers: self.worker_status(),
            streams,
        }
    }

    /// Worker utilisation over the last [`LOAD_WINDOW`] (since start until a sample is a second old).
    fn worker_status(&self) -> WorkerStatus {
        let now = Instant::now();
        let busy = crate::stream::counters::worker_busy();
        let oldest =
            lock(&self.load).front().copied().filter(|(t, _)| now.duration_since(*t) >= Duration::from_secs(1));
        let (since, busy_before) = oldest.unwrap_or((self.started, Duration::ZERO));
        let window_s = now.duration_since(since).as_secs_f64();
        let threads = self.pool.current_num_threads() as f64;
        WorkerStatus {
            busy_s: busy.as_secs_f64(),
            busy_percent: crate::stream::percent(busy.saturating_sub(busy_before).as_secs_f64(), window_s * threads),
            window_s,
        }
    }

    fn datasets(&self) -> Vec<DatasetInfo> {
        self.datasets.named()
    }

    /// Labels `viewer` may see: every dataset for root and the daemon's
    /// user; otherwise those named in the config and those its streams read.
    fn visible_labels(&self, viewer: u32) -> Option<std::collections::HashSet<String>> {
        if viewer == 0 || viewer == self.own_uid {
            return None;
        }
        let mine: std::collections::HashSet<u64> =
            lock(&self.clients).values().filter(|c| c.uid == viewer).map(|c| c.id).collect();
        let mut labels: std::collections::HashSet<String> = self.settings().datasets.keys().cloned().collect();
        labels.extend(
            lock(&self.streams)
                .values()
                .filter(|s| mine.contains(&s.meta().client_id))
                .map(|s| s.meta().dataset.clone()),
        );
        Some(labels)
    }

    /// The caches per dataset, as `viewer` may see them (`stoker cache ls`).
    fn cache_report(&self, viewer: u32) -> stoker_proto::CacheReport {
        let visible = self.visible_labels(viewer);
        let futures = &self.caches.futures;
        let mut datasets = Vec::new();
        let mut hidden: [Option<stoker_proto::CacheDatasetStatus>; 2] = [None, None];
        let per = [("chunks", self.caches.chunks.datasets()), ("samples", self.caches.samples.datasets())];
        for (k, (cache, rows)) in per.into_iter().enumerate() {
            for (dataset, c) in rows {
                let label = futures.label_of(dataset).unwrap_or_else(|| format!("(dataset {dataset:016x})"));
                let shown = visible.as_ref().is_none_or(|v| v.contains(&label));
                let row = stoker_proto::CacheDatasetStatus {
                    dataset: if shown { label } else { "(other users' datasets)".into() },
                    cache: cache.into(),
                    bytes: c.bytes,
                    entries: c.entries,
                    hits: c.hits,
                    misses: c.misses,
                    evictions: c.evictions,
                    rejected: c.rejected,
                };
                if shown {
                    // Reopened datasets (a changed file) share their label: one row each.
                    match datasets.iter_mut().find(|r: &&mut stoker_proto::CacheDatasetStatus| {
                        r.dataset == row.dataset && r.cache == row.cache
                    }) {
                        Some(r) => add_counts(r, &row),
                        None => datasets.push(row),
                    }
                } else {
                    match &mut hidden[k] {
                        Some(r) => add_counts(r, &row),
                        slot @ None => *slot = Some(row),
                    }
                }
            }
        }
        datasets.extend(hidden.into_iter().flatten());
        stoker_proto::CacheReport {
            policy: self.caches.chunks.policy().to_string(),
            chunks: cache_status(self.caches.chunks.stats()),
            samples: cache_status(self.caches.samples.stats()),
            streams: futures.streams() as u64,
            datasets,
        }
    }

    /// Drops the cache entries of `dataset` (every dataset with `None`, for root and the daemon's user only).
    fn cache_drop(&self, viewer: u32, dataset: Option<&str>) -> Response {
        let visible = self.visible_labels(viewer);
        let (mut entries, mut bytes) = (0, 0);
        let mut add = |(e, b): (u64, u64)| {
            entries += e;
            bytes += b;
        };
        match dataset {
            None if visible.is_some() => {
                return Response::Error {
                    kind: ErrorKind::PermissionDenied,
                    message: "only root and the daemon's user may drop every dataset's cache entries; name a dataset \
                              (`stoker cache ls` lists those you may drop)"
                        .into(),
                };
            }
            None => {
                add(self.caches.chunks.drop_dataset(None));
                add(self.caches.samples.drop_dataset(None));
            }
            Some(label) => {
                if visible.as_ref().is_some_and(|v| !v.contains(label)) {
                    return Response::Error {
                        kind: ErrorKind::NotFound,
                        message: format!("no cached dataset {label:?} that you may drop; see `stoker cache ls`"),
                    };
                }
                let fingerprints = self.caches.futures.datasets_named(label);
                if fingerprints.is_empty() {
                    return Response::Error {
                        kind: ErrorKind::NotFound,
                        message: format!("no cached dataset {label:?}; see `stoker cache ls`"),
                    };
                }
                for d in fingerprints {
                    add(self.caches.chunks.drop_dataset(Some(d)));
                    add(self.caches.samples.drop_dataset(Some(d)));
                }
            }
        }
        tracing::info!(uid = viewer, dataset = dataset.unwrap_or("(all)"), entries, bytes, "cache entries dropped");
        Response::CacheDropped { entries, bytes }
    }

    /// The Prometheus (OpenMetrics text) exposition of the daemon's state, for `GET /metrics`.
    pub fn metrics_text(&self) -> String {
        let streams: Vec<Arc<Stream>> = lock(&self.streams).values().cloned().collect();
        self.metrics.render(crate::metrics::Scrape {
            streams,
            sources: self.datasets.sources(),
            cache: self.caches.chunks.stats(),
            sample_cache: self.caches.samples.stats(),
            clients: lock(&self.clients).len() as u64,
            worker_threads: self.pool.current_num_threads() as u64,
        })
    }
}

fn cache_status(s: stoker_data::cache::CacheStats) -> CacheStatus {
    CacheStatus {
        bytes: s.bytes,
        capacity: s.capacity,
        entries: s.entries,
        hits: s.hits,
        misses: s.misses,
        evictions: s.evictions,
    }
}

fn add_counts(to: &mut stoker_proto::CacheDatasetStatus, from: &stoker_proto::CacheDatasetStatus) {
    to.bytes += from.bytes;
    to.entries += from.entries;
    to.hits += from.hits;
    to.misses += from.misses;
    to.evictions += from.evictions;
    to.rejected += from.rejected;
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
struct Admission {
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

/// Supplementary groups of process `pid` (from `/proc/PID/status`).
fn peer_groups(pid: u32) -> Vec<u32> {
    if pid == 0 {
        return Vec::new();
    }
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    text.lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| g.split_whitespace().filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default()
}

/// Lets a repeated warning through at most once per [`WARN_EVERY`], counting the rest.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    /// `Some(n)` when a warning may be logged now (`n` were suppressed since the last one).
    fn allow(&mut self) -> Option<u64> {
        if self.last.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.suppressed))
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
    use std::os::unix::fs::PermissionsExt;
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another stoker daemon is already listening on {}; stop it or pick another --socket",
                path.display()
            );
        }
        std::fs::remove_file(path).with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    if let Some(gid) = settings.socket_gid {
        std::os::unix::fs::chown(path, None, Some(gid))
            .with_context(|| format!("cannot give socket {} to group {gid} ([server] socket_group)", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(settings.socket_mode))
        .with_context(|| format!("cannot set mode {:o} on socket {}", settings.socket_mode, path.display()))?;
    Ok(listener)
}

/// Serves clients on `listener` until `shutdown` resolves, then stops
/// accepting, removes the socket file at `socket`, tells every connection
/// [`ErrorKind::ShuttingDown`] and (for [`Shutdown::Drain`]) waits up to
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
async fn refuse(mut sock: UnixStream, kind: ErrorKind, message: String, wait: Duration) {
    let mut first = [0u8; 4096];
    let _ = tokio::time::timeout(wait, sock.read(&mut first)).await;
    if let Ok(frame) = stoker_proto::encode_frame(&Response::Error { kind, message }) {
        let _ = tokio::time::timeout(wait, sock.write_all(&frame)).await;
    }
    let _ = sock.shutdown().await;
}

/// One client connection.
struct Connection {
    daemon: Arc<Daemon>,
    id: u64,
    uid: u32,
    pid: u32,
    job: Option<String>,
    peer: stoker_data::fsaccess::Peer,
    writer: OwnedWriteHalf,
    streams: HashMap<u64, Arc<Stream>>,
    /// How each `rescan = "epoch"` stream was opened: its dataset is opened
    /// again from this (with the client's rights) at each new epoch.
    rescans: HashMap<u64, OpenStream>,
    greeted: bool,
    bad_releases: Throttle,
    /// Shared memory this connection's streams may hold (`[limits] max_ring_bytes_per_client`).
    budget: Arc<Budget>,
    /// Longest a reply may wait for the client to read (`[server] frame_timeout_s`).
    write_timeout: Duration,
}

async fn serve_connection(daemon: Arc<Daemon>, sock: UnixStream, id: u64, mut stop: watch::Receiver<bool>) {
    let settings = daemon.settings();
    let (uid, gid, pid) = match sock.peer_cred() {
        Ok(cred) => (cred.uid(), cred.gid(), cred.pid().unwrap_or(0) as u32),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    if !daemon.allows(uid, gid, pid) {
        if let Some(suppressed) = lock(&daemon.refusals).allow() {
            tracing::warn!(uid, pid, suppressed, "refused: uid not allowed");
        }
        let msg = format!(
            "uid {uid} is not allowed to use this daemon; the admin can add it to [server] allowed_uids \
             (or its group to allowed_gids)"
        );
        refuse(sock, ErrorKind::PermissionDenied, msg, settings.frame_timeout).await;
        return;
    }
    let _admission = match daemon.admit(uid) {
        Ok(a) => a,
        Err(msg) => {
            if let Some(suppressed) = lock(&daemon.refusals).allow() {
                tracing::warn!(uid, pid, suppressed, "refused: {msg}");
            }
            refuse(sock, ErrorKind::Limit, msg, settings.frame_timeout).await;
            return;
        }
    };
    let (reader, writer) = sock.into_split();
    let mut conn = Connection {
        daemon: daemon.clone(),
        id,
        uid,
        pid,
        job: None,
        peer: stoker_data::fsaccess::Peer { uid, gid, pid },
        writer,
        streams: HashMap::new(),
        rescans: HashMap::new(),
        greeted: false,
        bad_releases: Throttle::default(),
        budget: Budget::new(settings.limits.max_ring_bytes_per_client),
        write_timeout: settings.frame_timeout,
    };
    let client =
        ClientStatus { id, pid, uid, job: None, streams: 0, connected_s: 0.0, wait_s: 0.0, stall_percent: 0.0 };
    lock(&daemon.clients).insert(id, client);
    lock(&daemon.connected).insert(id, Instant::now());

    let (tx, mut frames) = mpsc::channel(MAX_BACKLOG);
    let read_task = tokio::spawn(read_frames(reader, tx, settings.limits.max_message_bytes, settings.frame_timeout));
    drop(settings);
    loop {
        tokio::select! {
            frame = frames.recv() => match frame {
                None => break,
                Some(Err(message)) => {
                    let _ = conn.send(&Response::Error { kind: ErrorKind::Protocol, message }).await;
                    break;
                }
                Some(Ok(req)) => {
                    if conn.handle(req).await.is_err() {
                        break;
                    }
                }
            },
            _ = stop.changed() => {
                // A client waiting for its next batch sleeps on the control
                // page: a `Closed` record wakes it to reconnect to the next
                // daemon at once instead of timing out.
                for stream in conn.streams.values() {
                    stream.close(true);
                }
                break;
            }
        }
    }
    read_task.abort();
    for (_, stream) in conn.streams.drain() {
        stream.close(false);
        lock(&daemon.streams).remove(&stream.meta().id);
        tracing::info!(stream = stream.meta().id, dataset = %stream.meta().dataset, uid, pid, "stream closed (connection ended)");
    }
    lock(&daemon.clients).remove(&id);
    lock(&daemon.connected).remove(&id);
    tracing::info!(uid, pid, job = conn.job.as_deref().unwrap_or("-"), "disconnected");
}

/// Why reading a frame stopped.
enum ReadEnd {
    /// The peer closed the connection (or it broke).
    Closed,
    /// The frame is unacceptable; the message says why.
    Refused(String),
}

/// Reads frames into `tx`. Waiting for a message to begin is unbounded (an
/// idle client costs nothing), but a message once begun must arrive whole
/// within `deadline`, and its buffer grows only as its bytes arrive.
async fn read_frames(
    mut reader: OwnedReadHalf,
    tx: mpsc::Sender<Result<Request, String>>,
    limit: usize,
    deadline: Duration,
) {
    loop {
        let mut header = [0u8; stoker_proto::FRAME_HEADER_BYTES];
        match reader.read(&mut header[..1]).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let rest = async {
            reader.read_exact(&mut header[1..]).await.map_err(|_| ReadEnd::Closed)?;
            let len = stoker_proto::frame_len(header, limit)
                .map_err(|e| ReadEnd::Refused(format!("{e} ([limits] max_message_bytes)")))?;
            let mut body = Vec::new();
            (&mut reader).take(len as u64).read_to_end(&mut body).await.map_err(|_| ReadEnd::Closed)?;
            if body.len() < len {
                return Err(ReadEnd::Closed);
            }
            Ok(body)
        };
        let body = match tokio::time::timeout(deadline, rest).await {
            Ok(Ok(body)) => body,
            Ok(Err(ReadEnd::Closed)) => return,
            Ok(Err(ReadEnd::Refused(message))) => {
                let _ = tx.send(Err(message)).await;
                return;
            }
            Err(_) => {
                let message = format!(
                    "a message was started but not finished within {:.0} s ([server] frame_timeout_s); closing",
                    deadline.as_secs_f64()
                );
                tracing::warn!("{message}");
                let _ = tx.send(Err(message)).await;
                return;
            }
        };
        let msg = stoker_proto::decode_body(&body).map_err(|e| format!("{e}; is the client the same stoker version?"));
        let failed = msg.is_err();
        if tx.send(msg).await.is_err() || failed {
            return;
        }
    }
}

impl Connection {
    async fn send(&mut self, resp: &Response) -> std::io::Result<()> {
        let frame = stoker_proto::encode_frame(resp).map_err(std::io::Error::other)?;
        // A client that sends requests and never reads the replies must not
        // hold this task (and its connection slot) forever.
        match tokio::time::timeout(self.write_timeout, self.writer.write_all(&frame)).await {
            Ok(result) => result,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client did not read its replies within [server] frame_timeout_s",
            )),
        }
    }

    async fn send_error(&mut self, (kind, message): (ErrorKind, String)) -> Result<(), ()> {
        self.send(&Response::Error { kind, message }).await.map_err(drop)
    }

    /// Handles one request; `Err` closes the connection.
    async fn handle(&mut self, req: Request) -> Result<(), ()> {
        if !self.greeted && !matches!(req, Request::Hello { .. }) {
            let err = (ErrorKind::Protocol, "the first message must be Hello".to_string());
            let _ = self.send_error(err).await;
            return Err(());
        }
        let reply = match req {
            Request::Hello { version, client, job } => {
                if version != stoker_proto::PROTOCOL_VERSION {
                    let msg = format!(
                        "client speaks protocol {version}, this daemon speaks {}; install matching versions of the \
                         stoker client and daemon",
                        stoker_proto::PROTOCOL_VERSION
                    );
                    let _ = self.send_error((ErrorKind::Version, msg)).await;
                    return Err(());
                }
                let job = job.filter(|j| j.len() <= 64 && j.chars().all(|c| c.is_ascii_graphic()));
                tracing::info!(uid = self.uid, pid = self.pid, job = job.as_deref().unwrap_or("-"), client = %client.chars().take(80).collect::<String>().escape_debug(), "connected");
                if let Some(c) = lock(&self.daemon.clients).get_mut(&self.id) {
                    c.job.clone_from(&job);
                }
                self.job = job;
                self.greeted = true;
                Response::Hello {
                    version: stoker_proto::PROTOCOL_VERSION,
                    server: format!("stoker {}", env!("CARGO_PKG_VERSION")),
                }
            }
            Request::OpenStream(open) => {
                return match self.open_stream(open).await {
                    Ok(stream) => self.send_stream(stream).await.map_err(drop),
                    Err(e) => self.send_error(e).await,
                };
            }
            Request::Next { .. } => Response::Error {
                kind: ErrorKind::Version,
                message:
                    "Next is not part of protocols 4 and later: batches are handed over through the stream's control \
                          page; install matching versions of the stoker client and daemon"
                        .into(),
            },
            Request::Wake { stream } => {
                if let Some(s) = self.streams.get(&stream) {
                    s.wake();
                }
                return Ok(());
            }
            Request::Fetch { stream, seq } => match self.streams.get(&stream) {
                Some(s) => match s.fetch(seq) {
                    Fetched::Failed { epoch, step, message } => Response::BatchFailed { stream, epoch, step, message },
                    Fetched::Resumed => Response::Done,
                    Fetched::Exhausted(message) => Response::Error { kind: ErrorKind::RingExhausted, message },
                    Fetched::Unknown => Response::Error {
                        kind: ErrorKind::Protocol,
                        message: format!("stream {stream} has no record {seq} with details to fetch"),
                    },
                },
                None => no_stream(stream),
            },
            Request::Segment { stream, slot } => {
                let segment = self.streams.get(&stream).and_then(|s| s.segment(slot));
                return match segment {
                    Some(seg) => {
                        let resp = Response::Segment {
                            stream,
                            slot,
                            generation: seg.generation,
                            layout: seg.ring.layout().clone(),
                        };
                        self.send_with_fds(&resp, &[seg.ring.fd()]).await.map_err(drop)
                    }
                    None => {
                        let message = format!("stream {stream} has no extra slot {slot} (any more)");
                        self.send_error((ErrorKind::NotFound, message)).await
                    }
                };
            }
            Request::Release { stream, slot } => {
                match self.streams.get(&stream) {
                    Some(s) if s.release(slot) => {}
                    Some(_) => {
                        if let Some(suppressed) = self.bad_releases.allow() {
                            tracing::warn!(stream, slot, suppressed, "release of a slot the client does not hold");
                        }
                    }
                    // Arrays that outlive `close()` release their slots late: nothing left to do.
                    None => tracing::trace!(stream, slot, "release for a closed stream"),
                }
                return Ok(());
            }
            Request::SetEpoch { stream, epoch, step } => match self.streams.get(&stream).cloned() {
                Some(s) => {
                    let rescanned = match self.rescans.get(&stream).cloned() {
                        Some(open) if s.needs_rescan(epoch) => match self.rescan(&s, &open, epoch).await {
                            Ok(rescanned) => Some(rescanned),
                            Err(e) => return self.send_error(e).await,
                        },
                        _ => None,
                    };
                    match s.set_epoch_with(epoch, step, rescanned) {
                        Ok(skip_to) => {
                            let sampler = s.sampler();
                            Response::EpochSet {
                                stream,
                                skip_to,
                                num_samples: sampler.per_rank(),
                                batches_per_epoch: sampler.batches_per_epoch(),
                                generation: s.generation(),
                            }
                        }
                        Err(message) => Response::Error { kind: ErrorKind::Protocol, message },
                    }
                }
                None => no_stream(stream),
            },
            Request::Status => Response::Status(self.daemon.status(self.uid, self.id)),
            Request::Datasets => Response::Datasets(self.daemon.datasets()),
            Request::CacheList => Response::CacheList(self.daemon.cache_report(self.uid)),
            Request::CacheDrop { dataset } => self.daemon.cache_drop(self.uid, dataset.as_deref()),
            Request::Close { stream } => match self.streams.remove(&stream) {
                Some(s) => {
                    self.rescans.remove(&stream);
                    s.close(false);
                    lock(&self.daemon.streams).remove(&stream);
                    tracing::info!(stream, dataset = %s.meta().dataset, uid = self.uid, pid = self.pid, "stream closed");
                    Response::Done
                }
                None => no_stream(stream),
            },
        };
        self.send(&reply).await.map_err(drop)
    }

    async fn open_stream(&mut self, open: OpenStream) -> Reply<Arc<Stream>> {
        let settings = self.daemon.settings();
        let limits = &settings.limits;
        if open.batch_size == 0 || open.batch_size > limits.max_batch_size {
            return Err((
                ErrorKind::Limit,
                format!(
                    "batch_size {} is outside 1..={} ([limits] max_batch_size)",
                    open.batch_size, limits.max_batch_size
                ),
            ));
        }
        if open.world_size == 0 || open.rank >= open.world_size {
            return Err((
                ErrorKind::Protocol,
                format!("rank {} is not below world_size {}", open.rank, open.world_size),
            ));
        }
        if self.streams.len() >= limits.max_streams_per_client {
            return Err((
                ErrorKind::Limit,
                format!(
                    "this client already has {} streams open ([limits] max_streams_per_client)",
                    self.streams.len()
                ),
            ));
        }
        let opened = self.open_dataset(&open).await?;
        let (label, source, generation) = (opened.label, opened.source, opened.generation);
        let fingerprint = opened.fingerprint;
        let sampler = sampler_for(&open, &label, source.len())?;
        if open.step > sampler.batches_per_epoch() {
            return Err((
                ErrorKind::Protocol,
                format!("step {} is past the end of the epoch ({} batches)", open.step, sampler.batches_per_epoch()),
            ));
        }
        let layout = BatchLayout::new(open.batch_size, source.fields().iter().map(|f| f.decl()), &limits.layout())
            .map_err(|e| {
                let origin = match &e {
                    stoker_proto::LayoutError::SampleTooLarge { field, .. } => {
                        source.fields().iter().find(|f| &f.name == field).map(|f| format!(" (from {})", f.origin))
                    }
                    stoker_proto::LayoutError::BatchTooLarge { .. } => None,
                };
                (ErrorKind::Limit, format!("dataset {label}{}: {e}", origin.unwrap_or_default()))
            })?;
        let depth = settings.ring_depth;
        let want = layout
            .checked_ring_bytes(depth)
            .and_then(|b| b.checked_add(stoker_proto::ctrl::CTRL_BYTES))
            .unwrap_or(u64::MAX);
        // Reserved atomically, so concurrent opens (and ring growth) cannot
        // together overshoot either budget.
        let mine = self.budget.reserve(want).map_err(|held| {
            (
                ErrorKind::Limit,
                format!(
                    "this stream needs {want} bytes of shared memory ({depth} slots × {} bytes) and the client already \
                     holds {held}; the limit is {} ([limits] max_ring_bytes_per_client): use a smaller batch_size",
                    layout.slot_bytes,
                    self.budget.limit()
                ),
            )
        })?;
        let ours = self.daemon.memory.reserve(want).map_err(|total| {
            let cache = self.daemon.caches.capacity();
            (
                ErrorKind::Limit,
                format!(
                    "this stream needs {want} bytes of shared memory ({depth} slots × {} bytes) and the daemon's \
                     streams already hold {total}, besides {cache} bytes of caches ([cache] chunk_bytes + sample_bytes); the daemon's memory budget \
                     is {} ([limits] max_memory_bytes): use a smaller batch_size, or retry when other jobs have \
                     finished",
                    layout.slot_bytes, limits.max_memory_bytes
                ),
            )
        })?;
        let id = self.daemon.id();
        let shm_err =
            |e: std::io::Error| (ErrorKind::Internal, format!("cannot create shared memory of {want} bytes: {e}"));
        let ring = Ring::create(&format!("stoker-stream-{id}"), &layout, depth).map_err(shm_err)?;
        let control = ControlPage::create(&format!("stoker-stream-{id}-control")).map_err(shm_err)?;
        let shm = Shm {
            ring,
            control,
            budgets: [self.budget.clone(), self.daemon.memory.clone()],
            reserved: Mutex::new(vec![mine, ours]),
            limits: limits.layout(),
        };
        let counters = self.daemon.metrics.dataset(&label);
        let cursor = self.daemon.caches.futures.register(fingerprint, sampler.clone(), open.epoch, open.step);
        let meta = StreamMeta {
            id,
            client_id: self.id,
            pid: self.pid,
            dataset: label,
            rank: open.rank,
            world_size: open.world_size,
            counters,
            rescan: opened.rescan,
            cursor: Some(cursor),
        };
        let (epoch, step) = (open.epoch, open.step);
        let dataset = (source, sampler, generation);
        let stream = Stream::start_at(meta, dataset, shm, self.daemon.pool.clone(), epoch, step);
        lock(&self.daemon.streams).insert(id, stream.clone());
        self.streams.insert(id, stream.clone());
        if opened.rescan {
            self.rescans.insert(id, open.clone());
        }
        tracing::info!(
            stream = id,
            dataset = %stream.meta().dataset,
            rank = open.rank,
            world = open.world_size,
            order = ?stream.sampler().shuffle(),
            uid = self.uid,
            pid = self.pid,
            job = self.job.as_deref().unwrap_or("-"),
            "stream opened"
        );
        Ok(stream)
    }

    /// Opens (or reuses) the dataset `open` names, off the async threads, with the client's rights.
    async fn open_dataset(&self, open: &OpenStream) -> Reply<crate::dataset::Opened> {
        let daemon = self.daemon.clone();
        let (dataset, peer) = (open.dataset.clone(), self.peer);
        tokio::task::spawn_blocking(move || daemon.datasets.open(&dataset, &peer)).await.map_err(|e| {
            let why = if e.is_panic() { crate::stream::panic_message(&*e.into_panic()) } else { e.to_string() };
            tracing::error!(dataset = ?open.dataset, %why, "opening a dataset panicked");
            (
                ErrorKind::Internal,
                format!(
                    "opening the dataset failed inside the daemon (a bug: {why}); the daemon keeps serving other \
                     streams — please report this with the daemon's log"
                ),
            )
        })?
    }

    /// Matches a `rescan = "epoch"` dataset again for `epoch`: its files as
    /// they are now (a changed file opened afresh), a sampler over the new
    /// sample count. The new files must give the fields the stream's ring was
    /// laid out for.
    async fn rescan(
        &self,
        stream: &Arc<Stream>,
        open: &OpenStream,
        epoch: u64,
    ) -> Reply<(Arc<dyn stoker_data::source::Source>, Sampler, stoker_proto::Generation)> {
        let label = &stream.meta().dataset;
        let opened = self
            .open_dataset(open)
            .await
            .map_err(|(kind, message)| (kind, format!("rescanning dataset {label} for epoch {epoch}: {message}")))?;
        let was = stream.source();
        let decls = |s: &Arc<dyn stoker_data::source::Source>| s.fields().iter().map(|f| f.decl()).collect::<Vec<_>>();
        if decls(&opened.source) != decls(&was) {
            let show = |s: &Arc<dyn stoker_data::source::Source>| {
                s.fields().iter().map(|f| format!("{} {:?} {:?}", f.name, f.dtype, f.shape)).collect::<Vec<_>>()
            };
            return Err((
                ErrorKind::Dataset,
                format!(
                    "rescanning dataset {label} for epoch {epoch}: its files now give fields {:?}, but the stream \
                     was opened for {:?}; files added to a rescanned dataset must hold the same fields, dtypes and \
                     sample shapes (open a new Loader for the new layout)",
                    show(&opened.source),
                    show(&was)
                ),
            ));
        }
        let samples = opened.source.len();
        if samples == 0 {
            return Err((
                ErrorKind::Dataset,
                format!("rescanning dataset {label} for epoch {epoch}: no samples left; add files before the epoch"),
            ));
        }
        let generation = opened.generation;
        if generation != stream.generation() {
            tracing::info!(
                stream = stream.meta().id,
                dataset = %label,
                epoch,
                files = generation.files,
                samples,
                was_files = stream.generation().files,
                was_samples = stream.generation().samples,
                "dataset rescanned: its files changed"
            );
        }
        let sampler = sampler_for(open, label, samples)?;
        if let Some(cursor) = &stream.meta().cursor {
            // The caches plan over the files the stream reads from now on.
            cursor.set_dataset(opened.fingerprint);
        }
        Ok((opened.source, sampler, generation))
    }

    /// Sends `StreamOpened` with the ring's and the control page's memfds.
    async fn send_stream(&mut self, stream: Arc<Stream>) -> std::io::Result<()> {
        let sampler = stream.sampler();
        let info = StreamInfo {
            stream: stream.meta().id,
            num_samples: sampler.per_rank(),
            batches_per_epoch: sampler.batches_per_epoch(),
            depth: stream.ring().depth(),
            layout: stream.layout().clone(),
            rescan: stream.meta().rescan,
            generation: stream.generation(),
        };
        self.send_with_fds(&Response::StreamOpened(info), &[stream.ring().fd(), stream.control().fd()]).await
    }

    /// Sends `resp` with `fds` attached to its first byte.
    async fn send_with_fds(&mut self, resp: &Response, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let frame = stoker_proto::encode_frame(resp).map_err(std::io::Error::other)?;
        let sock: &UnixStream = self.writer.as_ref();
        let mut sent = 0;
        let send = async {
            while sent < frame.len() {
                sock.writable().await?;
                let fds = if sent == 0 { fds } else { &[] };
                match sock.try_io(Interest::WRITABLE, || send_part(sock, &frame[sent..], fds)) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.write_timeout, send).await {
            Ok(result) => result,
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the client did not read its reply")),
        }
    }
}

fn send_part(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)?;
    Ok(n)
}

/// The sampler of a stream opened as `open`, over `samples` samples (`≥ 1`)
/// of dataset `label`: at open, and again for each rescanned epoch.
fn sampler_for(open: &OpenStream, label: &str, samples: u64) -> Reply<Sampler> {
    let shuffle = match (open.shuffle, open.block) {
        (shuffle, None) => Shuffle::from(shuffle),
        (true, Some(b)) => Shuffle::Block { block_size: b.block_size, window: b.window },
        (false, Some(_)) => {
            return Err((ErrorKind::Protocol, "a block order needs shuffle; send block: None without it".into()));
        }
    };
    shuffle.check(samples).map_err(|e| (ErrorKind::Protocol, format!("dataset {label}: {e}")))?;
    Ok(Sampler::new(samples, open.rank, open.world_size, open.batch_size, shuffle, open.seed, open.drop_last))
}

fn no_stream(stream: u64) -> Response {
    Response::Error { kind: ErrorKind::NotFound, message: format!("no stream {stream} on this connection") }
}
