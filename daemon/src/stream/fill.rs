//! Filling slots: which step goes to which free slot, splitting a batch into
//! row ranges across the worker pool, reading each sample into the slot
//! (a panic fails that batch only), growing the ring when the client holds
//! every slot, and completing the batch into a record.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rayon::prelude::*;
use stoker_proto::ctrl::{Record, RecordKind};
use stoker_proto::{BatchLayout, FIELD_ALIGN};

use super::counters::Timer;
use crate::ring::Ring;
use stoker_data::source::{SampleRef, SourceError};

use super::*;

/// What producing one batch came to.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    /// The first error, naming file, field and index.
    error: Option<String>,
    /// Per field, the largest value that did not fit its ragged row (0: none).
    oversize: Vec<u64>,
    /// The first oversize message, for an error if no bigger slot can be had.
    oversize_message: Option<String>,
}

impl Stream {
    /// Creates an extra one-slot segment of `layout` within both budgets and
    /// returns its slot id.
    pub(super) fn grow(&self, st: &mut State, layout: &BatchLayout, oversize: bool) -> Result<usize, StreamError> {
        let bytes = layout.checked_ring_bytes(1).ok_or(StreamError::SlotTooLarge { bytes: layout.slot_bytes })?;
        let [client, user, daemon] = &self.shm.budgets;
        let mine =
            client.reserve(bytes).map_err(|used| StreamError::ClientBudget { bytes, used, limit: client.limit() })?;
        let users = user.reserve(bytes).map_err(|used| StreamError::UserBudget { bytes, used, limit: user.limit() })?;
        let ours =
            daemon.reserve(bytes).map_err(|used| StreamError::DaemonBudget { bytes, used, limit: daemon.limit() })?;
        let ring = Ring::create(&format!("stoker-stream-{}-extra", self.meta.id), layout, 1)
            .map_err(|source| StreamError::Shm { bytes, source })?;
        let generation = st.next_segment;
        st.next_segment = st.next_segment.wrapping_add(1).max(1);
        let segment = Some(Segment { ring, generation, oversize, _reserved: [mine, users, ours] });
        let id = match st.slots.iter().position(|s| s.state == SlotState::Absent) {
            Some(id) => id,
            None => {
                st.slots.push(Slot { state: SlotState::Absent, segment: None });
                st.slots.len() - 1
            }
        };
        st.slots[id] = Slot { state: SlotState::Free, segment };
        Ok(id)
    }

    /// Starts fills for the next steps while slots can be had.
    pub(super) fn fill(self: &Arc<Self>, st: &mut State) {
        let batches = self.sampler().batches_per_epoch();
        let depth = self.shm.ring.depth() as usize;
        while !st.closed && batches > 0 {
            // Read ahead `depth` batches, no more: extra slots are for what
            // the client holds, not for deeper prefetch (so they come back).
            let running = st
                .slots
                .iter()
                .filter(|s| matches!(s.state, SlotState::Filling { .. } | SlotState::Ready { .. }))
                .count();
            if running.saturating_add(self.untaken_batches(st).0 as usize) >= depth {
                return;
            }
            // Standard slots first, then extras of the standard layout.
            let free = st.slots.iter().enumerate().position(|(id, s)| {
                s.state == SlotState::Free && (id < depth || s.segment.as_ref().is_some_and(|seg| !seg.oversize))
            });
            let slot = match free {
                Some(slot) => slot,
                None => {
                    let busy =
                        st.slots.iter().any(|s| matches!(s.state, SlotState::Filling { .. } | SlotState::Ready { .. }));
                    let untaken = st.publisher.untaken(self.shm.control.control());
                    if busy || untaken > 0 || st.exhausted.is_some() {
                        // The client has batches to take or fills are running: wait for it.
                        return;
                    }
                    // The client holds every slot: grow, or say it cannot.
                    match self.grow(st, &self.shm.ring.layout().clone(), false) {
                        Ok(slot) => slot,
                        Err(why) => {
                            tracing::debug!(stream = self.meta.id, %why, "cannot grow the ring");
                            let record = Record {
                                kind: RecordKind::Exhausted,
                                slot: 0,
                                segment: 0,
                                epoch: st.epoch,
                                step: st.next_deliver,
                                rows: 0,
                            };
                            if st.publisher.has_room(self.shm.control.control()) {
                                st.exhausted = Some(self.publish_record(st, record));
                            }
                            return;
                        }
                    }
                }
            };
            if st.next_produce >= batches {
                if self.meta.rescan {
                    // The next epoch's files are matched at its `set_epoch`.
                    return;
                }
                // The last epoch a u64 counts has no next one to read ahead into.
                let Some(next) = st.produce_epoch.checked_add(1) else { return };
                st.produce_epoch = next;
                st.next_produce = 0;
            }
            let step = st.next_produce;
            // This user's (and within it this stream's) share of fills in flight.
            if let Some((gate, uid)) = &self.meta.share
                && !gate.try_start(*uid, self.meta.id, self)
            {
                return;
            }
            if !self.spawn_fill(st, slot, st.produce_epoch, step) {
                self.fill_not_started();
                return;
            }
            st.next_produce += 1;
        }
    }

