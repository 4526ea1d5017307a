//! Client of the stoker daemon.
//!
//! [`Client::connect`] opens a connection and checks the protocol version;
//! [`Client::open_stream`] asks the daemon for a stream of batches and maps
//! the stream's shared-memory ring copy-on-write; [`Stream::next`] waits for the
//! next batch and returns a [`Batch`]: typed views straight into the shared
//! slot. Dropping the last clone of a batch gives its slot back to the daemon.
//!
//! With the `cuda` feature, `cuda::Uploader` copies batches to a GPU
//! straight from the ring (see `docs/gpu.md`).
//!
//! Every call blocks the calling thread; waits for a batch can be cut short by
//! a caller-supplied check (Python uses it to answer Ctrl-C).

mod conn;
#[cfg(feature = "cuda")]
pub mod cuda;
mod mapping;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use stoker_proto as proto;
use stoker_proto::{
    BatchLayout, DType, DatasetInfo, ErrorKind, FieldLayout, Generation, OpenStream, Request, Response, StatusReport,
    StreamInfo,
};

use conn::Conn;
pub use mapping::Element;
use mapping::{ControlMap, Mapping};
use stoker_proto::ctrl::{Consumer, RecordKind};

/// Everything that can go wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answers at the socket.
    #[error(
        "no stoker daemon at {path}: {source} (start one with `stoker serve`, or point \
         $STOKER_SOCKET / socket= at the running daemon's socket)"
    )]
    Unavailable {
        /// Socket path tried.
        path: PathBuf,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// The daemon answered with an error.
    /// The socket exists but this user may not connect to it.
    #[error(
        "permission denied on the stoker socket {path} ({detail}): ask the admin to add you to the socket's group \
         or to [server] allowed_uids, or run your own daemon (`stoker serve --socket ...`)"
    )]
    SocketDenied {
        /// The socket path.
        path: PathBuf,
        /// Its mode and owner, as far as they can be read.
        detail: String,
    },
    #[error("{message}")]
    Daemon {
        /// Category.
        kind: ErrorKind,
        /// The daemon's message.
        message: String,
    },
    /// The daemon sent something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The daemon went away mid-conversation (stopped, crashed or restarted).
    #[error("lost the connection to the stoker daemon ({0}); it stopped or restarted, see its log")]
    Disconnected(String),
    /// The connection failed mid-conversation.
    #[error("connection to the stoker daemon failed: {0}")]
    Io(#[from] std::io::Error),
    /// The caller's interrupt check asked to stop waiting.
    #[error("interrupted")]
    Interrupted,
    /// The client was created in another process (before a `fork`).
    #[error(
        "this stoker connection was created in process {owner} and cannot be used from forked \
         process {current}; create the Loader inside the process that uses it"
    )]
    Forked {
        /// Pid that created the connection.
        owner: u32,
        /// Pid trying to use it.
        current: u32,
    },
}

/// Result alias of this crate.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// How often a blocked wait wakes up to run the caller's interrupt check.
pub const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// A connection to the daemon.
#[derive(Debug, Clone)]
pub struct Client {
    conn: Arc<Conn>,
}

