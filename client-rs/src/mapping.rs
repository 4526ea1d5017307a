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

use std::sync::OnceLock;

use memmap2::{Advice, Mmap, MmapMut, MmapOptions, UncheckedAdvice};
use rustix::fs::SealFlags;
use stoker_proto::ctrl::{CTRL_BYTES, Control};
use stoker_proto::{BatchLayout, DType, RingError, RingHeader};

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
    /// The memfd, for [`Mapping::shared_view`].
    file: File,
    /// A shared, read-only view of the same pages, mapped on first use (the
    /// GPU upload registers it); `Err` holds why it could not be mapped.
    shared: OnceLock<std::result::Result<ManuallyDrop<Mmap>, String>>,
}

impl Mapping {
    /// Maps the segment `fd` of `depth` slots of `layout`, after checking
    /// that it is sealed against shrinking, long enough, that every field of
    /// `layout` lies inside a slot, and that its [`RingHeader`] is this
    /// build's and says `depth` slots of `layout.slot_bytes`.
    pub(crate) fn new(fd: OwnedFd, layout: &BatchLayout, depth: u32) -> Result<Mapping> {
        let file = File::from(fd);
        require_size_sealed(&file, "shared-memory ring")?;
        let have = file.metadata()?.len();
        layout.check_segment(depth, have).map_err(ring_error)?;
        // SAFETY: the memfd is sealed against shrinking (F_SEAL_SHRINK, checked
        // above), so the mapping can never extend past the end of the file (no
        // SIGBUS). It is private: this process's writes never reach the file.
        // The daemon writes only to slots this client does not hold, and all
        // slices handed out cover held slots, so no reader observes a write.
        let mut map = unsafe { MmapOptions::new().map_copy(&file)? };
        // Best effort: without it a fork shares nothing wrong, it only copies more.
        let _ = map.advise(Advice::DontFork);
        let base = map.as_mut_ptr();
        let header = map.first_chunk().map(RingHeader::from_bytes).ok_or_else(|| {
            ring_error(RingError::TooShort { len: map.len() as u64, depth, slot_bytes: layout.slot_bytes, need: None })
        })?;
        header.check(layout, depth).map_err(ring_error)?;
        Ok(Mapping {
            map: ManuallyDrop::new(map),
            owner: std::process::id(),
            base,
            layout: layout.clone(),
            file,
            shared: OnceLock::new(),
        })
    }

    pub(crate) fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    pub(crate) fn range(&self) -> (usize, usize) {
        (self.map.as_ptr() as usize, self.map.len())
    }

    /// `(address, length)` of a shared, read-only view of the segment: the
    /// daemon's pages themselves, at the same offsets as in [`Mapping::range`].
    ///
    /// This, not the private mapping, is what may be pinned for the GPU.
    /// Pinning a range of a private (copy-on-write) mapping makes the kernel
    /// break copy-on-write first, even for a read-only pin: each page becomes
    /// a private copy of what the slot held at registration, and the device
    /// would read those stale copies for every later batch in the slot (seen
    /// on an H100, kernel 6.18: every batch from the `depth`-th on was stale).
    /// A shared read-only mapping has no copy-on-write to break (the memfd's
    /// `F_SEAL_FUTURE_WRITE` allows it, and no write access), so the pin holds
    /// the very pages the daemon fills.
    pub(crate) fn shared_view(&self) -> std::result::Result<(usize, usize), String> {
        let view = self.shared.get_or_init(|| {
            // SAFETY: the memfd is sealed against shrinking (checked in
            // `new`), so the view never extends past the file; it is
            // read-only, and read only by the device through a registration
            // that its owner (this mapping) outlives.
            let map = unsafe { MmapOptions::new().len(self.map.len()).map(&self.file) }
                .map_err(|e| format!("cannot map the ring shared and read-only: {e}"))?;
            let _ = map.advise(Advice::DontFork);
            Ok(ManuallyDrop::new(map))
        });
        match view {
            Ok(map) => Ok((map.as_ptr() as usize, map.len())),
            Err(e) => Err(e.clone()),
        }
    }

