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
        /// The batch job the client runs in (`$SLURM_JOB_ID`), for the audit log.
        job: Option<String>,
    },
    /// Opens a stream; the reply carries two memfds as `SCM_RIGHTS`: the ring,
    /// then the control page ([`crate::ctrl`]).
    OpenStream(OpenStream),
    /// Unused since protocol 4 (batches are handed over through the control
    /// page); answered with an error. Kept so variant numbers stay put.
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
    /// One-way: the client queued releases or took records after the daemon
    /// asked for word ([`crate::ctrl::DaemonWords::daemon_waiting`]).
    Wake {
        /// Stream id.
        stream: u64,
    },
    /// The details of control record `seq`: a failed batch's message
    /// ([`Response::BatchFailed`]), or whether "every slot is held" still
    /// holds ([`Response::Done`] if not, else an error).
    Fetch {
        /// Stream id.
        stream: u64,
        /// The record's sequence number.
        seq: u32,
    },
    /// The memfd and layout of extra slot `slot` (a grown ring or an
    /// oversized batch); answered by [`Response::Segment`] with the fd.
    Segment {
        /// Stream id.
        stream: u64,
        /// Slot id (at least the ring's depth).
        slot: u32,
    },
    /// The caches' contents per dataset (`stoker cache ls`); answered by [`Response::CacheList`].
    CacheList,
    /// Drops the cache entries of a dataset (a config name or an ad-hoc
    /// label as `stoker cache ls` shows it), or of every dataset with `None`
    /// (the daemon's own user and root only); answered by [`Response::CacheDropped`].
    CacheDrop {
        /// The dataset, or `None` for all.
        dataset: Option<String>,
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
    /// With `shuffle`, the locality order instead of the exact permutation
    /// (`shuffle="block"`); `None` for the exact one. Refused without `shuffle`.
    pub block: Option<BlockShuffle>,
}

/// The locality order's parameters (`shuffle="block"`): blocks of
/// `block_size` consecutive indices are permuted, then samples are permuted
/// within windows of `window` consecutive blocks. Both at least 1; the daemon
/// checks their bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockShuffle {
    /// Consecutive dataset indices per block.
    pub block_size: u64,
    /// Consecutive (permuted) blocks whose samples are mixed together.
    pub window: u64,
}

/// A dataset named in the daemon's config or described ad hoc by the client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum DatasetRef {
    /// A `[datasets.NAME]` table of the daemon's config.
    Named(String),
    /// HDF5 files matching a glob, each field an HDF5 dataset path (boxed to keep requests small).
    Hdf5(Box<crate::Hdf5Dataset>),
    /// LMDB environments, each field a value codec plus transforms.
    Lmdb(LmdbDataset),
}

/// How an HDF5 dataset's samples are taken beyond a plain window: The Well's
/// `n_steps_input`/`n_steps_output` split, `min_dt_stride`/`max_dt_stride`,
/// and fields without the item axis. `Default` is none of these.
///
/// A window of `size` steps (`size = n_steps_input + n_steps_output`) takes
/// steps `t0, t0 + dt, …, t0 + (size - 1)·dt` of its item; `input` fields get
/// the first `n_steps_input` of them, `output` fields the rest, other windowed
/// fields all of them. Windows per item are counted with `min_dt_stride`
/// (as The Well's `WellDataset` does); with `max_dt_stride > min_dt_stride`
/// each sample draws its `dt` uniformly from `min_dt_stride` to the largest
/// spacing that still fits its start (capped at `max_dt_stride`),
/// deterministically in (seed, epoch, index).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Hdf5Sampling {
    /// Steps of each window (its first ones) delivered to the `input` fields;
    /// the remaining `size - n_steps_input` go to the `output` fields. `None`: no split.
    pub n_steps_input: Option<u64>,
    /// Smallest spacing of the steps inside a window (1: consecutive steps).
    pub min_dt_stride: u64,
    /// Largest spacing; equal to `min_dt_stride` for a fixed spacing.
    pub max_dt_stride: u64,
    /// Windowed fields that deliver the window's first `n_steps_input` steps.
    pub input: Vec<String>,
    /// Windowed fields that deliver the window's last `size - n_steps_input` steps.
    pub output: Vec<String>,
    /// Fields without the item axis (The Well's `sample_varying = False`
    /// constants): each sample gets the whole dataset of its file.
    pub constant: Vec<String>,
    /// Windowed fields without the item axis, shaped `[time, ...]` (The
    /// Well's `sample_varying = False`, `time_varying = True`, such as
    /// `dimensions/time`): each sample gets its window's steps of them (or
    /// its `input`/`output` part), at the same spacing as the other fields.
    pub time_only: Vec<String>,
}

