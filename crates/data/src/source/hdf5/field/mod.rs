//! Reading one HDF5 dataset (one field of one file): a block `[item, …]` at a
//! time, straight into the destination.
//!
//! Three paths, chosen once at open:
//! - **contiguous**: `pread` at the dataset's file offset, outside libhdf5's
//!   global lock;
//! - **chunked**: chunk addresses are looked up through libhdf5 once per chunk
//!   (`H5Dget_chunk_info_by_coord`, remembered). Unfiltered chunks: only the
//!   runs the block needs are `pread` straight into place. Filtered chunks:
//!   the stored bytes are read whole and decoded by [`stoker_decode::filter`] on the
//!   calling worker thread, outside the lock, and kept in the node-wide
//!   [`ChunkCache`] for the chunk's other samples. Never-written chunks
//!   produce the fill value;
//! - **library**: `H5Dread` of a hyperslab under the lock, for everything the
//!   fast paths do not handle (compact layouts, bool/enum types,
//!   filters the fast path lacks). Logged once per field with the reason.
//!
//! The fast paths copy file-order bytes and byte-swap the destination at the
//! end when the file is big-endian. A dataset is opened by
//! [`open_own_dataset`]: its values come from its own file only (no external
//! links, virtual datasets or external raw storage).

use std::collections::HashMap;
use std::ffi::{c_char, c_uint};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, RwLock};

use hdf5_sys::h5::hsize_t;

use crate::cache::{CacheCtx, Key, NEVER, Uses};
use stoker_decode::filter::{self, FilterSpec};

mod error;
pub mod library;

pub use error::{FieldError, StoredChunk};
use library::{FieldFacts, LayoutFacts, LibFile, Location};

/// How a field's bytes are found.
#[derive(Debug)]
pub(crate) enum Layout {
    /// Row-major bytes at this file offset.
    Contiguous { offset: u64 },
    /// Chunked storage read and decoded in Rust.
    Chunked(Chunked),
    /// Read through `H5Dread`; the reason the fast paths do not apply.
    Library { reason: String },
}

fn describe_chunked(filters: &[FilterSpec]) -> String {
    if filters.is_empty() {
        return "fast path: chunked, pread".to_string();
    }
    let names: Vec<_> = filters.iter().map(|f| f.name.as_str()).collect();
    format!("fast path: chunked, pread + {} in Rust", names.join(" + "))
}

impl LayoutFacts {
    /// How a field with this layout is read, for `stoker inspect`.
    pub(crate) fn describe(&self) -> String {
        match self {
            LayoutFacts::Contiguous { .. } => "fast path: contiguous, pread".to_string(),
            LayoutFacts::Chunked { filters, .. } => describe_chunked(filters),
            LayoutFacts::Library { reason } => format!("libhdf5 (in the HDF5 helper): {reason}"),
        }
    }
}

/// Chunked-layout state of one field of one file.
#[derive(Debug)]
pub(crate) struct Chunked {
    /// Chunk shape, one entry per dataset dimension.
    pub(crate) chunk: Vec<u64>,
    /// Chunks per dimension.
    grid: Vec<u64>,
    /// Decoded bytes of one chunk.
    pub(crate) chunk_bytes: usize,
    /// The filter pipeline, in the order it was applied when writing.
    pub(crate) filters: Vec<FilterSpec>,
    /// The fill value, one element in file byte order.
    fill: Vec<u8>,
    /// Chunk locations looked up so far, by linear chunk index (at most
    /// [`MAX_LOCATIONS`]: the grid is the file's to declare).
    locations: RwLock<HashMap<u64, Location>>,
}

/// Chunk locations remembered per field of a file (about 3 MiB): beyond, the
/// memo starts afresh. A small file may declare billions of chunks, and an
/// epoch over them would otherwise keep one entry for each.
const MAX_LOCATIONS: usize = 1 << 16;

/// How long a worker waits for the decode budget before failing the sample.
const DECODE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// One field of one file.
#[derive(Debug)]
pub(crate) struct FieldReader {
    /// Dataset shape.
    pub(crate) dims: Vec<u64>,
    /// Bytes per element.
    elem: usize,
    /// File bytes are big-endian and must be swapped after a raw copy.
    swap: bool,
    pub(crate) layout: Layout,
    /// Identifies this field of this file in the chunk cache (a [`crate::cache::space_id`]).
    cache_id: u64,
    /// libhdf5's view of the file (a helper process's, in the daemon), for
    /// chunk locations and library reads.
    lib: Arc<dyn LibFile>,
    /// This field's index in `lib`.
    index: usize,
}

