//! A stream: one client's pass over one dataset, for one rank. Owns the ring,
//! schedules batch fills on the worker pool in step order as slots free up,
//! and hands filled slots to the client strictly in step order.
//!
//! Slot life cycle: `Free → Filling → Ready → Leased → Free`. Production runs
//! ahead across the epoch boundary into epoch + 1 (what the next `set_epoch`
//! almost always asks for), so a new epoch starts with a full ring. A fill
//! belongs to a *generation*; a `SetEpoch` to any other position, and `Close`,
//! start a new one, so fills still running for the old position are discarded
//! when they finish instead of being delivered. Decoding runs on the rayon
//! worker pool, never on tokio threads.
//!
//! A panic while producing a batch (a bug in a decoder, say) is caught on the
//! worker: that batch fails with an error naming the dataset and sample, the
//! stream goes on with the next one, and the process never aborts (rayon
//! aborts on a panic that escapes a spawned job).

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use stoker_proto::{BatchLayout, BatchReady, StreamStatus};

use crate::metrics::DatasetCounters;
use crate::ring::Ring;
use crate::sampler::Sampler;
use crate::source::{SampleRef, Source};

/// Rows below which a batch is not split further across workers.
const MIN_ROWS_PER_TASK: u64 = 8;
/// Window over which `stoker status` computes rates.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// Nanoseconds worker threads spent filling batches, summed over threads (the
/// process has one worker pool, the daemon's).
static WORKER_BUSY_NS: AtomicU64 = AtomicU64::new(0);

/// Time worker threads spent filling batches since the process started, summed over threads.
pub fn worker_busy() -> Duration {
    Duration::from_nanos(WORKER_BUSY_NS.load(Ordering::Relaxed))
}

/// Adds the time from its creation to its drop to [`WORKER_BUSY_NS`].
struct Busy(Instant);

impl Drop for Busy {
    fn drop(&mut self) {
        let ns = u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        WORKER_BUSY_NS.fetch_add(ns, Ordering::Relaxed);
    }
}

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
}

/// One open stream.
#[derive(Debug)]
pub struct Stream {
    meta: StreamMeta,
    source: Arc<dyn Source>,
    sampler: Sampler,
    ring: Arc<Ring>,
    pool: Arc<rayon::ThreadPool>,
    state: Mutex<State>,
    /// Woken whenever a slot changes state.
    changed: tokio::sync::Notify,
    opened: Instant,
}

#[derive(Debug)]
struct State {
    /// Epoch and step of the next batch to deliver.
    epoch: u64,
    next_deliver: u64,
    /// Epoch and step of the next batch to start filling.
    produce_epoch: u64,
    next_produce: u64,
    generation: u64,
    slots: Vec<Slot>,
    closed: bool,
    delivered: u64,
    bytes_delivered: u64,
    wait: Duration,
    /// Since when the client's `Next` has waited, while it waits.
    waiting_since: Option<Instant>,
    recent: VecDeque<(Instant, u64)>,
}

#[derive(Debug, Clone, PartialEq)]
enum Slot {
    Free,
    Filling { generation: u64 },
    Ready { generation: u64, epoch: u64, step: u64, rows: u64, error: Option<String> },
    Leased,
}

/// What a client's `Next` gets.
#[derive(Debug)]
pub enum Delivery {
    /// A filled slot, now leased.
    Batch(BatchReady),
    /// The epoch has no more batches.
    EndOfEpoch(u64),
    /// Batch `step` of `epoch` could not be produced (the stream moves past
    /// it); the message names file, field and index.
    Failed {
        /// Epoch of the failed batch.
        epoch: u64,
        /// Its position in the epoch.
        step: u64,
        /// What went wrong.
        message: String,
    },
    /// The client holds every slot, so nothing can be produced.
    Exhausted(u32),
    /// The stream was closed.
    Closed,
}

