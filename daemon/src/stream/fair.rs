//! The worker pool shared fairly between users, then between each user's streams.
//!
//! Two bounds, both per uid, then per stream within the uid:
//!
//! * **Fills in flight** (queued on the pool or running): a uid may have at
//!   most [`FairGate::fill_cap`] (four per worker, at least 4), enough to
//!   keep every worker busy and no more; within it each of the uid's active
//!   streams may have `cap / active streams` (at least one). A stream turned
//!   away queues in its uid's line and is woken, in turn, when a fill of that
//!   uid ends: one user's many Loaders cannot flood the pool's queue, and
//!   their streams take turns.
//! * **Parts reading** (a run of rows on one worker): a uid with fills in
//!   flight is "active" and may have `workers / active uids` parts reading at
//!   once (at least one); within it a stream may have `uid share / the uid's
//!   active streams` (at least one). A worker turned away runs other pending
//!   work meanwhile (rayon's `yield_now`; another user's fill, say) and tries
//!   again, so one user's (or one stream's) slow samples hold their share of
//!   the workers, never all of them, while a lone stream still gets every
//!   worker. A thread that already holds its uid's permit further down its
//!   stack (a part nested in a yield) passes through: it adds no
//!   concurrency, and waiting there could wait for itself.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

/// What a stream turned away by a fill bound is asked to do when its turn
/// comes: try to fill again.
pub trait WakeUp: Send + Sync {
    /// Takes the stream's state into account again (starting fills).
    fn wake_up(self: Arc<Self>);
}

impl WakeUp for super::Stream {
    fn wake_up(self: Arc<Self>) {
        self.wake();
    }
}

/// Fills in flight per worker that one uid may have.
const FILLS_PER_WORKER: usize = 4;

/// Fills in flight and parts reading, per uid and per stream.
#[derive(Debug)]
pub struct FairGate {
    workers: usize,
    uids: Mutex<HashMap<u32, Load>>,
}

#[derive(Debug, Default)]
struct Load {
    fills: usize,
    reading: usize,
    streams: HashMap<u64, StreamLoad>,
    /// Streams turned away by a fill bound, in the order they asked.
    waiting: VecDeque<(u64, Weak<dyn WakeUp>)>,
}

#[derive(Debug, Default, Clone, Copy)]
struct StreamLoad {
    fills: usize,
    reading: usize,
}

impl Load {
    fn idle(&self) -> bool {
        self.fills == 0 && self.reading == 0 && self.waiting.is_empty()
    }

    /// Streams of this uid with fills in flight or waiting for one, counting `stream`.
    fn active_streams(&self, stream: u64) -> usize {
        let mut n = self.streams.iter().filter(|(id, l)| l.fills > 0 && **id != stream).count() + 1;
        n += self
            .waiting
            .iter()
            .filter(|(id, _)| *id != stream && self.streams.get(id).is_none_or(|l| l.fills == 0))
            .count();
        n
    }

    fn forget_stream_if_idle(&mut self, stream: u64) {
        if self.streams.get(&stream).is_some_and(|l| l.fills == 0 && l.reading == 0) {
            self.streams.remove(&stream);
        }
    }
}