impl Client {
    /// Connects to the daemon at `path` and performs the version handshake.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Client::connect_interruptible(path, &mut || false)
    }

    /// Like [`Client::connect`], with an interrupt check as in [`Stream::next_interruptible`]
    /// (a socket whose daemon accepts but never answers would otherwise block forever).
    pub fn connect_interruptible(path: impl AsRef<Path>, interrupted: &mut dyn FnMut() -> bool) -> Result<Client> {
        let path = path.as_ref();
        if let Some(why) = stoker_proto::socket_path_problem(path) {
            let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            return Err(ClientError::Unavailable { path: path.to_owned(), source });
        }
        let sock = UnixStream::connect(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::PermissionDenied {
                ClientError::SocketDenied { path: path.to_owned(), detail: socket_owner(path) }
            } else {
                ClientError::Unavailable { path: path.to_owned(), source }
            }
        })?;
        Client::handshake(sock, interrupted)
    }

    /// Sends `Hello` on a connected socket and checks the daemon's reply: a
    /// daemon of another protocol version, whether it refuses the client or
    /// greets it with its version, is [`ClientError::Daemon`] of kind
    /// [`ErrorKind::Version`].
    fn handshake(sock: UnixStream, interrupted: &mut dyn FnMut() -> bool) -> Result<Client> {
        let conn = Arc::new(Conn::new(sock)?);
        let hello = Request::Hello {
            version: stoker_proto::PROTOCOL_VERSION,
            client: format!("stoker-client {}", env!("CARGO_PKG_VERSION")),
            job: std::env::var("SLURM_JOB_ID").ok().filter(|j| !j.is_empty()),
        };
        match conn.request(&hello, interrupted)? {
            Response::Hello { version, .. } if version == stoker_proto::PROTOCOL_VERSION => Ok(Client { conn }),
            Response::Hello { version, server } => Err(ClientError::Daemon {
                kind: ErrorKind::Version,
                message: format!(
                    "the daemon ({server:.80}) speaks protocol {version}, this client speaks {}; install matching \
                     versions of the stoker client and daemon",
                    stoker_proto::PROTOCOL_VERSION
                ),
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Socket path from `$STOKER_SOCKET`, else [`stoker_proto::DEFAULT_SOCKET`].
    pub fn default_socket() -> PathBuf {
        std::env::var_os(stoker_proto::SOCKET_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(stoker_proto::DEFAULT_SOCKET))
    }

    /// Opens a stream and maps its ring.
    pub fn open_stream(&self, open: OpenStream) -> Result<Stream> {
        self.open_stream_interruptible(open, &mut || false)
    }

    /// Like [`Client::open_stream`], with an interrupt check as in [`Stream::next_interruptible`].
    pub fn open_stream_interruptible(&self, open: OpenStream, interrupted: &mut dyn FnMut() -> bool) -> Result<Stream> {
        let (epoch, step) = (open.epoch, open.step);
        let (resp, fds) = self.conn.request_with_fds(&Request::OpenStream(open), interrupted)?;
        let info = match resp {
            Response::StreamOpened(info) => info,
            other => return Err(unexpected(&other)),
        };
        let [ring, control]: [_; 2] = fds.try_into().map_err(|fds: Vec<_>| {
            ClientError::Protocol(format!(
                "the daemon opened a stream with {} fds, not 2 (ring, control page)",
                fds.len()
            ))
        })?;
        let mapping = Arc::new(Mapping::new(ring, &info.layout, info.depth)?);
        let control = ControlMap::new(control)?;
        let shared = Arc::new(Shared {
            conn: self.conn.clone(),
            stream: info.stream,
            depth: info.depth,
            control,
            consumer: Mutex::new(Consumer::default()),
            extras: Mutex::new(HashMap::new()),
            position: Mutex::new((epoch, step)),
            pending_epoch: Mutex::new(None),
            current: Mutex::new(Current {
                num_samples: info.num_samples,
                batches_per_epoch: info.batches_per_epoch,
                generation: info.generation,
                scanned: epoch,
            }),
        });
        Ok(Stream { info, mapping, shared })
    }

    /// The daemon's status report.
    pub fn status(&self) -> Result<StatusReport> {
        match self.conn.request(&Request::Status, &mut || false)? {
            Response::Status(report) => Ok(report),
            other => Err(unexpected(&other)),
        }
    }

    /// Datasets named in the daemon's config.
    pub fn datasets(&self) -> Result<Vec<DatasetInfo>> {
        match self.conn.request(&Request::Datasets, &mut || false)? {
            Response::Datasets(list) => Ok(list),
            other => Err(unexpected(&other)),
        }
    }

    /// The caches' contents per dataset (what `stoker cache ls` prints).
    pub fn cache_list(&self) -> Result<stoker_proto::CacheReport> {
        match self.conn.request(&Request::CacheList, &mut || false)? {
            Response::CacheList(report) => Ok(report),
            other => Err(unexpected(&other)),
        }
    }

    /// Drops the cache entries of `dataset` (of every dataset with `None`);
    /// returns the entries and bytes dropped.
    pub fn cache_drop(&self, dataset: Option<&str>) -> Result<(u64, u64)> {
        match self.conn.request(&Request::CacheDrop { dataset: dataset.map(str::to_owned) }, &mut || false)? {
            Response::CacheDropped { entries, bytes } => Ok((entries, bytes)),
            other => Err(unexpected(&other)),
        }
    }
}

/// `mode 0600, owner uid 0, group 0` for a socket file, for messages.
fn socket_owner(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(m) => format!("mode {:04o}, owner uid {}, group {}", m.mode() & 0o7777, m.uid(), m.gid()),
        Err(e) => e.to_string(),
    }
}

fn unexpected(resp: &Response) -> ClientError {
    match resp {
        Response::Error { kind, message } => ClientError::Daemon { kind: *kind, message: message.clone() },
        Response::BatchFailed { message, .. } => {
            ClientError::Daemon { kind: ErrorKind::Dataset, message: message.clone() }
        }
        other => ClientError::Protocol(format!("unexpected reply {other:?}")),
    }
}

/// How long `next` spins on the control page before it sleeps.
const SPIN: Duration = Duration::from_micros(20);

/// What a stream's batches and leases share.
#[derive(Debug)]
struct Shared {
    conn: Arc<Conn>,
    stream: u64,
    /// Slots in the ring; ids from here on are extra segments.
    depth: u32,
    control: ControlMap,
    /// Taking records and queueing releases (one thread at a time).
    consumer: Mutex<Consumer>,
    /// Extra segments mapped so far: slot id → (generation, mapping).
    extras: Mutex<HashMap<u32, (u32, Arc<Mapping>)>>,
    /// `(epoch, step)` of the next batch the stream will deliver.
    position: Mutex<(u64, u64)>,
    /// A `SetEpoch` whose wait was cut short: sent again before the next batch.
    pending_epoch: Mutex<Option<(u64, u64)>>,
    /// Counts of the epoch the daemon last moved to (they change with rescan).
    current: Mutex<Current>,
}

/// What a stream's epoch reads, as the daemon last said (open or `EpochSet`).
#[derive(Debug, Clone, Copy)]
struct Current {
    num_samples: u64,
    batches_per_epoch: u64,
    generation: Generation,
    /// The epoch the dataset was last scanned for (rescan streams).
    scanned: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Gives `slot` back: through the control page, or by message when its
    /// queue is full; wakes the daemon if it waits for it.
    fn release(&self, slot: u32) {
        if !self.control.is_mapped_here() {
            // A forked child's copy of a lease: the slot is the parent's to give back.
            return;
        }
        let queued = lock(&self.consumer).release(self.control.control(), slot);
        // A failed send means the connection is gone, and with it every lease.
        let _ = match queued {
            Some(false) => Ok(()),
            Some(true) => self.conn.send_oneway(&Request::Wake { stream: self.stream }),
            None => self.conn.send_oneway(&Request::Release { stream: self.stream, slot }),
        };
    }
}

/// A stream of batches from one dataset, for one rank.
#[derive(Debug)]
pub struct Stream {
    info: StreamInfo,
    mapping: Arc<Mapping>,
    shared: Arc<Shared>,
}

impl Stream {
    /// Stream metadata as opened: id, sample and batch counts, layout. The
    /// counts of a rescan stream's later epochs are [`Stream::batches_per_epoch`] and so on.
    pub fn info(&self) -> &StreamInfo {
        &self.info
    }

    /// Batches per epoch for this rank in the epoch the stream was last moved to.
    pub fn batches_per_epoch(&self) -> u64 {
        lock(&self.shared.current).batches_per_epoch
    }

    /// Samples per rank in the epoch the stream was last moved to.
    pub fn num_samples(&self) -> u64 {
        lock(&self.shared.current).num_samples
    }

    /// The dataset generation (file or key list) of the epoch the stream was last moved to.
    pub fn generation(&self) -> Generation {
        lock(&self.shared.current).generation
    }

    /// Address range `(start, len)` of this stream's ring (copy-on-write mapping).
    pub fn mapping_range(&self) -> (usize, usize) {
        self.mapping.range()
    }

    /// Address range `(start, len)` of a shared, read-only view of the same
    /// ring, mapped on first call: what a GPU upload registers with the
    /// driver (a pin of the copy-on-write mapping would pin stale private
    /// copies; see `docs/gpu.md`). A field at `p` in [`Stream::mapping_range`]
    /// lies at `p - start + shared_start` here.
    pub fn shared_range(&self) -> std::result::Result<(usize, usize), String> {
        self.mapping.shared_view()
    }

    /// Moves the stream to `epoch`, resuming at batch `step`.
    pub fn set_epoch(&self, epoch: u64, step: u64) -> Result<()> {
        self.set_epoch_interruptible(epoch, step, &mut || false)
    }

    /// Like [`Stream::set_epoch`], with an interrupt check as in
    /// [`Stream::next_interruptible`]. A no-op (no message) when the stream
    /// is already there, as after an epoch ends, unless it rescans its
    /// dataset and `epoch` was not scanned yet.
    pub fn set_epoch_interruptible(&self, epoch: u64, step: u64, interrupted: &mut dyn FnMut() -> bool) -> Result<()> {
        self.shared.conn.check_pid()?;
        if lock(&self.shared.pending_epoch).is_none() && self.position() == (epoch, step) && !self.needs_rescan(epoch) {
            return Ok(());
        }
        // Nobody takes records while the stream moves.
        let mut consumer = lock(&self.shared.consumer);
        let req = Request::SetEpoch { stream: self.info.stream, epoch, step };
        match self.shared.conn.request(&req, interrupted) {
            Ok(Response::EpochSet { skip_to, num_samples, batches_per_epoch, generation, .. }) => {
                consumer.skip_to(self.shared.control.control(), skip_to);
                *lock(&self.shared.current) = Current { num_samples, batches_per_epoch, generation, scanned: epoch };
                *lock(&self.shared.position) = (epoch, step);
                *lock(&self.shared.pending_epoch) = None;
                Ok(())
            }
            Ok(other) => Err(unexpected(&other)),
            Err(e) => {
                // The daemon may move anyway: move it again before the next batch.
                *lock(&self.shared.pending_epoch) = Some((epoch, step));
                Err(e)
            }
        }
    }

    /// Whether moving to `epoch` makes the daemon match a rescan dataset again.
    fn needs_rescan(&self, epoch: u64) -> bool {
        self.info.rescan && lock(&self.shared.current).scanned != epoch
    }

    /// `(epoch, step)` of the next batch this stream will deliver, counting
    /// every batch taken or failed.
    pub fn position(&self) -> (u64, u64) {
        *lock(&self.shared.position)
    }

    /// Waits for the next batch; `None` at the end of the epoch.
    pub fn next(&self) -> Result<Option<Batch>> {
        self.next_interruptible(&mut || false)
    }

    /// Like [`Stream::next`], but calls `interrupted` every [`INTERRUPT_POLL`]
    /// while waiting and returns [`ClientError::Interrupted`] once it says so.
    ///
    /// A batch that is already waiting is taken from the control page with no
    /// system call; otherwise the call spins briefly, then sleeps on a futex
    /// the daemon wakes when it publishes.
    pub fn next_interruptible(&self, interrupted: &mut dyn FnMut() -> bool) -> Result<Option<Batch>> {
        // The control page is not mapped in a forked child.
        self.shared.conn.check_pid()?;
        let pending = *lock(&self.shared.pending_epoch);
        if let Some((epoch, step)) = pending {
            self.set_epoch_interruptible(epoch, step, interrupted)?;
        }
        // A rescan stream does not produce past an epoch's end: the next
        // epoch starts once its files are matched, which `set_epoch` asks for.
        let (epoch, step) = self.position();
        if self.needs_rescan(epoch) {
            self.set_epoch_interruptible(epoch, step, interrupted)?;
        }
        let control = self.shared.control.control();
        let mut spin_until: Option<Instant> = None;
        loop {
            let taken = lock(&self.shared.consumer).poll(control).map_err(|e| ClientError::Protocol(e.to_string()))?;
            if let Some((seq, rec)) = taken {
                match rec.kind {
                    RecordKind::Batch => {
                        *lock(&self.shared.position) = (rec.epoch, rec.step.saturating_add(1));
                        return self.batch(rec, interrupted).map(Some);
                    }
                    RecordKind::EndOfEpoch => {
                        *lock(&self.shared.position) = (rec.epoch.saturating_add(1), 0);
                        return Ok(None);
                    }
                    RecordKind::Failed => {
                        *lock(&self.shared.position) = (rec.epoch, rec.step.saturating_add(1));
                        let req = Request::Fetch { stream: self.info.stream, seq };
                        return Err(unexpected(&self.shared.conn.request(&req, interrupted)?));
                    }
                    RecordKind::Exhausted => {
                        let req = Request::Fetch { stream: self.info.stream, seq };
                        match self.shared.conn.request(&req, interrupted)? {
                            Response::Done => continue,
                            other => return Err(unexpected(&other)),
                        }
                    }
                    RecordKind::Closed => {
                        return Err(ClientError::Disconnected("the daemon is shutting down".into()));
                    }
                }
            }
            // Nothing yet: spin a little (a batch is often microseconds away) ...
            let now = Instant::now();
            if *spin_until.get_or_insert(now + SPIN) > now {
                std::hint::spin_loop();
                continue;
            }
            // ... then sleep on `published` until the daemon publishes.
            let sleep_on = {
                let consumer = lock(&self.shared.consumer);
                if consumer.take_wake(control) {
                    self.shared.conn.send_oneway(&Request::Wake { stream: self.info.stream })?;
                }
                consumer.prepare_sleep(control)
            };
            if let Some(value) = sleep_on {
                let timeout = rustix::fs::Timespec { tv_sec: 0, tv_nsec: INTERRUPT_POLL.as_nanos() as i64 };
                let slept = Instant::now();
                // Not FUTEX_PRIVATE: the daemon wakes it from another process.
                let _ = rustix::thread::futex::wait(
                    &control.daemon.published,
                    rustix::thread::futex::Flags::empty(),
                    value,
                    Some(&timeout),
                );
                let waited = u64::try_from(slept.elapsed().as_nanos()).unwrap_or(u64::MAX);
                lock(&self.shared.consumer).done_sleeping(control, waited);
                if interrupted() {
                    return Err(ClientError::Interrupted);
                }
                if self.shared.conn.peer_closed() {
                    return Err(ClientError::Disconnected("it closed the connection".into()));
                }
            }
        }
    }

    /// The batch a record names, mapping its extra segment if need be.
    fn batch(&self, rec: stoker_proto::ctrl::Record, interrupted: &mut dyn FnMut() -> bool) -> Result<Batch> {
        let (mapping, index) = if rec.slot < self.info.depth {
            (self.mapping.clone(), rec.slot)
        } else {
            (self.extra(rec.slot, rec.segment, interrupted)?, 0)
        };
        let lease = Lease { shared: self.shared.clone(), mapping, slot: rec.slot, index };
        if rec.rows > lease.mapping.layout().batch_size {
            return Err(ClientError::Protocol(format!(
                "batch of {} rows exceeds the batch size {}",
                rec.rows,
                lease.mapping.layout().batch_size
            )));
        }
        Ok(Batch { lease: Arc::new(lease), epoch: rec.epoch, step: rec.step, rows: rec.rows })
    }

    /// The mapping of extra slot `slot`'s segment of generation `generation`.
    fn extra(&self, slot: u32, generation: u32, interrupted: &mut dyn FnMut() -> bool) -> Result<Arc<Mapping>> {
        if let Some((g, mapping)) = lock(&self.shared.extras).get(&slot)
            && *g == generation
        {
            return Ok(mapping.clone());
        }
        let req = Request::Segment { stream: self.info.stream, slot };
        let (resp, fds) = self.shared.conn.request_with_fds(&req, interrupted)?;
        let (got, layout) = match resp {
            Response::Segment { generation, layout, .. } => (generation, layout),
            other => return Err(unexpected(&other)),
        };
        let fd =
            fds.into_iter().next().ok_or_else(|| ClientError::Protocol("a segment reply without its fd".into()))?;
        if got != generation {
            return Err(ClientError::Protocol(format!(
                "slot {slot} holds segment {got}, not {generation} as its record says"
            )));
        }
        let mapping = Arc::new(Mapping::new(fd, &layout, 1)?);
        lock(&self.shared.extras).insert(slot, (generation, mapping.clone()));
        Ok(mapping)
    }

    /// Closes the stream (dropping it without closing also frees it when the connection ends).
    pub fn close(&self) -> Result<()> {
        match self.shared.conn.request(&Request::Close { stream: self.info.stream }, &mut || false)? {
            Response::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }
}

impl Lease {
    /// Slots in the ring proper (ids past it are extra segments).
    fn mapping_depth(&self) -> u32 {
        self.shared.depth
    }
}

/// Holds one slot; dropping it releases the slot to the daemon.
#[derive(Debug)]
struct Lease {
    shared: Arc<Shared>,
    mapping: Arc<Mapping>,
    /// Slot id (for the daemon).
    slot: u32,
    /// The slot's index in `mapping`.
    index: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Writes to the batch were private copy-on-write pages: drop them so
        // the next batch in this slot is read from the daemon's pages.
        self.mapping.discard(self.index);
        if self.slot >= self.mapping_depth() {
            // The daemon may destroy an extra segment once it is back: do not
            // keep it mapped (its memory would outlive the daemon's accounting).
            lock(&self.shared.extras).remove(&self.slot);
        }
        self.shared.release(self.slot);
    }
}

/// One batch: per-field views of a leased slot. Cloning shares the lease.
#[derive(Debug, Clone)]
pub struct Batch {
    lease: Arc<Lease>,
    epoch: u64,
    step: u64,
    rows: u64,
}

impl Batch {
    /// Epoch this batch belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Position of the batch in its epoch.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Rows (samples) in the batch.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Slot index the batch occupies.
    pub fn slot(&self) -> u32 {
        self.lease.slot
    }

    /// Field layouts, in declaration order.
    pub fn layout(&self) -> &BatchLayout {
        self.lease.mapping.layout()
    }

    /// The named field, or `None`.
    pub fn field(&self, name: &str) -> Option<FieldView<'_>> {
        let layout = self.layout().fields.iter().find(|f| f.name == name)?;
        Some(self.view(layout))
    }

    /// All fields, in declaration order.
    pub fn fields(&self) -> impl Iterator<Item = FieldView<'_>> {
        self.layout().fields.iter().map(|f| self.view(f))
    }

    fn view<'a>(&'a self, layout: &'a FieldLayout) -> FieldView<'a> {
        let mapping = &self.lease.mapping;
        let len = (layout.sample_bytes() * self.rows) as usize;
        let data_offset = layout.ragged.map_or(layout.offset, |r| r.data_offset);
        let bytes = mapping.slot_bytes(self.lease.index, data_offset, len);
        let shapes = if layout.ragged.is_some() {
            mapping.slot_bytes(self.lease.index, layout.offset, layout.shape_table_bytes(self.rows) as usize)
        } else {
            &[]
        };
        FieldView { layout, rows: self.rows, bytes, shapes }
    }
}