impl Stream {
    /// Creates the stream positioned at (`epoch`, `step`) and starts filling its ring.
    pub fn start(
        meta: StreamMeta,
        source: Arc<dyn Source>,
        sampler: Sampler,
        ring: Arc<Ring>,
        pool: Arc<rayon::ThreadPool>,
        epoch: u64,
        step: u64,
    ) -> Arc<Stream> {
        let depth = ring.depth() as usize;
        let stream = Arc::new(Stream {
            meta,
            source,
            sampler,
            ring,
            pool,
            state: Mutex::new(State {
                epoch,
                next_deliver: step,
                produce_epoch: epoch,
                next_produce: step,
                generation: 0,
                slots: vec![Slot::Free; depth],
                closed: false,
                delivered: 0,
                bytes_delivered: 0,
                wait: Duration::ZERO,
                waiting_since: None,
                recent: VecDeque::new(),
            }),
            changed: tokio::sync::Notify::new(),
            opened: Instant::now(),
        });
        let mut st = stream.lock();
        stream.fill(&mut st);
        drop(st);
        stream
    }

    /// Owner and dataset.
    pub fn meta(&self) -> &StreamMeta {
        &self.meta
    }

    /// The dataset it reads.
    pub fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    /// The ring (its fd is sent to the client).
    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Where fields lie in each slot.
    pub fn layout(&self) -> &BatchLayout {
        self.ring.layout()
    }

    /// Sample bytes delivered so far (for metrics).
    pub fn bytes_delivered(&self) -> u64 {
        self.lock().bytes_delivered
    }