impl Default for Hdf5Sampling {
    fn default() -> Self {
        Hdf5Sampling {
            n_steps_input: None,
            min_dt_stride: 1,
            max_dt_stride: 1,
            input: Vec::new(),
            output: Vec::new(),
            constant: Vec::new(),
            time_only: Vec::new(),
        }
    }
}

/// An LMDB dataset: the same keys in one or more environments, one field per
/// (environment, codec). Also the `[datasets.NAME]` table of `format = "lmdb"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LmdbDataset {
    /// Fields in delivery order.
    pub fields: Vec<LmdbFieldDef>,
    /// A file listing the sample keys, one per line (or BasicSR `meta_info.txt` lines).
    #[serde(default)]
    pub key_file: Option<String>,
    /// Only keys starting with this prefix are samples.
    #[serde(default)]
    pub key_prefix: Option<String>,
    /// Only keys this regular expression matches are samples.
    #[serde(default)]
    pub key_regex: Option<String>,
    /// What a bad value does: `"fail"` (default) or `"skip"` (substitute the next good sample).
    #[serde(default)]
    pub on_error: Option<String>,
    /// Keys probed at open to learn each field's dtype and shape (default 8).
    #[serde(default)]
    pub probe: Option<u64>,
    /// Whether the keys are listed again at each new epoch.
    #[serde(default)]
    pub rescan: Rescan,
}

/// When a dataset's file list (HDF5 glob) or key list (LMDB) is read again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rescan {
    /// Once, when the stream opens (the default).
    #[default]
    Never,
    /// At every `SetEpoch` to another epoch than the one last scanned: new
    /// files (keys) join, removed ones leave, and the epoch's permutation is
    /// over the new sample count.
    Epoch,
}

/// Which files (or keys) a stream's epoch reads: a fingerprint of the file
/// list with each file's identity (path, device, inode, size, mtime), or of
/// an LMDB dataset's key list. Loader state records it, so resuming against
/// another one is noticed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Generation {
    /// 64-bit FNV-1a hash of the list.
    pub fingerprint: u64,
    /// HDF5 files (LMDB: environments) of the dataset.
    pub files: u64,
    /// Samples of the dataset (before sharding).
    pub samples: u64,
}

/// One field of an LMDB dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LmdbFieldDef {
    /// Field name delivered to the client.
    pub name: String,
    /// Environment directory (or data file of a `subdir=False` environment).
    pub env: String,
    /// Value codec: `png`, `jpeg`, `npy`, `raw`, optionally `lz4+…` or `zstd+…`.
    pub codec: String,
    /// For `raw`: dtype such as `"uint8"` or `"<f4"`. For `png`/`jpeg`: the
    /// dtype pixels are converted to, `"uint8"`, `"uint16"` or `"float32"` (`[0, 1]`).
    #[serde(default)]
    pub dtype: Option<String>,
    /// For `raw`: the value's shape.
    #[serde(default)]
    pub shape: Option<Vec<u64>>,
    /// Transforms applied after decoding, in order, in any form Python takes (`{ random_crop = 48 }`).
    #[serde(default, deserialize_with = "crate::steps::steps_any_form")]
    pub transforms: Vec<TransformDef>,
    /// Draw random crops and flips together with another field: `(field, size ratio)`.
    #[serde(default)]
    pub pair: Option<PairDef>,
    /// Bytes reserved per sample when the shape varies (ragged delivery).
    #[serde(default)]
    pub max_sample_bytes: Option<u64>,
    /// For `png`/`jpeg`: `"unchanged"` (default), `"L"`, `"RGB"` or `"RGBA"`,
    /// converted as Pillow's `Image.convert` does.
    #[serde(default)]
    pub mode: Option<String>,
}

/// Pairing of a field's random draws with another field's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairDef {
    /// The field whose crops and flips this one follows.
    pub with: String,
    /// This field's size over the other's (4 for HR over 4×-downscaled LR).
    pub scale: u64,
}