/// One field of a batch, borrowed from shared memory.
#[derive(Debug, Clone, Copy)]
pub struct FieldView<'a> {
    layout: &'a FieldLayout,
    rows: u64,
    bytes: &'a [u8],
    /// A ragged field's shape table (native-endian u64 per dimension per row).
    shapes: &'a [u8],
}

impl<'a> FieldView<'a> {
    /// Field name.
    pub fn name(&self) -> &'a str {
        &self.layout.name
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    /// Shape including the batch axis (for a ragged field, 0 marks the varying dimensions).
    pub fn shape(&self) -> Vec<u64> {
        std::iter::once(self.rows).chain(self.layout.shape.iter().copied()).collect()
    }

    /// Whether samples of this field vary in shape (see [`FieldView::row`]).
    pub fn is_ragged(&self) -> bool {
        self.layout.ragged.is_some()
    }

    /// Raw native-endian bytes, C order (for a ragged field: every row's
    /// reserved region, `row_stride` bytes apart).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Row `i`'s shape and values (C order, native-endian), for fixed and ragged fields.
    pub fn row(&self, i: u64) -> Result<(Vec<u64>, &'a [u8])> {
        if i >= self.rows {
            return Err(ClientError::Protocol(format!("row {i} of a batch of {}", self.rows)));
        }
        let stride = self.layout.sample_bytes();
        let start = (i * stride) as usize;
        let shape: Vec<u64> = match self.layout.ragged {
            None => self.layout.shape.clone(),
            Some(_) => {
                let ndim = self.layout.shape.len();
                self.shapes[i as usize * ndim * 8..(i as usize + 1) * ndim * 8]
                    .chunks_exact(8)
                    .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            }
        };
        let len = shape.iter().try_fold(self.layout.dtype.size() as u64, |acc, &d| acc.checked_mul(d));
        match len {
            Some(len) if len <= stride => Ok((shape, &self.bytes[start..start + len as usize])),
            _ => Err(ClientError::Protocol(format!(
                "field {:?} row {i} has shape {shape:?}, larger than its {stride}-byte region",
                self.layout.name
            ))),
        }
    }

    /// Typed elements, or `None` when `T` is not this field's dtype or the field is ragged.
    pub fn as_slice<T: Element>(&self) -> Option<&'a [T]> {
        (T::DTYPE == self.layout.dtype && !self.is_ragged()).then(|| mapping::cast_slice(self.bytes))
    }
}