/// Facts about a field that cannot be true of an HDF5 dataset (a corrupt
/// file, or a helper that lies): the field is refused, naming them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadFacts {
    /// The dataset's bytes do not fit in 64 bits.
    #[error("has shape {shape:?}, whose bytes do not fit in 64 bits")]
    Shape {
        /// The shape reported.
        shape: Vec<u64>,
    },
    /// Chunks of another rank than the dataset, or with an empty extent.
    #[error("declares chunks of {chunk:?} for a dataset of shape {shape:?}")]
    Chunk {
        /// The chunk shape reported.
        chunk: Vec<u64>,
        /// The dataset shape reported.
        shape: Vec<u64>,
    },
    /// A fill value that is not one element.
    #[error("declares a fill value of {fill} bytes for {elem}-byte elements")]
    Fill {
        /// Bytes of the fill value.
        fill: usize,
        /// Bytes of one element.
        elem: usize,
    },
}

/// The chunk cache, and which samples a chunk read for this block serves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkUse<'a> {
    /// The caches and the dataset's fingerprint.
    pub ctx: &'a CacheCtx,
    /// `(first sample index of the file's item 0, samples per item)`; `None`
    /// for a field every sample reads (a constant).
    pub items: Option<(u64, u64)>,
}

impl FieldReader {
    /// The reader of field `index` of `lib` from its `facts`, which come from
    /// another process and are checked here before anything is read: the
    /// element size is the dtype's, a chunk shape has one non-zero extent
    /// per dimension and a size that fits in memory, the fill value is one
    /// element, and filters the Rust decoders lack send the field to the
    /// library path. Errors say what is inconsistent.
    pub(crate) fn from_facts(
        facts: &FieldFacts,
        index: usize,
        lib: Arc<dyn LibFile>,
        cache_id: u64,
    ) -> Result<FieldReader, BadFacts> {
        let dims = facts.shape.clone();
        let elem = facts.dtype.size();
        if dims.iter().try_fold(elem as u64, |acc, &d| acc.checked_mul(d)).is_none() {
            return Err(BadFacts::Shape { shape: dims });
        }
        let layout = match &facts.layout {
            LayoutFacts::Contiguous { offset } => Layout::Contiguous { offset: *offset },
            LayoutFacts::Library { reason } => Layout::Library { reason: reason.clone() },
            LayoutFacts::Chunked { chunk, filters, fill } => {
                if chunk.len() != dims.len() || chunk.contains(&0) {
                    return Err(BadFacts::Chunk { chunk: chunk.clone(), shape: dims });
                }
                if fill.len() != elem {
                    return Err(BadFacts::Fill { fill: fill.len(), elem });
                }
                let chunk_bytes = chunk
                    .iter()
                    .try_fold(elem, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
                    .filter(|&b| b <= isize::MAX as usize);
                match (chunk_bytes, filter::unsupported_reason(filters)) {
                    (None, _) => Layout::Library { reason: "chunk size does not fit in memory".into() },
                    (_, Some(reason)) => Layout::Library { reason },
                    (Some(chunk_bytes), None) => {
                        let grid = dims.iter().zip(chunk).map(|(&d, &c)| d.div_ceil(c)).collect();
                        Layout::Chunked(Chunked {
                            chunk: chunk.clone(),
                            grid,
                            chunk_bytes,
                            filters: filters.clone(),
                            fill: fill.clone(),
                            locations: RwLock::new(HashMap::new()),
                        })
                    }
                }
            }
        };
        Ok(FieldReader { dims, elem, swap: facts.swap && elem > 1, layout, cache_id, lib, index })
    }

    /// Reads the block at `start` of shape `count` (both full rank, C order)
    /// into `dst` (exactly `prod(count) * elem` bytes). Errors are messages
    /// naming the chunk involved; the caller adds file and field.
    pub(crate) fn read_block(
        &self,
        file: &File,
        cache: &ChunkUse<'_>,
        start: &[u64],
        count: &[u64],
        dst: &mut [u8],
    ) -> Result<(), FieldError> {
        debug_assert_eq!(dst.len() as u64, count.iter().product::<u64>() * self.elem as u64);
        match &self.layout {
            Layout::Contiguous { offset } => {
                // Blocks are [1, n, full trailing dims…], so they are one run.
                let mut at = 0u64;
                for (d, (&s, &dim)) in start.iter().zip(&self.dims).enumerate() {
                    let stride: u64 = self.dims[d + 1..].iter().product::<u64>() * self.elem as u64;
                    at += s * stride;
                    debug_assert!(s < dim || count[d] == 0);
                }
                let at = offset + at;
                file.read_exact_at(dst, at).map_err(|error| FieldError::Read {
                    bytes: dst.len(),
                    offset: at,
                    error,
                })?;
            }
            Layout::Chunked(c) => self.read_chunked(c, file, cache, start, count, dst)?,
            Layout::Library { .. } => return self.lib.read(self.index, start, count, dst),
        }
        if self.swap {
            for element in dst.chunks_exact_mut(self.elem) {
                element.reverse();
            }
        }
        Ok(())
    }

    fn read_chunked(
        &self,
        c: &Chunked,
        file: &File,
        cache: &ChunkUse<'_>,
        start: &[u64],
        count: &[u64],
        dst: &mut [u8],
    ) -> Result<(), FieldError> {
        let rank = self.dims.len();
        if count.contains(&0) {
            return Ok(());
        }
        // Chunk grid range covering the block.
        let first: Vec<u64> = (0..rank).map(|a| start[a] / c.chunk[a]).collect();
        let last: Vec<u64> = (0..rank).map(|a| (start[a] + count[a] - 1) / c.chunk[a]).collect();
        let mut grid_pos = first.clone();
        loop {
            let linear = grid_pos.iter().zip(&c.grid).fold(0u64, |acc, (&g, &n)| acc * n + g);
            let chunk_start: Vec<u64> = (0..rank).map(|a| grid_pos[a] * c.chunk[a]).collect();
            if c.filters.is_empty() {
                // Unfiltered: read just the runs needed, straight into place.
                let loc = self.location(c, linear, &chunk_start)?;
                let from = match loc.addr {
                    Some(addr) if loc.size as usize == c.chunk_bytes => ChunkBytes::File { file, addr },
                    Some(_) => {
                        return Err(FieldError::StoredSize {
                            chunk: chunk_start,
                            stored: loc.size,
                            expected: c.chunk_bytes,
                        });
                    }
                    None => ChunkBytes::Fill(&c.fill),
                };
                copy_region(c, self.elem, &chunk_start, start, count, from, dst)
                    .map_err(|error| FieldError::ChunkRead { chunk: chunk_start.clone(), error })?;
            } else {
                let mut lease = None;
                let data = self.decoded_chunk(c, file, cache, linear, &chunk_start, &mut lease)?;
                let from = data.as_deref().map_or(ChunkBytes::Fill(&c.fill), |d| ChunkBytes::Memory(d));
                copy_region(c, self.elem, &chunk_start, start, count, from, dst)
                    .expect("copies from memory cannot fail");
                // The decode buffers count against the budget until copied from.
                drop(data);
                drop(lease);
            }
            // Next chunk position (odometer over the grid range).
            let mut a = rank;
            loop {
                if a == 0 {
                    return Ok(());
                }
                a -= 1;
                if grid_pos[a] < last[a] {
                    grid_pos[a] += 1;
                    break;
                }
                grid_pos[a] = first[a];
            }
        }
    }

    /// The decoded bytes of one filtered chunk (cached), or `None` if it was
    /// never written. A chunk decoded here reserves its buffers from the
    /// daemon-wide decode budget first; the reservation is left in `lease`.
    fn decoded_chunk<'c>(
        &self,
        c: &Chunked,
        file: &File,
        cache: &ChunkUse<'c>,
        linear: u64,
        chunk_start: &[u64],
        lease: &mut Option<crate::cache::DecodeLease<'c>>,
    ) -> Result<Option<Arc<Vec<u8>>>, FieldError> {
        let key = Key { space: self.cache_id, item: linear };
        cache.ctx.caches.chunks.get_or_load(&key, cache.ctx.dataset, || {
            let loc = self.location(c, linear, chunk_start)?;
            let Some(addr) = loc.addr else { return Ok(None) };
            let at = || StoredChunk { start: chunk_start.to_vec(), addr, stored: loc.size };
            // The chunk index is file contents: its size is checked before it is allocated.
            let len = file.metadata().map_err(|error| FieldError::FileSize { at: at(), error })?.len();
            if addr.checked_add(loc.size).is_none_or(|end| end > len) {
                return Err(FieldError::PastEnd { at: at(), file_bytes: len });
            }
            if loc.size > max_stored(c.chunk_bytes) {
                return Err(FieldError::Oversized { at: at(), chunk_bytes: c.chunk_bytes });
            }
            let need = loc.size.saturating_add(c.chunk_bytes as u64);
            let budget = &cache.ctx.caches.decode;
            *lease = Some(budget.acquire(need, DECODE_WAIT).map_err(|limit| FieldError::DecodeBudget {
                at: at(),
                need,
                limit,
                why: if need > limit { "is smaller" } else { "stayed busy for 30 s" },
            })?);
            let mut stored = vec![0u8; loc.size as usize];
            file.read_exact_at(&mut stored, addr).map_err(|error| FieldError::StoredRead { at: at(), error })?;
            let mut out = Vec::new();
            filter::decode_chunk(&c.filters, loc.filter_mask, &stored, self.elem, c.chunk_bytes, &mut out)
                .map_err(|error| FieldError::Decode { at: at(), error })?;
            // The samples that read this chunk: those of the items it spans
            // (every sample, for a constant field).
            let uses = match cache.items {
                Some((base, windows)) => {
                    let first = chunk_start.first().copied().unwrap_or(0);
                    let end =
                        (first + c.chunk.first().copied().unwrap_or(1)).min(self.dims.first().copied().unwrap_or(1));
                    let at = |item: u64| base.saturating_add(item.saturating_mul(windows));
                    Uses { dataset: cache.ctx.dataset, lo: at(first), hi: at(end) }
                }
                None => Uses { dataset: cache.ctx.dataset, lo: 0, hi: NEVER },
            };
            let bytes = out.len();
            Ok(Some((Arc::new(out), bytes, uses)))
        })
    }

