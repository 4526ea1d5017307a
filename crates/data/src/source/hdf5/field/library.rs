//! What libhdf5 is asked, and nothing else: the facts of a file's fields
//! (shape, type, byte order, layout, chunk shape, filters, fill value), the
//! location of a chunk, and `H5Dread` of a block for the fields the fast
//! paths do not read.
//!
//! The daemon never runs this code on a client's file: its HDF5 helper
//! processes do (`stoker hdf5-helper`, one per trust domain, see
//! `docs/ARCHITECTURE.md`), and hand back these facts as plain data, which
//! the daemon checks before it reads a byte ([`super::FieldReader::from_facts`]).
//! `stoker inspect`, `stoker validate` and the tests run it in their own
//! process ([`LocalOpener`]).

use std::ffi::c_uint;
use std::fs::File;
use std::sync::Arc;

use hdf5::datatype::ByteOrder;
use hdf5_sys::h5::{haddr_t, hsize_t};
use serde::{Deserialize, Serialize};
use stoker_decode::filter::FilterSpec;
use stoker_proto::DType;

use super::{FieldError, chunked, library_has_filter, open_own_dataset, pipeline};
use crate::source::hdf5::types::{classify, mem_type};

/// Where a chunk is stored, as the file's chunk index says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    /// File address, `None` when the chunk was never written.
    pub addr: Option<u64>,
    /// Bytes stored.
    pub size: u64,
    /// Filters skipped for this chunk (bit i: filter i).
    pub filter_mask: u32,
}

/// How a field's bytes are stored, as libhdf5 reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayoutFacts {
    /// Row-major bytes at this file offset.
    Contiguous {
        /// File offset of element 0.
        offset: u64,
    },
    /// Chunked storage the fast path can read.
    Chunked {
        /// Chunk shape, one entry per dimension.
        chunk: Vec<u64>,
        /// The filter pipeline, in the order applied when writing.
        filters: Vec<FilterSpec>,
        /// The fill value, one element in file byte order.
        fill: Vec<u8>,
    },
    /// Only `H5Dread` reads it; why.
    Library {
        /// Why the fast paths do not apply.
        reason: String,
    },
}

/// What libhdf5 says about one field of one file: plain data, checked by the
/// daemon before use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldFacts {
    /// Dataset shape.
    pub shape: Vec<u64>,
    /// The dtype served.
    pub dtype: DType,
    /// File bytes are big-endian (swapped after a raw copy).
    pub swap: bool,
    /// How it is stored.
    pub layout: LayoutFacts,
    /// Chunk shape of a chunked dataset (any layout path), for messages.
    pub chunk: Option<Vec<u64>>,
    /// Decoded bytes of one chunk, for a chunked dataset with filters
    /// (whose reads decode whole chunks on either path).
    pub decoded_chunk_bytes: Option<u64>,
}

/// Why a file's fields could not be probed (the caller adds file and field
/// names; `field` indexes the fields asked for).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ProbeError {
    /// libhdf5 cannot open the file.
    #[error("{0}")]
    Open(String),
    /// No dataset at the field's path.
    #[error("no such dataset")]
    Missing {
        /// The field.
        field: usize,
    },
    /// The field's type is not served (what it is).
    #[error("dtype {found}")]
    Dtype {
        /// The field.
        field: usize,
        /// What the file has.
        found: String,
    },
    /// The field cannot be served as it is (why, and what to do).
    #[error("{message}")]
    Field {
        /// The field.
        field: usize,
        /// Why.
        message: String,
    },
    /// The helper that runs libhdf5 crashed, hung or could not be started.
    #[error("{0}")]
    Helper(String),
}

/// Where a file is opened with libhdf5: in a helper process (the daemon) or
/// in this process ([`LocalOpener`]: the CLI and tests).
pub trait Hdf5Opener: Send + Sync + std::fmt::Debug {
    /// Opens `file` (checked, by handle) with libhdf5 and probes the datasets
    /// at `h5paths`; the handle answers chunk lookups and library reads by
    /// field index.
    fn open(
        &self,
        file: &File,
        h5paths: &[String],
        fast_path: bool,
    ) -> Result<(Vec<FieldFacts>, Arc<dyn LibFile>), ProbeError>;
}

/// An open file, as libhdf5 reads it: chunk locations and `H5Dread`s.
pub trait LibFile: Send + Sync + std::fmt::Debug {
    /// Where the chunk of field `field` whose first element is `chunk_start` is stored.
    fn locate(&self, field: usize, chunk_start: &[u64]) -> Result<Location, FieldError>;
    /// `H5Dread` of the block (`start`, `count`) of field `field` into `dst`
    /// (exactly the block's bytes), in native byte order.
    fn read(&self, field: usize, start: &[u64], count: &[u64], dst: &mut [u8]) -> Result<(), FieldError>;
}