    /// Starts filling slot `id` with batch `step` of `epoch`. False if a
    /// discarded fill still holds the slot (its completion frees the slot
    /// and fills again).
    pub(super) fn spawn_fill(self: &Arc<Self>, st: &mut State, id: usize, epoch: u64, step: u64) -> bool {
        let rows = self.sampler().rows(step);
        let (ring, index) = self.ring_of(st, id);
        let Some(writer) = ring.writer(index, 0..rows) else {
            return false;
        };
        st.slots[id].state = SlotState::Filling { generation: st.generation, epoch, step };
        self.sync_cursor(st);
        let generation = st.generation;
        let stream = self.clone();
        let parts = self.pool.current_num_threads();
        self.pool.spawn(move || {
            // Backstop: a panic outside the per-sample guard in `produce`.
            let produced = catch_unwind(AssertUnwindSafe(|| stream.produce(writer, parts, epoch, generation, step)));
            let outcome = produced.unwrap_or_else(|payload| {
                let why = panic_message(&*payload);
                tracing::error!(stream = stream.meta.id, dataset = %stream.meta.dataset, epoch, step, %why, "batch fill panicked");
                Outcome {
                    error: Some(format!(
                        "dataset {}: producing batch {step} of epoch {epoch} failed inside the daemon (a bug: {why}); \
                         the batch is skipped and the stream goes on — please report this with the daemon's log",
                        stream.meta.dataset
                    )),
                    ..Outcome::default()
                }
            });
            stream.complete(id, generation, epoch, step, rows, outcome);
            if let Some((gate, uid)) = &stream.meta.share {
                // No lock is held here: the streams whose turn it is fill now.
                gate.fill_finished(*uid, stream.meta.id).wake();
            }
        });
        true
    }

    /// Gives back a fill counted by the fair gate that did not start. Called
    /// under the stream's lock, so the streams whose turn it is are woken
    /// from the pool.
    fn fill_not_started(self: &Arc<Self>) {
        if let Some((gate, uid)) = &self.meta.share {
            let woken = gate.fill_finished(*uid, self.meta.id);
            if !woken.is_empty() {
                self.pool.spawn(move || woken.wake());
            }
        }
    }

