//! A stream: one client's pass over one dataset, for one rank. Owns the ring
//! and the control page, schedules batch fills on the worker pool in step
//! order as slots free up, and publishes filled slots to the client strictly
//! in step order through the control page ([`stoker_proto::ctrl`]), with no
//! request and no round trip.
//!
//! Slot life cycle: `Free → Filling → Ready → Leased → Free`. A slot is
//! *Leased* from the moment its record is published until the client gives
//! it back (through the control page's release queue, or a `Release`
//! message). Production runs ahead across the epoch boundary into epoch + 1
//! (what the next `set_epoch` almost always asks for), so a new epoch starts
//! with a full ring. A fill belongs to a *generation*; a `SetEpoch` to any
//! other position, and `Close`, start a new one, so fills still running for
//! the old position are discarded when they finish, and records published
//! for it and not yet taken are reclaimed.
//!
//! Slots `0..depth` live in the ring's memfd. When the client holds every
//! slot (and has taken every published batch), the stream grows by an extra
//! one-slot segment (another sealed memfd, which the client fetches with
//! `Request::Segment`), within the client's and the daemon's byte budgets;
//! extras beyond `depth` free ones are destroyed as they come back. A batch
//! whose ragged values do not fit a standard slot is produced again in an
//! extra segment sized for it, destroyed when it comes back. Only when a
//! budget refuses is there an "every slot is held" record, which the client
//! turns into a `LimitError`.
//!
//! Decoding runs on the rayon worker pool, never on tokio threads. A panic
//! while producing a batch (a bug in a decoder, say) is caught on the worker:
//! that batch fails with an error naming the dataset and sample, the stream
//! goes on with the next one, and the process never aborts (rayon aborts on a
//! panic that escapes a spawned job).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use stoker_proto::ctrl::{Publisher, RECORDS, Record, RecordKind};
use stoker_proto::{BatchLayout, Generation, LayoutLimits, StreamStatus};

pub mod budget;
pub mod counters;
mod error;
pub mod fair;
mod fill;

pub use error::StreamError;

use crate::ring::{ControlPage, Ring};
pub use budget::{Budget, Reservation};
use counters::{DatasetCounters, WarnLimit};
pub use fair::FairGate;
use stoker_data::sampler::Sampler;
use stoker_data::source::Source;

/// Rows below which a batch is not split further across workers.
const MIN_ROWS_PER_TASK: u64 = 8;
/// Window over which `stoker status` computes rates.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Messages of failed batches kept for `Fetch`: every record the queue can
/// hold untaken, and as many again taken and not yet fetched (a client's
/// threads may each hold one).
const MAX_FAILURES: usize = 2 * RECORDS as usize;

/// Who owns a stream and what it reads.
#[derive(Debug, Clone)]
pub struct StreamMeta {
    /// Stream id.
    pub id: u64,
    /// Owning connection.
    pub client_id: u64,
    /// Owning process.
    pub pid: u32,
    /// Dataset name or glob, for status.
    pub dataset: String,
    /// Rank.
    pub rank: u64,
    /// World size.
    pub world_size: u64,
    /// The counters of the dataset it reads (metrics).
    pub counters: Arc<DatasetCounters>,
    /// The dataset is scanned again at each new epoch (`rescan = "epoch"`):
    /// production stops at the end of an epoch instead of running into the
    /// next, whose files are only known once `set_epoch` rescanned them.
    pub rescan: bool,
    /// Where the stream is, for the caches' eviction plan (`None`: untracked).
    pub cursor: Option<Arc<stoker_data::cache::Cursor>>,
    /// The worker pool's fair gate and the uid this stream's fills count
    /// against (`None`: ungated, unit tests).
    pub share: Option<(Arc<FairGate>, u32)>,
}

