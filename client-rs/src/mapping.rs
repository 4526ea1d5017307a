//! The client's copy-on-write mapping of a stream's ring. This module is the
//! only place in the client that turns shared-memory addresses into slices.
//!
//! The ring is mapped `MAP_PRIVATE` (the daemon's `F_SEAL_FUTURE_WRITE` allows
//! no shared writable mapping): reads see the daemon's pages with no copy, a
//! write gives this process its own copy of the page touched, and nobody else
//! (the daemon, other clients, later batches) sees it. Before a slot goes back
//! to the daemon its private pages are dropped (`MADV_DONTNEED`), so the next
//! batch in that slot is read from the shared pages again. The mapping is
//! `MADV_DONTFORK`: a forked child (a DataLoader worker, say) does not inherit
//! it, and a fork never turns the parent's pages copy-on-write.

use std::fs::File;
use std::os::fd::OwnedFd;

use std::mem::ManuallyDrop;

use memmap2::{Advice, MmapMut, MmapOptions, UncheckedAdvice};
use stoker_proto::ctrl::{CTRL_BYTES, Control};
use stoker_proto::{BatchLayout, DType, RING_LAYOUT_VERSION, RING_MAGIC};

use crate::{ClientError, Result};

#[derive(Debug)]
pub(crate) struct Mapping {
    /// Unmapped on drop only in the process that mapped it: in a forked
    /// child the range is not mapped (`MADV_DONTFORK`), and may hold the
    /// child's own mappings by now.
    map: ManuallyDrop<MmapMut>,
    owner: u32,
    /// `map`'s start, taken once so slices and array pointers never go
    /// through a shared borrow of the (mutable) mapping.
    base: *mut u8,
    layout: BatchLayout,
}

impl Mapping {
    pub(crate) fn new(fd: OwnedFd, layout: &BatchLayout, depth: u32) -> Result<Mapping> {
        let file = File::from(fd);
        let want = layout.ring_bytes(depth);
        let have = file.metadata()?.len();
        if have < want {
            return Err(ClientError::Protocol(format!("shared-memory ring is {have} bytes, the layout needs {want}")));
        }
        // SAFETY: the daemon sealed the memfd against shrinking (F_SEAL_SHRINK),
        // so the mapping can never extend past the end of the file (no SIGBUS).
        // It is private: this process's writes never reach the file. The
        // daemon writes only to slots this client does not hold, and all
        // slices handed out cover held slots, so no reader observes a write.
        let mut map = unsafe { MmapOptions::new().map_copy(&file)? };
        // Best effort: without it a fork shares nothing wrong, it only copies more.
        let _ = map.advise(Advice::DontFork);
        let base = map.as_mut_ptr();
        let header = &map[..16];
        let magic = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        if magic != RING_MAGIC || version != RING_LAYOUT_VERSION {
            return Err(ClientError::Protocol(format!(
                "shared-memory ring has magic {magic:#x} version {version}; this client expects \
                 {RING_MAGIC:#x} version {RING_LAYOUT_VERSION} (client and daemon versions differ)"
            )));
        }
        Ok(Mapping { map: ManuallyDrop::new(map), owner: std::process::id(), base, layout: layout.clone() })
    }

    pub(crate) fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    pub(crate) fn range(&self) -> (usize, usize) {
        (self.map.as_ptr() as usize, self.map.len())
    }

    /// `len` bytes at `offset` inside `slot`.
    ///
    /// Panics if the range lies outside the mapping, which the layout check in
    /// [`Mapping::new`] rules out for every field of every slot.
    pub(crate) fn slot_bytes(&self, slot: u32, offset: u64, len: usize) -> &[u8] {
        let start = (self.layout.slot_offset(slot) + offset) as usize;
        assert!(start.checked_add(len).is_some_and(|end| end <= self.map.len()), "slot range inside the mapping");
        // SAFETY: in bounds (checked above). The slot is held by the caller's
        // lease, so the daemon does not write it; this process may write it
        // through arrays handed to Python (private copy-on-write pages), which
        // is why the slice is made from `base` and lives no longer than the
        // caller's borrow of the batch.
        unsafe { std::slice::from_raw_parts(self.base.add(start), len) }
    }

    /// Drops this process's private copies of `slot`'s pages, so that the
    /// next batch in it is read from the daemon's pages. Call it only when no
    /// view of the slot is left.
    ///
    /// Dropping pages costs twice: the zap itself and the faults of the next
    /// read (about 13 ms per 64 MiB here). So it happens only when
    /// `/proc/self/pagemap` shows a private (copied) page in the slot; a
    /// batch that was only read keeps its page tables.
    pub(crate) fn discard(&self, slot: u32) {
        if std::process::id() != self.owner {
            return;
        }
        let start = self.layout.slot_offset(slot) as usize;
        let len = (self.layout.slot_bytes as usize).min(self.map.len().saturating_sub(start));
        // SAFETY: `start` lies inside the mapping (clamped above).
        let addr = unsafe { self.base.add(start) } as usize;
        if !has_private_pages(addr, len) {
            return;
        }
        // SAFETY: MADV_DONTNEED on a private file mapping drops private pages
        // and re-reads the file's; it never touches memory outside the range,
        // which lies inside the mapping. No reference into the slot is alive
        // (the lease that owned it is being dropped), so nobody observes the
        // contents change.
        let _ = unsafe { self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, len) };
    }
}

