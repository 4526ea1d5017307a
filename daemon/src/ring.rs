//! Shared-memory rings: one sealed memfd per stream, holding a header page and
//! `depth` batch slots. This is the only module of the daemon that touches
//! raw shared-memory pointers.
//!
//! The daemon maps the memfd read-write, then seals it with
//! `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL`: the size
//! can never change (no client can truncate it and SIGBUS the daemon), and no
//! new writable mapping or `write()` is possible, so clients that receive the
//! fd can only map it read-only. Exclusive write access to a slot is handed out
//! as a [`SlotWriter`]; while any writer of a slot lives, no other can be made.
//!
//! Offsets come from a [`BatchLayout`] whose sizes were checked when it was
//! made; they are still computed with checked arithmetic (clippy's
//! `arithmetic_side_effects` is denied here) and bounds-checked against the
//! mapping before any slice is made.
#![deny(clippy::arithmetic_side_effects)]

use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::MmapMut;
use rustix::fs::{MemfdFlags, SealFlags};
use stoker_data::source::FieldOut;
use stoker_proto::ctrl::{CTRL_BYTES, Control};
use stoker_proto::{BatchLayout, RingHeader};

/// A stream's shared-memory ring.
#[derive(Debug)]
pub struct Ring {
    fd: OwnedFd,
    map: MmapMut,
    /// `map`'s start, taken from `&mut` once so writers never derive a
    /// mutable pointer from a shared borrow of the mapping.
    base: *mut u8,
    layout: BatchLayout,
    depth: u32,
    /// One flag per slot: a [`SlotWriter`] for it exists.
    claimed: Vec<AtomicBool>,
}

impl Ring {
    /// Creates, maps and seals a ring for `depth` slots of `layout` (whose
    /// sizes [`BatchLayout::new`] checked; the total is checked here).
    pub fn create(name: &str, layout: &BatchLayout, depth: u32) -> std::io::Result<Arc<Ring>> {
        let bytes = layout
            .checked_ring_bytes(depth)
            .filter(|&b| usize::try_from(b).is_ok_and(|b| b <= isize::MAX as usize))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("a ring of {depth} slots of {} bytes does not fit in memory", layout.slot_bytes),
                )
            })?;
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, bytes)?;
        let file = std::fs::File::from(fd);
        // SAFETY: the memfd is private to this process until it is sealed and
        // sent; its size is fixed (sealed below, before any client sees it), so
        // the mapping never outlives the file's extent.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        // The rest of the header page stays zero (a fresh memfd reads as zeros).
        map[..RingHeader::BYTES].copy_from_slice(&RingHeader::new(layout, depth).to_bytes());
        let fd = OwnedFd::from(file);
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL,
        )?;
        let claimed = (0..depth).map(|_| AtomicBool::new(false)).collect();
        let base = map.as_mut_ptr();
        Ok(Arc::new(Ring { fd, map, base, layout: layout.clone(), depth, claimed }))
    }

    /// The memfd, to send to the client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where fields lie in each slot.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// Slots in the ring.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Bytes of shared memory the ring takes.
    pub fn bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Bytes of sample data in the first `rows` rows of `slot`: fixed fields in
    /// full, ragged fields by the shapes their rows recorded. For statistics;
    /// call it only for a slot no writer holds.
    pub fn batch_bytes(&self, slot: u32, rows: u64) -> u64 {
        let base = self.layout.slot_offset(slot);
        self.layout
            .fields
            .iter()
            .map(|field| match field.ragged {
                None => field.sample_bytes().saturating_mul(rows),
                Some(_) => {
                    let bytes = (field.shape.len() as u64).saturating_mul(8).saturating_mul(rows);
                    let (table, bytes) = self.span(base.saturating_add(field.offset), bytes);
                    // SAFETY: in bounds (checked by `span`); the caller guarantees no
                    // writer holds this slot, so nothing mutates these bytes
                    // while the shared slice lives. Built from `base` rather
                    // than by borrowing the whole mapping, so it does not
                    // alias writers' slices of other slots.
                    let shapes = unsafe { std::slice::from_raw_parts(self.base.add(table), bytes) };
                    shapes
                        .chunks_exact(field.shape.len().max(1).saturating_mul(8))
                        .map(|row| {
                            // Shapes were written by a source: saturate rather than trust them.
                            row.chunks_exact(8)
                                .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
                                .fold(field.dtype.size() as u64, u64::saturating_mul)
                        })
                        .fold(0, u64::saturating_add)
                }
            })
            .fold(0, u64::saturating_add)
    }

    /// `(start, len)` of the `len` bytes at `start` as indices into the
    /// mapping, checked to lie inside it. Layouts keep every row and shape
    /// table inside the ring ([`BatchLayout::new`]), so a failure is a bug.
    fn span(&self, start: u64, len: u64) -> (usize, usize) {
        let span = usize::try_from(start).ok().zip(usize::try_from(len).ok());
        match span {
            Some((start, len)) if start.checked_add(len).is_some_and(|end| end <= self.map.len()) => (start, len),
            _ => panic!("{len} bytes at {start} lie outside the ring of {} bytes", self.map.len()),
        }
    }

    /// Exclusive write access to `rows` of `slot`, or `None` while another
    /// writer of that slot exists.
    pub fn writer(self: &Arc<Self>, slot: u32, rows: Range<u64>) -> Option<SlotWriter> {
        assert!(slot < self.depth && rows.end <= self.layout.batch_size, "slot and rows within the ring");
        // Acquire pairs with the Release in `Claim::drop`: the previous
        // writer's stores happen-before this writer's.
        let flag = &self.claimed[slot as usize];
        flag.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok()?;
        Some(SlotWriter { claim: Arc::new(Claim { ring: self.clone(), slot }), rows })
    }
}

