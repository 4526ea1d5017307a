//! The counters the batch-fill path keeps: per dataset ([`DatasetCounters`],
//! shared by every stream reading it and kept by the metrics registry
//! after they close, so they only grow) and the one daemon-wide worker busy
//! time ([`worker_busy`]) that admission and the metrics read. The fill path
//! pays a few relaxed atomic adds per batch, none per sample.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use stoker_data::source::Source;

/// Nanoseconds worker threads spent filling batches, summed over threads (the
/// process has one worker pool, the daemon's).
static WORKER_BUSY_NS: AtomicU64 = AtomicU64::new(0);

/// Time worker threads spent filling batches since the process started, summed over threads.
pub fn worker_busy() -> Duration {
    Duration::from_nanos(WORKER_BUSY_NS.load(Ordering::Relaxed))
}

/// Counters of one dataset (by its config name or ad-hoc path), shared by
/// every stream reading it and kept after they close, so they only grow.
#[derive(Debug, Default)]
pub struct DatasetCounters {
    batches: AtomicU64,
    bytes: AtomicU64,
    decode_ns: AtomicU64,
    errors: AtomicU64,
    skips: Mutex<Skips>,
}

/// Samples skipped (`on_error = "skip"`) summed over the sources a dataset
/// has had: a source counts its own, and may be replaced by a fresh one.
#[derive(Debug, Default)]
struct Skips {
    total: u64,
    /// Each source seen and its count when last looked at. The `Weak` keeps
    /// the address from being reused (not the source open).
    seen: Vec<(Weak<dyn Source>, u64)>,
}

impl DatasetCounters {
    /// Records the thread-time one batch fill spent reading and decoding samples.
    pub fn filled(&self, busy: Duration) {
        let ns = u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: statistics, ordered with nothing.
        self.decode_ns.fetch_add(ns, Ordering::Relaxed);
        WORKER_BUSY_NS.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records a batch made ready for delivery: `bytes` of samples, or a failure.
    pub fn completed(&self, bytes: u64, failed: bool) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.errors.fetch_add(1, Ordering::Relaxed);
        } else {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Adds what `source` skipped since it was last looked at. Called at
    /// every scrape for open streams and when a stream closes, so skips of a
    /// source that goes away are counted before it does.
    pub fn observe_skips(&self, source: &Arc<dyn Source>) {
        let now = source.skipped();
        let mut skips = self.skips.lock().unwrap_or_else(|e| e.into_inner());
        let weak = Arc::downgrade(source);
        match skips.seen.iter().position(|(w, _)| w.ptr_eq(&weak)) {
            Some(i) => {
                let before = std::mem::replace(&mut skips.seen[i].1, now);
                skips.total = skips.total.saturating_add(now.saturating_sub(before));
            }
            None => {
                skips.total = skips.total.saturating_add(now);
                skips.seen.push((weak, now));
            }
        }
        skips.seen.retain(|(w, _)| w.strong_count() > 0);
    }

    /// Batches made ready (failed ones included).
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Bytes of samples in the batches that did not fail.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Failed batches.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Worker thread-time spent reading and decoding this dataset's samples.
    pub fn decode(&self) -> Duration {
        Duration::from_nanos(self.decode_ns.load(Ordering::Relaxed))
    }

    /// Samples skipped over every source the dataset has had.
    pub fn skipped(&self) -> u64 {
        self.skips.lock().unwrap_or_else(|e| e.into_inner()).total
    }
}

/// Adds the time from its creation to its drop to a nanosecond counter
/// (one part of a batch fill, however it ends).
#[derive(Debug)]
pub struct Timer<'a> {
    total_ns: &'a AtomicU64,
    started: Instant,
}

impl<'a> Timer<'a> {
    /// Starts timing into `total_ns`.
    pub fn new(total_ns: &'a AtomicU64) -> Timer<'a> {
        Timer { total_ns, started: Instant::now() }
    }
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Lets a repeated warning through at most once per [`WarnLimit::EVERY`],
/// counting the rest; shared by worker threads without a lock.
#[derive(Debug, Default)]
pub struct WarnLimit {
    /// When the last warning was let through, in milliseconds since the
    /// process's first call plus one (0: none yet).
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnLimit {
    /// The shortest interval between two warnings let through.
    pub const EVERY: Duration = Duration::from_secs(10);

    /// `Some(n)` when a warning may be logged now (`n` were suppressed since
    /// the last one), `None` when it is counted instead.
    pub fn allow(&self) -> Option<u64> {
        static START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
        let now = u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.allow_at(now.saturating_add(1))
    }

    fn allow_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        let every = u64::try_from(Self::EVERY.as_millis()).unwrap_or(u64::MAX);
        let due = last == 0 || now_ms.saturating_sub(last) >= every;
        // One thread wins the slot; the others count themselves suppressed.
        if due && self.last_ms.compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warn_limit_lets_one_through_per_interval_and_counts_the_rest() {
        let limit = WarnLimit::default();
        assert_eq!(limit.allow_at(1), Some(0));
        let let_through = std::thread::scope(|s| {
            let threads: Vec<_> =
                (0..4).map(|_| s.spawn(|| (0..250).filter(|_| limit.allow_at(5_000).is_some()).count())).collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum::<usize>()
        });
        assert_eq!(let_through, 0, "within the interval nothing more is let through");
        assert_eq!(limit.allow_at(10_001), Some(1000), "the next interval's first says how many were not");
        assert_eq!(limit.allow_at(10_002), None);
        assert!(WarnLimit::default().allow().is_some(), "the first one ever is let through");
    }
}