    /// Fills one batch; runs on the worker pool.
    pub(super) fn produce(
        &self,
        writer: crate::ring::SlotWriter,
        parts: usize,
        epoch: u64,
        generation: u64,
        step: u64,
    ) -> Outcome {
        // The source and sampler this fill's generation was started with.
        let (source, sampler) = {
            let st = self.lock();
            if st.closed || st.generation != generation {
                return Outcome::default();
            }
            (self.source(), self.sampler())
        };
        let perm = sampler.permutation(epoch);
        let seed = sampler.seed();
        let failure = Mutex::new(None::<String>);
        let nfields = source.fields().len();
        let oversize = Mutex::new((vec![0u64; nfields], None::<String>));
        let busy = AtomicU64::new(0);
        writer.split(parts, MIN_ROWS_PER_TASK).into_par_iter().for_each(|mut part| {
            // This user's share of the workers (a lone user has them all).
            let _permit = self.meta.share.as_ref().map(|(gate, uid)| gate.enter(*uid, self.meta.id));
            let _timer = Timer::new(&busy);
            for row in part.rows() {
                let index = sampler.index(perm.as_ref(), step, row);
                let sample = SampleRef { index, seed, epoch };
                let read = catch_unwind(AssertUnwindSafe(|| source.read_sample(sample, &mut part.row_mut(row))));
                let error = match read {
                    Ok(Ok(())) => continue,
                    Ok(Err(SourceError::Oversize { field, bytes, message })) if field < nfields => {
                        // Measure the rest of the batch: it is produced again in a slot sized for it.
                        let mut big = oversize.lock().unwrap_or_else(|e| e.into_inner());
                        big.0[field] = big.0[field].max(bytes);
                        big.1.get_or_insert(message);
                        continue;
                    }
                    Ok(Err(e)) => {
                        if let Some(suppressed) = self.failures_logged.allow() {
                            tracing::warn!(stream = self.meta.id, error = %e, suppressed, "batch failed");
                        }
                        e.to_string()
                    }
                    Err(payload) => {
                        let why = panic_message(&*payload);
                        let fields: Vec<&str> = source.fields().iter().map(|f| f.name.as_str()).collect();
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
        let (oversize, oversize_message) = oversize.into_inner().unwrap_or_else(|e| e.into_inner());
        Outcome { error: failure.into_inner().unwrap_or_else(|e| e.into_inner()), oversize, oversize_message }
    }

    pub(super) fn complete(
        self: &Arc<Self>,
        id: usize,
        generation: u64,
        epoch: u64,
        step: u64,
        rows: u64,
        outcome: Outcome,
    ) {
        let mut st = self.lock();
        let current = st.generation == generation && !st.closed;
        if !current {
            // An extra whose segment is gone (oversized, or the stream closed) stays gone.
            let extra = id >= self.shm.ring.depth() as usize;
            let keep = st.slots[id].segment.as_ref().is_some_and(|s| !s.oversize);
            st.slots[id] = if extra && !keep {
                Slot { state: SlotState::Absent, segment: None }
            } else {
                Slot { state: SlotState::Free, segment: st.slots[id].segment.take() }
            };
            self.advance(&mut st);
            return;
        }
        let Outcome { mut error, oversize, oversize_message } = outcome;
        if error.is_none() && oversize.iter().any(|&b| b > 0) {
            st.slots[id].state = SlotState::Free;
            if st.slots[id].segment.as_ref().is_some_and(|s| s.oversize) {
                st.slots[id] = Slot { state: SlotState::Absent, segment: None };
            }
            match self.oversize_layout(&oversize).and_then(|layout| self.grow(&mut st, &layout, true)) {
                Ok(big) => {
                    // It takes the place of the fill that just ended (outside the cap).
                    if let Some((gate, uid)) = &self.meta.share {
                        gate.fill_started(*uid, self.meta.id);
                    }
                    if self.spawn_fill(&mut st, big, epoch, step) {
                        tracing::debug!(
                            stream = self.meta.id,
                            epoch,
                            step,
                            "batch produced again in a slot of its own"
                        );
                        return;
                    }
                    self.fill_not_started();
                    error = Some("a fresh segment was already claimed (a bug)".to_string());
                }
                Err(why) => {
                    error = Some(format!("{}; {why}", oversize_message.unwrap_or_default()));
                }
            }
        }
        // No writer holds the slot any more: its shape table is final.
        let bytes = if error.is_none() {
            let (ring, index) = self.ring_of(&st, id);
            ring.batch_bytes(index, rows)
        } else {
            0
        };
        self.meta.counters.completed(bytes, error.is_some());
        st.slots[id].state = SlotState::Ready { generation, epoch, step, rows, error };
        self.sync_cursor(&st);
        self.advance(&mut st);
    }

    /// Puts the cache cursor at the oldest batch a fill of this generation is
    /// still producing (fills run concurrently and finish out of order: the
    /// chunks the oldest reads are needed now, not next epoch), or at the next
    /// batch to produce when none runs.
    pub(super) fn sync_cursor(&self, st: &State) {
        let Some(cursor) = &self.meta.cursor else { return };
        let oldest = st
            .slots
            .iter()
            .filter_map(|s| match s.state {
                SlotState::Filling { generation, epoch, step } if generation == st.generation => Some((epoch, step)),
                _ => None,
            })
            .min()
            .unwrap_or((st.produce_epoch, st.next_produce));
        cursor.set(oldest.0, oldest.1);
    }

    /// The stream's layout with the ragged rooms `oversize` asks for.
    pub(super) fn oversize_layout(&self, oversize: &[u64]) -> Result<BatchLayout, StreamError> {
        let layout = self.shm.ring.layout();
        let source = self.source();
        let decls = source.fields().iter().zip(oversize).map(|(f, &need)| {
            let mut decl = f.decl();
            if need > 0 {
                let room = need.checked_next_multiple_of(FIELD_ALIGN).unwrap_or(need);
                decl.max_sample_bytes = Some(decl.max_sample_bytes.unwrap_or(0).max(room));
            }
            decl
        });
        Ok(BatchLayout::new(layout.batch_size, decls, &self.shm.limits)?)
    }
}