/// One transform step, deterministic in (seed, epoch, index).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TransformDef {
    /// Crop `height × width` from the centre.
    CenterCrop {
        /// Rows kept.
        height: u64,
        /// Columns kept.
        width: u64,
    },
    /// Crop `height × width` at a random offset.
    RandomCrop {
        /// Rows kept.
        height: u64,
        /// Columns kept.
        width: u64,
    },
    /// Resize to `height × width`.
    Resize {
        /// Output rows.
        height: u64,
        /// Output columns.
        width: u64,
        /// `nearest`, `bilinear` (default), `bicubic` or `lanczos3`.
        #[serde(default)]
        filter: Option<String>,
    },
    /// Mirror left–right with probability 0.5.
    Hflip,
    /// Convert to float32, times `scale` (default 1).
    ToF32 {
        /// Factor applied while converting (`1/255` maps uint8 to `[0, 1]`).
        #[serde(default)]
        scale: Option<f32>,
    },
    /// `(x - mean[c]) / std[c]` per channel, as float32.
    Normalize {
        /// Per-channel means (one value broadcasts to every channel); empty when read from `stats`.
        /// Config and Python may give one number for the list of it.
        #[serde(default, deserialize_with = "number_or_list")]
        mean: Vec<f32>,
        /// Per-channel standard deviations; empty when read from `stats`.
        #[serde(default, deserialize_with = "number_or_list")]
        std: Vec<f32>,
        /// A statistics file (The Well's `stats.yaml`: `mean:` and `std:` maps from field name to
        /// a number or a nested list) to take `mean` and `std` from, instead of giving them.
        #[serde(default)]
        stats: Option<String>,
        /// The entry of `stats` to use (default: the field's name).
        #[serde(default)]
        key: Option<String>,
        /// Standard deviations below this are raised to it before dividing
        /// (`WellDataset`'s clip). Default: 1e-4 with `stats`, as `WellDataset`;
        /// none with `mean`/`std` given, as torchvision's `Normalize`.
        #[serde(default)]
        min_std: Option<f32>,
    },
    /// `[h, w, c]` → `[c, h, w]`: the last axis moves to the front.
    Chw,
    /// Mirror top–bottom with probability 0.5.
    Vflip,
    /// Rotate by 0, 90, 180 or 270 degrees (`np.rot90(x, k)` over the spatial axes), `k` uniform.
    Rot90,
    /// Convert to `dtype` (numpy's name: `"float32"`, `"uint8"`, ...), as numpy's `astype`.
    Cast {
        /// Target element type.
        dtype: String,
    },
    /// Reorder the axes (numpy's `transpose(axes)`).
    Permute {
        /// `axes[i]` is the input axis that becomes axis `i`.
        axes: Vec<u64>,
    },
    /// Shrink both spatial axes by an integer factor: `mean` of each block (default) or `stride`.
    Downsample {
        /// Block size; the output is `floor(size / factor)` along each spatial axis.
        factor: u64,
        /// `"mean"` (default) or `"stride"` (the block's first element).
        #[serde(default)]
        mode: Option<String>,
    },
}