/// The shared memory of a stream, made by the server within its budgets.
#[derive(Debug)]
pub struct Shm {
    /// The ring: header and `depth` standard slots.
    pub ring: Arc<Ring>,
    /// The control page.
    pub control: Arc<ControlPage>,
    /// The client's budget, then the daemon's: extra segments reserve from both.
    pub budgets: [Arc<Budget>; 3],
    /// The ring's reservations, given back when the stream closes.
    pub reserved: Mutex<Vec<Reservation>>,
    /// Limits for the layouts of oversized batches.
    pub limits: LayoutLimits,
}

/// One open stream.
#[derive(Debug)]
pub struct Stream {
    meta: StreamMeta,
    /// The source and sampler of the current epoch: replaced together, under
    /// the state lock, only by [`Stream::set_epoch_with`] (a rescan), which
    /// also starts a new fill generation, so no fill mixes the two.
    source: RwLock<Arc<dyn Source>>,
    sampler: RwLock<Arc<Sampler>>,
    shm: Shm,
    pool: Arc<rayon::ThreadPool>,
    state: Mutex<State>,
    opened: Instant,
    /// Failed samples are logged at most once per [`WarnLimit::EVERY`]: a
    /// client taking the records of an all-failing stream wrote megabytes of
    /// warnings a second.
    failures_logged: WarnLimit,
}

#[derive(Debug)]
struct State {
    /// Epoch and step of the next record to publish.
    epoch: u64,
    next_deliver: u64,
    /// Epoch and step of the next batch to start filling.
    produce_epoch: u64,
    /// `EndOfEpoch` of epoch `u64::MAX` was published: nothing follows it until a `set_epoch`.
    ended_last_epoch: bool,
    next_produce: u64,
    generation: u64,
    /// The epoch whose file list the source holds (rescan streams), and its generation.
    scanned: (u64, Generation),
    slots: Vec<Slot>,
    closed: bool,
    publisher: Publisher,
    /// Batch records published, as `(seq, slot, bytes)`, that the client may
    /// not have taken yet (pruned by its `consumed` count).
    published: VecDeque<(u32, u32, u64)>,
    /// Messages of published `Failed` records, by sequence number.
    failures: VecDeque<(u32, u64, u64, String)>,
    /// Sequence number of a published `Exhausted` record not yet answered.
    exhausted: Option<u32>,
    /// The next extra segment's generation (records name it, so the client
    /// maps the right memfd for a slot id that was reused).
    next_segment: u32,
    /// Slot ids the client gave back that it did not hold (for the log).
    bad_releases: u64,
    delivered: u64,
    bytes_delivered: u64,
    recent: VecDeque<(Instant, u64)>,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    /// For slots past the ring's depth: their own memfd.
    segment: Option<Segment>,
}

#[derive(Debug)]
struct Segment {
    ring: Arc<Ring>,
    generation: u32,
    /// Made for one batch too large for a standard slot: destroyed when it comes back.
    oversize: bool,
    _reserved: [Reservation; 3],
}

#[derive(Debug, Clone, PartialEq)]
enum SlotState {
    Free,
    Filling {
        generation: u64,
        epoch: u64,
        step: u64,
    },
    Ready {
        generation: u64,
        epoch: u64,
        step: u64,
        rows: u64,
        error: Option<String>,
    },
    Leased,
    /// An extra slot id whose segment was destroyed (the id may be reused).
    Absent,
}

/// An extra segment's memfd and layout, for `Request::Segment`.
#[derive(Debug)]
pub struct SegmentInfo {
    /// Its ring (one slot).
    pub ring: Arc<Ring>,
    /// Generation named by the records.
    pub generation: u32,
}

/// Why a `Fetch` could not be answered with a message.
#[derive(Debug)]
pub enum Fetched {
    /// Batch `step` of `epoch` failed with this message.
    Failed {
        /// Epoch.
        epoch: u64,
        /// Step.
        step: u64,
        /// The message.
        message: String,
    },
    /// The client no longer holds every slot: go on waiting.
    Resumed,
    /// The client still holds every slot it may have.
    Exhausted(String),
    /// No such record.
    Unknown,
}