// SAFETY: `base` points into `map`, which lives as long as the ring; all
// writes through it go through `SlotWriter`, whose claims keep them exclusive.
unsafe impl Send for Ring {}
// SAFETY: as above; shared access only reads the header fields and the flags.
unsafe impl Sync for Ring {}

/// A stream's control page ([`stoker_proto::ctrl`]): a memfd both sides map
/// shared and writable, sealed against resizing (so a client cannot make the
/// daemon's mapping fault) but not against writes. Everything the daemon
/// reads from it is a client's claim, checked before use.
#[derive(Debug)]
pub struct ControlPage {
    fd: OwnedFd,
    map: MmapMut,
}

impl ControlPage {
    /// Creates, maps, stamps and seals a control page.
    pub fn create(name: &str) -> std::io::Result<Arc<ControlPage>> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, CTRL_BYTES)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let file = std::fs::File::from(fd);
        // SAFETY: the memfd's size is sealed, so the mapping never outlives
        // the file's extent (no SIGBUS whatever the client does). The memory
        // is shared with one client, so it is only ever accessed through the
        // atomics of `Control` (see `control`).
        let map = unsafe { MmapMut::map_mut(&file)? };
        let page = ControlPage { fd: OwnedFd::from(file), map };
        page.control().stamp();
        Ok(Arc::new(page))
    }

    /// The memfd, to send to the client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The page's contents.
    pub fn control(&self) -> &Control {
        assert!(self.map.len() >= std::mem::size_of::<Control>(), "the control memfd holds a Control");
        // SAFETY: the mapping is page-aligned (so aligned for `Control`), at
        // least as large as `Control` (checked above) and lives as long as
        // `self`. `Control` consists of atomics only (and padding), for which
        // every bit pattern is valid, so whatever the client writes, at any
        // time, is read as some value of them; the daemon only accesses it
        // through those atomics.
        unsafe { &*self.map.as_ptr().cast::<Control>() }
    }
}

/// Marks a slot claimed for as long as any of its writers lives.
#[derive(Debug)]
struct Claim {
    ring: Arc<Ring>,
    slot: u32,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Release pairs with the Acquire in `Ring::writer`.
        self.ring.claimed[self.slot as usize].store(false, Ordering::Release);
    }
}

/// Exclusive write access to some rows of one slot.
#[derive(Debug)]
pub struct SlotWriter {
    claim: Arc<Claim>,
    rows: Range<u64>,
}

impl SlotWriter {
    /// Rows this writer covers.
    pub fn rows(&self) -> Range<u64> {
        self.rows.clone()
    }

    /// Splits into writers of disjoint row ranges, about `parts` of them, each
    /// at least `min_rows` long (except possibly the last).
    pub fn split(self, parts: usize, min_rows: u64) -> Vec<SlotWriter> {
        let len = self.rows.end.saturating_sub(self.rows.start);
        let per = len.div_ceil(parts.max(1) as u64).max(min_rows.max(1));
        let mut out = Vec::new();
        let mut start = self.rows.start;
        while start < self.rows.end {
            let end = start.saturating_add(per).min(self.rows.end);
            out.push(SlotWriter { claim: self.claim.clone(), rows: start..end });
            start = end;
        }
        out
    }