/// Runs libhdf5 in this process.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalOpener;

impl Hdf5Opener for LocalOpener {
    fn open(
        &self,
        file: &File,
        h5paths: &[String],
        fast_path: bool,
    ) -> Result<(Vec<FieldFacts>, Arc<dyn LibFile>), ProbeError> {
        let (facts, local) = probe(file, h5paths, fast_path)?;
        Ok((facts, Arc::new(local)))
    }
}

/// A file opened with libhdf5 in this process.
#[derive(Debug)]
pub struct LocalFile {
    /// Keeps the file open while its datasets are used.
    _h5: hdf5::File,
    /// Per field: the dataset and the native type `H5Dread` converts to.
    fields: Vec<(hdf5::Dataset, hdf5::Datatype)>,
}

/// Opens `file` with libhdf5 (through `/proc/self/fd/N`: the same inode, no
/// path lookup) and probes the datasets at `h5paths`.
pub fn probe(file: &File, h5paths: &[String], fast_path: bool) -> Result<(Vec<FieldFacts>, LocalFile), ProbeError> {
    // libhdf5's default chunk cache is 1 MiB per dataset: reads of rows from a
    // few different chunks in turn (parallel fills) would decompress whole
    // chunks again for every row on the libhdf5 path. 16 MiB per dataset.
    // No file locking: any reader of a shared file could take an exclusive
    // `flock` and make every open of it fail; a file changing under a stream
    // is caught by its identity checks instead.
    let h5 = hdf5::File::with_options()
        .with_fapl(|fapl| fapl.chunk_cache(4093, 16 << 20, 0.75).file_locking(false))
        .open(crate::fsaccess::fd_path(file))
        .map_err(|e| ProbeError::Open(e.to_string()))?;
    let mut facts = Vec::with_capacity(h5paths.len());
    let mut fields = Vec::with_capacity(h5paths.len());
    for (field, h5path) in h5paths.iter().enumerate() {
        let dataset = open_own_dataset(&h5, h5path).map_err(|why| match why.explain() {
            Some(message) => ProbeError::Field { field, message },
            None => ProbeError::Missing { field },
        })?;
        let (f, mem) = field_facts(&dataset, fast_path).map_err(|e| match e {
            FactsError::Dtype(found) => ProbeError::Dtype { field, found },
            FactsError::Other(message) => ProbeError::Field { field, message },
        })?;
        facts.push(f);
        fields.push((dataset, mem));
    }
    Ok((facts, LocalFile { _h5: h5, fields }))
}

/// Why a dataset's facts could not be read.
#[derive(Debug)]
pub(crate) enum FactsError {
    /// A type stoker does not serve (what it is).
    Dtype(String),
    /// Anything else (the message).
    Other(String),
}

/// The facts of `dataset`, and the native type `H5Dread` converts it to.
pub(crate) fn field_facts(
    dataset: &hdf5::Dataset,
    fast_path: bool,
) -> Result<(FieldFacts, hdf5::Datatype), FactsError> {
    let shape: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
    let file_type = dataset.dtype().map_err(|e| FactsError::Other(e.to_string()))?;
    let (dtype, descriptor) = classify(&file_type).map_err(|found| FactsError::Dtype(found.to_string()))?;
    let mem = mem_type(&file_type, &descriptor).map_err(|e| FactsError::Other(e.to_string()))?;
    let elem = dtype.size();
    let order = file_type.byte_order();
    let swap = order == ByteOrder::BigEndian && cfg!(target_endian = "little") && elem > 1;
    // One-byte types (bool is h5py's int8 enum of 0 and 1) need no byte
    // order; wider ones must be plain little- or big-endian.
    let raw_ok = elem == 1 || matches!(order, ByteOrder::LittleEndian | ByteOrder::BigEndian);
    let layout = if !fast_path {
        LayoutFacts::Library { reason: "fast path disabled ([hdf5] fast_path = false)".into() }
    } else if !raw_ok {
        LayoutFacts::Library { reason: format!("{dtype} stored with an unusual byte order") }
    } else {
        match dataset.layout() {
            hdf5::dataset::Layout::Contiguous => match dataset.offset() {
                Some(offset) => LayoutFacts::Contiguous { offset },
                None => LayoutFacts::Library { reason: "contiguous storage not allocated (never written)".into() },
            },
            hdf5::dataset::Layout::Chunked => chunked(dataset, &file_type, shape.len(), elem),
            hdf5::dataset::Layout::Compact => LayoutFacts::Library { reason: "compact layout".into() },
            #[allow(unreachable_patterns)]
            other => LayoutFacts::Library { reason: format!("{other:?} layout") },
        }
    };
    let filters = pipeline(dataset);
    if !matches!(layout, LayoutFacts::Chunked { .. }) {
        // libhdf5 reads it, so libhdf5 must have every filter of the pipeline.
        let missing: Vec<FilterSpec> = filters.iter().filter(|f| !library_has_filter(f.id)).cloned().collect();
        if !missing.is_empty() {
            return Err(FactsError::Other(FieldError::Undecodable { missing }.to_string()));
        }
    }
    let chunk: Option<Vec<u64>> = dataset.chunk().map(|c| c.iter().map(|&d| d as u64).collect());
    let decoded_chunk_bytes = match &chunk {
        Some(chunk) if !filters.is_empty() => {
            Some(chunk.iter().try_fold(elem as u64, |acc, &d| acc.checked_mul(d)).unwrap_or(u64::MAX))
        }
        _ => None,
    };
    Ok((FieldFacts { shape, dtype, swap, layout, chunk, decoded_chunk_bytes }, mem))
}

