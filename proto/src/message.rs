//! Requests, responses and the reports they carry.

use serde::{Deserialize, Serialize};

use crate::layout::BatchLayout;

/// A message from a client to the daemon.
///
/// Every request gets exactly one [`Response`], except [`Request::Release`],
/// which is one-way so that releasing a slot never costs a round trip.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    /// First message on a connection.
    Hello {
        /// The client's [`crate::PROTOCOL_VERSION`].
        version: u32,
        /// Free-form client description for logs (`"stoker-py 0.1.0"`).
        client: String,
    },
    /// Opens a stream; the reply carries the ring's memfd as `SCM_RIGHTS`.
    OpenStream(OpenStream),
    /// Asks for the next batch of the stream's current epoch.
    Next {
        /// Stream id from [`StreamInfo::stream`].
        stream: u64,
    },
    /// Gives a slot back (one-way, no reply).
    Release {
        /// Stream id.
        stream: u64,
        /// Slot from [`BatchReady::slot`].
        slot: u32,
    },
    /// Moves the stream to `epoch`, resuming at batch `step` of it.
    SetEpoch {
        /// Stream id.
        stream: u64,
        /// Epoch that seeds the permutation.
        epoch: u64,
        /// First batch to deliver (0 to start the epoch from the beginning).
        step: u64,
    },
    /// Asks for the daemon's status report.
    Status,
    /// Lists the datasets named in the daemon's config.
    Datasets,
    /// Closes a stream and frees its ring.
    Close {
        /// Stream id.
        stream: u64,
    },
}

/// Which dataset to serve, and how.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenStream {
    /// The dataset.
    pub dataset: DatasetRef,
    /// Samples per batch.
    pub batch_size: u64,
    /// Permute the indices each epoch (seeded by `seed` and the epoch).
    pub shuffle: bool,
    /// Seed of the permutation, shared by all ranks.
    pub seed: u64,
    /// Drop the tail that does not divide evenly among ranks, and the last partial batch.
    pub drop_last: bool,
    /// This client's rank.
    pub rank: u64,
    /// Number of ranks sharing the dataset.
    pub world_size: u64,
    /// Epoch to start in.
    pub epoch: u64,
    /// Batch of that epoch to start at.
    pub step: u64,
}

/// A dataset named in the daemon's config or described ad hoc by the client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum DatasetRef {
    /// A `[datasets.NAME]` table of the daemon's config.
    Named(String),
    /// HDF5 files matching a glob, each field an HDF5 dataset path.
    Hdf5 {
        /// Absolute glob; files are taken in sorted order.
        files: String,
        /// `(field name, HDF5 path)` pairs, in delivery order.
        fields: Vec<(String, String)>,
        /// Optional window along axis 1: `(size, stride)`.
        window: Option<(u64, u64)>,
        /// Fields delivered whole per item when windowed.
        per_item: Vec<String>,
    },
}

/// A message from the daemon to a client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Response {
    /// Reply to [`Request::Hello`].
    Hello {
        /// The daemon's protocol version.
        version: u32,
        /// Daemon version string.
        server: String,
    },
    /// Reply to [`Request::OpenStream`]; the ring's memfd travels with it.
    StreamOpened(StreamInfo),
    /// A filled slot, now leased to the client until it sends [`Request::Release`].
    Batch(BatchReady),
    /// Reply to [`Request::Next`] when the epoch has no more batches.
    EndOfEpoch {
        /// Stream id.
        stream: u64,
        /// The epoch that ended.
        epoch: u64,
    },
    /// Reply to requests that carry no data ([`Request::SetEpoch`], [`Request::Close`]).
    Done,
    /// Reply to [`Request::Status`].
    Status(StatusReport),
    /// Reply to [`Request::Datasets`].
    Datasets(Vec<DatasetInfo>),
    /// The request failed; `message` names the file, field and index involved.
    Error {
        /// Category, mapped to an exception class by clients.
        kind: ErrorKind,
        /// Human-readable message saying what went wrong and what to do.
        message: String,
    },
}