    /// `len` bytes at `offset` inside `slot`.
    ///
    /// Panics if the range does not lie inside the slot, or the slot inside
    /// the mapping, which the layout checks in [`Mapping::new`] rule out for
    /// every field of every slot.
    pub(crate) fn slot_bytes(&self, slot: u32, offset: u64, len: usize) -> &[u8] {
        let in_slot = offset.checked_add(len as u64).is_some_and(|end| end <= self.layout.slot_bytes);
        let start = self.layout.slot_offset(slot).checked_add(offset).and_then(|s| usize::try_from(s).ok());
        let start = match start {
            Some(start) if in_slot && start.checked_add(len).is_some_and(|end| end <= self.map.len()) => start,
            _ => panic!(
                "{len} bytes at offset {offset} of slot {slot} lie outside the slot ({} bytes) or the ring's \
                 mapping ({} bytes)",
                self.layout.slot_bytes,
                self.map.len()
            ),
        };
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

/// A segment's problem as a client error.
fn ring_error(e: RingError) -> ClientError {
    ClientError::Protocol(e.to_string())
}

/// Refuses a memfd whose size is not sealed against shrinking: the daemon
/// seals every segment it sends, and only the seal keeps a mapping of it
/// from faulting (SIGBUS) when someone truncates the file.
fn require_size_sealed(file: &File, what: &str) -> Result<()> {
    match rustix::fs::fcntl_get_seals(file) {
        Ok(seals) if seals.contains(SealFlags::SHRINK) => Ok(()),
        Ok(_) => Err(ClientError::Protocol(format!(
            "the {what} is not sealed against shrinking (F_SEAL_SHRINK); the daemon is not stoker's"
        ))),
        Err(e) => Err(ClientError::Protocol(format!("the {what} is not a sealable memfd ({e})"))),
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
            if let Some(Ok(view)) = self.shared.get_mut() {
                // SAFETY: as above; a registration of the view holds this
                // mapping (`Arc`) and unregisters before letting go.
                unsafe { ManuallyDrop::drop(view) };
            }
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
        require_size_sealed(&file, "stream's control page")?;
        let have = file.metadata()?.len();
        if have < CTRL_BYTES {
            return Err(ClientError::Protocol(format!(
                "the stream's control page is {have} bytes, this client expects {CTRL_BYTES} (client and daemon \
                 versions differ)"
            )));
        }
        // SAFETY: the memfd is sealed against shrinking (F_SEAL_SHRINK, checked
        // above), so the mapping never outlives the file. The page is shared
        // with the daemon and accessed only through the atomics of `Control`.
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
        // The element size is proto's size of the dtype.
        const _: () = assert!(std::mem::size_of::<$t>() == DType::$d.size());
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

/// Real memfds, written and sealed as the daemon's `Ring::create` does.
#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use rustix::fs::MemfdFlags;
    use stoker_proto::ctrl::{CTRL_MAGIC, CTRL_VERSION};
    use stoker_proto::{FieldDecl, LayoutLimits, RING_MAGIC};

    use super::*;

    fn layout() -> BatchLayout {
        let fields = [
            FieldDecl { name: "x".into(), dtype: DType::U32, shape: vec![3], max_sample_bytes: None },
            FieldDecl { name: "img".into(), dtype: DType::U8, shape: vec![0, 3], max_sample_bytes: Some(100) },
        ];
        BatchLayout::new(4, fields, &LayoutLimits::DEFAULT).unwrap()
    }

    /// A memfd of `len` bytes starting with `header`, `0xAB` at the start of
    /// slot 1's first field, sealed unless `seal` is false.
    fn segment(layout: &BatchLayout, header: RingHeader, len: u64, seal: bool) -> OwnedFd {
        let fd = rustix::fs::memfd_create("mapping-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let file = File::from(fd);
        file.write_all_at(&header.to_bytes(), 0).unwrap();
        if len > layout.slot_offset(1) {
            file.write_all_at(&[0xAB; 12], layout.slot_offset(1) + layout.fields[0].offset).unwrap();
        }
        file.set_len(len).unwrap();
        if seal {
            let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
            rustix::fs::fcntl_add_seals(&file, seals).unwrap();
        }
        OwnedFd::from(file)
    }

    fn good(layout: &BatchLayout, depth: u32) -> OwnedFd {
        segment(layout, RingHeader::new(layout, depth), layout.ring_bytes(depth), true)
    }

    /// The protocol error `Mapping::new` gives for `fd`.
    fn refusal(fd: OwnedFd, layout: &BatchLayout, depth: u32) -> String {
        match Mapping::new(fd, layout, depth) {
            Err(ClientError::Protocol(message)) => message,
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    #[test]
    fn a_good_header_maps_and_slots_read_the_segment() {
        let layout = layout();
        let map = Mapping::new(good(&layout, 2), &layout, 2).unwrap();
        assert_eq!(map.layout(), &layout);
        assert_eq!(map.range().1 as u64, layout.ring_bytes(2));
        let x = &layout.fields[0];
        assert_eq!(map.slot_bytes(1, x.offset, 12), &[0xAB; 12]);
        assert_eq!(map.slot_bytes(0, x.offset, 12), &[0; 12]);
        // The last byte of the last slot is in bounds; an empty range at the slot's end too.
        assert_eq!(map.slot_bytes(1, layout.slot_bytes - 1, 1), &[0]);
        assert!(map.slot_bytes(1, layout.slot_bytes, 0).is_empty());
        // An extra segment: one slot.
        Mapping::new(good(&layout, 1), &layout, 1).unwrap();
    }

    #[test]
    fn the_shared_view_shows_the_daemons_pages_at_the_same_offsets() {
        let layout = layout();
        let fd = rustix::fs::memfd_create("view-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let file = File::from(fd);
        file.set_len(layout.ring_bytes(2)).unwrap();
        // The daemon's writable mapping, made before the seal (as the daemon does).
        // SAFETY: a memfd of this test, never shrunk.
        let mut daemon = unsafe { MmapMut::map_mut(&file) }.unwrap();
        daemon[..RingHeader::BYTES].copy_from_slice(&RingHeader::new(&layout, 2).to_bytes());
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&file, seals).unwrap();
        let map = Mapping::new(OwnedFd::from(file.try_clone().unwrap()), &layout, 2).unwrap();
        let (private, len) = map.range();
        let (view, view_len) = map.shared_view().unwrap();
        assert_eq!(view_len, len);
        assert_eq!(map.shared_view().unwrap().0, view, "mapped once");
        let at = layout.slot_offset(1) as usize + layout.fields[0].offset as usize;
        // SAFETY: `at` lies inside both mappings, which `map` keeps alive.
        let read_view = || unsafe { *((view + at) as *const u8) };
        // SAFETY: as above.
        let read_private = || unsafe { *((private + at) as *const u8) };
        daemon[at] = 7;
        assert_eq!((read_private(), read_view()), (7, 7));
        // A private write (copy-on-write) stays private; the view keeps the daemon's byte.
        // SAFETY: the slot is not read elsewhere; the private mapping is writable.
        unsafe { *((private + at) as *mut u8) = 9 };
        assert_eq!((read_private(), read_view()), (9, 7));
        map.discard(1);
        daemon[at] = 11;
        assert_eq!((read_private(), read_view()), (11, 11));
        // The view's page is the file's, never a private copy.
        assert!(!has_private_pages(view + at, 1));
    }

    #[test]
    fn a_bad_magic_is_refused() {
        let layout = layout();
        let header = RingHeader { magic: u64::from_le_bytes(*b"NOTARING"), ..RingHeader::new(&layout, 2) };
        let msg = refusal(segment(&layout, header, layout.ring_bytes(2), true), &layout, 2);
        assert!(msg.contains("is not a stoker ring") && msg.contains(&format!("{RING_MAGIC:#018x}")), "{msg}");
        // A segment nobody wrote a header into.
        let zeros = RingHeader::from_bytes(&[0; RingHeader::BYTES]);
        let msg = refusal(segment(&layout, zeros, layout.ring_bytes(2), true), &layout, 2);
        assert!(msg.contains("magic 0x0000000000000000"), "{msg}");
    }

    #[test]
    fn another_layout_version_is_refused() {
        let layout = layout();
        let header = RingHeader { version: 2, ..RingHeader::new(&layout, 2) };
        let msg = refusal(segment(&layout, header, layout.ring_bytes(2), true), &layout, 2);
        assert!(msg.contains("layout version 2") && msg.contains("client and daemon versions differ"), "{msg}");
    }

    #[test]
    fn a_header_of_another_geometry_is_refused() {
        let layout = layout();
        // A header of three slots in a segment long enough for them, mapped as two.
        let msg = refusal(segment(&layout, RingHeader::new(&layout, 3), layout.ring_bytes(3), true), &layout, 2);
        assert!(msg.contains("holds 3 slots") && msg.contains("opened with 2 slots"), "{msg}");
        let header = RingHeader { slot_bytes: layout.slot_bytes * 2, ..RingHeader::new(&layout, 1) };
        let msg = refusal(segment(&layout, header, layout.ring_bytes(2), true), &layout, 1);
        assert!(msg.contains(&format!("of {} bytes", layout.slot_bytes * 2)), "{msg}");
    }

    #[test]
    fn a_short_segment_is_refused() {
        let layout = layout();
        let need = layout.ring_bytes(2);
        for len in [0, 10, RingHeader::BYTES as u64, layout.header_bytes(), need - 1] {
            let msg = refusal(segment(&layout, RingHeader::new(&layout, 2), len, true), &layout, 2);
            assert!(
                msg.contains(&format!("ring is {len} bytes")) && msg.contains(&format!("need {need} bytes")),
                "{msg}"
            );
        }
    }

    #[test]
    fn an_unsealed_segment_is_refused() {
        let layout = layout();
        let msg = refusal(segment(&layout, RingHeader::new(&layout, 2), layout.ring_bytes(2), false), &layout, 2);
        assert!(msg.contains("not sealed against shrinking"), "{msg}");
        // Not a memfd at all: a regular file has no seals.
        let msg = refusal(OwnedFd::from(File::open("/proc/self/exe").unwrap()), &layout, 2);
        assert!(msg.contains("not a sealable memfd"), "{msg}");
    }

    #[test]
    fn a_layout_whose_fields_leave_the_slot_is_refused() {
        let layout = layout();
        let mut bad = layout.clone();
        bad.fields[0].shape = vec![1 << 20];
        let msg = refusal(good(&layout, 2), &bad, 2);
        assert!(msg.contains("field \"x\" end past its slot"), "{msg}");
    }

    #[test]
    #[should_panic(expected = "lie outside the slot")]
    fn a_range_past_the_slot_panics() {
        let layout = layout();
        let map = Mapping::new(good(&layout, 2), &layout, 2).unwrap();
        // Slot 0's range spilling into slot 1 is inside the mapping, and still refused.
        map.slot_bytes(0, layout.slot_bytes - 4, 8);
    }

    #[test]
    #[should_panic(expected = "lie outside the slot")]
    fn a_slot_past_the_ring_panics() {
        let layout = layout();
        let map = Mapping::new(good(&layout, 2), &layout, 2).unwrap();
        map.slot_bytes(2, 0, 1);
    }

    #[test]
    #[should_panic(expected = "lie outside the slot")]
    fn an_offset_that_overflows_panics_with_the_bounds_message() {
        let layout = layout();
        let map = Mapping::new(good(&layout, 1), &layout, 1).unwrap();
        map.slot_bytes(0, u64::MAX, 1);
    }

    fn control_memfd(len: u64, stamp: bool) -> OwnedFd {
        let fd = rustix::fs::memfd_create("control-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let file = File::from(fd);
        file.set_len(len).unwrap();
        if stamp {
            // Where `Control` keeps its magic and version (`#[repr(C)]`, native-endian atomics).
            file.write_all_at(&CTRL_MAGIC.to_ne_bytes(), std::mem::offset_of!(Control, magic) as u64).unwrap();
            file.write_all_at(&CTRL_VERSION.to_ne_bytes(), std::mem::offset_of!(Control, version) as u64).unwrap();
        }
        rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).unwrap();
        OwnedFd::from(file)
    }

    #[test]
    fn a_control_page_maps_only_when_stamped_sealed_and_whole() {
        let page = ControlMap::new(control_memfd(CTRL_BYTES, true)).unwrap();
        assert!(page.is_mapped_here() && page.control().is_valid());
        let err = ControlMap::new(control_memfd(CTRL_BYTES, false)).unwrap_err();
        assert!(err.to_string().contains("another magic or version"), "{err}");
        let err = ControlMap::new(control_memfd(CTRL_BYTES - 4096, true)).unwrap_err();
        assert!(err.to_string().contains(&format!("expects {CTRL_BYTES}")), "{err}");
    }
}