/// The transforms of one field of an HDF5 dataset (wire and `[datasets.NAME]`
/// `transforms`/`pair`/`spatial_axes` tables).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldTransforms {
    /// The field.
    pub field: String,
    /// Steps in order.
    #[serde(default)]
    pub steps: Vec<TransformDef>,
    /// Draw random crops and flips together with another field.
    #[serde(default)]
    pub pair: Option<PairDef>,
    /// The two axes (of the field's sample as read; negative counts from the end) that spatial
    /// steps act on; default the first two of a 2-d sample, else the two before the last
    /// (`[..., height, width, channels]`).
    #[serde(default)]
    pub spatial_axes: Option<[i64; 2]>,
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
    /// Reply to [`Request::OpenStream`]; the ring's and the control page's memfds travel with it.
    StreamOpened(StreamInfo),
    /// Unused since protocol 4 (see [`crate::ctrl`]); kept so variant numbers stay put.
    Batch(BatchReady),
    /// Reply to [`Request::Next`] when batch `step` could not be produced: the
    /// stream moves past it, so the next `Next` gets `step + 1`.
    BatchFailed {
        /// Stream id.
        stream: u64,
        /// Epoch of the failed batch.
        epoch: u64,
        /// Position of the failed batch in the epoch.
        step: u64,
        /// What went wrong (file, field, key or index) and what to do.
        message: String,
    },
    /// Unused since protocol 4 (see [`crate::ctrl`]); kept so variant numbers stay put.
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
    /// The stream moved ([`Request::SetEpoch`]): control records before
    /// `skip_to` belong to the old position and are to be skipped.
    EpochSet {
        /// Stream id.
        stream: u64,
        /// Sequence number of the first record of the new position.
        skip_to: u32,
        /// As [`StreamInfo::num_samples`], for the new epoch (changes only with rescan).
        num_samples: u64,
        /// Batches per epoch for this rank in the new epoch.
        batches_per_epoch: u64,
        /// The dataset generation the new epoch reads.
        generation: Generation,
    },
    /// An extra slot's segment: its memfd travels with this message.
    Segment {
        /// Stream id.
        stream: u64,
        /// Slot id.
        slot: u32,
        /// Generation of the segment (as in the records naming it).
        generation: u32,
        /// Where fields lie in it (one slot, at [`BatchLayout::slot_offset`] 0).
        layout: BatchLayout,
    },
    /// Reply to [`Request::CacheList`].
    CacheList(CacheReport),
    /// Reply to [`Request::CacheDrop`].
    CacheDropped {
        /// Entries dropped.
        entries: u64,
        /// Bytes freed.
        bytes: u64,
    },
}

/// The caches, per dataset.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheReport {
    /// Eviction policy of both caches (`"belady"` or `"lru"`).
    pub policy: String,
    /// Decompressed HDF5 chunks, in total.
    pub chunks: CacheStatus,
    /// Decoded samples, in total.
    pub samples: CacheStatus,
    /// Streams whose future reads eviction plans over.
    pub streams: u64,
    /// Per dataset and cache.
    pub datasets: Vec<CacheDatasetStatus>,
}

/// One dataset's share of one cache.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheDatasetStatus {
    /// Config name or ad-hoc label; `"(other users' datasets)"` sums what the asker may not see.
    pub dataset: String,
    /// `"chunks"` (decompressed HDF5 chunks) or `"samples"` (decoded values).
    pub cache: String,
    /// Bytes held.
    pub bytes: u64,
    /// Entries held.
    pub entries: u64,
    /// Lookups that hit.
    pub hits: u64,
    /// Lookups that missed.
    pub misses: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Entries offered but not admitted (read later than everything held).
    pub rejected: u64,
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
    /// Whether the dataset is scanned again at each new epoch ([`Rescan::Epoch`]).
    pub rescan: bool,
    /// The dataset generation the stream's epoch reads.
    pub generation: Generation,
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
    /// Samples substituted for bad ones since the daemon opened the dataset (`on_error = "skip"`).
    pub skipped: u64,
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
    /// The node-wide cache of decoded samples.
    pub sample_cache: CacheStatus,
    /// Open datasets that substituted bad samples (`on_error = "skip"`).
    pub skipped: Vec<DatasetSkips>,
    /// Datasets the daemon holds open (those no stream uses close after `[limits] idle_close_s`).
    pub datasets: Vec<DatasetStatus>,
    /// How busy the decode workers are.
    pub workers: WorkerStatus,
    /// The daemon's memory budget (`[limits] max_memory_bytes`) and where it came from.
    pub memory: MemoryStatus,
}

/// The daemon's memory budget, for `stoker status`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MemoryStatus {
    /// Bytes the rings and caches may take together.
    pub budget_bytes: u64,
    /// Where the figure came from (`half of the limit of cgroup …`, `[limits] max_memory_bytes`).
    pub source: String,
}

/// Utilisation of the decode worker pool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Seconds the workers spent filling batches since the daemon started (summed over threads).
    pub busy_s: f64,
    /// Busy time over wall time × `worker_threads` in the last `window_s` seconds, in percent.
    pub busy_percent: f64,
    /// Seconds the utilisation was measured over (up to 10; less just after start).
    pub window_s: f64,
}

/// A dataset the daemon holds open.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetStatus {
    /// Config name, or the ad-hoc path.
    pub dataset: String,
    /// `"hdf5"` or `"lmdb"`.
    pub format: String,
    /// Files it reads (HDF5 files; LMDB data files and key file).
    pub files: u64,
    /// Their size on disk in bytes.
    pub bytes: u64,
    /// Samples it holds.
    pub samples: u64,
    /// Open streams reading it.
    pub streams: u64,
    /// Shared memory of those streams' rings, in bytes.
    pub ring_bytes: u64,
    /// Samples substituted for bad ones since it was opened (`on_error = "skip"`).
    pub skipped: u64,
}

