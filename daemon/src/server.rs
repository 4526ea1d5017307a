//! The control server: accepts clients on the Unix socket, checks their uid
//! with `SO_PEERCRED`, and serves each connection's requests on tokio. Opening
//! datasets runs on the blocking pool; reading samples runs on the worker pool
//! (see `stream`); this module only moves messages and fds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use stoker_proto::{
    BatchLayout, CacheStatus, ClientStatus, DatasetInfo, DatasetSkips, ErrorKind, OpenStream, Request, Response,
    StatusReport, StreamInfo,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::cache::ChunkCache;
use crate::config::Settings;
use crate::dataset::Datasets;
use crate::ring::Ring;
use crate::sampler::Sampler;
use crate::stream::{Delivery, Stream, StreamMeta};

/// An error reply: kind plus a message for the user.
type Reply<T> = Result<T, (ErrorKind, String)>;

/// State shared by all connections.
#[derive(Debug)]
pub struct Daemon {
    settings: Settings,
    started: Instant,
    pool: Arc<rayon::ThreadPool>,
    datasets: Datasets,
    chunk_cache: Arc<ChunkCache>,
    clients: Mutex<BTreeMap<u64, ClientStatus>>,
    streams: Mutex<BTreeMap<u64, Arc<Stream>>>,
    connected: Mutex<HashMap<u64, Instant>>,
    next_id: AtomicU64,
    own_uid: u32,
}

impl Daemon {
    /// Creates the daemon state and its worker pool.
    pub fn new(settings: Settings) -> anyhow::Result<Arc<Daemon>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(settings.worker_threads)
            .thread_name(|i| format!("stoker-worker-{i}"))
            .build()?;
        let chunk_cache = Arc::new(ChunkCache::new(settings.chunk_cache_bytes as usize));
        let datasets = Datasets::new(settings.clone(), chunk_cache.clone());
        Ok(Arc::new(Daemon {
            settings,
            started: Instant::now(),
            pool: Arc::new(pool),
            datasets,
            chunk_cache,
            clients: Mutex::new(BTreeMap::new()),
            streams: Mutex::new(BTreeMap::new()),
            connected: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            own_uid: rustix::process::getuid().as_raw(),
        }))
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn status(&self) -> StatusReport {
        let streams: Vec<_> = lock(&self.streams).values().map(|s| s.status()).collect();
        let connected = lock(&self.connected).clone();
        let clients = lock(&self.clients)
            .values()
            .map(|c| ClientStatus {
                streams: streams.iter().filter(|s| s.client_id == c.id).count() as u64,
                connected_s: connected.get(&c.id).map_or(0.0, |t| t.elapsed().as_secs_f64()),
                ..c.clone()
            })
            .collect();
        StatusReport {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            worker_threads: self.pool.current_num_threads() as u64,
            clients,
            streams,
            chunk_cache: {
                let s = self.chunk_cache.stats();
                CacheStatus { bytes: s.bytes, capacity: s.capacity, entries: s.entries, hits: s.hits, misses: s.misses }
            },
            skipped: self
                .datasets
                .skips()
                .into_iter()
                .map(|(dataset, skipped)| DatasetSkips { dataset, skipped })
                .collect(),
        }
    }

    fn datasets(&self) -> Vec<DatasetInfo> {
        self.datasets.named()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds the daemon's socket at `path`, replacing a stale socket file but
/// refusing to steal one a live daemon listens on.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
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
    UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))
}

/// Serves clients on `listener` until `shutdown` resolves, then closes every
/// connection and removes the socket file at `socket`.
pub async fn run(
    daemon: Arc<Daemon>,
    listener: UnixListener,
    socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    tracing::info!(socket = %socket.display(), workers = daemon.settings.worker_threads, "listening");
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => {
                    let id = daemon.id();
                    let span = tracing::info_span!("client", id);
                    tokio::spawn(serve_connection(daemon.clone(), sock, id, stop_rx.clone()).instrument(span));
                }
                Err(e) => tracing::warn!(error = %e, "accept failed"),
            },
            () = &mut shutdown => break,
        }
    }
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// One client connection.
struct Connection {
    daemon: Arc<Daemon>,
    id: u64,
    pid: u32,
    peer: crate::fsaccess::Peer,
    writer: OwnedWriteHalf,
    streams: HashMap<u64, Arc<Stream>>,
    greeted: bool,
}

