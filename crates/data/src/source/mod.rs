//! Where samples come from. A source knows its sample count and field layout
//! and writes every field of one sample straight into destination slices
//! (the sample's places in a ring slot).

pub mod hdf5;
pub mod lmdb;
pub mod transformed;

use std::path::PathBuf;

use stoker_proto::DType;

/// One field of a dataset as the client receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldSpec {
    /// Field name.
    pub name: String,
    /// Where the field comes from (an HDF5 path), for messages.
    pub origin: String,
    /// Element type delivered.
    pub dtype: DType,
    /// Shape of one sample; 0 marks a dimension that varies (ragged fields).
    pub shape: Vec<u64>,
    /// `Some(most bytes one sample may take)` for a ragged (variable-shape) field.
    pub max_sample_bytes: Option<u64>,
}

impl FieldSpec {
    /// The field as the batch layout needs it.
    pub fn decl(&self) -> stoker_proto::FieldDecl {
        stoker_proto::FieldDecl {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            max_sample_bytes: self.max_sample_bytes,
        }
    }
}

/// Where a source writes one field of one row.
#[derive(Debug)]
pub struct FieldOut<'a> {
    /// The row's bytes: exactly one sample for fixed-shape fields; for a
    /// ragged field, room for the largest sample allowed (the values go first).
    pub data: &'a mut [u8],
    /// For a ragged field, the row's shape, to be filled in (one entry per dimension).
    pub shape: Option<&'a mut [u64]>,
}

/// Which sample to produce, and the context that randomized steps are keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleRef {
    /// Dataset index.
    pub index: u64,
    /// The stream's seed.
    pub seed: u64,
    /// The epoch being produced.
    pub epoch: u64,
}

/// A dataset the daemon can serve.
pub trait Source: Send + Sync + std::fmt::Debug {
    /// Number of samples.
    fn len(&self) -> u64;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fields in delivery order.
    fn fields(&self) -> &[FieldSpec];

    /// Bad samples substituted so far (`on_error = "skip"`).
    fn skipped(&self) -> u64 {
        0
    }

    /// Files it holds open now (HDF5 files, LMDB environments), for metrics.
    fn open_files(&self) -> u64 {
        0
    }

    /// Why the source can no longer be read, once a read found one of its
    /// mapped files truncated or corrupt (LMDB). A poisoned source fails
    /// every read; whoever caches sources must open a fresh one instead.
    fn poisoned(&self) -> Option<String> {
        None
    }

    /// Writes every field of `sample` into `out` (one entry per field, in
    /// field order): a fixed-shape field fills `data` exactly; a ragged field
    /// writes its values at the start of `data` and its shape into `shape`.
    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError>;
}

