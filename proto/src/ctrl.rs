//! A stream's control page: the shared-memory handoff between the daemon and
//! one client, so that taking a batch that is already waiting costs no system
//! call and no daemon wake-up.
//!
//! The page is a second memfd next to the ring, mapped shared and writable by
//! both sides (sealed against resizing only). It holds two single-producer
//! single-consumer queues:
//!
//! - **records**, daemon → client: what the stream delivers, in order (a
//!   batch in slot *s*, the end of an epoch, a failed batch, "every slot is
//!   held"). The daemon writes a record, then publishes it by advancing
//!   [`DaemonWords::published`] (Release); the client reads `published` (Acquire),
//!   then the record, then advances [`ClientWords::consumed`] (Release).
//! - **releases**, client → daemon: slot ids the client gave back. The client
//!   writes an entry, then advances [`ClientWords::released`] (Release); the
//!   daemon reads `released` (Acquire), then the entries, then advances
//!   [`DaemonWords::reclaimed`] (Release) so the client sees the room.
//!
//! Sleeping and waking: a side that finds nothing to do after a short spin
//! sets its *waiting* word, issues a SeqCst fence and looks again before it
//! sleeps; the other side, after publishing, issues a SeqCst fence and reads
//! that word (Dekker's pattern: at least one of the two sees the other's
//! store). The client sleeps on a futex on `published` (the futex rechecks
//! the value, so a wake cannot be lost); the daemon, which never blocks a
//! thread on a client, "sleeps" by setting [`DaemonWords::daemon_waiting`], and a
//! client that clears it sends one `Wake` message over the socket.
//!
//! Trust: the client can write anything anywhere in this page at any time.
//! The daemon therefore keeps its own copies of `published` and `reclaimed`,
//! never reads a record back, and treats `consumed`, `released` and the
//! release entries as claims to check (a slot id it did not lease to this
//! client is ignored; a release count beyond the queue's capacity closes the
//! stream). A client that lies only confuses its own stream.
//!
//! Everything here is safe code over a [`Control`] reference: the daemon and
//! the client get one from their mapping of the memfd (in their mapping
//! modules), tests from a heap allocation ([`Control::boxed`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// `b"STOKCTRL"`: first word of every control page.
pub const CTRL_MAGIC: u64 = u64::from_le_bytes(*b"STOKCTRL");
/// Layout version of [`Control`]; bumped on any change to it.
pub const CTRL_VERSION: u32 = 1;
/// Records the daemon may have published and the client not yet taken.
pub const RECORDS: u32 = 256;
/// Releases the client may have queued and the daemon not yet taken.
pub const RELEASES: u32 = 1024;
/// Bytes of the control memfd (the size of [`Control`], rounded up to pages).
pub const CTRL_BYTES: u64 = (std::mem::size_of::<Control>() as u64).div_ceil(4096) * 4096;

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// Batch `step` of `epoch` is in `slot`, leased to the client from now on.
    Batch,
    /// Epoch `epoch` has no more batches.
    EndOfEpoch,
    /// Batch `step` of `epoch` failed; the message comes with `Request::Fetch`.
    Failed,
    /// The client holds every slot it may have, so nothing more can be
    /// produced; `Request::Fetch` says whether that is still so.
    Exhausted,
    /// The stream was closed (the daemon is shutting down).
    Closed,
}

impl RecordKind {
    fn code(self) -> u32 {
        match self {
            RecordKind::Batch => 1,
            RecordKind::EndOfEpoch => 2,
            RecordKind::Failed => 3,
            RecordKind::Exhausted => 4,
            RecordKind::Closed => 5,
        }
    }

    fn from_code(code: u32) -> Option<RecordKind> {
        Some(match code {
            1 => RecordKind::Batch,
            2 => RecordKind::EndOfEpoch,
            3 => RecordKind::Failed,
            4 => RecordKind::Exhausted,
            5 => RecordKind::Closed,
            _ => return None,
        })
    }
}