async fn serve_connection(daemon: Arc<Daemon>, sock: UnixStream, id: u64, mut stop: watch::Receiver<bool>) {
    let (uid, gid, pid) = match sock.peer_cred() {
        Ok(cred) => (cred.uid(), cred.gid(), cred.pid().unwrap_or(0) as u32),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    let (reader, writer) = sock.into_split();
    let peer = crate::fsaccess::Peer { uid, gid, pid };
    let mut conn =
        Connection { daemon: daemon.clone(), id, pid, peer, writer, streams: HashMap::new(), greeted: false };
    let allowed = uid == 0 || uid == daemon.own_uid || daemon.settings.allowed_uids.contains(&uid);
    if !allowed {
        tracing::warn!(uid, pid, "refused: uid not allowed");
        let msg = format!("uid {uid} is not allowed to use this daemon; the admin can add it to [server] allowed_uids");
        let _ = conn.send(&Response::Error { kind: ErrorKind::PermissionDenied, message: msg }).await;
        return;
    }
    tracing::debug!(uid, pid, "connected");
    lock(&daemon.clients).insert(id, ClientStatus { id, pid, uid, streams: 0, connected_s: 0.0 });
    lock(&daemon.connected).insert(id, Instant::now());

    let (tx, mut frames) = mpsc::channel(64);
    let limit = daemon.settings.limits.max_message_bytes;
    let read_task = tokio::spawn(read_frames(reader, tx, limit));
    let mut pending: Option<Arc<Stream>> = None;
    let mut backlog: VecDeque<Request> = VecDeque::new();
    loop {
        tokio::select! {
            frame = frames.recv() => match frame {
                None => break,
                Some(Err(message)) => {
                    let _ = conn.send(&Response::Error { kind: ErrorKind::Protocol, message }).await;
                    break;
                }
                Some(Ok(req)) => {
                    // Replies go out in request order: while a `Next` waits,
                    // only one-way releases are handled; the rest queue up.
                    if pending.is_some() && !matches!(req, Request::Release { .. }) {
                        backlog.push_back(req);
                        continue;
                    }
                    match conn.handle(req).await {
                        Ok(next) => pending = next,
                        Err(()) => break,
                    }
                }
            },
            delivery = wait_next(pending.clone()), if pending.is_some() => {
                let stream = pending.take().map_or(0, |s| s.meta().id);
                if conn.deliver(stream, delivery).await.is_err() {
                    break;
                }
                while pending.is_none() {
                    let Some(req) = backlog.pop_front() else { break };
                    match conn.handle(req).await {
                        Ok(next) => pending = next,
                        Err(()) => break,
                    }
                }
            },
            _ = stop.changed() => break,
        }
    }
    read_task.abort();
    for (_, stream) in conn.streams.drain() {
        stream.close();
        lock(&daemon.streams).remove(&stream.meta().id);
    }
    lock(&daemon.clients).remove(&id);
    lock(&daemon.connected).remove(&id);
    tracing::debug!("disconnected");
}

async fn wait_next(stream: Option<Arc<Stream>>) -> Delivery {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn read_frames(mut reader: OwnedReadHalf, tx: mpsc::Sender<Result<Request, String>>, limit: usize) {
    loop {
        let mut header = [0u8; stoker_proto::FRAME_HEADER_BYTES];
        if reader.read_exact(&mut header).await.is_err() {
            return;
        }
        let len = match stoker_proto::frame_len(header, limit) {
            Ok(len) => len,
            Err(e) => {
                let _ = tx.send(Err(format!("{e} ([limits] max_message_bytes)"))).await;
                return;
            }
        };
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
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
        self.writer.write_all(&frame).await
    }

    async fn send_error(&mut self, (kind, message): (ErrorKind, String)) -> Result<(), ()> {
        self.send(&Response::Error { kind, message }).await.map_err(drop)
    }

    /// Handles one request. `Ok(Some(stream))` means a `Next` now waits on that stream.
    async fn handle(&mut self, req: Request) -> Result<Option<Arc<Stream>>, ()> {
        if !self.greeted && !matches!(req, Request::Hello { .. }) {
            let err = (ErrorKind::Protocol, "the first message must be Hello".to_string());
            let _ = self.send_error(err).await;
            return Err(());
        }
        let reply = match req {
            Request::Hello { version, client } => {
                if version != stoker_proto::PROTOCOL_VERSION {
                    let msg = format!(
                        "client speaks protocol {version}, this daemon speaks {}; install matching versions of the \
                         stoker client and daemon",
                        stoker_proto::PROTOCOL_VERSION
                    );
                    let _ = self.send_error((ErrorKind::Version, msg)).await;
                    return Err(());
                }
                tracing::debug!(%client, "hello");
                self.greeted = true;
                Response::Hello {
                    version: stoker_proto::PROTOCOL_VERSION,
                    server: format!("stoker {}", env!("CARGO_PKG_VERSION")),
                }
            }
            Request::OpenStream(open) => {
                return match self.open_stream(open).await {
                    Ok(stream) => self.send_stream(stream).await.map(|()| None).map_err(drop),
                    Err(e) => self.send_error(e).await.map(|()| None),
                };
            }
            Request::Next { stream } => match self.streams.get(&stream) {
                Some(s) => return Ok(Some(s.clone())),
                None => no_stream(stream),
            },
            Request::Release { stream, slot } => {
                match self.streams.get(&stream) {
                    Some(s) if s.release(slot) => {}
                    Some(_) => tracing::warn!(stream, slot, "release of a slot the client does not hold"),
                    // Arrays that outlive `close()` release their slots late: nothing left to do.
                    None => tracing::debug!(stream, slot, "release for a closed stream"),
                }
                return Ok(None);
            }
            Request::SetEpoch { stream, epoch, step } => match self.streams.get(&stream) {
                Some(s) => match s.set_epoch(epoch, step) {
                    Ok(()) => Response::Done,
                    Err(message) => Response::Error { kind: ErrorKind::Protocol, message },
                },
                None => no_stream(stream),
            },
            Request::Status => Response::Status(self.daemon.status()),
            Request::Datasets => Response::Datasets(self.daemon.datasets()),
            Request::Close { stream } => match self.streams.remove(&stream) {
                Some(s) => {
                    s.close();
                    lock(&self.daemon.streams).remove(&stream);
                    Response::Done
                }
                None => no_stream(stream),
            },
        };
        self.send(&reply).await.map(|()| None).map_err(drop)
    }

    async fn deliver(&mut self, stream: u64, delivery: Delivery) -> Result<(), ()> {
        let resp = match delivery {
            Delivery::Batch(ready) => Response::Batch(ready),
            Delivery::EndOfEpoch(epoch) => Response::EndOfEpoch { stream, epoch },
            Delivery::Failed(message) => Response::Error { kind: ErrorKind::Dataset, message },
            Delivery::Exhausted(depth) => Response::Error {
                kind: ErrorKind::RingExhausted,
                message: format!(
                    "all {depth} ring slots are held by this process, so no further batch can be produced; \
                     drop references to old batches (copy what you keep), or raise [ring] depth"
                ),
            },
            Delivery::Closed => Response::Error { kind: ErrorKind::NotFound, message: "stream closed".into() },
        };
        self.send(&resp).await.map_err(drop)
    }

    async fn open_stream(&mut self, open: OpenStream) -> Reply<Arc<Stream>> {
        let limits = &self.daemon.settings.limits;
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
        let daemon = self.daemon.clone();
        let (dataset, peer) = (open.dataset.clone(), self.peer);
        let opened = tokio::task::spawn_blocking(move || daemon.datasets.open(&dataset, &peer))
            .await
            .map_err(|e| (ErrorKind::Internal, format!("dataset open panicked: {e}")))??;
        let (label, source) = (opened.label, opened.source);
        let sampler = Sampler::new(
            source.len(),
            open.rank,
            open.world_size,
            open.batch_size,
            open.shuffle,
            open.seed,
            open.drop_last,
        );
        if open.step > sampler.batches_per_epoch() {
            return Err((
                ErrorKind::Protocol,
                format!("step {} is past the end of the epoch ({} batches)", open.step, sampler.batches_per_epoch()),
            ));
        }
        let layout = BatchLayout::new(open.batch_size, source.fields().iter().map(|f| f.decl()));
        let depth = self.daemon.settings.ring_depth;
        let held: u64 = self.streams.values().map(|s| s.ring().bytes()).sum();
        let want = layout.ring_bytes(depth);
        if held + want > limits.max_ring_bytes_per_client {
            return Err((
                ErrorKind::Limit,
                format!(
                    "this stream needs {want} bytes of shared memory ({depth} slots × {} bytes) and the client already \
                     holds {held}; the limit is {} ([limits] max_ring_bytes_per_client): use a smaller batch_size",
                    layout.slot_bytes, limits.max_ring_bytes_per_client
                ),
            ));
        }
        let id = self.daemon.id();
        let ring = Ring::create(&format!("stoker-stream-{id}"), &layout, depth)
            .map_err(|e| (ErrorKind::Internal, format!("cannot create shared memory of {want} bytes: {e}")))?;
        let meta = StreamMeta {
            id,
            client_id: self.id,
            pid: self.pid,
            dataset: label,
            rank: open.rank,
            world_size: open.world_size,
        };
        let stream = Stream::start(meta, source, sampler, ring, self.daemon.pool.clone(), open.epoch, open.step);
        self.streams.insert(id, stream.clone());
        lock(&self.daemon.streams).insert(id, stream.clone());
        tracing::info!(stream = id, dataset = %stream.meta().dataset, rank = open.rank, world = open.world_size, "stream opened");
        Ok(stream)
    }

    /// Sends `StreamOpened` with the ring's memfd attached to its first byte.
    async fn send_stream(&mut self, stream: Arc<Stream>) -> std::io::Result<()> {
        let info = StreamInfo {
            stream: stream.meta().id,
            num_samples: stream.sampler().per_rank(),
            batches_per_epoch: stream.sampler().batches_per_epoch(),
            depth: stream.ring().depth(),
            layout: stream.layout().clone(),
        };
        let frame = stoker_proto::encode_frame(&Response::StreamOpened(info)).map_err(std::io::Error::other)?;
        let sock: &UnixStream = self.writer.as_ref();
        let fd = stream.ring().fd();
        let mut sent = 0;
        while sent < frame.len() {
            sock.writable().await?;
            match sock.try_io(Interest::WRITABLE, || send_part(sock, &frame[sent..], (sent == 0).then_some(fd))) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn send_part(sock: &UnixStream, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> std::io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)?;
    Ok(n)
}

fn no_stream(stream: u64) -> Response {
    Response::Error { kind: ErrorKind::NotFound, message: format!("no stream {stream} on this connection") }
}