    /// Row `row` (which must be one of this writer's rows) of every field, in layout order.
    pub fn row_mut(&mut self, row: u64) -> Vec<FieldOut<'_>> {
        assert!(self.rows.contains(&row), "row {row} outside this writer's rows {:?}", self.rows);
        let ring = &self.claim.ring;
        let slot = ring.layout.slot_offset(self.claim.slot);
        ring.layout
            .fields
            .iter()
            .map(|field| {
                let len = field.sample_bytes();
                // Offset of this row in an array of `stride`-byte rows at `at` (saturating:
                // an offset past the end fails the bounds check in `span`).
                let nth = |at: u64, stride: u64| slot.saturating_add(at).saturating_add(row.saturating_mul(stride));
                let table_row = (field.shape.len() as u64).saturating_mul(8);
                let (start, shape_at) = match field.ragged {
                    Some(r) => (nth(r.data_offset, len), Some(ring.span(nth(field.offset, table_row), table_row))),
                    None => (nth(field.offset, len), None),
                };
                let (start, len) = ring.span(start, len);
                // SAFETY: the range is inside the mapping (checked by `span`) and
                // fields occupy disjoint ranges of a slot (BatchLayout::new), so
                // the slices returned together never overlap. Writers of one
                // slot exist only while the slot's claim is held, and the
                // writers of one claim cover disjoint rows (`split`), so no
                // other live `&mut` aliases these bytes; the slices borrow
                // `self` mutably, so one writer cannot hand them out twice.
                // The client maps the memfd read-only and, by protocol, reads
                // only slots it was handed after their writers were dropped.
                let data = unsafe { std::slice::from_raw_parts_mut(ring.base.add(start), len) };
                let shape = shape_at.map(|(at, _)| {
                    let ndim = field.shape.len();
                    assert!(at.is_multiple_of(8), "shape tables are aligned");
                    // SAFETY: as for `data`: the row's entry of the field's
                    // shape table is in bounds (checked by `span`), 8-byte aligned
                    // (tables start at 64-byte-aligned offsets), disjoint
                    // from every other slice handed out, and any bit
                    // pattern is a valid u64.
                    unsafe { std::slice::from_raw_parts_mut(ring.base.add(at).cast::<u64>(), ndim) }
                });
                FieldOut { data, shape }
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use stoker_proto::{DType, FieldDecl};

    fn ring() -> Arc<Ring> {
        let decl = FieldDecl { name: "x".into(), dtype: DType::U32, shape: vec![3], max_sample_bytes: None };
        let layout = BatchLayout::new(4, [decl], &stoker_proto::LayoutLimits::DEFAULT).unwrap();
        Ring::create("test", &layout, 2).unwrap()
    }

    #[test]
    fn one_writer_per_slot_until_dropped() {
        let ring = ring();
        let w = ring.writer(0, 0..4).unwrap();
        assert!(ring.writer(0, 0..4).is_none());
        assert!(ring.writer(1, 0..4).is_some());
        let parts = w.split(3, 1);
        assert!(ring.writer(0, 0..4).is_none());
        drop(parts);
        assert!(ring.writer(0, 0..4).is_some());
    }

    #[test]
    fn split_rows_are_disjoint_and_cover() {
        let ring = ring();
        let parts = ring.writer(1, 0..4).unwrap().split(3, 1);
        let rows: Vec<u64> = parts.iter().flat_map(|p| p.rows()).collect();
        assert_eq!(rows, vec![0, 1, 2, 3]);
    }

    #[test]
    fn sealed_against_resizing_and_new_writable_maps() {
        let ring = ring();
        assert!(rustix::fs::ftruncate(ring.fd(), 1).is_err());
        let seals = rustix::fs::fcntl_get_seals(ring.fd()).unwrap();
        assert!(seals.contains(SealFlags::FUTURE_WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        let file = std::fs::File::from(ring.fd().try_clone_to_owned().unwrap());
        // SAFETY: test-only mapping attempt, expected to fail.
        assert!(unsafe { MmapMut::map_mut(&file) }.is_err());
    }

    #[test]
    fn control_page_is_stamped_and_sealed_against_resizing_only() {
        let page = ControlPage::create("ctl").unwrap();
        assert!(page.control().is_valid());
        assert!(rustix::fs::ftruncate(page.fd(), 1).is_err());
        let file = std::fs::File::from(page.fd().try_clone_to_owned().unwrap());
        // SAFETY: test-only shared mapping of a live control page, read through atomics.
        let map = unsafe { MmapMut::map_mut(&file) }.unwrap();
        assert_eq!(map.len() as u64, CTRL_BYTES);
    }

    #[test]
    fn writes_land_in_the_right_place() {
        let ring = ring();
        let mut w = ring.writer(1, 0..4).unwrap();
        w.row_mut(2)[0].data.copy_from_slice(&[7u8; 12]);
        let layout = &ring.layout;
        let at = (layout.slot_offset(1) + 2 * 12) as usize;
        assert_eq!(&ring.map[at..at + 12], &[7u8; 12]);
    }

    #[test]
    fn the_header_says_what_the_ring_holds() {
        let ring = ring();
        let header = RingHeader::from_bytes(ring.map.first_chunk().unwrap());
        assert_eq!(header, RingHeader::new(&ring.layout, 2));
        header.check(&ring.layout, 2).unwrap();
        ring.layout.check_segment(2, ring.bytes()).unwrap();
        assert_eq!(&ring.map[..8], b"STOKRING");
        assert!(ring.map[RingHeader::BYTES..ring.layout.header_bytes() as usize].iter().all(|&b| b == 0));
    }
}