/// One record's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// What it says.
    pub kind: RecordKind,
    /// Slot of a batch.
    pub slot: u32,
    /// Generation of the slot's segment (extra segments are created and
    /// destroyed; the client maps the one whose generation matches).
    pub segment: u32,
    /// Epoch of the batch (or of the epoch that ended).
    pub epoch: u64,
    /// Position of the batch in its epoch.
    pub step: u64,
    /// Rows in the batch.
    pub rows: u64,
}

/// One record as it lies in shared memory.
#[derive(Debug, Default)]
#[repr(C)]
pub struct RecordCell {
    /// `kind` in the low 32 bits, `slot` in the high.
    head: AtomicU64,
    segment: AtomicU64,
    epoch: AtomicU64,
    step: AtomicU64,
    rows: AtomicU64,
}

/// Words written by the daemon (one cache line, apart from the client's).
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub struct DaemonWords {
    /// Records published (wrapping). Release store after the record is
    /// written; pairs with the client's Acquire load in [`Consumer::poll`].
    /// The futex word the client sleeps on.
    pub published: AtomicU32,
    /// Releases taken (wrapping). Release store after the entries were read;
    /// pairs with the client's Acquire load in [`Consumer::release`].
    pub reclaimed: AtomicU32,
    /// Non-zero while the daemon needs to hear of a release or a consumed
    /// record. Set with a SeqCst fence after it (pairs with the client's fence
    /// in [`Consumer::take_wake`]); cleared by the client,
    /// which then sends `Wake`.
    pub daemon_waiting: AtomicU32,
}

/// Words written by the client.
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub struct ClientWords {
    /// Records taken (wrapping). Release store after the record was read.
    pub consumed: AtomicU32,
    /// Releases queued (wrapping). Release store after the entry is written;
    /// pairs with the daemon's Acquire load in [`Publisher::take_releases`].
    pub released: AtomicU32,
    /// Non-zero while the client sleeps on `published` (set, then a SeqCst
    /// fence, then `published` is read again; pairs with the fence in
    /// [`Publisher::publish`]).
    pub client_waiting: AtomicU32,
    /// Nanoseconds the client has spent waiting for batches (for `stoker status`).
    pub wait_ns: AtomicU64,
}

/// The control page. Every field that both sides touch is an atomic.
#[derive(Debug)]
#[repr(C)]
pub struct Control {
    /// [`CTRL_MAGIC`].
    pub magic: AtomicU64,
    /// [`CTRL_VERSION`].
    pub version: AtomicU32,
    /// Daemon-written words.
    pub daemon: DaemonWords,
    /// Client-written words.
    pub client: ClientWords,
    records: [RecordCell; RECORDS as usize],
    releases: [AtomicU32; RELEASES as usize],
}

impl Control {
    /// A zeroed page on the heap, stamped with the magic and version (for tests).
    pub fn boxed() -> Box<Control> {
        let c = Box::new(Control {
            magic: AtomicU64::new(0),
            version: AtomicU32::new(0),
            daemon: DaemonWords::default(),
            client: ClientWords::default(),
            records: std::array::from_fn(|_| RecordCell::default()),
            releases: std::array::from_fn(|_| AtomicU32::new(0)),
        });
        c.stamp();
        c
    }

    /// Writes the magic and version (the daemon, before sending the page).
    pub fn stamp(&self) {
        self.magic.store(CTRL_MAGIC, Ordering::Relaxed);
        self.version.store(CTRL_VERSION, Ordering::Relaxed);
    }

    /// Whether the page carries this build's magic and version.
    pub fn is_valid(&self) -> bool {
        self.magic.load(Ordering::Relaxed) == CTRL_MAGIC && self.version.load(Ordering::Relaxed) == CTRL_VERSION
    }
}

/// The daemon's side: publishes records, takes releases. Holds its own
/// counters; the page's copies are for the client.
#[derive(Debug, Default)]
pub struct Publisher {
    published: u32,
    reclaimed: u32,
}

/// The client queued more releases than the queue holds: it is not a stoker client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the client claims {0} queued releases, more than the queue's {RELEASES}")]
pub struct ReleaseOverflow(pub u32);

impl Publisher {
    /// Records published so far (wrapping); the next record's sequence number.
    pub fn published(&self) -> u32 {
        self.published
    }