impl Stream {
    /// Creates the stream positioned at (`epoch`, `step`) and starts filling its ring.
    pub fn start(
        meta: StreamMeta,
        source: Arc<dyn Source>,
        sampler: Sampler,
        shm: Shm,
        pool: Arc<rayon::ThreadPool>,
        epoch: u64,
        step: u64,
    ) -> Arc<Stream> {
        Stream::start_at(meta, (source, sampler, Generation::default()), shm, pool, epoch, step)
    }

    /// [`Stream::start`] with the dataset generation the source reads.
    pub fn start_at(
        meta: StreamMeta,
        (source, sampler, generation): (Arc<dyn Source>, Sampler, Generation),
        shm: Shm,
        pool: Arc<rayon::ThreadPool>,
        epoch: u64,
        step: u64,
    ) -> Arc<Stream> {
        let depth = shm.ring.depth() as usize;
        let stream = Arc::new(Stream {
            meta,
            source: RwLock::new(source),
            sampler: RwLock::new(Arc::new(sampler)),
            shm,
            pool,
            failures_logged: WarnLimit::default(),
            state: Mutex::new(State {
                epoch,
                next_deliver: step,
                produce_epoch: epoch,
                ended_last_epoch: false,
                next_produce: step,
                generation: 0,
                scanned: (epoch, generation),
                slots: (0..depth).map(|_| Slot { state: SlotState::Free, segment: None }).collect(),
                closed: false,
                publisher: Publisher::default(),
                published: VecDeque::new(),
                failures: VecDeque::new(),
                exhausted: None,
                next_segment: 1,
                bad_releases: 0,
                delivered: 0,
                bytes_delivered: 0,
                recent: VecDeque::new(),
            }),
            opened: Instant::now(),
        });
        let mut st = stream.lock();
        stream.advance(&mut st);
        drop(st);
        stream
    }

    /// Owner and dataset.
    pub fn meta(&self) -> &StreamMeta {
        &self.meta
    }

