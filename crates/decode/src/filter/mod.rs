//! Undoes HDF5 filter pipelines on raw chunk bytes, in Rust and outside
//! libhdf5's global lock: deflate, shuffle, fletcher32, lzf, and the
//! registered plugins lz4, zstd, bitshuffle, blosc (1.x frames) and blosc2
//! (frames of Blosc2 chunks, b2nd arrays included).
//!
//! Pure functions over byte slices: no HDF5 calls and no I/O. The caller reads
//! the pipeline once (`H5Pget_filter2`), asks [`unsupported_reason`] whether
//! this module can handle it, then pairs each chunk's stored bytes and filter
//! mask (`H5Dget_chunk_info`) with [`decode_chunk`]. Anything reported
//! unsupported, including [`FilterError::Unsupported`] from a chunk whose
//! header names a codec this module lacks, should fall back to libhdf5.
//!
//! Corrupt input is an error, never a panic, and no allocation is sized by a
//! length read from the stream: every buffer is bounded by the expected
//! decoded size, which the caller derives from the dataset's metadata.

mod blosc;
mod blosc2;
mod checksum;
mod codec;
mod shuffle;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::fmt;

/// HDF5's registered filter ids (`H5Zpublic.h` and the HDF Group's registry
/// of third-party filters).
pub mod id {
    /// zlib deflate (`H5Z_FILTER_DEFLATE`).
    pub const DEFLATE: u32 = 1;
    /// Byte shuffle (`H5Z_FILTER_SHUFFLE`).
    pub const SHUFFLE: u32 = 2;
    /// Fletcher-32 checksum (`H5Z_FILTER_FLETCHER32`).
    pub const FLETCHER32: u32 = 3;
    /// SZIP (`H5Z_FILTER_SZIP`); not handled here.
    pub const SZIP: u32 = 4;
    /// N-bit packing (`H5Z_FILTER_NBIT`); not handled here.
    pub const NBIT: u32 = 5;
    /// Scale-offset (`H5Z_FILTER_SCALEOFFSET`); not handled here.
    pub const SCALEOFFSET: u32 = 6;
    /// LZF, as shipped with h5py.
    pub const LZF: u32 = 32000;
    /// Blosc 1.x.
    pub const BLOSC: u32 = 32001;
    /// Blosc2 (hdf5-blosc2: PyTables ≥ 3.8, hdf5plugin), including b2nd chunks.
    pub const BLOSC2: u32 = 32026;
    /// The HDF5 LZ4 plugin.
    pub const LZ4: u32 = 32004;
    /// Bitshuffle, optionally with LZ4 or zstd.
    pub const BITSHUFFLE: u32 = 32008;
    /// The HDF5 zstd plugin.
    pub const ZSTD: u32 = 32015;
}

/// One entry of a dataset's filter pipeline as `H5Pget_filter2` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct FilterSpec {
    /// Registered filter id (see [`id`]).
    pub id: u32,
    /// `H5Z_FLAG_*` bits (mandatory / optional); decoding does not need them.
    pub flags: u32,
    /// The filter's `cd_values` as stored in the file.
    pub client_data: Vec<u32>,
    /// Name stored with the filter, used only in messages.
    pub name: String,
}

impl FilterSpec {
    /// A spec with the given id and client data, no flags and no name.
    pub fn new(id: u32, client_data: &[u32]) -> Self {
        FilterSpec { id, flags: 0, client_data: client_data.to_vec(), name: String::new() }
    }
}

/// Why one chunk could not be decoded. The caller adds the file, field and
/// chunk coordinates.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FilterError {
    /// The pipeline, or this chunk's own header, uses something this module
    /// does not decode; read the chunk through libhdf5 instead.
    #[error("{filter}: not supported by the Rust decoder: {reason}")]
    Unsupported {
        /// The filter (or inner codec) concerned.
        filter: String,
        /// What exactly is missing.
        reason: String,
    },
    /// The filter's client data (`cd_values`) make no sense.
    #[error("{filter}: invalid filter parameters: {reason}")]
    InvalidParams {
        /// The filter concerned.
        filter: &'static str,
        /// What is wrong with them.
        reason: String,
    },
    /// The Fletcher-32 checksum stored with the chunk does not match its data.
    #[error("fletcher32: checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// The checksum stored in the chunk's last four bytes.
        stored: u32,
        /// The checksum of the data in front of it.
        computed: u32,
    },
    /// The stored bytes end before the stream they hold does.
    #[error("{filter}: input truncated: {reason}")]
    Truncated {
        /// The filter concerned.
        filter: &'static str,
        /// Where it ran out.
        reason: String,
    },
    /// The stream decodes, or declares that it decodes, to the wrong size.
    #[error("{filter}: decoded size {actual} bytes, expected {expected}")]
    SizeMismatch {
        /// The filter concerned.
        filter: &'static str,
        /// Size the dataset's metadata implies.
        expected: usize,
        /// Size the stream produced or declared.
        actual: u64,
    },
    /// The stream would decode to more bytes than the chunk can hold.
    #[error("{filter}: data decodes past the expected {expected} bytes")]
    TooLong {
        /// The filter concerned.
        filter: &'static str,
        /// Size the dataset's metadata implies.
        expected: usize,
    },
    /// The stream is malformed.
    #[error("{filter}: corrupt data: {reason}")]
    Corrupt {
        /// The filter concerned.
        filter: &'static str,
        /// What the decoder found.
        reason: String,
    },
}

