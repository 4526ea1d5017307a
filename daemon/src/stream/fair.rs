//! The worker pool shared fairly between users.
//!
//! Each uid with fills in flight is "active". A part of a fill (a run of
//! rows on one worker) enters the gate of its stream's uid before it reads,
//! and a uid may have at most `workers / active uids` parts reading at once
//! (at least one). A worker turned away runs other pending work meanwhile
//! (rayon's `yield_now`; another user's fill, say) and tries again, so one
//! user's slow samples hold their share of the workers, never all of them,
//! while a lone user still gets every worker. A thread that already holds
//! its uid's permit further down its stack (a part nested in a yield) passes
//! through: it adds no concurrency, and waiting there could wait for itself.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Fills in flight and parts reading, per uid.
#[derive(Debug)]
pub struct FairGate {
    workers: usize,
    uids: Mutex<HashMap<u32, Load>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Load {
    fills: usize,
    reading: usize,
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

impl FairGate {
    /// A gate for a pool of `workers` threads.
    pub fn new(workers: usize) -> Arc<FairGate> {
        Arc::new(FairGate { workers: workers.max(1), uids: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Load>> {
        self.uids.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fill of `uid` was queued.
    pub fn fill_started(&self, uid: u32) {
        self.lock().entry(uid).or_default().fills += 1;
    }

    /// A fill of `uid` ended.
    pub fn fill_finished(&self, uid: u32) {
        let mut uids = self.lock();
        if let Some(load) = uids.get_mut(&uid) {
            load.fills = load.fills.saturating_sub(1);
            if load.fills == 0 && load.reading == 0 {
                uids.remove(&uid);
            }
        }
    }

    /// How many parts of one uid may read at once now.
    fn share(&self, uids: &HashMap<u32, Load>) -> usize {
        let active = uids.values().filter(|l| l.fills > 0).count().max(1);
        (self.workers / active).max(1)
    }

    fn try_enter(&self, uid: u32) -> bool {
        let mut uids = self.lock();
        let share = self.share(&uids);
        let load = uids.entry(uid).or_default();
        if load.reading < share {
            load.reading += 1;
            true
        } else {
            false
        }
    }

    /// Waits (running other work meanwhile) until a part of `uid` may read.
    pub fn enter(self: &Arc<Self>, uid: u32) -> Permit {
        if HELD.with(|h| h.borrow().contains(&uid)) {
            return Permit { gate: None, uid };
        }
        while !self.try_enter(uid) {
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
        Permit { gate: Some(self.clone()), uid }
    }
}

/// A part's leave to read, given back on drop.
#[derive(Debug)]
pub struct Permit {
    gate: Option<Arc<FairGate>>,
    uid: u32,
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
            if load.fills == 0 && load.reading == 0 {
                uids.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_user_gets_every_worker_and_two_share_them() {
        let gate = FairGate::new(4);
        gate.fill_started(1);
        let alone: Vec<bool> = (0..5).map(|_| gate.try_enter(1)).collect();
        assert_eq!(alone, [true, true, true, true, false]);
        gate.fill_started(2);
        // Now each has a share of 2: uid 1 (holding 4) must wait, uid 2 may read twice.
        assert!(!gate.try_enter(1));
        assert!(gate.try_enter(2) && gate.try_enter(2) && !gate.try_enter(2));
        gate.fill_finished(1);
        gate.fill_finished(2);
    }

    #[test]
    fn a_permit_held_further_down_the_stack_passes_through() {
        let gate = FairGate::new(1);
        gate.fill_started(7);
        let outer = gate.enter(7);
        // Share 1, held: a nested part of the same uid does not wait for itself.
        let inner = gate.enter(7);
        assert!(inner.gate.is_none());
        drop(inner);
        drop(outer);
        assert!(gate.try_enter(7));
    }
}