thread_local! {
    /// Uids whose permit this thread holds (further down its stack).
    static HELD: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// Parts run nested inside this thread's waits.
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Nested waits beyond which a turned-away worker sleeps instead of running
/// more work (bounds the stack).
const MAX_DEPTH: u32 = 4;

/// Streams to wake (outside every lock) because a fill of their uid ended.
#[must_use = "wake the streams outside the stream's lock"]
#[derive(Debug, Default)]
pub struct Woken(Vec<Weak<dyn WakeUp>>);

impl Woken {
    /// Wakes each stream in turn (each takes its own lock: call it holding none).
    pub fn wake(self) {
        for weak in self.0 {
            if let Some(stream) = weak.upgrade() {
                stream.wake_up();
            }
        }
    }

    /// Whether nobody is to be woken.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many are to be woken.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl FairGate {
    /// A gate for a pool of `workers` threads.
    pub fn new(workers: usize) -> Arc<FairGate> {
        Arc::new(FairGate { workers: workers.max(1), uids: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Load>> {
        self.uids.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fills in flight (queued or running) and streams waiting for a turn, all users together.
    pub fn load(&self) -> (usize, usize) {
        let uids = self.lock();
        uids.values().fold((0, 0), |(f, w), l| (f + l.fills, w + l.waiting.len()))
    }

    /// Fills in flight one uid may have.
    pub fn fill_cap(&self) -> usize {
        self.workers.saturating_mul(FILLS_PER_WORKER).max(4)
    }

    /// A fill of `stream` (of `uid`) may start now: counted, true. Otherwise
    /// the stream queues in its uid's line (once) and `wake` is called on
    /// it when its turn comes.
    pub fn try_start<W: WakeUp + 'static>(&self, uid: u32, stream: u64, waker: &Arc<W>) -> bool {
        let cap = self.fill_cap();
        let mut uids = self.lock();
        let load = uids.entry(uid).or_default();
        let stream_cap = (cap / load.active_streams(stream)).max(1);
        let mine = load.streams.get(&stream).map_or(0, |l| l.fills);
        if load.fills < cap && mine < stream_cap {
            load.fills += 1;
            load.streams.entry(stream).or_default().fills += 1;
            return true;
        }
        if !load.waiting.iter().any(|(id, _)| *id == stream) {
            let weak: Weak<W> = Arc::downgrade(waker);
            let weak: Weak<dyn WakeUp> = weak;
            load.waiting.push_back((stream, weak));
        }
        false
    }

    /// A fill started outside the cap (a batch produced again in a bigger
    /// slot: it replaces the fill that just ended).
    pub fn fill_started(&self, uid: u32, stream: u64) {
        let mut uids = self.lock();
        let load = uids.entry(uid).or_default();
        load.fills += 1;
        load.streams.entry(stream).or_default().fills += 1;
    }

    /// A fill of `stream` ended (or never started): the streams whose turn
    /// it now is, to wake once no lock is held.
    pub fn fill_finished(&self, uid: u32, stream: u64) -> Woken {
        let mut uids = self.lock();
        let Some(load) = uids.get_mut(&uid) else { return Woken::default() };
        load.fills = load.fills.saturating_sub(1);
        if let Some(l) = load.streams.get_mut(&stream) {
            l.fills = l.fills.saturating_sub(1);
        }
        load.forget_stream_if_idle(stream);
        // Everyone in line asks again, in order; those still over a bound
        // queue again. (A stream refused has a fill of its uid in flight to
        // wake it: the uid is at its cap, or the stream at its own.)
        let woken = Woken(std::mem::take(&mut load.waiting).into_iter().map(|(_, w)| w).collect());
        if load.idle() {
            uids.remove(&uid);
        }
        woken
    }

    /// A stream closed: it leaves its uid's line.
    pub fn stream_closed(&self, uid: u32, stream: u64) {
        let mut uids = self.lock();
        if let Some(load) = uids.get_mut(&uid) {
            load.waiting.retain(|(id, _)| *id != stream);
            if load.idle() {
                uids.remove(&uid);
            }
        }
    }

    /// How many parts of one uid may read at once now.
    fn share(&self, uids: &HashMap<u32, Load>) -> usize {
        let active = uids.values().filter(|l| l.fills > 0).count().max(1);
        (self.workers / active).max(1)
    }

    fn try_enter(&self, uid: u32, stream: u64) -> bool {
        let mut uids = self.lock();
        let share = self.share(&uids);
        let load = uids.entry(uid).or_default();
        let streams = load.streams.iter().filter(|(id, l)| l.fills > 0 || **id == stream).count().max(1);
        let stream_share = (share / streams).max(1);
        let mine = load.streams.entry(stream).or_default();
        if load.reading < share && mine.reading < stream_share {
            mine.reading += 1;
            load.reading += 1;
            true
        } else {
            load.forget_stream_if_idle(stream);
            false
        }
    }

    /// Waits (running other work meanwhile) until a part of `stream` (of
    /// `uid`) may read.
    pub fn enter(self: &Arc<Self>, uid: u32, stream: u64) -> Permit {
        if HELD.with(|h| h.borrow().contains(&uid)) {
            return Permit { gate: None, uid, stream };
        }
        while !self.try_enter(uid, stream) {
            let depth = DEPTH.with(|d| d.get());
            let ran = if depth < MAX_DEPTH {
                DEPTH.with(|d| d.set(depth + 1));
                let ran = rayon::yield_now();
                DEPTH.with(|d| d.set(depth));
                ran
            } else {
                None
            };
            if !matches!(ran, Some(rayon::Yield::Executed)) {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        HELD.with(|h| h.borrow_mut().push(uid));
        Permit { gate: Some(self.clone()), uid, stream }
    }
}

/// A part's leave to read, given back on drop.
#[derive(Debug)]
pub struct Permit {
    gate: Option<Arc<FairGate>>,
    uid: u32,
    stream: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(gate) = self.gate.take() else { return };
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            if let Some(at) = held.iter().rposition(|&u| u == self.uid) {
                held.remove(at);
            }
        });
        let mut uids = gate.lock();
        if let Some(load) = uids.get_mut(&self.uid) {
            load.reading = load.reading.saturating_sub(1);
            if let Some(l) = load.streams.get_mut(&self.stream) {
                l.reading = l.reading.saturating_sub(1);
            }
            load.forget_stream_if_idle(self.stream);
            if load.idle() {
                uids.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nobody;
    impl WakeUp for Nobody {
        fn wake_up(self: Arc<Self>) {}
    }

    #[test]
    fn a_lone_user_gets_every_worker_and_two_share_them() {
        let gate = FairGate::new(4);
        gate.fill_started(1, 10);
        let alone: Vec<bool> = (0..5).map(|_| gate.try_enter(1, 10)).collect();
        assert_eq!(alone, [true, true, true, true, false]);
        gate.fill_started(2, 20);
        // Now each has a share of 2: uid 1 (holding 4) must wait, uid 2 may read twice.
        assert!(!gate.try_enter(1, 10));
        assert!(gate.try_enter(2, 20) && gate.try_enter(2, 20) && !gate.try_enter(2, 20));
        gate.fill_finished(1, 10).wake();
        gate.fill_finished(2, 20).wake();
    }

    #[test]
    fn a_users_streams_share_its_workers() {
        let gate = FairGate::new(4);
        gate.fill_started(1, 10);
        assert!(gate.try_enter(1, 10) && gate.try_enter(1, 10) && gate.try_enter(1, 10));
        // A second stream of the same uid: each may read with 2 of the 4.
        gate.fill_started(1, 11);
        assert!(!gate.try_enter(1, 10));
        assert!(gate.try_enter(1, 11));
        // The uid's 4 are all reading now; stream 11 is under its 2 but the uid is not.
        assert!(!gate.try_enter(1, 11));
    }

    #[test]
    fn a_permit_held_further_down_the_stack_passes_through() {
        let gate = FairGate::new(1);
        gate.fill_started(7, 1);
        let outer = gate.enter(7, 1);
        // Share 1, held: a nested part of the same uid does not wait for itself.
        let inner = gate.enter(7, 2);
        assert!(inner.gate.is_none());
        drop(inner);
        drop(outer);
        assert!(gate.try_enter(7, 1));
    }

    #[test]
    fn fills_in_flight_are_bounded_per_uid_then_shared_between_its_streams() {
        let gate = FairGate::new(1);
        let cap = gate.fill_cap();
        assert_eq!(cap, 4);
        let (a, b) = (Arc::new(Nobody), Arc::new(Nobody));
        let started =
            |stream: u64, waker: &Arc<Nobody>, n: usize| (0..n).filter(|_| gate.try_start(1, stream, waker)).count();
        // A lone stream may have the whole cap in flight, no more.
        assert_eq!(started(1, &a, 8), cap);
        // Another user is not bounded by this user's fills.
        let c = Arc::new(Nobody);
        assert_eq!((0..2).filter(|_| gate.try_start(2, 9, &c)).count(), 2);
        // A second stream of the uid queues behind the first (turned away
        // above); when a fill ends both are woken, in order, to ask again.
        assert_eq!(started(2, &b, 1), 0);
        assert_eq!(gate.load(), (6, 2));
        let woken = gate.fill_finished(1, 1);
        assert_eq!(woken.len(), 2);
        assert_eq!(gate.load(), (5, 0));
        // Now two streams are active: each may hold half the cap.
        assert_eq!(started(2, &b, 4), 1);
        assert_eq!(started(1, &a, 1), 0, "the uid is at its cap");
        for _ in 0..2 {
            let _ = gate.fill_finished(1, 1);
        }
        assert_eq!(started(2, &b, 4), 1, "stream 2 holds half the cap: 2");
        assert_eq!(started(1, &a, 4), 1, "stream 1 back to its half");
    }
}