impl FilterError {
    /// Whether this error means "use libhdf5 for this chunk" rather than "the
    /// chunk is damaged".
    pub fn is_unsupported(&self) -> bool {
        matches!(self, FilterError::Unsupported { .. })
    }
}

pub(crate) fn truncated(filter: &'static str, reason: impl Into<String>) -> FilterError {
    FilterError::Truncated { filter, reason: reason.into() }
}

pub(crate) fn corrupt(filter: &'static str, reason: impl Into<String>) -> FilterError {
    FilterError::Corrupt { filter, reason: reason.into() }
}

pub(crate) fn size_mismatch(filter: &'static str, expected: usize, actual: impl TryInto<u64>) -> FilterError {
    FilterError::SizeMismatch { filter, expected, actual: actual.try_into().unwrap_or(u64::MAX) }
}

/// One pipeline entry, parsed and checked.
#[derive(Debug, Clone, Copy)]
enum Stage {
    Deflate,
    Shuffle { element_size: usize },
    Fletcher32,
    Lzf,
    Lz4,
    Zstd,
    Bitshuffle(shuffle::BitshuffleParams),
    Blosc,
    Blosc2,
}

impl Stage {
    fn parse(spec: &FilterSpec, element_size: usize) -> Result<Stage, FilterError> {
        let cd = &spec.client_data;
        let unsupported = |reason: &str| FilterError::Unsupported {
            filter: if spec.name.is_empty() { format!("filter {}", spec.id) } else { spec.name.clone() },
            reason: reason.to_string(),
        };
        Ok(match spec.id {
            id::DEFLATE => Stage::Deflate,
            id::SHUFFLE => {
                // H5Z's set_local stores the type size in cd_values[0].
                let size = cd.first().map_or(element_size, |&s| s as usize);
                if size == 0 {
                    return Err(FilterError::InvalidParams { filter: "shuffle", reason: "element size 0".into() });
                }
                Stage::Shuffle { element_size: size }
            }
            id::FLETCHER32 => Stage::Fletcher32,
            id::LZF => Stage::Lzf,
            id::LZ4 => Stage::Lz4,
            id::ZSTD => Stage::Zstd,
            id::BITSHUFFLE => Stage::Bitshuffle(shuffle::BitshuffleParams::parse(cd)?),
            id::BLOSC => {
                // cd_values[6] is the compressor chosen at write time; each
                // chunk's header says it again, and that is what decoding uses.
                if let Some(&code) = cd.get(6) {
                    blosc::check_compressor_code(code)?;
                }
                Stage::Blosc
            }
            // Each chunk is a self-describing frame; the client data
            // (revision, sizes, level, shuffle, codec, b2nd rank and shape)
            // only repeat what the frame says.
            id::BLOSC2 => Stage::Blosc2,
            id::SZIP => return Err(unsupported("szip")),
            id::NBIT => return Err(unsupported("n-bit packing")),
            id::SCALEOFFSET => return Err(unsupported("scale-offset")),
            other => return Err(unsupported(&format!("unknown filter id {other}"))),
        })
    }

    /// Whether undoing the stage writes a new buffer (fletcher32 only trims).
    fn copies(self) -> bool {
        !matches!(self, Stage::Fletcher32)
    }

    /// Whether the stage changes the data's size by more than a checksum.
    fn compresses(self) -> bool {
        match self {
            Stage::Shuffle { .. } | Stage::Fletcher32 => false,
            Stage::Bitshuffle(params) => params.compresses(),
            Stage::Deflate | Stage::Lzf | Stage::Lz4 | Stage::Zstd | Stage::Blosc | Stage::Blosc2 => true,
        }
    }
}

