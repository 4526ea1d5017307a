//! One client connection: reads its frames, answers each request in order,
//! opens its streams (dataset, sampler, ring, budget) and sends their rings'
//! descriptors; everything it opened goes away with it.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoker_proto::{BatchLayout, ClientStatus, ErrorKind, OpenStream, Request, Response, StreamInfo};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, watch};

use crate::config::LimitsConfig;
use crate::error::WireError;
use crate::ring::{ControlPage, Ring};
use crate::stream::{Budget, Fetched, Reservation, Shm, Stream, StreamMeta};
use stoker_data::sampler::{Sampler, Shuffle};

use super::*;

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
    /// Set when the client closed its end (or the connection ended): an
    /// open still running for it stops.
    gone: Arc<std::sync::atomic::AtomicBool>,
}

pub(super) async fn serve_connection(daemon: Arc<Daemon>, sock: UnixStream, id: u64, mut stop: watch::Receiver<bool>) {
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
        refuse_bounded(&daemon, uid, sock, WireError::new(ErrorKind::PermissionDenied, msg), settings.frame_timeout)
            .await;
        return;
    }
    let _admission = match daemon.admit(uid) {
        Ok(a) => a,
        Err(full) => {
            if let Some(suppressed) = lock(&daemon.refusals).allow() {
                tracing::warn!(uid, pid, suppressed, "refused: {full}");
            }
            let error = WireError::new(ErrorKind::Limit, full.to_string());
            refuse_bounded(&daemon, uid, sock, error, settings.frame_timeout).await;
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
        gone: Arc::default(),
    };
    let client =
        ClientStatus { id, pid, uid, job: None, streams: 0, connected_s: 0.0, wait_s: 0.0, stall_percent: 0.0 };
    lock(&daemon.clients).insert(id, client);
    let kick = Arc::new(tokio::sync::Notify::new());
    lock(&daemon.connected).insert(id, admission::Presence::new(uid, kick.clone()));

    let (tx, mut frames) = mpsc::channel(MAX_BACKLOG);
    let gone = conn.gone.clone();
    let (limit, deadline) = (settings.limits.max_message_bytes, settings.frame_timeout);
    let read_task = tokio::spawn(async move {
        read_frames(reader, tx, limit, deadline).await;
        // The client closed its end (or broke the protocol): nobody waits
        // for an open still running.
        gone.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    drop(settings);
    loop {
        tokio::select! {
            frame = frames.recv() => match frame {
                None => break,
                Some(Err(bad)) => {
                    let _ = conn.send(&WireError::new(ErrorKind::Protocol, bad.to_string()).into()).await;
                    break;
                }
                Some(Ok(req)) => {
                    if let Some(p) = lock(&daemon.connected).get_mut(&id) {
                        p.busy();
                    }
                    let ended = conn.handle(req).await.is_err();
                    if let Some(p) = lock(&daemon.connected).get_mut(&id) {
                        p.active(conn.streams.len());
                    }
                    if ended {
                        break;
                    }
                }
            },
            () = kick.notified() => {
                // Idle (no stream, no request for a while) and its place was
                // needed by a new connection: the daemon or its uid was full.
                // (A request that came in the meantime and opened a stream wins.)
                if conn.streams.is_empty() {
                    tracing::info!(uid, pid, "closing an idle connection: its place was needed");
                    break;
                }
            }
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
    conn.gone.store(true, std::sync::atomic::Ordering::Relaxed);
    for (_, stream) in conn.streams.drain() {
        stream.close(false);
        lock(&daemon.streams).remove(&stream.meta().id);
        tracing::info!(stream = stream.meta().id, dataset = %stream.meta().dataset, uid, pid, "stream closed (connection ended)");
    }
    lock(&daemon.clients).remove(&id);
    lock(&daemon.connected).remove(&id);
    tracing::info!(uid, pid, job = conn.job.as_deref().unwrap_or("-"), "disconnected");
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

    async fn send_error(&mut self, error: WireError) -> Result<(), ()> {
        self.send(&error.into()).await.map_err(drop)
    }

    /// Handles one request; `Err` closes the connection.
    async fn handle(&mut self, req: Request) -> Result<(), ()> {
        if !self.greeted && !matches!(req, Request::Hello { .. }) {
            let err = WireError::new(ErrorKind::Protocol, "the first message must be Hello");
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
                    let _ = self.send_error(WireError::new(ErrorKind::Version, msg)).await;
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
            Request::Fetch { stream, seq } => self.fetch(stream, seq),
            Request::Segment { stream, slot } => return self.send_segment(stream, slot).await,
            Request::Release { stream, slot } => {
                self.release(stream, slot);
                return Ok(());
            }
            Request::SetEpoch { stream, epoch, step } => self.set_epoch(stream, epoch, step).await,
            Request::Status => Response::Status(self.daemon.status(self.uid, self.id)),
            Request::Datasets => Response::Datasets(self.daemon.datasets()),
            Request::CacheList => Response::CacheList(self.daemon.cache_report(self.uid)),
            Request::CacheDrop { dataset } => self.daemon.cache_drop(self.uid, dataset.as_deref()),
            Request::Close { stream } => self.close_stream(stream),
        };
        self.send(&reply).await.map_err(drop)
    }

    /// The details of failed or special record `seq` of `stream`.
    fn fetch(&self, stream: u64, seq: u32) -> Response {
        let Some(s) = self.streams.get(&stream) else { return no_stream(stream) };
        match s.fetch(seq) {
            Fetched::Failed { epoch, step, message } => Response::BatchFailed { stream, epoch, step, message },
            Fetched::Resumed => Response::Done,
            Fetched::Exhausted(message) => WireError::new(ErrorKind::RingExhausted, message).into(),
            Fetched::Unknown => WireError::new(
                ErrorKind::Protocol,
                format!("stream {stream} has no record {seq} with details to fetch"),
            )
            .into(),
        }
    }

    /// Sends extra segment `slot` of `stream` with its memfd.
    async fn send_segment(&mut self, stream: u64, slot: u32) -> Result<(), ()> {
        match self.streams.get(&stream).and_then(|s| s.segment(slot)) {
            Some(seg) => {
                let resp =
                    Response::Segment { stream, slot, generation: seg.generation, layout: seg.ring.layout().clone() };
                self.send_with_fds(&resp, &[seg.ring.fd()]).await.map_err(drop)
            }
            None => {
                let message = format!("stream {stream} has no extra slot {slot} (any more)");
                self.send_error(WireError::new(ErrorKind::NotFound, message)).await
            }
        }
    }

    /// A one-way `Release` (the control page's queue is the usual path).
    fn release(&mut self, stream: u64, slot: u32) {
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
    }

    /// Moves `stream` to (`epoch`, `step`), matching a rescanned dataset's files again first.
    async fn set_epoch(&mut self, stream: u64, epoch: u64, step: u64) -> Response {
        let Some(s) = self.streams.get(&stream).cloned() else { return no_stream(stream) };
        let rescanned = match self.rescans.get(&stream).cloned() {
            Some(open) if s.needs_rescan(epoch) => match self.rescan(&s, &open, epoch).await {
                Ok(rescanned) => Some(rescanned),
                Err(e) => return e.into(),
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
            Err(e) => WireError::from(e).into(),
        }
    }

    /// Closes `stream`; arrays still alive keep their pages until dropped.
    fn close_stream(&mut self, stream: u64) -> Response {
        let Some(s) = self.streams.remove(&stream) else { return no_stream(stream) };
        self.rescans.remove(&stream);
        s.close(false);
        lock(&self.daemon.streams).remove(&stream);
        tracing::info!(stream, dataset = %s.meta().dataset, uid = self.uid, pid = self.pid, "stream closed");
        Response::Done
    }

    async fn open_stream(&mut self, open: OpenStream) -> Result<Arc<Stream>, WireError> {
        let settings = self.daemon.settings();
        let limits = &settings.limits;
        self.check_open(&open, limits)?;
        let opened = self.open_dataset(&open).await?;
        let (label, source, generation) = (opened.label, opened.source, opened.generation);
        let fingerprint = opened.fingerprint;
        let sampler = sampler_for(&open, &label, source.len())?;
        if open.step > sampler.batches_per_epoch() {
            return Err(WireError::new(
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
                WireError::new(ErrorKind::Limit, format!("dataset {label}{}: {e}", origin.unwrap_or_default()))
            })?;
        let depth = settings.ring_depth;
        let want = layout
            .checked_ring_bytes(depth)
            .and_then(|b| b.checked_add(stoker_proto::ctrl::CTRL_BYTES))
            .unwrap_or(u64::MAX);
        let user = self.daemon.uid_budget(self.uid);
        let [mine, users, ours] = self.reserve(want, depth, &layout, limits, &user)?;
        let id = self.daemon.id();
        let shm_err = |e: std::io::Error| {
            WireError::new(ErrorKind::Internal, format!("cannot create shared memory of {want} bytes: {e}"))
        };
        let ring = Ring::create(&format!("stoker-stream-{id}"), &layout, depth).map_err(shm_err)?;
        let control = ControlPage::create(&format!("stoker-stream-{id}-control")).map_err(shm_err)?;
        let shm = Shm {
            ring,
            control,
            budgets: [self.budget.clone(), user, self.daemon.memory.clone()],
            reserved: Mutex::new(vec![mine, users, ours]),
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
            share: Some((self.daemon.fair.clone(), self.uid)),
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

    /// The limits an `OpenStream` is checked against before anything is opened.
    fn check_open(&self, open: &OpenStream, limits: &LimitsConfig) -> Result<(), WireError> {
        if open.batch_size == 0 || open.batch_size > limits.max_batch_size {
            return Err(WireError::new(
                ErrorKind::Limit,
                format!(
                    "batch_size {} is outside 1..={} ([limits] max_batch_size)",
                    open.batch_size, limits.max_batch_size
                ),
            ));
        }
        if open.world_size == 0 || open.rank >= open.world_size {
            return Err(WireError::new(
                ErrorKind::Protocol,
                format!("rank {} is not below world_size {}", open.rank, open.world_size),
            ));
        }
        if self.streams.len() >= limits.max_streams_per_client {
            return Err(WireError::new(
                ErrorKind::Limit,
                format!(
                    "this client already has {} streams open ([limits] max_streams_per_client)",
                    self.streams.len()
                ),
            ));
        }
        Ok(())
    }

    /// Reserves `want` bytes of shared memory against the client's, its
    /// user's (`user`) and the daemon's budgets.
    fn reserve(
        &self,
        want: u64,
        depth: u32,
        layout: &BatchLayout,
        limits: &LimitsConfig,
        user: &Arc<Budget>,
    ) -> Result<[Reservation; 3], WireError> {
        // Reserved atomically, so concurrent opens (and ring growth) cannot
        // together overshoot either budget.
        let mine = self.budget.reserve(want).map_err(|held| {
            WireError::new(
                ErrorKind::Limit,
                format!(
                    "this stream needs {want} bytes of shared memory ({depth} slots × {} bytes) and the client already \
                     holds {held}; the limit is {} ([limits] max_ring_bytes_per_client): use a smaller batch_size",
                    layout.slot_bytes,
                    self.budget.limit()
                ),
            )
        })?;
        let users = user.reserve(want).map_err(|held| {
            WireError::new(
                ErrorKind::Limit,
                format!(
                    "this stream needs {want} bytes of shared memory ({depth} slots × {} bytes) and the streams of \
                     uid {} already hold {held}; one user may hold at most {} ([limits] max_memory_bytes_per_uid, by \
                     default half of the daemon's memory for streams) so that other users can open theirs: close \
                     Loaders you no longer use, or use a smaller batch_size",
                    layout.slot_bytes,
                    self.uid,
                    user.limit()
                ),
            )
        })?;
        let ours = self.daemon.memory.reserve(want).map_err(|total| {
            let cache = self.daemon.caches.capacity();
            WireError::new(
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
        Ok([mine, users, ours])
    }

    /// Opens (or reuses) the dataset `open` names, off the async threads, with the client's rights.
    async fn open_dataset(&self, open: &OpenStream) -> Result<crate::dataset::Opened, WireError> {
        let daemon = self.daemon.clone();
        let (dataset, peer) = (open.dataset.clone(), self.peer);
        let gone = self.gone.clone();
        tokio::task::spawn_blocking(move || {
            // A glob walk stops when the client leaves.
            let _scope = stoker_data::cancel::Scope::enter(gone);
            daemon.datasets.open(&dataset, &peer)
        })
        .await
        .map_err(|e| {
            let why = if e.is_panic() { crate::stream::panic_message(&*e.into_panic()) } else { e.to_string() };
            tracing::error!(dataset = ?open.dataset, %why, "opening a dataset panicked");
            WireError::new(
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
    ) -> Result<(Arc<dyn stoker_data::source::Source>, Sampler, stoker_proto::Generation), WireError> {
        let label = &stream.meta().dataset;
        let opened = self.open_dataset(open).await.map_err(|e| {
            WireError::new(e.kind, format!("rescanning dataset {label} for epoch {epoch}: {}", e.message))
        })?;
        let was = stream.source();
        let decls = |s: &Arc<dyn stoker_data::source::Source>| s.fields().iter().map(|f| f.decl()).collect::<Vec<_>>();
        if decls(&opened.source) != decls(&was) {
            let show = |s: &Arc<dyn stoker_data::source::Source>| {
                s.fields().iter().map(|f| format!("{} {:?} {:?}", f.name, f.dtype, f.shape)).collect::<Vec<_>>()
            };
            return Err(WireError::new(
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
            return Err(WireError::new(
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

/// The sampler of a stream opened as `open`, over `samples` samples (`≥ 1`)
/// of dataset `label`: at open, and again for each rescanned epoch.
fn sampler_for(open: &OpenStream, label: &str, samples: u64) -> Result<Sampler, WireError> {
    let shuffle = match (open.shuffle, open.block) {
        (shuffle, None) => Shuffle::from(shuffle),
        (true, Some(b)) => Shuffle::Block { block_size: b.block_size, window: b.window },
        (false, Some(_)) => {
            return Err(WireError::new(
                ErrorKind::Protocol,
                "a block order needs shuffle; send block: None without it",
            ));
        }
    };
    shuffle.check(samples).map_err(|e| WireError::new(ErrorKind::Protocol, format!("dataset {label}: {e}")))?;
    Ok(Sampler::new(samples, open.rank, open.world_size, open.batch_size, shuffle, open.seed, open.drop_last))
}

fn no_stream(stream: u64) -> Response {
    Response::Error { kind: ErrorKind::NotFound, message: format!("no stream {stream} on this connection") }
}