/// Category of an [`Response::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The peer speaks another protocol version.
    Version,
    /// A malformed or unexpected message.
    Protocol,
    /// The dataset cannot be opened or a sample cannot be read.
    Dataset,
    /// A configured limit would be exceeded.
    Limit,
    /// The peer's uid, or the dataset's path, is not allowed.
    PermissionDenied,
    /// No such stream or dataset name.
    NotFound,
    /// Every slot of the ring is leased by the client, so the next batch cannot be produced.
    RingExhausted,
    /// The daemon is shutting down.
    ShuttingDown,
    /// A bug or an operating-system failure inside the daemon.
    Internal,
}

/// What a client needs to read a stream's batches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamInfo {
    /// Stream id, unique within the daemon.
    pub stream: u64,
    /// Samples in the dataset (before sharding).
    pub num_samples: u64,
    /// Batches per epoch for this rank.
    pub batches_per_epoch: u64,
    /// Slots in the ring.
    pub depth: u32,
    /// Where fields lie inside each slot.
    pub layout: BatchLayout,
}

/// A slot holding batch `step` of `epoch`, leased to the client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchReady {
    /// Stream id.
    pub stream: u64,
    /// Epoch of the batch.
    pub epoch: u64,
    /// Position of the batch in the epoch.
    pub step: u64,
    /// Slot index; see [`BatchLayout::slot_offset`].
    pub slot: u32,
    /// Rows filled (`batch_size`, or fewer for a last partial batch).
    pub rows: u64,
}

/// A dataset named in the config.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetInfo {
    /// Name under `[datasets]`.
    pub name: String,
    /// Source format (`"hdf5"`).
    pub format: String,
    /// Glob of its files.
    pub files: String,
    /// `(field, path)` pairs.
    pub fields: Vec<(String, String)>,
    /// Window along axis 1 as `(size, stride)`, if any.
    pub window: Option<(u64, u64)>,
    /// Fields delivered whole per item when windowed.
    pub per_item: Vec<String>,
}

/// The daemon's state, as `stoker status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    /// Daemon version.
    pub version: String,
    /// Daemon process id.
    pub pid: u32,
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// Decode worker threads.
    pub worker_threads: u64,
    /// Connected clients.
    pub clients: Vec<ClientStatus>,
    /// Open streams.
    pub streams: Vec<StreamStatus>,
    /// The node-wide cache of decoded HDF5 chunks.
    pub chunk_cache: CacheStatus,
}

/// Occupancy and effectiveness of a cache.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheStatus {
    /// Bytes held.
    pub bytes: u64,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Entries held.
    pub entries: u64,
    /// Lookups that hit.
    pub hits: u64,
    /// Lookups that missed.
    pub misses: u64,
}

/// One connected client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientStatus {
    /// Connection id.
    pub id: u64,
    /// Peer pid from `SO_PEERCRED`.
    pub pid: u32,
    /// Peer uid from `SO_PEERCRED`.
    pub uid: u32,
    /// Streams the client has open.
    pub streams: u64,
    /// Seconds since it connected.
    pub connected_s: f64,
}

/// One open stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamStatus {
    /// Stream id.
    pub id: u64,
    /// Owning connection.
    pub client_id: u64,
    /// Owning process.
    pub pid: u32,
    /// Dataset name, or the glob of an ad-hoc dataset.
    pub dataset: String,
    /// Rank and world size.
    pub rank: u64,
    /// World size.
    pub world_size: u64,
    /// Current epoch.
    pub epoch: u64,
    /// Next batch to deliver in this epoch.
    pub step: u64,
    /// Batches per epoch for this rank.
    pub batches_per_epoch: u64,
    /// Batches delivered since the stream opened.
    pub batches: u64,
    /// Batches per second over the last few seconds.
    pub batches_per_s: f64,
    /// Megabytes (10^6) per second delivered over the last few seconds.
    pub mb_per_s: f64,
    /// Total seconds the client spent waiting for a batch that was not ready yet.
    pub wait_s: f64,
    /// Slots filled and waiting for the client.
    pub slots_filled: u64,
    /// Slots held by the client.
    pub slots_leased: u64,
    /// Slots in the ring.
    pub depth: u64,
}