/// Why the Rust decoder cannot handle `pipeline` (the caller then reads
/// through libhdf5), or `None` when it can. Chunks of a supported pipeline
/// can still return [`FilterError::Unsupported`] when their own header names
/// a codec that is missing here (blosc's snappy).
pub fn unsupported_reason(pipeline: &[FilterSpec]) -> Option<String> {
    if pipeline.len() > 32 {
        return Some(format!("{} filters; HDF5 allows at most 32", pipeline.len()));
    }
    let mut compressors = 0;
    for spec in pipeline {
        // The element size only matters for shuffle without client data,
        // which parses with any nonzero value.
        match Stage::parse(spec, 1) {
            Ok(stage) => compressors += usize::from(stage.compresses()),
            Err(e) => return Some(e.to_string()),
        }
    }
    (compressors > 1).then(|| format!("pipeline: {TWO_COMPRESSORS}"))
}

const TWO_COMPRESSORS: &str = "more than one compressing filter (the inner one's decoded size is not recorded)";

/// Undoes `pipeline` on one stored chunk, writing exactly `chunk_bytes` bytes
/// into `out` (cleared first; its capacity is reused).
///
/// Filters were applied in pipeline order when writing, so they are undone in
/// reverse; bit `i` of `filter_mask` set means filter `i` was skipped for this
/// chunk (`H5Dget_chunk_info`'s mask). `element_size` is the dataset's dtype
/// size (shuffle falls back to it without client data); `chunk_bytes` is the
/// decoded size, `prod(chunk dims) * element_size`.
///
/// Uses a per-thread [`Decoder`] for scratch space. On error `out` is empty.
pub fn decode_chunk(
    pipeline: &[FilterSpec],
    filter_mask: u32,
    stored: &[u8],
    element_size: usize,
    chunk_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<(), FilterError> {
    /// Scratch kept per thread beyond this is released after each chunk.
    const MAX_RETAINED: usize = 64 << 20;
    thread_local! {
        static DECODER: RefCell<Decoder> = RefCell::new(Decoder::new());
    }
    DECODER.with(|cell| match cell.try_borrow_mut() {
        Ok(mut decoder) => {
            let result = decoder.decode(pipeline, filter_mask, stored, element_size, chunk_bytes, out);
            decoder.shrink_to(MAX_RETAINED);
            result
        }
        // Only reachable if decoding re-entered itself; stay correct anyway.
        Err(_) => Decoder::new().decode(pipeline, filter_mask, stored, element_size, chunk_bytes, out),
    })
}

/// Scratch buffers and codec contexts reused across chunks. One per worker
/// thread; [`decode_chunk`] keeps one per thread for you.
#[derive(Default)]
pub struct Decoder {
    /// Holds the intermediate result between two copying stages.
    scratch: Vec<u8>,
    /// Codec contexts and per-block scratch.
    ctx: codec::Contexts,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder").field("scratch_capacity", &self.scratch.capacity()).finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
enum Loc {
    Stored,
    Out,
    Scratch,
}

impl Decoder {
    /// An empty decoder; buffers grow on first use.
    pub fn new() -> Self {
        Decoder::default()
    }

    /// Releases scratch buffers larger than `max_bytes`.
    pub fn shrink_to(&mut self, max_bytes: usize) {
        if self.scratch.capacity() > max_bytes {
            self.scratch = Vec::new();
        }
        self.ctx.shrink_to(max_bytes);
    }

    /// Same as [`decode_chunk`], with this decoder's scratch space.
    pub fn decode(
        &mut self,
        pipeline: &[FilterSpec],
        filter_mask: u32,
        stored: &[u8],
        element_size: usize,
        chunk_bytes: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), FilterError> {
        out.clear();
        let result = self.decode_inner(pipeline, filter_mask, stored, element_size, chunk_bytes, out);
        if result.is_err() {
            out.clear();
        }
        result
    }

    fn decode_inner(
        &mut self,
        pipeline: &[FilterSpec],
        filter_mask: u32,
        stored: &[u8],
        element_size: usize,
        chunk_bytes: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), FilterError> {
        if pipeline.len() > 32 {
            return Err(FilterError::InvalidParams {
                filter: "pipeline",
                reason: format!("{} filters; HDF5 allows at most 32", pipeline.len()),
            });
        }
        // Each active stage, with the size a compressing stage must decode to:
        // its input at write time, which is the chunk plus four bytes for each
        // fletcher32 applied before it. That holds while no other compressor
        // ran before it, hence at most one compressing stage per chunk.
        // Shuffles keep the size; fletcher32 only trims its checksum.
        let mut stages = Vec::with_capacity(pipeline.len());
        let mut checksums = 0usize;
        let mut compressors = 0usize;
        for (i, spec) in pipeline.iter().enumerate() {
            if filter_mask & (1 << i) != 0 {
                continue;
            }
            let stage = Stage::parse(spec, element_size)?;
            let size = if stage.compresses() {
                compressors += 1;
                let extra = checksums.checked_mul(checksum::FLETCHER_LEN);
                Some(extra.and_then(|e| chunk_bytes.checked_add(e)).ok_or_else(|| FilterError::InvalidParams {
                    filter: "pipeline",
                    reason: "chunk size overflows".into(),
                })?)
            } else {
                None
            };
            if let Stage::Fletcher32 = stage {
                checksums += 1;
            }
            stages.push((stage, size));
        }
        if compressors > 1 {
            return Err(FilterError::Unsupported { filter: "pipeline".into(), reason: TWO_COMPRESSORS.into() });
        }

        // Copying stages alternate between `out` and `scratch` so that the
        // last one lands in `out`; fletcher32 only shortens the current data.
        let mut remaining = stages.iter().filter(|(s, _)| s.copies()).count();
        let mut loc = Loc::Stored;
        let mut len = stored.len();
        let Decoder { scratch, ctx } = self;
        for &(stage, size) in stages.iter().rev() {
            if !stage.copies() {
                let data = match loc {
                    Loc::Stored => &stored[..len],
                    Loc::Out => &out[..len],
                    Loc::Scratch => &scratch[..len],
                };
                len = checksum::verify_fletcher32(data)?;
                continue;
            }
            let expected = size.unwrap_or(len);
            remaining -= 1;
            let to_out = remaining % 2 == 0;
            let (src, dst): (&[u8], &mut Vec<u8>) = match (loc, to_out) {
                (Loc::Stored, true) => (&stored[..len], &mut *out),
                (Loc::Stored, false) => (&stored[..len], &mut *scratch),
                (Loc::Scratch, true) => (&scratch[..len], &mut *out),
                (Loc::Out, false) => (&out[..len], &mut *scratch),
                (Loc::Out, true) | (Loc::Scratch, false) => {
                    unreachable!("copying stages alternate between out and scratch")
                }
            };
            set_len(dst, expected);
            run_stage(stage, src, &mut dst[..], ctx)?;
            loc = if to_out { Loc::Out } else { Loc::Scratch };
            len = expected;
        }

        if len != chunk_bytes {
            let what = if stages.is_empty() { "unfiltered chunk" } else { "pipeline" };
            return Err(size_mismatch(what, chunk_bytes, len));
        }
        match loc {
            Loc::Stored => out.extend_from_slice(&stored[..len]),
            Loc::Out => out.truncate(len),
            Loc::Scratch => unreachable!("the last copying stage writes to out"),
        }
        Ok(())
    }
}

/// Makes `buf` exactly `len` bytes long. Only bytes past the old length are
/// zeroed: every stage overwrites all of its output or fails.
fn set_len(buf: &mut Vec<u8>, len: usize) {
    buf.truncate(len);
    buf.resize(len, 0);
}

fn run_stage(stage: Stage, src: &[u8], dst: &mut [u8], ctx: &mut codec::Contexts) -> Result<(), FilterError> {
    match stage {
        Stage::Deflate => codec::inflate(src, dst, ctx.inflate()),
        Stage::Shuffle { element_size } => {
            if src.len() != dst.len() {
                return Err(size_mismatch("shuffle", dst.len(), src.len()));
            }
            shuffle::unshuffle(src, dst, element_size);
            Ok(())
        }
        Stage::Lzf => codec::lzf(src, dst),
        Stage::Lz4 => codec::hdf5_lz4(src, dst),
        Stage::Zstd => codec::zstd(src, dst, ctx.zstd()?),
        Stage::Bitshuffle(params) => shuffle::bitshuffle_filter(src, dst, params, ctx),
        Stage::Blosc => blosc::decode(src, dst, ctx),
        Stage::Blosc2 => blosc2::decode(src, dst, ctx),
        Stage::Fletcher32 => unreachable!("fletcher32 does not copy"),
    }
}