    /// Whether another record fits: fewer than [`RECORDS`] are untaken. A
    /// client whose `consumed` is not between what it could have taken reads
    /// as a full queue (its stream stalls; nobody else's does).
    pub fn has_room(&self, c: &Control) -> bool {
        let consumed = c.client.consumed.load(Ordering::Acquire);
        self.published.wrapping_sub(consumed) < RECORDS
    }

    /// Records published and not yet taken, by the client's count (at most [`RECORDS`]).
    pub fn untaken(&self, c: &Control) -> u32 {
        self.published.wrapping_sub(c.client.consumed.load(Ordering::Acquire)).min(RECORDS)
    }

    /// Writes `record` and publishes it. Returns its sequence number, and
    /// whether the client sleeps and must be woken (a futex wake on
    /// [`DaemonWords::published`]). Call only after [`Publisher::has_room`].
    pub fn publish(&mut self, c: &Control, record: Record) -> (u32, bool) {
        let seq = self.published;
        let cell = &c.records[(seq % RECORDS) as usize];
        let head = u64::from(record.kind.code()) | (u64::from(record.slot) << 32);
        cell.head.store(head, Ordering::Relaxed);
        cell.segment.store(u64::from(record.segment), Ordering::Relaxed);
        cell.epoch.store(record.epoch, Ordering::Relaxed);
        cell.step.store(record.step, Ordering::Relaxed);
        cell.rows.store(record.rows, Ordering::Relaxed);
        self.published = seq.wrapping_add(1);
        // Release: the record's stores happen-before a client that sees the count.
        c.daemon.published.store(self.published, Ordering::Release);
        // Dekker with the client's fence in `Consumer::prepare_sleep`.
        fence(Ordering::SeqCst);
        let wake = c.client.client_waiting.load(Ordering::Relaxed) != 0;
        (seq, wake)
    }

    /// Moves the given-back slot ids into `out`.
    pub fn take_releases(&mut self, c: &Control, out: &mut Vec<u32>) -> Result<(), ReleaseOverflow> {
        // Acquire pairs with the client's Release store in `Consumer::release`.
        let tail = c.client.released.load(Ordering::Acquire);
        let n = tail.wrapping_sub(self.reclaimed);
        if n > RELEASES {
            return Err(ReleaseOverflow(n));
        }
        for i in 0..n {
            let at = self.reclaimed.wrapping_add(i) % RELEASES;
            out.push(c.releases[at as usize].load(Ordering::Relaxed));
        }
        self.reclaimed = tail;
        // Release: the entries were read before the client may overwrite them.
        c.daemon.reclaimed.store(tail, Ordering::Release);
        Ok(())
    }

    /// Asks the client to send `Wake` at its next release or consumed record.
    /// Call [`Publisher::take_releases`] (and check for room) again after it:
    /// a release that raced with this call is seen by one side or the other.
    pub fn want_wake(&self, c: &Control) {
        c.daemon.daemon_waiting.store(1, Ordering::Relaxed);
        // Dekker with the client's fence in `Consumer::take_wake`.
        fence(Ordering::SeqCst);
    }

    /// The client's reported wait time.
    pub fn client_wait_ns(&self, c: &Control) -> u64 {
        c.client.wait_ns.load(Ordering::Relaxed)
    }
}

/// The client's side: takes records, queues releases.
#[derive(Debug, Default)]
pub struct Consumer {
    consumed: u32,
    released: u32,
}

/// A record read by [`Consumer::poll`] whose kind is unknown: the page is corrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("control record {seq} has unknown kind {code}")]
pub struct BadRecord {
    /// Its sequence number.
    pub seq: u32,
    /// The kind found.
    pub code: u32,
}

impl Consumer {
    /// Sequence number of the next record to take.
    pub fn next_seq(&self) -> u32 {
        self.consumed
    }

