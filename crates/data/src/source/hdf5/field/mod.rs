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

use hdf5::datatype::ByteOrder;
use hdf5_sys::h5::{haddr_t, hsize_t};
use stoker_proto::DType;

use crate::cache::{CacheCtx, Key, NEVER, Uses};
use stoker_decode::filter::{self, FilterSpec};

mod error;

pub(crate) use error::{FieldError, StoredChunk};

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

impl Layout {
    /// Short description for `stoker inspect` and logs.
    pub(crate) fn describe(&self) -> String {
        match self {
            Layout::Contiguous { .. } => "fast path: contiguous, pread".to_string(),
            Layout::Chunked(c) if c.filters.is_empty() => "fast path: chunked, pread".to_string(),
            Layout::Chunked(c) => {
                let names: Vec<_> = c.filters.iter().map(|f| f.name.as_str()).collect();
                format!("fast path: chunked, pread + {} in Rust", names.join(" + "))
            }
            Layout::Library { reason } => format!("libhdf5 (under its global lock): {reason}"),
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

#[derive(Debug, Clone, Copy)]
struct Location {
    /// File address, `None` when the chunk was never written.
    addr: Option<u64>,
    size: u64,
    filter_mask: u32,
}

/// One field of one file.
#[derive(Debug)]
pub(crate) struct FieldReader {
    pub(crate) dataset: hdf5::Dataset,
    /// Dataset shape.
    pub(crate) dims: Vec<u64>,
    /// Bytes per element.
    elem: usize,
    /// File bytes are big-endian and must be swapped after a raw copy.
    swap: bool,
    /// Native in-memory type for `H5Dread`.
    mem_type: hdf5::Datatype,
    pub(crate) layout: Layout,
    /// Identifies this field of this file in the chunk cache (a [`crate::cache::space_id`]).
    cache_id: u64,
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
    /// Inspects `dataset` and picks its read path.
    pub(crate) fn new(
        dataset: hdf5::Dataset,
        dtype: DType,
        file_type: &hdf5::Datatype,
        mem_type: hdf5::Datatype,
        cache_id: u64,
        fast_path: bool,
    ) -> Result<FieldReader, FieldError> {
        let dims: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
        let elem = dtype.size();
        let order = file_type.byte_order();
        let swap = order == ByteOrder::BigEndian && cfg!(target_endian = "little") && elem > 1;
        // One-byte types (bool is h5py's int8 enum of 0 and 1) need no byte
        // order; wider ones must be plain little- or big-endian.
        let raw_ok = elem == 1 || matches!(order, ByteOrder::LittleEndian | ByteOrder::BigEndian);
        let layout = if !fast_path {
            Layout::Library { reason: "fast path disabled ([hdf5] fast_path = false)".into() }
        } else if !raw_ok {
            Layout::Library { reason: format!("{dtype} stored with an unusual byte order") }
        } else {
            match dataset.layout() {
                hdf5::dataset::Layout::Contiguous => match dataset.offset() {
                    Some(offset) => Layout::Contiguous { offset },
                    None => Layout::Library { reason: "contiguous storage not allocated (never written)".into() },
                },
                hdf5::dataset::Layout::Chunked => chunked(&dataset, file_type, &dims, elem),
                hdf5::dataset::Layout::Compact => Layout::Library { reason: "compact layout".into() },
                #[allow(unreachable_patterns)]
                other => Layout::Library { reason: format!("{other:?} layout") },
            }
        };
        if !matches!(layout, Layout::Chunked(_)) {
            // libhdf5 reads it, so libhdf5 must have every filter of the pipeline.
            let missing: Vec<FilterSpec> =
                pipeline(&dataset).into_iter().filter(|f| !library_has_filter(f.id)).collect();
            if !missing.is_empty() {
                return Err(FieldError::Undecodable { missing });
            }
        }
        Ok(FieldReader { dataset, dims, elem, swap, mem_type, layout, cache_id })
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
            Layout::Library { .. } => return self.read_library(start, count, dst),
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
                let data = self.decoded_chunk(c, file, cache, linear, &chunk_start)?;
                let from = data.as_deref().map_or(ChunkBytes::Fill(&c.fill), |d| ChunkBytes::Memory(d));
                copy_region(c, self.elem, &chunk_start, start, count, from, dst)
                    .expect("copies from memory cannot fail");
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

    /// The decoded bytes of one filtered chunk (cached), or `None` if it was never written.
    fn decoded_chunk(
        &self,
        c: &Chunked,
        file: &File,
        cache: &ChunkUse<'_>,
        linear: u64,
        chunk_start: &[u64],
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
        let coords: Vec<hsize_t> = chunk_start.to_vec();
        let (mut mask, mut addr, mut size): (c_uint, haddr_t, hsize_t) = (0, 0, 0);
        let status = hdf5::sync::sync(|| {
            // SAFETY: the dataset id is valid while `self.dataset` lives;
            // `coords` has one entry per dimension; the out-pointers point at
            // locals; libhdf5 is called under hdf5-metno's global lock.
            unsafe {
                hdf5_sys::h5d::H5Dget_chunk_info_by_coord(
                    self.dataset.id(),
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
        let loc = Location { addr: (addr != hdf5_sys::h5::HADDR_UNDEF).then_some(addr), size, filter_mask: mask };
        let mut locations = c.locations.write().unwrap_or_else(|e| e.into_inner());
        if locations.len() >= MAX_LOCATIONS {
            locations.clear();
        }
        locations.insert(linear, loc);
        Ok(loc)
    }

    /// `H5Dread` of the block under the library lock, converting to native order.
    fn read_library(&self, start: &[u64], count: &[u64], dst: &mut [u8]) -> Result<(), FieldError> {
        use hdf5_sys::h5d::{H5Dget_space, H5Dread};
        use hdf5_sys::h5p::H5P_DEFAULT;
        use hdf5_sys::h5s::{H5S_seloper_t, H5Sclose, H5Screate_simple, H5Sselect_hyperslab};

        let elements: u64 = count.iter().product();
        let mem_dims = [elements];
        hdf5::sync::sync(|| {
            // SAFETY: the dataset and memory type stay open while `self`
            // lives; the spaces are created and closed here; `start` and
            // `count` have one entry per dimension; `dst` holds `elements`
            // values of `mem_type`; libhdf5 runs under hdf5-metno's lock.
            unsafe {
                let file_space = H5Dget_space(self.dataset.id());
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
                        self.dataset.id(),
                        self.mem_type.id(),
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

/// The bytes one chunk of `dataset` takes decoded, for a chunked dataset
/// with filters (whose reads decode whole chunks, on the fast path and in
/// libhdf5 alike); `None` for other layouts. A chunk shape whose size does
/// not fit in 64 bits counts as `u64::MAX`.
pub(crate) fn decoded_chunk_bytes(dataset: &hdf5::Dataset, elem: usize) -> Option<u64> {
    let chunk = dataset.chunk()?;
    if pipeline(dataset).is_empty() {
        return None;
    }
    Some(chunk.iter().try_fold(elem as u64, |acc, &d| acc.checked_mul(d as u64)).unwrap_or(u64::MAX))
}

/// Reads the chunked layout's metadata: chunk shape, filters, fill value.
fn chunked(dataset: &hdf5::Dataset, file_type: &hdf5::Datatype, dims: &[u64], elem: usize) -> Layout {
    use hdf5_sys::h5d::H5Dget_create_plist;
    use hdf5_sys::h5p::{H5Pclose, H5Pget_chunk, H5Pget_fill_value, H5Pget_filter2, H5Pget_nfilters};

    let rank = dims.len();
    let mut chunk = vec![0 as hsize_t; rank];
    let mut fill = vec![0u8; elem];
    let mut filters = Vec::new();
    let ok = hdf5::sync::sync(|| {
        // SAFETY: the dataset and type ids are valid while their owners live;
        // the property list is created here and closed before returning;
        // buffers are sized as libhdf5 expects (rank dims, one fill element
        // of the file type, 32 client-data values, a 256-byte name); all under
        // hdf5-metno's global lock.
        unsafe {
            let dcpl = H5Dget_create_plist(dataset.id());
            if dcpl < 0 {
                return false;
            }
            let got = H5Pget_chunk(dcpl, rank as i32, chunk.as_mut_ptr());
            let fill_ok = H5Pget_fill_value(dcpl, file_type.id(), fill.as_mut_ptr().cast()) >= 0;
            let n = H5Pget_nfilters(dcpl).max(0);
            for i in 0..n {
                let mut flags: c_uint = 0;
                let mut nelmts: usize = 32;
                let mut cd = vec![0 as c_uint; 32];
                let mut name = [0 as c_char; 256];
                let mut config: c_uint = 0;
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
                cd.truncate(nelmts.min(32));
                let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
                filters.push(FilterSpec { id: id as u32, flags, client_data: cd, name });
            }
            H5Pclose(dcpl);
            got == rank as i32 && fill_ok
        }
    });
    if !ok || chunk.contains(&0) {
        return Layout::Library { reason: "cannot read the chunk layout".into() };
    }
    if let Some(reason) = filter::unsupported_reason(&filters) {
        return Layout::Library { reason };
    }
    let grid = dims.iter().zip(&chunk).map(|(&d, &c)| d.div_ceil(c)).collect();
    let Some(chunk_bytes) =
        chunk.iter().try_fold(elem, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
    else {
        return Layout::Library { reason: "chunk size does not fit in memory".into() };
    };
    Layout::Chunked(Chunked { chunk, grid, chunk_bytes, filters, fill, locations: RwLock::new(HashMap::new()) })
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

/// The dataset's filter pipeline (`H5Pget_filter2`), empty when it has none.
pub(crate) fn pipeline(dataset: &hdf5::Dataset) -> Vec<FilterSpec> {
    use hdf5_sys::h5d::H5Dget_create_plist;
    use hdf5_sys::h5p::{H5Pclose, H5Pget_filter2, H5Pget_nfilters};
    hdf5::sync::sync(|| {
        let mut filters = Vec::new();
        // SAFETY: the dataset id is valid while `dataset` lives; the property
        // list is created here and closed before returning; buffers are sized
        // as passed (32 client-data values, a 256-byte name); under
        // hdf5-metno's global lock.
        unsafe {
            let dcpl = H5Dget_create_plist(dataset.id());
            if dcpl < 0 {
                return filters;
            }
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
                    continue;
                }
                cd.truncate(nelmts.min(32));
                let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
                filters.push(FilterSpec { id: id as u32, flags, client_data: cd, name });
            }
            H5Pclose(dcpl);
        }
        filters
    })
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
    use super::*;

    #[test]
    fn chunk_locations_remembered_stay_bounded_however_many_chunks_a_file_declares() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grid.h5");
        let rows = MAX_LOCATIONS + 300;
        // One row per chunk, none written: a small file with a large grid.
        // (Read through the handle that wrote it: a second open of the file
        // may meet libhdf5's file lock while the tests run in parallel.)
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<u8>().shape([rows, 4]).chunk([1, 4]).create("x").unwrap();
        let dataset = open_own_dataset(&file, "x").unwrap();
        let file_type = dataset.dtype().unwrap();
        let mem_type = native_type(&file_type).unwrap();
        let reader = FieldReader::new(dataset, DType::U8, &file_type, mem_type, 0, true).unwrap();
        let Layout::Chunked(c) = &reader.layout else { panic!("chunked: {}", reader.layout.describe()) };
        for row in 0..rows as u64 {
            let loc = reader.location(c, row, &[row, 0]).unwrap();
            assert!(loc.addr.is_none(), "row {row}: never written");
            let held = c.locations.read().unwrap().len();
            assert!(held <= MAX_LOCATIONS, "{held} locations held after {row} rows");
        }
    }
}