/// Bad samples a dataset skipped.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetSkips {
    /// Dataset name or ad-hoc path.
    pub dataset: String,
    /// Samples substituted since it was opened.
    pub skipped: u64,
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
    /// Entries evicted to make room.
    pub evictions: u64,
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
    /// The batch job it runs in (`$SLURM_JOB_ID`, from its `Hello`).
    pub job: Option<String>,
    /// Streams the client has open.
    pub streams: u64,
    /// Seconds since it connected.
    pub connected_s: f64,
    /// Seconds its open streams kept it waiting for a batch that was not ready.
    pub wait_s: f64,
    /// `wait_s` as a percentage of `connected_s`: how much of its time the client was starved of data.
    pub stall_percent: f64,
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
    /// Seconds since the stream opened.
    pub open_s: f64,
    /// `wait_s` as a percentage of `open_s`.
    pub stall_percent: f64,
    /// Slots filled and waiting for the client.
    pub slots_filled: u64,
    /// Slots held by the client.
    pub slots_leased: u64,
    /// Slots in the ring.
    pub depth: u64,
}

/// `mean`/`std` in config and Python (`0.5` or `[0.5, 0.4]`): one number is
/// the list of it, as torchvision users write `Normalize(0.5, 0.5)`. The wire
/// (bincode, not human-readable) keeps the list's own encoding.
fn number_or_list<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
    struct NumberOrList;
    impl<'de> serde::de::Visitor<'de> for NumberOrList {
        type Value = Vec<f32>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a number or a list of numbers")
        }

        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Vec<f32>, E> {
            Ok(vec![v as f32])
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Vec<f32>, E> {
            Ok(vec![v as f32])
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Vec<f32>, E> {
            Ok(vec![v as f32])
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<f32>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(v) = seq.next_element::<f32>()? {
                out.push(v);
            }
            Ok(out)
        }
    }
    if deserializer.is_human_readable() {
        deserializer.deserialize_any(NumberOrList)
    } else {
        Vec::<f32>::deserialize(deserializer)
    }
}

#[cfg(test)]
mod fuzz {
    //! Whatever bytes a client sends, decoding ends in a value or an error:
    //! never a panic, never an allocation beyond the frame limit.
    use proptest::prelude::*;

    use super::*;

    fn open(batch_size: u64, rank: u64, world_size: u64, epoch: u64, step: u64) -> Request {
        Request::OpenStream(OpenStream {
            dataset: DatasetRef::Hdf5(Box::new(crate::Hdf5Dataset {
                window: Some(crate::WindowDef { size: Some(batch_size), stride: step, ..Default::default() }),
                transforms: [(
                    "x".to_string(),
                    vec![TransformDef::Rot90, TransformDef::Cast { dtype: "float32".into() }],
                )]
                .into(),
                spatial_axes: [("x".to_string(), [-2, -1])].into(),
                rescan: Rescan::Epoch,
                ..crate::Hdf5Dataset::new("/data/*.h5", [("x".to_string(), "x".to_string())])
            })),
            batch_size,
            shuffle: true,
            seed: epoch,
            drop_last: false,
            rank,
            world_size,
            epoch,
            step,
            block: Some(BlockShuffle { block_size: batch_size, window: step }),
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bodies_decode_or_fail(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = crate::decode_body::<Request>(&body);
        }

        #[test]
        fn mutated_requests_decode_or_fail(
            sizes in (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let req = open(sizes.0, sizes.1, sizes.2, sizes.3, sizes.4);
            let frame = crate::encode_frame(&req).unwrap();
            let mut body = frame[crate::FRAME_HEADER_BYTES..].to_vec();
            for (at, byte) in flips {
                let i = at.index(body.len());
                body[i] ^= byte;
            }
            let _ = crate::decode_body::<Request>(&body[..cut.index(body.len() + 1)]);
        }

        #[test]
        fn frame_headers_are_checked_against_the_limit(header in any::<[u8; 4]>(), limit in 0usize..(1 << 24)) {
            if let Ok(len) = crate::frame_len(header, limit) {
                prop_assert!(len <= limit);
            }
        }
    }
}