    /// Takes the next record, if one is published, with its sequence number.
    pub fn poll(&mut self, c: &Control) -> Result<Option<(u32, Record)>, BadRecord> {
        // Acquire pairs with the daemon's Release store in `Publisher::publish`.
        let published = c.daemon.published.load(Ordering::Acquire);
        if published == self.consumed {
            return Ok(None);
        }
        let seq = self.consumed;
        let cell = &c.records[(seq % RECORDS) as usize];
        let head = cell.head.load(Ordering::Relaxed);
        let code = head as u32;
        let kind = RecordKind::from_code(code).ok_or(BadRecord { seq, code })?;
        let record = Record {
            kind,
            slot: (head >> 32) as u32,
            segment: cell.segment.load(Ordering::Relaxed) as u32,
            epoch: cell.epoch.load(Ordering::Relaxed),
            step: cell.step.load(Ordering::Relaxed),
            rows: cell.rows.load(Ordering::Relaxed),
        };
        self.consumed = seq.wrapping_add(1);
        // Release: the record was read before the daemon may overwrite it.
        c.client.consumed.store(self.consumed, Ordering::Release);
        Ok(Some((seq, record)))
    }

    /// Skips every record before `seq` (after `SetEpoch`, whose reply says
    /// where the new position's records start).
    pub fn skip_to(&mut self, c: &Control, seq: u32) {
        self.consumed = seq;
        c.client.consumed.store(seq, Ordering::Release);
    }

    /// Queues `slot` for release. Returns `None` when the queue is full (send
    /// the release over the socket instead), else whether the daemon asked
    /// for a `Wake`.
    pub fn release(&mut self, c: &Control, slot: u32) -> Option<bool> {
        // Acquire pairs with the daemon's Release store in `take_releases`.
        let reclaimed = c.daemon.reclaimed.load(Ordering::Acquire);
        if self.released.wrapping_sub(reclaimed) >= RELEASES {
            return None;
        }
        c.releases[(self.released % RELEASES) as usize].store(slot, Ordering::Relaxed);
        self.released = self.released.wrapping_add(1);
        c.client.released.store(self.released, Ordering::Release);
        Some(self.take_wake(c))
    }

    /// Whether the daemon waits for word from this client (call it before
    /// sleeping; [`Consumer::release`] calls it); clears the request, so one
    /// `Wake` answers it.
    pub fn take_wake(&self, c: &Control) -> bool {
        // Dekker with the daemon's fence in `Publisher::want_wake`.
        fence(Ordering::SeqCst);
        c.daemon.daemon_waiting.load(Ordering::Relaxed) != 0 && c.daemon.daemon_waiting.swap(0, Ordering::Relaxed) != 0
    }

    /// Announces that the client is about to sleep; returns the `published`
    /// value to sleep on, or `None` if a record arrived meanwhile (do not
    /// sleep). Call [`Consumer::done_sleeping`] after the sleep.
    pub fn prepare_sleep(&self, c: &Control) -> Option<u32> {
        c.client.client_waiting.store(1, Ordering::Relaxed);
        // Dekker with the daemon's fence in `Publisher::publish`.
        fence(Ordering::SeqCst);
        let published = c.daemon.published.load(Ordering::Acquire);
        if published != self.consumed {
            c.client.client_waiting.store(0, Ordering::Relaxed);
            return None;
        }
        Some(published)
    }