    fn location(&self, c: &Chunked, linear: u64, chunk_start: &[u64]) -> Result<Location, FieldError> {
        if let Some(loc) = c.locations.read().unwrap_or_else(|e| e.into_inner()).get(&linear) {
            return Ok(*loc);
        }
        let loc = self.lib.locate(self.index, chunk_start)?;
        let mut locations = c.locations.write().unwrap_or_else(|e| e.into_inner());
        if locations.len() >= MAX_LOCATIONS {
            locations.clear();
        }
        locations.insert(linear, loc);
        Ok(loc)
    }
}

/// Where a chunk's decoded bytes come from.
#[derive(Clone, Copy)]
enum ChunkBytes<'a> {
    /// Decoded in memory.
    Memory(&'a [u8]),
    /// Stored unfiltered in the file at `addr`.
    File { file: &'a File, addr: u64 },
    /// Never written: every element is this fill value.
    Fill(&'a [u8]),
}

/// Copies the part of the block (`start`, `count`) that lies in the chunk at
/// `chunk_start` into `dst`, in runs as long as both layouts allow.
fn copy_region(
    c: &Chunked,
    elem: usize,
    chunk_start: &[u64],
    start: &[u64],
    count: &[u64],
    from: ChunkBytes<'_>,
    dst: &mut [u8],
) -> std::io::Result<()> {
    let rank = c.chunk.len();
    let lo: Vec<u64> = (0..rank).map(|a| start[a].max(chunk_start[a])).collect();
    let hi: Vec<u64> = (0..rank).map(|a| (start[a] + count[a]).min(chunk_start[a] + c.chunk[a])).collect();
    // Merge trailing axes that are whole in both the chunk and the block into one run.
    let mut split = rank - 1;
    while split > 0 {
        let a = split;
        let whole =
            lo[a] == chunk_start[a] && hi[a] - lo[a] == c.chunk[a] && lo[a] == start[a] && hi[a] - lo[a] == count[a];
        if !whole {
            break;
        }
        split -= 1;
    }
    let run_elems = (hi[split] - lo[split]) * c.chunk[split + 1..].iter().product::<u64>();
    let run = run_elems as usize * elem;
    let mut chunk_strides = vec![elem as u64; rank];
    let mut block_strides = vec![elem as u64; rank];
    for a in (0..rank.saturating_sub(1)).rev() {
        chunk_strides[a] = chunk_strides[a + 1] * c.chunk[a + 1];
        block_strides[a] = block_strides[a + 1] * count[a + 1];
    }
    let mut pos = lo[..split].to_vec();
    loop {
        let mut src = (lo[split] - chunk_start[split]) * chunk_strides[split];
        let mut out = (lo[split] - start[split]) * block_strides[split];
        for a in 0..split {
            src += (pos[a] - chunk_start[a]) * chunk_strides[a];
            out += (pos[a] - start[a]) * block_strides[a];
        }
        let target = &mut dst[out as usize..out as usize + run];
        match from {
            ChunkBytes::Memory(data) => target.copy_from_slice(&data[src as usize..src as usize + run]),
            ChunkBytes::File { file, addr } => file.read_exact_at(target, addr + src)?,
            ChunkBytes::Fill(fill) => {
                for element in target.chunks_exact_mut(elem) {
                    element.copy_from_slice(fill);
                }
            }
        }
        let mut a = split;
        loop {
            if a == 0 {
                return Ok(());
            }
            a -= 1;
            if pos[a] + 1 < hi[a] {
                pos[a] += 1;
                break;
            }
            pos[a] = lo[a];
        }
    }
}

/// Why a field cannot be served from the file it is named in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotOwn {
    /// No dataset at that path (or libhdf5 could not open it).
    Missing,
    /// The path reaches another file through an external link (`file:object`).
    ExternalLink(String),
    /// A virtual dataset: its values are read from other files (the first named).
    Virtual(String),
    /// External raw storage: its values are the bytes of other files (the first named).
    ExternalStorage(String),
}

impl NotOwn {
    /// What is wrong and what to do, for an error that names file and field.
    pub(crate) fn explain(&self) -> Option<String> {
        let what = match self {
            NotOwn::Missing => return None,
            NotOwn::ExternalLink(to) => format!("is reached through an external link to {to}"),
            NotOwn::Virtual(from) if from.is_empty() => {
                "is a virtual dataset (its values are read from other files)".into()
            }
            NotOwn::Virtual(from) => format!("is a virtual dataset (its values are read from {from}, ...)"),
            NotOwn::ExternalStorage(from) => format!("keeps its values in the external file {from}"),
        };
        Some(format!(
            "{what}; stoker serves a file's own bytes, read through the handle it opened (with the client's \
             rights, beneath the allowed roots), and follows no links into other files: name the file that holds \
             the data instead (a glob concatenates files, as a virtual dataset would)"
        ))
    }
}

thread_local! {
    /// Where the last refused external link led, on this thread (set by
    /// [`refuse_external_link`] inside `H5Dopen2`, taken right after it).
    static REFUSED_LINK: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// libhdf5's external-link traversal callback: never follows the link and
/// records where it led in [`REFUSED_LINK`]. It takes no `op_data`: the
/// dataset keeps a copy of the access property list it was opened with, so a
/// pointer there would outlive the open.
extern "C" fn refuse_external_link(
    _parent_file: *const c_char,
    _parent_group: *const c_char,
    child_file: *const c_char,
    child_object: *const c_char,
    _acc_flags: *mut c_uint,
    _fapl: hdf5_sys::h5i::hid_t,
    _op_data: *mut std::ffi::c_void,
) -> hdf5_sys::h5::herr_t {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: libhdf5 passes NUL-terminated names valid for the call.
            unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let to = format!("{}:{}", text(child_file), text(child_object));
    // No panic may cross this C frame: neither a destroyed thread-local nor a borrow.
    let _ = REFUSED_LINK.try_with(|seen| {
        if let Ok(mut seen) = seen.try_borrow_mut() {
            seen.get_or_insert(to);
        }
    });
    -1
}

/// Opens the dataset at `path` in `group` so that its values can only come
/// from the group's file itself: external links on the way are not followed (libhdf5
/// would open the other file by path, with the daemon's rights and outside
/// the allowed roots, and the fast paths would read that file's offsets from
/// this one), and virtual datasets and external raw storage (whose values
/// libhdf5 reads from other files, by path, at read time) are refused.
pub(crate) fn open_own_dataset(group: &hdf5::Group, path: &str) -> Result<hdf5::Dataset, NotOwn> {
    use hdf5_sys::h5d::H5Dopen2;
    use hdf5_sys::h5p::H5Pset_elink_cb;
    let name = std::ffi::CString::new(path).map_err(|_| NotOwn::Missing)?;
    let dapl = hdf5::plist::DatasetAccess::try_new().map_err(|_| NotOwn::Missing)?;
    let _ = REFUSED_LINK.try_with(|seen| seen.borrow_mut().take());
    let id = hdf5::sync::sync(|| {
        // SAFETY: the group and property list ids are valid while their owners
        // live; the callback takes no data pointer; under hdf5-metno's global
        // lock (the callback runs on this thread, inside H5Dopen2).
        unsafe {
            if H5Pset_elink_cb(dapl.id(), Some(refuse_external_link), std::ptr::null_mut()) < 0 {
                return -1;
            }
            H5Dopen2(group.id(), name.as_ptr(), dapl.id())
        }
    });
    drop(dapl);
    if let Some(to) = REFUSED_LINK.try_with(|seen| seen.borrow_mut().take()).ok().flatten() {
        return Err(NotOwn::ExternalLink(to));
    }
    if id < 0 {
        return Err(NotOwn::Missing);
    }
    // SAFETY: `id` is a dataset id just opened by libhdf5, owned by nobody else.
    let dataset: hdf5::Dataset = unsafe { hdf5::from_id(id) }.map_err(|_| NotOwn::Missing)?;
    let dcpl = dataset.dcpl().map_err(|_| NotOwn::Missing)?;
    if dcpl.layout() == hdf5::plist::dataset_create::Layout::Virtual {
        let from = dcpl.virtual_map().first().map_or_else(String::new, |m| m.src_filename.clone());
        return Err(NotOwn::Virtual(from));
    }
    if let Some(first) = dcpl.external().first() {
        return Err(NotOwn::ExternalStorage(first.name.clone()));
    }
    Ok(dataset)
}

/// Reads the chunked layout's metadata: chunk shape, filters, fill value.
fn chunked(dataset: &hdf5::Dataset, file_type: &hdf5::Datatype, rank: usize, elem: usize) -> LayoutFacts {
    use hdf5_sys::h5d::H5Dget_create_plist;
    use hdf5_sys::h5p::{H5Pclose, H5Pget_chunk, H5Pget_fill_value};

    let mut chunk = vec![0 as hsize_t; rank];
    let mut fill = vec![0u8; elem];
    let mut filters = Vec::new();
    let ok = hdf5::sync::sync(|| {
        // SAFETY: the dataset and type ids are valid while their owners live;
        // the property list is created here and closed before returning;
        // buffers are sized as libhdf5 expects (rank dims, one fill element
        // of the file type); all under hdf5-metno's global lock.
        unsafe {
            let dcpl = H5Dget_create_plist(dataset.id());
            if dcpl < 0 {
                return false;
            }
            let got = H5Pget_chunk(dcpl, rank as i32, chunk.as_mut_ptr());
            let fill_ok = H5Pget_fill_value(dcpl, file_type.id(), fill.as_mut_ptr().cast()) >= 0;
            let (read, whole) = filters_of(dcpl);
            filters = read;
            H5Pclose(dcpl);
            // A filter that cannot be read must not be skipped: decoding
            // without it would serve wrong values.
            got == rank as i32 && fill_ok && whole
        }
    });
    if !ok || chunk.contains(&0) {
        return LayoutFacts::Library { reason: "cannot read the chunk layout".into() };
    }
    if let Some(reason) = filter::unsupported_reason(&filters) {
        return LayoutFacts::Library { reason };
    }
    LayoutFacts::Chunked { chunk, filters, fill }
}

/// The size in bytes of `file_type` when it is an HDF5 bitfield
/// (`H5T_BITFIELD`: PyTables' bool arrays), `None` for any other class.
pub(crate) fn bitfield_size(file_type: &hdf5::Datatype) -> Option<usize> {
    use hdf5_sys::h5t::{H5T_class_t, H5Tget_class, H5Tget_size};
    hdf5::sync::sync(|| {
        // SAFETY: the type id is valid while `file_type` lives; both calls
        // only read the type, under hdf5-metno's global lock.
        unsafe { (H5Tget_class(file_type.id()) == H5T_class_t::H5T_BITFIELD).then(|| H5Tget_size(file_type.id())) }
    })
}

/// The native in-memory form of `file_type` (`H5Tget_native_type`).
pub(crate) fn native_type(file_type: &hdf5::Datatype) -> hdf5::Result<hdf5::Datatype> {
    use hdf5_sys::h5t::{H5T_direction_t, H5Tget_native_type};
    let id = hdf5::sync::sync(|| {
        // SAFETY: the type id is valid while `file_type` lives; the returned
        // id is a new type that `from_id` takes ownership of (or an error).
        unsafe { H5Tget_native_type(file_type.id(), H5T_direction_t::H5T_DIR_ASCEND) }
    });
    if id < 0 {
        return Err("H5Tget_native_type failed".into());
    }
    // SAFETY: `id` is a datatype id just created by libhdf5, owned by nobody else.
    unsafe { hdf5::from_id(id) }
}

/// The dataset's filter pipeline (`H5Pget_filter2`), empty when it has none;
/// entries libhdf5 cannot describe are left out.
pub(crate) fn pipeline(dataset: &hdf5::Dataset) -> Vec<FilterSpec> {
    use hdf5_sys::h5d::H5Dget_create_plist;
    use hdf5_sys::h5p::H5Pclose;
    hdf5::sync::sync(|| {
        // SAFETY: the dataset id is valid while `dataset` lives; the property
        // list is created here and closed before returning; under
        // hdf5-metno's global lock.
        unsafe {
            let dcpl = H5Dget_create_plist(dataset.id());
            if dcpl < 0 {
                return Vec::new();
            }
            let (filters, _) = filters_of(dcpl);
            H5Pclose(dcpl);
            filters
        }
    })
}

/// The filters of the dataset creation property list `dcpl`, and whether
/// every entry could be read (the ones that could not are left out).
///
/// # Safety
/// `dcpl` is a valid property list id; the caller holds hdf5-metno's lock.
unsafe fn filters_of(dcpl: hdf5_sys::h5i::hid_t) -> (Vec<FilterSpec>, bool) {
    use hdf5_sys::h5p::{H5Pget_filter2, H5Pget_nfilters};
    let mut filters = Vec::new();
    let mut whole = true;
    // SAFETY: `dcpl` is valid (the caller's contract); buffers are sized as
    // passed (32 client-data values, a 256-byte name, NUL-terminated by
    // libhdf5 within it).
    unsafe {
        for i in 0..H5Pget_nfilters(dcpl).max(0) {
            let (mut flags, mut nelmts, mut config): (c_uint, usize, c_uint) = (0, 32, 0);
            let mut cd = vec![0 as c_uint; 32];
            let mut name = [0 as c_char; 256];
            let id = H5Pget_filter2(
                dcpl,
                i as c_uint,
                &mut flags,
                &mut nelmts,
                cd.as_mut_ptr(),
                name.len(),
                name.as_mut_ptr(),
                &mut config,
            );
            if id < 0 {
                whole = false;
                continue;
            }
            cd.truncate(nelmts.min(32));
            let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            filters.push(FilterSpec { id: id as u32, flags, client_data: cd, name });
        }
    }
    (filters, whole)
}

/// Whether libhdf5 can apply filter `id`: built in, registered, or loadable
/// as a plugin from `HDF5_PLUGIN_PATH` (`H5Zfilter_avail` tries to load it).
pub(crate) fn library_has_filter(id: u32) -> bool {
    let Ok(id) = i32::try_from(id) else { return false };
    // SAFETY: H5Zfilter_avail takes a plain filter id; under hdf5-metno's global lock.
    hdf5::sync::sync(|| unsafe { hdf5_sys::h5z::H5Zfilter_avail(id) } > 0)
}

/// Who decodes `filter` here: `"Rust"`, `"libhdf5"` (built in or a plugin),
/// or `None` when nothing can.
pub(crate) fn decoder_of(filter: &FilterSpec) -> Option<&'static str> {
    if filter::unsupported_reason(std::slice::from_ref(filter)).is_none() {
        Some("Rust")
    } else if library_has_filter(filter.id) {
        Some("libhdf5")
    } else {
        None
    }
}

/// A filter's usual name (hdf5plugin's names for the registered plugins).
pub(crate) fn filter_name(filter: &FilterSpec) -> String {
    let known = match filter.id {
        1 => "deflate",
        2 => "shuffle",
        3 => "fletcher32",
        4 => "szip",
        5 => "nbit",
        6 => "scaleoffset",
        307 => "bzip2",
        32000 => "lzf",
        32001 => "blosc",
        32004 => "lz4",
        32008 => "bitshuffle",
        32013 => "zfp",
        32015 => "zstd",
        32017 => "sz",
        32018 => "fcidecomp",
        32024 => "sz3",
        32026 => "blosc2",
        _ => "",
    };
    match (known, filter.name.trim()) {
        ("", "") => "unregistered filter".to_string(),
        ("", stored) => stored.to_string(),
        (known, _) => known.to_string(),
    }
}

/// The most bytes a chunk of `chunk_bytes` may take stored: every HDF5
/// filter (deflate, lz4, zstd, Blosc, bitshuffle, Fletcher-32) grows
/// incompressible data by a small fraction at most; a larger size in the
/// chunk index is corrupt, and is refused before it is allocated.
fn max_stored(chunk_bytes: usize) -> u64 {
    (chunk_bytes as u64).saturating_mul(2).saturating_add(1 << 20)
}

#[cfg(test)]
mod tests {
    use stoker_proto::DType;

    use super::*;

    #[test]
    fn chunk_locations_remembered_stay_bounded_however_many_chunks_a_file_declares() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grid.h5");
        let rows = MAX_LOCATIONS + 300;
        // One row per chunk, none written: a small file with a large grid.
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<u8>().shape([rows, 4]).chunk([1, 4]).create("x").unwrap();
        file.close().unwrap();
        let raw = File::open(&path).unwrap();
        let (facts, lib) = library::probe(&raw, &["x".to_string()], true).unwrap();
        let reader = FieldReader::from_facts(&facts[0], 0, Arc::new(lib), 0).unwrap();
        let Layout::Chunked(c) = &reader.layout else { panic!("chunked: {:?}", reader.layout) };
        for row in 0..rows as u64 {
            let loc = reader.location(c, row, &[row, 0]).unwrap();
            assert!(loc.addr.is_none(), "row {row}: never written");
            let held = c.locations.read().unwrap().len();
            assert!(held <= MAX_LOCATIONS, "{held} locations held after {row} rows");
        }
    }

    /// Facts from another process are checked before anything is read.
    #[test]
    fn inconsistent_facts_are_refused_or_read_by_the_library() {
        #[derive(Debug)]
        struct Nothing;
        impl LibFile for Nothing {
            fn locate(&self, _: usize, c: &[u64]) -> Result<Location, FieldError> {
                Err(FieldError::Locate { chunk: c.to_vec() })
            }
            fn read(&self, _: usize, s: &[u64], c: &[u64], _: &mut [u8]) -> Result<(), FieldError> {
                Err(FieldError::Library { start: s.to_vec(), count: c.to_vec() })
            }
        }
        let facts = |shape: Vec<u64>, chunk: Vec<u64>, fill: usize| FieldFacts {
            shape,
            dtype: DType::F32,
            swap: false,
            layout: LayoutFacts::Chunked { chunk, filters: Vec::new(), fill: vec![0; fill] },
            chunk: None,
            decoded_chunk_bytes: None,
        };
        let open = |f: &FieldFacts| FieldReader::from_facts(f, 0, Arc::new(Nothing), 0);
        assert!(open(&facts(vec![64, 4], vec![16, 4], 4)).is_ok());
        for bad in [
            facts(vec![64, 4], vec![16], 4),
            facts(vec![64, 4], vec![16, 0], 4),
            facts(vec![64, 4], vec![16, 4], 3),
            facts(vec![u64::MAX, 4], vec![16, 4], 4),
        ] {
            assert!(open(&bad).is_err(), "{bad:?} accepted");
        }
        let huge = open(&facts(vec![64, 4], vec![1 << 40, 1 << 40], 4)).unwrap();
        assert!(matches!(huge.layout, Layout::Library { .. }), "{:?}", huge.layout);
    }
}