/// Whether any page in `[addr, addr + len)` of this process is a private
/// (anonymous) page, i.e. a copy made by a write to a private file mapping.
/// `/proc/self/pagemap` holds one u64 per page: bit 63 "present", bit 61
/// "file page or shared anonymous". Both flags are readable without
/// privileges. Any failure answers `true` (drop the pages: always correct).
fn has_private_pages(addr: usize, len: usize) -> bool {
    use std::os::unix::fs::FileExt;
    static PAGEMAP: std::sync::OnceLock<Option<File>> = std::sync::OnceLock::new();
    let Some(pagemap) = PAGEMAP.get_or_init(|| File::open("/proc/self/pagemap").ok()) else {
        return true;
    };
    const PAGE: usize = 4096;
    let first = addr / PAGE;
    let pages = len.div_ceil(PAGE);
    let mut buf = vec![0u8; 8 * pages.min(4096)];
    let mut done = 0;
    while done < pages {
        let n = (pages - done).min(4096);
        let bytes = &mut buf[..8 * n];
        if pagemap.read_exact_at(bytes, 8 * (first + done) as u64).is_err() {
            return true;
        }
        let private = bytes.chunks_exact(8).any(|e| {
            let e = u64::from_ne_bytes(e.try_into().expect("8 bytes"));
            e >> 63 & 1 == 1 && e >> 61 & 1 == 0
        });
        if private {
            return true;
        }
        done += n;
    }
    false
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if std::process::id() == self.owner {
            // SAFETY: dropped once, here; no slice of it outlives the
            // mapping (leases and batches hold an `Arc` of it).
            unsafe { ManuallyDrop::drop(&mut self.map) };
        }
    }
}

/// The client's shared, writable mapping of a stream's control page.
#[derive(Debug)]
pub(crate) struct ControlMap {
    map: ManuallyDrop<MmapMut>,
    owner: u32,
}

impl ControlMap {
    pub(crate) fn new(fd: OwnedFd) -> Result<ControlMap> {
        let file = File::from(fd);
        let have = file.metadata()?.len();
        if have < CTRL_BYTES {
            return Err(ClientError::Protocol(format!(
                "the stream's control page is {have} bytes, this client expects {CTRL_BYTES} (client and daemon \
                 versions differ)"
            )));
        }
        // SAFETY: the daemon sealed the memfd's size (F_SEAL_SHRINK|GROW), so
        // the mapping never outlives the file. The page is shared with the
        // daemon and accessed only through the atomics of `Control`.
        let map = unsafe { MmapMut::map_mut(&file)? };
        let _ = map.advise(Advice::DontFork);
        let page = ControlMap { map: ManuallyDrop::new(map), owner: std::process::id() };
        if !page.control().is_valid() {
            return Err(ClientError::Protocol(
                "the stream's control page has another magic or version (client and daemon versions differ)".into(),
            ));
        }
        Ok(page)
    }

    /// Whether this process mapped it (a forked child has no such mapping:
    /// `MADV_DONTFORK`).
    pub(crate) fn is_mapped_here(&self) -> bool {
        std::process::id() == self.owner
    }

    /// The page. Call only where [`ControlMap::is_mapped_here`].
    pub(crate) fn control(&self) -> &Control {
        assert!(self.map.len() >= std::mem::size_of::<Control>(), "checked in ControlMap::new");
        // SAFETY: page-aligned, large enough (checked above and in `new`),
        // alive as long as `self`; `Control` is atomics only, valid for any
        // bits the daemon writes.
        unsafe { &*self.map.as_ptr().cast::<Control>() }
    }
}

impl Drop for ControlMap {
    fn drop(&mut self) {
        if std::process::id() == self.owner {
            // SAFETY: dropped once, here, in the process that mapped it.
            unsafe { ManuallyDrop::drop(&mut self.map) };
        }
    }
}

// SAFETY: `base` points into `map`, owned by the mapping; writes through it
// happen only in slots leased to this process, by the code holding the lease.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access reads the layout and hands out pointers.
unsafe impl Sync for Mapping {}

/// Element types a field can be viewed as.
pub trait Element: Copy + sealed::Sealed {
    /// The field dtype this type matches.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(u8 => U8, u16 => U16, u32 => U32, u64 => U64, i8 => I8, i16 => I16, i32 => I32, i64 => I64, f32 => F32, f64 => F64);

pub(crate) fn cast_slice<T: Element>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) && bytes.len().is_multiple_of(size),
        "field bytes are not aligned for their dtype; the daemon's layout keeps every field 64-byte aligned"
    );
    // SAFETY: alignment and length were checked above; every bit pattern is a
    // valid value of the integer and float types that implement `Element`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) }
}