    /// Ends a sleep begun with [`Consumer::prepare_sleep`], adding `waited_ns` to the reported wait.
    pub fn done_sleeping(&self, c: &Control, waited_ns: u64) {
        c.client.client_waiting.store(0, Ordering::Relaxed);
        c.client.wait_ns.fetch_add(waited_ns, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn batch(slot: u32, step: u64) -> Record {
        Record { kind: RecordKind::Batch, slot, segment: 0, epoch: 0, step, rows: 4 }
    }

    #[test]
    fn page_fits_its_memfd_and_lines_stay_apart() {
        assert!(CTRL_BYTES >= std::mem::size_of::<Control>() as u64);
        assert_eq!(std::mem::align_of::<DaemonWords>(), 64);
        assert!(Control::boxed().is_valid());
    }

    #[test]
    fn records_arrive_in_order_and_the_queue_bounds_them() {
        let c = Control::boxed();
        let (mut p, mut q) = (Publisher::default(), Consumer::default());
        for round in 0..3u64 {
            let mut n = 0;
            while p.has_room(&c) {
                p.publish(&c, batch(n as u32, round * 1000 + n));
                n += 1;
            }
            assert_eq!(n, u64::from(RECORDS));
            for i in 0..n {
                let (_, rec) = q.poll(&c).unwrap().unwrap();
                assert_eq!(rec, batch(i as u32, round * 1000 + i));
            }
            assert!(q.poll(&c).unwrap().is_none());
        }
    }

    #[test]
    fn releases_round_trip_and_overflow_is_caught() {
        let c = Control::boxed();
        let (mut p, mut q) = (Publisher::default(), Consumer::default());
        let mut out = Vec::new();
        for slot in 0..RELEASES {
            assert_eq!(q.release(&c, slot), Some(false));
        }
        assert_eq!(q.release(&c, 7), None, "a full queue says so");
        p.take_releases(&c, &mut out).unwrap();
        assert_eq!(out, (0..RELEASES).collect::<Vec<_>>());
        assert_eq!(q.release(&c, 7), Some(false));
        // A hostile client's counter.
        c.client.released.store(5 * RELEASES, Ordering::Relaxed);
        assert!(p.take_releases(&c, &mut out).is_err());
    }

    #[test]
    fn a_wake_request_is_answered_once() {
        let c = Control::boxed();
        let (p, mut q) = (Publisher::default(), Consumer::default());
        p.want_wake(&c);
        assert_eq!(q.release(&c, 1), Some(true));
        assert_eq!(q.release(&c, 2), Some(false));
    }

    #[test]
    fn a_sleeping_client_is_woken_and_a_late_record_prevents_the_sleep() {
        let c = Control::boxed();
        let (mut p, q) = (Publisher::default(), Consumer::default());
        assert_eq!(q.prepare_sleep(&c), Some(0));
        assert!(p.publish(&c, batch(0, 0)).1, "the publisher sees the sleeper");
        q.done_sleeping(&c, 5);
        assert!(!p.publish(&c, batch(1, 1)).1);
        assert_eq!(q.prepare_sleep(&c), None, "records are waiting");
        assert_eq!(p.client_wait_ns(&c), 5);
    }

    /// Two real threads: every record arrives once, in order, and every
    /// release is seen, with the wake handshakes racing all along. Also run
    /// under Miri (`cargo +nightly miri test -p stoker-proto ctrl`), which
    /// checks the orderings for data races and emulates weak memory.
    #[test]
    fn threads_hand_over_every_record_and_release() {
        let c: Arc<Control> = Arc::from(Control::boxed());
        // Miri explores weak-memory interleavings: fewer rounds, each far more thorough.
        const N: u64 = if cfg!(miri) { 300 } else { 200_000 };
        let daemon = {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut p = Publisher::default();
                let mut free: Vec<u32> = (0..8).collect();
                let mut back = Vec::new();
                let mut step = 0;
                while step < N {
                    p.take_releases(&c, &mut free).unwrap();
                    match free.pop() {
                        Some(slot) if p.has_room(&c) => {
                            p.publish(&c, batch(slot, step));
                            step += 1;
                        }
                        Some(slot) => free.push(slot),
                        None => {
                            p.want_wake(&c);
                            back.clear();
                            p.take_releases(&c, &mut back).unwrap();
                            free.append(&mut back);
                            std::hint::spin_loop();
                        }
                    }
                }
                // Every slot comes home.
                while free.len() < 8 {
                    p.take_releases(&c, &mut free).unwrap();
                    std::hint::spin_loop();
                }
                free.sort_unstable();
                free
            })
        };
        let mut q = Consumer::default();
        let mut next = 0;
        while next < N {
            match q.poll(&c).unwrap() {
                Some((_, rec)) => {
                    assert_eq!(rec.step, next);
                    next += 1;
                    while q.release(&c, rec.slot).is_none() {
                        std::hint::spin_loop();
                    }
                }
                None => std::hint::spin_loop(),
            }
        }
        assert_eq!(daemon.join().unwrap(), (0..8).collect::<Vec<_>>());
    }
}