    /// The sampler (batch counts).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent-enough state for
        // status and shutdown; keep serving rather than poisoning the stream.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the next batch (or end of epoch, or an error) is available.
    /// Cancel-safe: nothing changes unless it returns.
    pub async fn next(self: &Arc<Self>) -> Delivery {
        let started = Instant::now();
        let mut waited = false;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(delivery) = self.poll_next(if waited { Some(started) } else { None }) {
                return delivery;
            }
            waited = true;
            notified.await;
        }
    }

    fn poll_next(self: &Arc<Self>, waiting_since: Option<Instant>) -> Option<Delivery> {
        let mut st = self.lock();
        st.waiting_since = None;
        if st.closed {
            return Some(Delivery::Closed);
        }
        if st.next_deliver >= self.sampler.batches_per_epoch() {
            // Production already runs ahead into the next epoch.
            let ended = st.epoch;
            st.epoch += 1;
            st.next_deliver = 0;
            return Some(Delivery::EndOfEpoch(ended));
        }
        let (generation, epoch, step) = (st.generation, st.epoch, st.next_deliver);
        let ready = st
            .slots
            .iter()
            .position(|s| matches!(s, Slot::Ready { generation: g, epoch: e, step: k, .. } if (*g, *e, *k) == (generation, epoch, step)));
        let Some(slot) = ready else {
            if st.slots.iter().all(|s| *s == Slot::Leased) {
                return Some(Delivery::Exhausted(self.ring.depth()));
            }
            st.waiting_since = Some(waiting_since.unwrap_or_else(Instant::now));
            return None;
        };
        let Slot::Ready { rows, error, .. } = std::mem::replace(&mut st.slots[slot], Slot::Leased) else {
            unreachable!("matched Ready above");
        };
        st.next_deliver += 1;
        if let Some(since) = waiting_since {
            st.wait += since.elapsed();
        }
        if let Some(message) = error {
            st.slots[slot] = Slot::Free;
            self.fill(&mut st);
            return Some(Delivery::Failed { epoch, step, message });
        }
        let now = Instant::now();
        st.delivered += 1;
        let bytes = self.ring.batch_bytes(slot as u32, rows);
        st.bytes_delivered = st.bytes_delivered.saturating_add(bytes);
        st.recent.push_back((now, bytes));
        while st.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            st.recent.pop_front();
        }
        Some(Delivery::Batch(BatchReady { stream: self.meta.id, epoch, step, slot: slot as u32, rows }))
    }

    /// The client gave `slot` back. Returns false if it did not hold it.
    pub fn release(self: &Arc<Self>, slot: u32) -> bool {
        let mut st = self.lock();
        match st.slots.get_mut(slot as usize) {
            Some(s @ Slot::Leased) => {
                *s = Slot::Free;
                self.fill(&mut st);
                drop(st);
                self.changed.notify_waiters();
                true
            }
            _ => false,
        }
    }

    /// Moves to `epoch`, resuming at `step`. A no-op when the stream is already
    /// there (as after an epoch ends); otherwise prefetched batches are dropped.
    pub fn set_epoch(self: &Arc<Self>, epoch: u64, step: u64) -> Result<(), String> {
        let batches = self.sampler.batches_per_epoch();
        if step > batches {
            return Err(format!(
                "step {step} is past the end of the epoch ({batches} batches per epoch for this rank)"
            ));
        }
        let mut st = self.lock();
        if (st.epoch, st.next_deliver) == (epoch, step) {
            return Ok(());
        }
        st.generation += 1;
        st.epoch = epoch;
        st.next_deliver = step;
        st.produce_epoch = epoch;
        st.next_produce = step;
        for s in &mut st.slots {
            if matches!(s, Slot::Ready { .. }) {
                *s = Slot::Free;
            }
        }
        self.fill(&mut st);
        drop(st);
        self.changed.notify_waiters();
        Ok(())
    }

    /// Stops producing; running fills finish and are discarded.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.generation += 1;
        drop(st);
        self.meta.counters.observe_skips(&self.source);
        self.changed.notify_waiters();
    }

    /// Starts fills for the next steps while free slots remain.
    fn fill(self: &Arc<Self>, st: &mut State) {
        let batches = self.sampler.batches_per_epoch();
        while !st.closed && batches > 0 {
            let Some(slot) = st.slots.iter().position(|s| *s == Slot::Free) else {
                return;
            };
            if st.next_produce >= batches {
                st.produce_epoch += 1;
                st.next_produce = 0;
            }
            let step = st.next_produce;
            let rows = self.sampler.rows(step);
            let Some(writer) = self.ring.writer(slot as u32, 0..rows) else {
                // Only reachable if a discarded fill still holds the slot; its
                // completion frees the slot and calls fill again.
                return;
            };
            st.slots[slot] = Slot::Filling { generation: st.generation };
            st.next_produce += 1;
            let (epoch, generation) = (st.produce_epoch, st.generation);
            let stream = self.clone();
            let parts = self.pool.current_num_threads();
            self.pool.spawn(move || {
                // Backstop: a panic outside the per-sample guard in `produce`.
                let produced = catch_unwind(AssertUnwindSafe(|| stream.produce(writer, parts, epoch, generation, step)));
                let error = produced.unwrap_or_else(|payload| {
                    let why = panic_message(&*payload);
                    tracing::error!(stream = stream.meta.id, dataset = %stream.meta.dataset, epoch, step, %why, "batch fill panicked");
                    Some(format!(
                        "dataset {}: producing batch {step} of epoch {epoch} failed inside the daemon (a bug: {why}); \
                         the batch is skipped and the stream goes on — please report this with the daemon's log",
                        stream.meta.dataset
                    ))
                });
                stream.complete(slot, generation, epoch, step, rows, error);
            });
        }
    }

    /// Fills one batch; runs on the worker pool. Returns the first error.
    fn produce(
        &self,
        writer: crate::ring::SlotWriter,
        parts: usize,
        epoch: u64,
        generation: u64,
        step: u64,
    ) -> Option<String> {
        {
            let st = self.lock();
            if st.closed || st.generation != generation {
                return None;
            }
        }
        let perm = self.sampler.permutation(epoch);
        let seed = self.sampler.seed();
        let failure = Mutex::new(None::<String>);
        let busy = AtomicU64::new(0);
        writer.split(parts, MIN_ROWS_PER_TASK).into_par_iter().for_each(|mut part| {
            let _timer = crate::metrics::Timer::new(&busy);
            let _busy = Busy(Instant::now());
            for row in part.rows() {
                let index = self.sampler.index(perm.as_ref(), step, row);
                let sample = SampleRef { index, seed, epoch };
                let read = catch_unwind(AssertUnwindSafe(|| self.source.read_sample(sample, &mut part.row_mut(row))));
                let error = match read {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => {
                        tracing::warn!(stream = self.meta.id, error = %e, "batch failed");
                        e.to_string()
                    }
                    Err(payload) => {
                        let why = panic_message(&*payload);
                        let fields: Vec<&str> = self.source.fields().iter().map(|f| f.name.as_str()).collect();
                        tracing::error!(stream = self.meta.id, dataset = %self.meta.dataset, index, %why, "reading a sample panicked");
                        format!(
                            "dataset {}: reading sample {index} (fields {fields:?}, epoch {epoch}, batch {step}) failed \
                             inside the daemon (a bug: {why}); the batch is skipped and the stream goes on — please \
                             report this with the daemon's log",
                            self.meta.dataset
                        )
                    }
                };
                failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(error);
                return;
            }
        });
        self.meta.counters.filled(Duration::from_nanos(busy.into_inner()));
        failure.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    fn complete(
        self: &Arc<Self>,
        slot: usize,
        generation: u64,
        epoch: u64,
        step: u64,
        rows: u64,
        error: Option<String>,
    ) {
        let mut st = self.lock();
        let current = st.generation == generation && !st.closed;
        if current {
            // No writer holds the slot any more: its shape table is final.
            let bytes = if error.is_none() { self.ring.batch_bytes(slot as u32, rows) } else { 0 };
            self.meta.counters.completed(bytes, error.is_some());
        }
        st.slots[slot] = if current { Slot::Ready { generation, epoch, step, rows, error } } else { Slot::Free };
        if !current {
            self.fill(&mut st);
        }
        drop(st);
        self.changed.notify_waiters();
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
        // A wait still in progress counts: a client stuck right now is stalled.
        let wait_s = (st.wait + st.waiting_since.map_or(Duration::ZERO, |t| now.duration_since(t))).as_secs_f64();
        let open_s = now.duration_since(self.opened).as_secs_f64();
        StreamStatus {
            id: self.meta.id,
            client_id: self.meta.client_id,
            pid: self.meta.pid,
            dataset: self.meta.dataset.clone(),
            rank: self.meta.rank,
            world_size: self.meta.world_size,
            epoch: st.epoch,
            step: st.next_deliver,
            batches_per_epoch: self.sampler.batches_per_epoch(),
            batches: st.delivered,
            batches_per_s,
            mb_per_s,
            wait_s,
            open_s,
            stall_percent: percent(wait_s, open_s),
            slots_filled: st
                .slots
                .iter()
                .filter(|s| matches!(s, Slot::Ready { generation, .. } if *generation == st.generation))
                .count() as u64,
            slots_leased: st.slots.iter().filter(|s| **s == Slot::Leased).count() as u64,
            depth: u64::from(self.ring.depth()),
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
mod tests {
    use stoker_proto::{DType, LayoutLimits};

    use super::*;
    use crate::source::{FieldOut, FieldSpec, SourceError};

    /// One scalar u64 field: each source below writes the sample's index into it.
    fn u64_field() -> FieldSpec {
        FieldSpec { name: "x".into(), origin: "test".into(), dtype: DType::U64, shape: vec![], max_sample_bytes: None }
    }

    /// A stream over `source` (`samples` long, unshuffled, one rank) with a
    /// ring of `depth` slots of `batch` rows, filled by `threads` workers,
    /// starting at `(epoch, step)`.
    fn start(
        source: Arc<dyn Source>,
        dataset: &str,
        samples: u64,
        batch: u64,
        depth: u32,
        threads: usize,
        (epoch, step): (u64, u64),
    ) -> Arc<Stream> {
        let fields: Vec<_> = source.fields().iter().map(|f| f.decl()).collect();
        let layout = BatchLayout::new(batch, fields, &LayoutLimits::DEFAULT).unwrap();
        let ring = Ring::create(dataset, &layout, depth).unwrap();
        let pool = Arc::new(rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap());
        let meta = StreamMeta {
            id: 1,
            client_id: 1,
            pid: 1,
            dataset: dataset.into(),
            rank: 0,
            world_size: 1,
            counters: Default::default(),
        };
        let sampler = Sampler::new(samples, 0, 1, batch, false, 0, false);
        Stream::start(meta, source, sampler, ring, pool, epoch, step)
    }

    /// Writes each sample's index; panics on one of them, as a buggy decoder would.
    #[derive(Debug)]
    struct Panicky {
        fields: Vec<FieldSpec>,
        panic_on: u64,
    }

    impl Source for Panicky {
        fn len(&self) -> u64 {
            32
        }

        fn fields(&self) -> &[FieldSpec] {
            &self.fields
        }

        fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
            if sample.index == self.panic_on {
                let shape: Vec<u64> = vec![];
                // A typical bug: indexing past a shape the value did not have.
                let _ = shape[sample.index as usize];
            }
            out[0].data.copy_from_slice(&sample.index.to_ne_bytes());
            Ok(())
        }
    }

    #[test]
    fn a_panicking_source_fails_one_batch_and_the_stream_goes_on() {
        let source = Arc::new(Panicky { fields: vec![u64_field()], panic_on: 5 });
        let stream = start(source, "panicky", 32, 4, 3, 2, (0, 0));
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut outcomes = Vec::new();
        runtime.block_on(async {
            loop {
                match stream.next().await {
                    Delivery::Batch(b) => {
                        assert_eq!(b.step, outcomes.len() as u64);
                        // Sample indices are in order without shuffling: row r of step s is 4s + r.
                        let bytes = stream.ring().batch_bytes(b.slot, b.rows);
                        assert_eq!(bytes, 4 * 8);
                        outcomes.push(Ok(b.step));
                        assert!(stream.release(b.slot));
                    }
                    Delivery::Failed { message, .. } => outcomes.push(Err(message)),
                    Delivery::EndOfEpoch(0) => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
        });
        assert_eq!(outcomes.len(), 8, "{outcomes:?}");
        for (step, outcome) in outcomes.iter().enumerate() {
            match (step, outcome) {
                (1, Err(message)) => {
                    for needle in ["panicky", "sample 5", "\"x\"", "index out of bounds", "report"] {
                        assert!(message.contains(needle), "{needle} missing from: {message}");
                    }
                }
                (1, Ok(_)) => panic!("batch 1 holds sample 5 and must fail"),
                (_, Ok(s)) => assert_eq!(*s, step as u64),
                (_, Err(message)) => panic!("batch {step} failed: {message}"),
            }
        }
        // The pool survived: a second epoch is produced as well.
        runtime.block_on(async {
            assert!(matches!(stream.next().await, Delivery::Batch(BatchReady { epoch: 1, step: 0, .. })));
        });
    }

    /// Writes each sample's index, but only as far as the test lets it: a
    /// deterministic stand-in for a slow read.
    #[derive(Debug)]
    struct Gated {
        fields: Vec<FieldSpec>,
        allowed: std::sync::Mutex<u64>,
        opened: std::sync::Condvar,
    }

    impl Gated {
        fn allow(&self, samples: u64) {
            *self.allowed.lock().unwrap() += samples;
            self.opened.notify_all();
        }
    }

    impl Source for Gated {
        fn len(&self) -> u64 {
            16
        }

        fn fields(&self) -> &[FieldSpec] {
            &self.fields
        }

        fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
            let mut allowed = self.allowed.lock().unwrap();
            while *allowed == 0 {
                allowed = self.opened.wait(allowed).unwrap();
            }
            *allowed -= 1;
            out[0].data.copy_from_slice(&sample.index.to_ne_bytes());
            Ok(())
        }
    }

    fn gated_stream(depth: u32) -> (Arc<Gated>, Arc<Stream>) {
        let source = Arc::new(Gated {
            fields: vec![u64_field()],
            allowed: std::sync::Mutex::new(0),
            opened: std::sync::Condvar::new(),
        });
        let stream = start(source.clone(), "gated", 16, 2, depth, 1, (0, 0));
        (source, stream)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    #[test]
    fn a_release_while_next_waits_does_not_answer_the_next() {
        let (gate, stream) = gated_stream(2);
        let rt = runtime();
        gate.allow(2);
        let first = match rt.block_on(stream.next()) {
            Delivery::Batch(b) => b,
            other => panic!("expected batch 0, got {other:?}"),
        };
        assert_eq!(first.step, 0);
        // Batch 1 is filling (gated); a Next waits for it.
        let waiting = rt.spawn({
            let stream = stream.clone();
            async move { stream.next().await }
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiting.is_finished());
        // A release from another thread frees a slot but does not satisfy the wait.
        let releaser = std::thread::spawn({
            let stream = stream.clone();
            move || stream.release(first.slot)
        });
        assert!(releaser.join().unwrap());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiting.is_finished(), "the waiting Next returned before its batch was ready");
        gate.allow(2);
        match rt.block_on(waiting).unwrap() {
            Delivery::Batch(b) => assert_eq!((b.epoch, b.step), (0, 1)),
            other => panic!("expected batch 1, got {other:?}"),
        }
    }

    #[test]
    fn deliveries_stay_in_step_order_whatever_the_clients_release_order() {
        let (gate, stream) = gated_stream(4);
        gate.allow(u64::MAX / 2);
        let rt = runtime();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut held: Vec<BatchReady> = Vec::new();
        let mut steps = Vec::new();
        while steps.len() < 8 * 3 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Hold up to three batches, releasing a random one of them now and then.
            if held.len() == 3 || (!held.is_empty() && rng.is_multiple_of(3)) {
                let b = held.swap_remove((rng >> 8) as usize % held.len());
                assert!(stream.release(b.slot));
                assert!(!stream.release(b.slot), "a slot is released once");
                continue;
            }
            match rt.block_on(stream.next()) {
                Delivery::Batch(b) => {
                    steps.push((b.epoch, b.step));
                    held.push(b);
                }
                Delivery::EndOfEpoch(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        let want: Vec<(u64, u64)> = (0..3).flat_map(|e| (0..8).map(move |s| (e, s))).collect();
        assert_eq!(steps, want);
    }

    #[test]
    fn a_failed_batch_names_its_step_and_the_stream_moves_past_it() {
        let source = Arc::new(Panicky { fields: vec![u64_field()], panic_on: 9 });
        let stream = start(source, "p", 32, 4, 2, 1, (3, 1));
        let rt = runtime();
        match rt.block_on(stream.next()) {
            Delivery::Batch(b) => {
                assert_eq!((b.epoch, b.step), (3, 1));
                stream.release(b.slot);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(rt.block_on(stream.next()), Delivery::Failed { epoch: 3, step: 2, .. }));
        assert!(matches!(rt.block_on(stream.next()), Delivery::Batch(BatchReady { epoch: 3, step: 3, .. })));
    }

    #[test]
    fn set_epoch_discards_prefetch_and_resumes_at_the_step() {
        let (gate, stream) = gated_stream(3);
        gate.allow(u64::MAX / 2);
        let rt = runtime();
        let Delivery::Batch(b) = rt.block_on(stream.next()) else { panic!("no batch") };
        assert!(stream.release(b.slot));
        stream.set_epoch(5, 6).unwrap();
        match rt.block_on(stream.next()) {
            Delivery::Batch(b) => assert_eq!((b.epoch, b.step), (5, 6)),
            other => panic!("{other:?}"),
        }
        assert!(stream.set_epoch(5, 9).is_err(), "a step past the epoch is refused");
    }
}