impl LocalFile {
    fn field(&self, field: usize) -> Result<&(hdf5::Dataset, hdf5::Datatype), FieldError> {
        self.fields.get(field).ok_or(FieldError::NoSuchField { field })
    }
}

impl LibFile for LocalFile {
    fn locate(&self, field: usize, chunk_start: &[u64]) -> Result<Location, FieldError> {
        let (dataset, _) = self.field(field)?;
        if chunk_start.len() != dataset.ndim() {
            return Err(FieldError::Locate { chunk: chunk_start.to_vec() });
        }
        let coords: Vec<hsize_t> = chunk_start.to_vec();
        let (mut mask, mut addr, mut size): (c_uint, haddr_t, hsize_t) = (0, 0, 0);
        let status = hdf5::sync::sync(|| {
            // SAFETY: the dataset id is valid while `self` lives; `coords` has
            // one entry per dimension (checked above); the out-pointers point
            // at locals; libhdf5 is called under hdf5-metno's global lock.
            unsafe {
                hdf5_sys::h5d::H5Dget_chunk_info_by_coord(
                    dataset.id(),
                    coords.as_ptr(),
                    &mut mask,
                    &mut addr,
                    &mut size,
                )
            }
        });
        if status < 0 {
            return Err(FieldError::Locate { chunk: chunk_start.to_vec() });
        }
        Ok(Location { addr: (addr != hdf5_sys::h5::HADDR_UNDEF).then_some(addr), size, filter_mask: mask })
    }

    fn read(&self, field: usize, start: &[u64], count: &[u64], dst: &mut [u8]) -> Result<(), FieldError> {
        use hdf5_sys::h5d::{H5Dget_space, H5Dread};
        use hdf5_sys::h5p::H5P_DEFAULT;
        use hdf5_sys::h5s::{H5S_seloper_t, H5Sclose, H5Screate_simple, H5Sselect_hyperslab};

        let (dataset, mem_type) = self.field(field)?;
        let elements = count.iter().try_fold(1u64, |acc, &c| acc.checked_mul(c));
        let bytes = elements.and_then(|e| e.checked_mul(mem_type.size() as u64));
        if start.len() != dataset.ndim() || count.len() != start.len() || bytes != Some(dst.len() as u64) {
            return Err(FieldError::Library { start: start.to_vec(), count: count.to_vec() });
        }
        let mem_dims = [elements.unwrap_or(0)];
        hdf5::sync::sync(|| {
            // SAFETY: the dataset and memory type stay open while `self`
            // lives; the spaces are created and closed here; `start` and
            // `count` have one entry per dimension and `dst` holds exactly
            // `elements` values of `mem_type` (both checked above); libhdf5
            // runs under hdf5-metno's lock.
            unsafe {
                let file_space = H5Dget_space(dataset.id());
                if file_space < 0 {
                    return Err(FieldError::NoSpace);
                }
                let mem_space = H5Screate_simple(1, mem_dims.as_ptr(), std::ptr::null());
                // A scalar dataspace (rank 0, a constant field) has one element, selected already.
                let mut status = if start.is_empty() {
                    0
                } else {
                    H5Sselect_hyperslab(
                        file_space,
                        H5S_seloper_t::H5S_SELECT_SET,
                        start.as_ptr(),
                        std::ptr::null(),
                        count.as_ptr(),
                        std::ptr::null(),
                    )
                };
                if status >= 0 && mem_space >= 0 {
                    status = H5Dread(
                        dataset.id(),
                        mem_type.id(),
                        mem_space,
                        file_space,
                        H5P_DEFAULT,
                        dst.as_mut_ptr().cast(),
                    );
                }
                if mem_space >= 0 {
                    H5Sclose(mem_space);
                }
                H5Sclose(file_space);
                if status < 0 || mem_space < 0 {
                    return Err(FieldError::Library { start: start.to_vec(), count: count.to_vec() });
                }
                Ok(())
            }
        })
    }
}
