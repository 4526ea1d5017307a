//! HDF5 filter pipelines decoded in Rust (interim: until the Rust decoders
//! land, every filtered dataset is routed to libhdf5 by `unsupported_reason`).

/// One entry of a dataset's filter pipeline as `H5Pget_filter2` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterSpec {
    /// Registered HDF5 filter id.
    pub id: u32,
    /// Filter flags.
    pub flags: u32,
    /// Client data values.
    pub client_data: Vec<u32>,
    /// Filter name as stored in the file.
    pub name: String,
}

/// Errors decoding a chunk.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// The pipeline contains a filter this build cannot decode.
    #[error("filter {0} is not supported by the Rust decoders")]
    Unsupported(String),
}

/// Why the Rust decoders cannot handle `pipeline`, if they cannot.
pub fn unsupported_reason(pipeline: &[FilterSpec]) -> Option<String> {
    pipeline.first().map(|f| format!("filter {} ({}) is decoded by libhdf5", f.name, f.id))
}

/// Undoes `pipeline` on one stored chunk.
pub fn decode_chunk(
    pipeline: &[FilterSpec],
    _filter_mask: u32,
    _stored: &[u8],
    _element_size: usize,
    _chunk_bytes: usize,
    _out: &mut Vec<u8>,
) -> Result<(), FilterError> {
    Err(FilterError::Unsupported(pipeline.first().map(|f| f.name.clone()).unwrap_or_default()))
}