/// Errors opening a dataset or reading a sample; each names the file and field involved.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The glob matches nothing.
    #[error(
        "no files match {pattern:?}; check the path, or that the files exist and are readable (by you, for \
         ad-hoc datasets; by the daemon's user, for datasets named in its config)"
    )]
    NoFiles {
        /// The glob.
        pattern: String,
    },
    /// Matching the glob passed a bound (depth, entries, matches or time).
    #[error("glob {pattern:?} is too broad: {message}")]
    GlobTooBroad {
        /// The glob.
        pattern: String,
        /// Which bound.
        message: String,
    },
    /// The glob is malformed.
    #[error("invalid glob {pattern:?}: {message}")]
    BadGlob {
        /// The glob.
        pattern: String,
        /// glob's message.
        message: String,
    },
    /// A file could not be opened by handle: outside the allowed roots, not
    /// a regular file, or refused with the client's rights.
    #[error("{0}")]
    Access(#[from] crate::fsaccess::AccessError),
    /// A file changed (replaced, rewritten, appended to) while being served.
    #[error("{path} {problem}")]
    Changed {
        /// The file.
        path: PathBuf,
        /// How it changed, and what to do.
        problem: crate::fsaccess::ChangedError,
    },
    /// The file cannot be opened as HDF5.
    #[error("cannot open {path} as HDF5: {message}")]
    Open {
        /// The file.
        path: PathBuf,
        /// libhdf5's message.
        message: String,
    },
    /// A field's HDF5 path is missing from a file.
    #[error("{path} has no dataset {h5path:?} (field {field:?}); check the path with `h5ls -r {path}`")]
    MissingField {
        /// The file.
        path: PathBuf,
        /// Field name.
        field: String,
        /// HDF5 path.
        h5path: String,
    },
    /// A field's dtype cannot be served.
    #[error(
        "{path}: field {field:?} ({h5path:?}) has dtype {found}; stoker serves numeric datasets only \
         (bool, int8–int64, uint8–uint64, float16/32/64)"
    )]
    Dtype {
        /// The file.
        path: PathBuf,
        /// Field name.
        field: String,
        /// HDF5 path.
        h5path: String,
        /// What the file has.
        found: String,
    },
    /// Fields of one dataset disagree, within a file or across files.
    #[error("{path}: field {field:?} ({h5path:?}) {message}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// Field name.
        field: String,
        /// HDF5 path.
        h5path: String,
        /// What disagrees with what.
        message: String,
    },
    /// The dataset's description contradicts itself (window, per_item).
    #[error("dataset {pattern:?}: {message}")]
    Spec {
        /// The glob.
        pattern: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The dataset has no samples.
    #[error("{pattern:?} holds no samples (every field has length 0 along the first axis)")]
    Empty {
        /// The glob.
        pattern: String,
    },
    /// An LMDB environment cannot be opened.
    #[error("cannot open LMDB environment {env}: {message}")]
    LmdbOpen {
        /// The environment (a directory holding data.mdb, or the data file itself).
        env: PathBuf,
        /// What failed.
        message: String,
    },
    /// A field of an LMDB dataset is declared wrongly (codec, transforms, pairing),
    /// or its values disagree with each other (dtype).
    #[error("LMDB field {field:?} ({env}, codec {codec}): {message}")]
    LmdbField {
        /// The field's environment.
        env: PathBuf,
        /// Field name.
        field: String,
        /// The field's codec.
        codec: String,
        /// What is wrong.
        message: String,
    },
    /// The key file cannot be read.
    #[error("cannot read key file {path}: {message}")]
    LmdbKeyFile {
        /// The key file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// After filtering (or from the key file) there are no keys.
    #[error("LMDB environment {env} has no sample keys {detail}")]
    LmdbEmpty {
        /// The environment the keys come from.
        env: PathBuf,
        /// How keys were selected.
        detail: String,
    },
    /// A sample key is missing from one of the joined environments.
    #[error(
        "key {key:?} is missing from LMDB environment {env} (field {field:?}); {missing} of the dataset's \
         {total} keys are missing there — joined environments must hold the same keys"
    )]
    LmdbMissingKey {
        /// The environment lacking the key.
        env: PathBuf,
        /// The field read from that environment.
        field: String,
        /// The first missing key (bytes shown escaped).
        key: String,
        /// How many keys are missing there.
        missing: u64,
        /// Keys in the dataset.
        total: u64,
    },
    /// Reading or decoding one value of an LMDB dataset failed (boxed to keep errors small).
    #[error("{0}")]
    LmdbRead(Box<LmdbReadError>),
    /// A size the dataset declares (a shape, a transform's output) exceeds a
    /// `[limits]` value or 64 bits; the message names file, field, size and key.
    #[error("{0}")]
    Limit(String),
    /// A ragged field's value is larger than the room its slot row reserves
    /// (but within `[limits] max_sample_bytes`): the stream produces this
    /// batch again in a slot of its own, sized for it.
    #[error("{message}")]
    Oversize {
        /// Index of the field among the source's fields.
        field: usize,
        /// Bytes the value needs.
        bytes: u64,
        /// What happened, for a log or an error if no bigger slot can be had.
        message: String,
    },
    /// Reading a sample failed.
    #[error("{path}: field {field:?} ({h5path:?}), sample {index} (row {row} of the file): {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Field name.
        field: String,
        /// HDF5 path.
        h5path: String,
        /// Global sample index.
        index: u64,
        /// Row within the file.
        row: u64,
        /// What failed.
        message: String,
    },
}

/// Where and why reading one value of an LMDB dataset failed.
#[derive(Debug, thiserror::Error)]
#[error("LMDB {env}: key {key:?}, field {field:?}, codec {codec}, sample {index}: {message}")]
pub struct LmdbReadError {
    /// The environment.
    pub env: PathBuf,
    /// The sample's key (bytes shown escaped when not UTF-8).
    pub key: String,
    /// Field name.
    pub field: String,
    /// The field's codec.
    pub codec: String,
    /// Dataset index.
    pub index: u64,
    /// What failed.
    pub message: String,
}