    /// The dataset it reads (in the current epoch).
    pub fn source(&self) -> Arc<dyn Source> {
        self.source.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The ring (its fd is sent to the client).
    pub fn ring(&self) -> &Arc<Ring> {
        &self.shm.ring
    }

    /// The control page (its fd is sent to the client).
    pub fn control(&self) -> &Arc<ControlPage> {
        &self.shm.control
    }

    /// Bytes of shared memory the stream holds: the ring, the control page and extra segments.
    pub fn shm_bytes(&self) -> u64 {
        let st = self.lock();
        let extra: u64 = st.slots.iter().filter_map(|s| s.segment.as_ref()).map(|s| s.ring.bytes()).sum();
        self.shm.ring.bytes().saturating_add(stoker_proto::ctrl::CTRL_BYTES).saturating_add(extra)
    }

    /// Where fields lie in each standard slot.
    pub fn layout(&self) -> &BatchLayout {
        self.shm.ring.layout()
    }

    /// Sample bytes the client has taken so far (for metrics).
    pub fn bytes_delivered(&self) -> u64 {
        let st = self.lock();
        st.bytes_delivered.saturating_sub(self.untaken_batches(&st).1)
    }

    /// Batch records published and not yet taken: how many, and their bytes.
    fn untaken_batches(&self, st: &State) -> (u64, u64) {
        let untaken = st.publisher.untaken(self.shm.control.control());
        let first = st.publisher.published().wrapping_sub(untaken);
        st.published
            .iter()
            .filter(|(seq, _, _)| seq.wrapping_sub(first) < untaken)
            .fold((0, 0), |(n, b), (_, _, bytes)| (n + 1, b + bytes))
    }

    /// The sampler (batch counts) of the current epoch.
    pub fn sampler(&self) -> Arc<Sampler> {
        self.sampler.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The dataset generation the current epoch reads.
    pub fn generation(&self) -> Generation {
        self.lock().scanned.1
    }

    /// Whether moving to `epoch` rescans the dataset: a rescan stream moving
    /// to another epoch than the one its files were matched for.
    pub fn needs_rescan(&self, epoch: u64) -> bool {
        self.meta.rescan && self.lock().scanned.0 != epoch
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent-enough state for
        // status and shutdown; keep serving rather than poisoning the stream.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ring holding slot `id`, and the slot's index in it.
    fn ring_of(&self, st: &State, id: usize) -> (Arc<Ring>, u32) {
        match &st.slots[id].segment {
            Some(seg) => (seg.ring.clone(), 0),
            None => (self.shm.ring.clone(), id as u32),
        }
    }

    /// The client queued releases or took records: take them into account.
    pub fn wake(self: &Arc<Self>) {
        let mut st = self.lock();
        self.advance(&mut st);
    }

    /// The client gave `slot` back by message (its release queue was full).
    /// Returns false if it did not hold it.
    pub fn release(self: &Arc<Self>, slot: u32) -> bool {
        let mut st = self.lock();
        let held = self.release_slot(&mut st, slot);
        self.advance(&mut st);
        held
    }

    /// Marks `id` free (or destroys its segment). False if it was not leased.
    fn release_slot(&self, st: &mut State, id: u32) -> bool {
        let depth = self.shm.ring.depth() as usize;
        let free = st.slots.iter().filter(|s| s.state == SlotState::Free).count();
        let Some(slot) = st.slots.get_mut(id as usize) else { return false };
        if slot.state != SlotState::Leased {
            return false;
        }
        let destroy = slot.segment.as_ref().is_some_and(|seg| seg.oversize || free >= depth);
        if destroy {
            slot.segment = None;
            slot.state = SlotState::Absent;
        } else {
            slot.state = SlotState::Free;
        }
        true
    }

    /// Takes the client's queued releases. A client that claims more than
    /// the queue holds is not a stoker client: its stream closes.
    fn drain(&self, st: &mut State) {
        let mut ids = Vec::new();
        if let Err(e) = st.publisher.take_releases(self.shm.control.control(), &mut ids) {
            tracing::warn!(stream = self.meta.id, pid = self.meta.pid, error = %e, "closing a stream whose control page is corrupt");
            st.closed = true;
            st.generation += 1;
            return;
        }
        for id in ids {
            if !self.release_slot(st, id) {
                st.bad_releases += 1;
                if st.bad_releases.is_power_of_two() {
                    tracing::warn!(
                        stream = self.meta.id,
                        slot = id,
                        count = st.bad_releases,
                        "release of a slot the client does not hold"
                    );
                }
            }
        }
    }

    /// Takes releases, starts fills, publishes what is ready, and asks the
    /// client for word when it is blocked on it. Call after any change.
    fn advance(self: &Arc<Self>, st: &mut State) {
        if st.closed {
            return;
        }
        self.drain(st);
        loop {
            // Publishing can free slots (a failed batch's): fill and publish
            // again while records go out (at most the queue's room of rounds).
            let mut full;
            loop {
                let before = st.publisher.published();
                self.fill(st);
                full = self.publish(st);
                if full || st.closed || st.publisher.published() == before {
                    break;
                }
            }
            // With no fill running, only the client can move the stream: ask it for word.
            let blocked = self.sampler().batches_per_epoch() > 0
                && !st.slots.iter().any(|s| matches!(s.state, SlotState::Filling { .. }));
            if st.closed || !(blocked || full) {
                return;
            }
            let control = self.shm.control.control();
            let untaken = st.publisher.untaken(control);
            st.publisher.want_wake(control);
            // A release or a take that raced with the request: one side saw the other.
            let mut again = Vec::new();
            if st.publisher.take_releases(control, &mut again).is_err() {
                self.drain(st); // closes the stream, naming why
                return;
            }
            let freed = again.iter().filter(|&&id| self.release_slot(st, id)).count();
            st.bad_releases = st.bad_releases.saturating_add((again.len() - freed) as u64);
            // Only slots given back (or records taken) move the stream on;
            // ids of slots the client does not hold (a client refilling its
            // queue with them) must not keep the daemon here, lock held.
            if freed == 0 && !(full && st.publisher.untaken(control) < untaken) {
                return;
            }
        }
    }

    /// Moves to `epoch`, resuming at `step`; prefetched batches are dropped
    /// and records not yet taken reclaimed. Returns the sequence number of
    /// the new position's first record.
    pub fn set_epoch(self: &Arc<Self>, epoch: u64, step: u64) -> Result<u32, StreamError> {
        self.set_epoch_with(epoch, step, None)
    }

    /// [`Stream::set_epoch`], reading `rescanned` (the dataset matched again
    /// for `epoch`: source, sampler over its samples, generation) from then on.
    pub fn set_epoch_with(
        self: &Arc<Self>,
        epoch: u64,
        step: u64,
        rescanned: Option<(Arc<dyn Source>, Sampler, Generation)>,
    ) -> Result<u32, StreamError> {
        let batches = match &rescanned {
            Some((_, sampler, _)) => sampler.batches_per_epoch(),
            None => self.sampler().batches_per_epoch(),
        };
        if step > batches {
            return Err(StreamError::PastEpochEnd { step, batches });
        }
        let mut st = self.lock();
        let control = self.shm.control.control();
        self.drain(&mut st);
        // Batches published and not taken go back to the pool.
        let untaken = st.publisher.untaken(control);
        let first_untaken = st.publisher.published().wrapping_sub(untaken);
        let reclaim: Vec<u32> = st
            .published
            .iter()
            .filter(|(seq, _, _)| seq.wrapping_sub(first_untaken) < untaken)
            .map(|&(_, slot, _)| slot)
            .collect();
        for slot in reclaim {
            self.release_slot(&mut st, slot);
        }
        st.published.clear();
        st.failures.clear();
        st.exhausted = None;
        if let Some((source, sampler, generation)) = rescanned {
            // Under the state lock and with the generation bump below: fills
            // of the old list still running are discarded when they finish.
            let old = std::mem::replace(&mut *self.source.write().unwrap_or_else(|e| e.into_inner()), source);
            if let Some(cursor) = &self.meta.cursor {
                cursor.set_sampler(sampler.clone());
            }
            *self.sampler.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(sampler);
            self.meta.counters.observe_skips(&old);
            st.scanned = (epoch, generation);
        }
        st.generation += 1;
        st.epoch = epoch;
        st.next_deliver = step;
        st.produce_epoch = epoch;
        st.ended_last_epoch = false;
        st.next_produce = step;
        for s in &mut st.slots {
            if matches!(s.state, SlotState::Ready { .. }) {
                s.state = SlotState::Free;
            }
        }
        let skip_to = st.publisher.published();
        self.advance(&mut st);
        Ok(skip_to)
    }

    /// Stops producing; running fills finish and are discarded. With
    /// `notify`, a `Closed` record wakes a client waiting for its next batch
    /// (the daemon is shutting down).
    pub fn close(&self, notify: bool) {
        let mut st = self.lock();
        if notify && !st.closed && st.publisher.has_room(self.shm.control.control()) {
            let record = Record { kind: RecordKind::Closed, slot: 0, segment: 0, epoch: 0, step: 0, rows: 0 };
            self.publish_record(&mut st, record);
        }
        st.closed = true;
        st.generation += 1;
        // The budgets count what open streams hold: a closed stream's memory
        // is the client's once its last view is gone.
        let depth = self.shm.ring.depth() as usize;
        for slot in st.slots.iter_mut().skip(depth) {
            *slot = Slot { state: SlotState::Absent, segment: None };
        }
        drop(st);
        if let Some((gate, uid)) = &self.meta.share {
            gate.stream_closed(*uid, self.meta.id);
        }
        self.shm.reserved.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.meta.counters.observe_skips(&self.source());
    }

    /// The answer to `Fetch { seq }`.
    pub fn fetch(self: &Arc<Self>, seq: u32) -> Fetched {
        let mut st = self.lock();
        if let Some(at) = st.failures.iter().position(|f| f.0 == seq) {
            let (_, epoch, step, message) = st.failures.remove(at).expect("found above");
            return Fetched::Failed { epoch, step, message };
        }
        if st.exhausted != Some(seq) {
            return Fetched::Unknown;
        }
        st.exhausted = None;
        self.advance(&mut st);
        match st.exhausted {
            // Still exhausted: `advance` published a fresh record for the next wait.
            Some(_) => Fetched::Exhausted(self.exhausted_message(&st)),
            None => Fetched::Resumed,
        }
    }

    fn exhausted_message(&self, st: &State) -> String {
        let held = st.slots.iter().filter(|s| s.state == SlotState::Leased).count();
        let [client, _, daemon] = &self.shm.budgets;
        format!(
            "this process holds all {held} batches of the stream that its shared-memory budget allows \
             ({} of {} bytes, [limits] max_ring_bytes_per_client; the daemon has {} of {} bytes in use, \
             [limits] max_memory_bytes), so no further batch can be produced; drop references to old batches \
             (copy what you keep), or ask the admin to raise the limit",
            client.used(),
            client.limit(),
            daemon.used(),
            daemon.limit()
        )
    }

    /// The segment of extra slot `slot`, for `Request::Segment`.
    pub fn segment(&self, slot: u32) -> Option<SegmentInfo> {
        let st = self.lock();
        let seg = st.slots.get(slot as usize)?.segment.as_ref()?;
        Some(SegmentInfo { ring: seg.ring.clone(), generation: seg.generation })
    }

    /// Publishes, in step order, everything that is ready. Returns true when
    /// the record queue is full (the client has not taken enough).
    fn publish(&self, st: &mut State) -> bool {
        let control = self.shm.control.control();
        let batches = self.sampler().batches_per_epoch();
        loop {
            if st.closed {
                return false;
            }
            if !st.publisher.has_room(control) {
                return true;
            }
            if st.next_deliver >= batches {
                // The end of an epoch production has moved past (or of any
                // epoch, when this rank has no batches: once per `set_epoch`).
                if st.epoch > st.produce_epoch || (batches == 0 && st.epoch != st.produce_epoch) {
                    return false;
                }
                if st.ended_last_epoch {
                    // Epoch u64::MAX ended: there is no epoch after it to deliver.
                    return false;
                }
                let record =
                    Record { kind: RecordKind::EndOfEpoch, slot: 0, segment: 0, epoch: st.epoch, step: 0, rows: 0 };
                self.publish_record(st, record);
                match st.epoch.checked_add(1) {
                    Some(next) => {
                        st.epoch = next;
                        st.next_deliver = 0;
                    }
                    None => st.ended_last_epoch = true,
                }
                continue;
            }
            let (generation, epoch, step) = (st.generation, st.epoch, st.next_deliver);
            let ready = st.slots.iter().position(|s| {
                matches!(&s.state, SlotState::Ready { generation: g, epoch: e, step: k, .. } if (*g, *e, *k) == (generation, epoch, step))
            });
            let Some(id) = ready else { return false };
            let SlotState::Ready { rows, error, .. } = std::mem::replace(&mut st.slots[id].state, SlotState::Leased)
            else {
                unreachable!("matched Ready above");
            };
            st.next_deliver += 1;
            if let Some(message) = error {
                st.slots[id].state = SlotState::Free;
                if st.slots[id].segment.as_ref().is_some_and(|s| s.oversize) {
                    st.slots[id] = Slot { state: SlotState::Absent, segment: None };
                }
                let record = Record { kind: RecordKind::Failed, slot: 0, segment: 0, epoch, step, rows: 0 };
                let seq = self.publish_record(st, record);
                st.failures.push_back((seq, epoch, step, message));
                // Bounded (a client that never fetches), but with room for
                // more than the queue: a client that took a failed record
                // freed a place, which a new one may fill before its `Fetch`
                // arrives; with `RECORDS` here that taken one was dropped and
                // its fetch answered "no record" (a `ProtocolError` after a
                // run of failed batches).
                while st.failures.len() > MAX_FAILURES {
                    st.failures.pop_front();
                }
                continue;
            }
            let segment = st.slots[id].segment.as_ref().map_or(0, |s| s.generation);
            let record = Record { kind: RecordKind::Batch, slot: id as u32, segment, epoch, step, rows };
            let (ring, index) = self.ring_of(st, id);
            let bytes = ring.batch_bytes(index, rows);
            let seq = self.publish_record(st, record);
            st.published.push_back((seq, id as u32, bytes));
            let untaken = st.publisher.untaken(control);
            while st.published.len() > untaken as usize {
                st.published.pop_front();
            }
            let now = Instant::now();
            st.delivered += 1;
            st.bytes_delivered = st.bytes_delivered.saturating_add(bytes);
            st.recent.push_back((now, bytes));
            while st.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
                st.recent.pop_front();
            }
        }
    }

    /// Publishes one record and wakes a sleeping client. Returns its sequence number.
    fn publish_record(&self, st: &mut State, record: Record) -> u32 {
        let control = self.shm.control.control();
        let (seq, wake) = st.publisher.publish(control, record);
        if wake {
            // Not FUTEX_PRIVATE: the client sleeps in another process, on its own mapping of the page.
            let _ =
                rustix::thread::futex::wake(&control.daemon.published, rustix::thread::futex::Flags::empty(), u32::MAX);
        }
        seq
    }

    /// Status line for `stoker status`.
    pub fn status(&self) -> StreamStatus {
        let st = self.lock();
        let now = Instant::now();
        let (count, bytes) = st
            .recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW)
            .fold((0u64, 0u64), |(c, b), (_, n)| (c + 1, b + n));
        let span = st.recent.front().map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64()).max(1e-3);
        let (batches_per_s, mb_per_s) =
            if count < 2 { (0.0, 0.0) } else { (count as f64 / span, bytes as f64 / span / 1e6) };
        let open_s = now.duration_since(self.opened).as_secs_f64();
        // The client's own count of time spent waiting (it sleeps on the
        // control page, where the daemon cannot see it); a claim, so clamped.
        let wait_s = (st.publisher.client_wait_ns(self.shm.control.control()) as f64 / 1e9).clamp(0.0, open_s);
        let untaken = st.publisher.untaken(self.shm.control.control()) as usize;
        let leased = st.slots.iter().filter(|s| s.state == SlotState::Leased).count();
        StreamStatus {
            id: self.meta.id,
            client_id: self.meta.client_id,
            pid: self.meta.pid,
            dataset: self.meta.dataset.clone(),
            rank: self.meta.rank,
            world_size: self.meta.world_size,
            epoch: st.epoch,
            step: st.next_deliver,
            batches_per_epoch: self.sampler().batches_per_epoch(),
            batches: st.delivered.saturating_sub(self.untaken_batches(&st).0),
            batches_per_s,
            mb_per_s,
            wait_s,
            open_s,
            stall_percent: percent(wait_s, open_s),
            slots_filled: st
                .slots
                .iter()
                .filter(|s| matches!(s.state, SlotState::Ready { generation, .. } if generation == st.generation))
                .count()
                .saturating_add(untaken.min(leased)) as u64,
            slots_leased: leased.saturating_sub(untaken) as u64,
            depth: st.slots.iter().filter(|s| s.state != SlotState::Absent).count() as u64,
        }
    }
}

/// `part` as a percentage of `whole` (0 when `whole` is not positive), at most 100.
pub fn percent(part: f64, whole: f64) -> f64 {
    if whole > 0.0 { (100.0 * part / whole).clamp(0.0, 100.0) } else { 0.0 }
}

/// The message a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_string(),
    }
}

#[cfg(test)]
mod tests;
