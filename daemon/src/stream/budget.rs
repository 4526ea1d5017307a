//! Byte budgets for shared memory, reserved atomically.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A byte budget for shared memory: one per client connection
/// (`[limits] max_ring_bytes_per_client`) and one for the daemon
/// (`[limits] max_memory_bytes` less the chunk cache). Reserving is atomic,
/// so concurrent opens and grows can never overshoot it together.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    limit: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: u64) -> Arc<Budget> {
        Arc::new(Budget { used: AtomicU64::new(0), limit: AtomicU64::new(limit) })
    }

    /// Changes the limit (a reload); reservations already made stand.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Reserves `bytes`, or returns how many are in use when they do not fit.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, u64> {
        let limit = self.limit();
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .map(|_| Reservation { budget: self.clone(), bytes })
    }
}

/// Bytes held against a [`Budget`] until dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}
