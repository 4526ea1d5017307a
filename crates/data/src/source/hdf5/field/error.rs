//! Why one field of one file cannot be opened or read, with the chunk,
//! offset and sizes involved (the caller adds the file and field).

use stoker_decode::filter::{self, FilterSpec};

use super::filter_name;

/// Why a field of a file cannot be opened or read; the caller adds the file
/// and field (the messages follow them).
#[derive(Debug, thiserror::Error)]
pub enum FieldError {
    /// The HDF5 helper reading this file crashed or hung on it, or none
    /// could be started (what happened and what to do).
    #[error("{message}")]
    Helper {
        /// What happened, and what to do.
        message: String,
        /// The helper died on this file's request (the file is then not
        /// read again until it changes).
        file_crashed_it: bool,
    },
    /// The HDF5 helper that opened this file has been restarted since (the
    /// file must be opened again).
    #[error(
        "the HDF5 helper that had this file open has since been restarted (after another file crashed it); the \
         next read opens it again"
    )]
    Reopen,
    /// Decoding the chunk needs more buffer bytes than the daemon-wide decode
    /// budget allows at once, or the budget stayed taken too long.
    #[error(
        "{at}: decoding it needs {need} bytes of buffers and the daemon's decode budget ({limit} bytes for all \
         workers together, 2 × [limits] max_sample_bytes + 64 MiB) {why}"
    )]
    DecodeBudget {
        /// The chunk.
        at: StoredChunk,
        /// Bytes asked for.
        need: u64,
        /// The budget.
        limit: u64,
        /// "is smaller" or "stayed busy for 30 s".
        why: &'static str,
    },
    /// A helper was asked for a field it does not have.
    #[error("the HDF5 helper has no field {field}")]
    NoSuchField {
        /// The field index asked for.
        field: usize,
    },
    /// libhdf5 reads the field, but lacks filters of its pipeline (these).
    #[error("{}", undecodable(missing))]
    Undecodable {
        /// The filters nothing here decodes.
        missing: Vec<FilterSpec>,
    },
    /// A read of contiguous storage failed.
    #[error("read of {bytes} bytes at file offset {offset}: {error}")]
    Read {
        /// Bytes asked for.
        bytes: usize,
        /// Where in the file.
        offset: u64,
        /// The system's error.
        error: std::io::Error,
    },
    /// libhdf5 cannot say where the chunk at `chunk` (its first element) is stored.
    #[error("cannot locate the chunk at {chunk:?} (H5Dget_chunk_info_by_coord failed)")]
    Locate {
        /// The chunk's first element.
        chunk: Vec<u64>,
    },
    /// An unfiltered chunk is stored in a different size than it holds.
    #[error("chunk at {chunk:?}: {stored} bytes stored, expected {expected}")]
    StoredSize {
        /// The chunk's first element.
        chunk: Vec<u64>,
        /// Bytes the chunk index gives.
        stored: u64,
        /// Bytes of one chunk.
        expected: usize,
    },
    /// A read of an unfiltered chunk's runs failed.
    #[error("chunk at {chunk:?}: read failed: {error}")]
    ChunkRead {
        /// The chunk's first element.
        chunk: Vec<u64>,
        /// The system's error.
        error: std::io::Error,
    },
    /// The file's size, to check a filtered chunk against, cannot be read.
    #[error("{at}: {error}")]
    FileSize {
        /// The chunk.
        at: StoredChunk,
        /// The system's error.
        error: std::io::Error,
    },
    /// The chunk index puts a filtered chunk past the end of the file.
    #[error(
        "{at}: the chunk index says it ends past the end of the file ({file_bytes} bytes); the file is truncated \
         or corrupt (h5py/h5dump will fail on it too)"
    )]
    PastEnd {
        /// The chunk.
        at: StoredChunk,
        /// The file's size.
        file_bytes: u64,
    },
    /// The chunk index gives a filtered chunk more bytes than any filter makes of it.
    #[error(
        "{at}: more than any filter makes of a {chunk_bytes}-byte chunk; the chunk index is corrupt (h5py/h5dump \
         will fail on it too)"
    )]
    Oversized {
        /// The chunk.
        at: StoredChunk,
        /// Bytes of one chunk decoded.
        chunk_bytes: usize,
    },
    /// The read of a filtered chunk's stored bytes failed.
    #[error("{at}: read failed: {error}")]
    StoredRead {
        /// The chunk.
        at: StoredChunk,
        /// The system's error.
        error: std::io::Error,
    },
    /// A filtered chunk does not decode.
    #[error("{at}: {error}; the file may be corrupt (h5py/h5dump will fail on it too)")]
    Decode {
        /// The chunk.
        at: StoredChunk,
        /// The decoder's error.
        error: filter::FilterError,
    },
    /// libhdf5 gave no dataspace for the dataset.
    #[error("H5Dget_space failed")]
    NoSpace,
    /// `H5Dread` of the block failed.
    #[error(
        "libhdf5 failed to read the block at {start:?} of shape {count:?} (corrupt data, or a filter plugin that \
         is not installed: set HDF5_PLUGIN_PATH)"
    )]
    Library {
        /// The block's first element.
        start: Vec<u64>,
        /// Its shape.
        count: Vec<u64>,
    },
}

/// A filtered chunk as messages name it: where it starts in the dataset,
/// where it is stored and how many bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredChunk {
    /// The chunk's first element.
    pub(super) start: Vec<u64>,
    /// Its file offset.
    pub(super) addr: u64,
    /// Its stored bytes.
    pub(super) stored: u64,
}

impl std::fmt::Display for StoredChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "chunk at {:?} (file offset {}, {} bytes stored)", self.start, self.addr, self.stored)
    }
}

/// The message for a pipeline libhdf5 cannot decode: which filters, and what to install.
fn undecodable(missing: &[FilterSpec]) -> String {
    let names: Vec<String> = missing.iter().map(|f| format!("{} (HDF5 filter id {})", filter_name(f), f.id)).collect();
    format!(
        "is compressed with {}, which neither stoker's Rust decoders nor this daemon's libhdf5 can decode; \
         install the filter plugin (`pip install hdf5plugin` ships blosc2, bitshuffle, bzip2, lz4, zfp, zstd, sz, \
         sz3 and fcidecomp) and start the daemon with \
         HDF5_PLUGIN_PATH=$(python -c 'import hdf5plugin; print(hdf5plugin.PLUGIN_PATH)') (docs/operations.md)",
        names.join(" and ")
    )
}
