//! Stream unit tests over small in-memory sources: ordering, failures,
//! epochs, growth, budgets and rescans.

use stoker_proto::ctrl::Consumer;
use stoker_proto::{DType, LayoutLimits};

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use stoker_data::source::{FieldOut, FieldSpec, SampleRef, Source, SourceError};

/// One scalar u64 field: each source below writes the sample's index into it.
fn u64_field() -> FieldSpec {
    FieldSpec { name: "x".into(), origin: "test".into(), dtype: DType::U64, shape: vec![], max_sample_bytes: None }
}

/// A stream over `source` (`samples` long, unshuffled, one rank) with a
/// ring of `depth` slots of `batch` rows, filled by `threads` workers,
/// starting at `(epoch, step)`, with a client budget of `budget` bytes.
#[allow(clippy::too_many_arguments)]
fn start_with(
    source: Arc<dyn Source>,
    dataset: &str,
    samples: u64,
    batch: u64,
    depth: u32,
    threads: usize,
    (epoch, step): (u64, u64),
    budget: u64,
) -> Arc<Stream> {
    let fields: Vec<_> = source.fields().iter().map(|f| f.decl()).collect();
    let layout = BatchLayout::new(batch, fields, &LayoutLimits::DEFAULT).unwrap();
    let ring = Ring::create(dataset, &layout, depth).unwrap();
    let budgets = [Budget::new(budget), Budget::new(u64::MAX), Budget::new(u64::MAX)];
    let reserved = Mutex::new(vec![budgets[0].reserve(ring.bytes()).unwrap()]);
    let shm =
        Shm { ring, control: ControlPage::create(dataset).unwrap(), budgets, reserved, limits: LayoutLimits::DEFAULT };
    let pool = Arc::new(rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap());
    let meta = StreamMeta {
        id: 1,
        client_id: 1,
        pid: 1,
        dataset: dataset.into(),
        rank: 0,
        world_size: 1,
        counters: Default::default(),
        rescan: false,
        cursor: None,
        share: None,
    };
    let sampler = Sampler::new(samples, 0, 1, batch, false, 0, false);
    Stream::start(meta, source, sampler, shm, pool, epoch, step)
}

fn start(
    source: Arc<dyn Source>,
    dataset: &str,
    samples: u64,
    batch: u64,
    depth: u32,
    threads: usize,
    at: (u64, u64),
) -> Arc<Stream> {
    start_with(source, dataset, samples, batch, depth, threads, at, u64::MAX)
}

/// A client of a stream's control page, as the real one behaves.
struct Client {
    stream: Arc<Stream>,
    q: Consumer,
}

impl Client {
    fn new(stream: &Arc<Stream>) -> Client {
        Client { stream: stream.clone(), q: Consumer::default() }
    }

    /// The next record, waiting up to 10 s.
    fn try_take(&mut self, wait: Duration) -> Option<(u32, Record)> {
        let deadline = Instant::now() + wait;
        loop {
            let control = self.stream.control().control();
            if let Some(got) = self.q.poll(control).unwrap() {
                return Some(got);
            }
            if self.q.take_wake(control) {
                self.stream.wake();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn take(&mut self) -> Record {
        match self.try_take(Duration::from_secs(60)) {
            Some((_, rec)) => rec,
            None => {
                let st = self.stream.lock();
                let states: Vec<_> = st.slots.iter().map(|s| format!("{:?}", s.state)).collect();
                let c = self.stream.control().control();
                panic!(
                    "no record within 60 s: epoch {} step {} produce {}:{} published {} exhausted {:?} slots {states:?} \
                     waiting {} released {} reclaimed {} consumed {}",
                    st.epoch,
                    st.next_deliver,
                    st.produce_epoch,
                    st.next_produce,
                    st.publisher.published(),
                    st.exhausted,
                    c.daemon.daemon_waiting.load(Ordering::Relaxed),
                    c.client.released.load(Ordering::Relaxed),
                    c.daemon.reclaimed.load(Ordering::Relaxed),
                    c.client.consumed.load(Ordering::Relaxed),
                )
            }
        }
    }

    fn give_back(&mut self, slot: u32) {
        if self.q.release(self.stream.control().control(), slot).expect("room in the release queue") {
            self.stream.wake();
        }
    }

    fn set_epoch(&mut self, epoch: u64, step: u64) {
        let skip_to = self.stream.set_epoch(epoch, step).unwrap();
        self.q.skip_to(self.stream.control().control(), skip_to);
    }

    /// The value written in row `row` of a batch record.
    fn value(&self, rec: &Record, row: u64) -> u64 {
        let (ring, index) = {
            let st = self.stream.lock();
            self.stream.ring_of(&st, rec.slot as usize)
        };
        let layout = ring.layout();
        let at = layout.slot_offset(index) + layout.fields[0].offset + row * 8;
        let fd = ring.fd().try_clone_to_owned().unwrap();
        let mut buf = [0u8; 8];
        rustix::io::pread(&fd, &mut buf, at).unwrap();
        u64::from_ne_bytes(buf)
    }
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
    let mut client = Client::new(&stream);
    let mut outcomes = Vec::new();
    loop {
        let rec = client.take();
        match rec.kind {
            RecordKind::Batch => {
                assert_eq!(rec.step, outcomes.len() as u64);
                // Sample indices are in order without shuffling: row r of step s is 4s + r.
                for row in 0..4 {
                    assert_eq!(client.value(&rec, row), 4 * rec.step + row);
                }
                outcomes.push(Ok(rec.step));
                client.give_back(rec.slot);
            }
            RecordKind::Failed => {
                let Fetched::Failed { message, .. } = stream.fetch(client.q.next_seq() - 1) else {
                    panic!("a failed record has its message")
                };
                outcomes.push(Err(message));
            }
            RecordKind::EndOfEpoch => break,
            other => panic!("unexpected {other:?}"),
        }
    }
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
    let rec = client.take();
    assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 1, 0));
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

#[test]
fn a_release_publishes_nothing_out_of_order() {
    let (gate, stream) = gated_stream(2);
    let mut client = Client::new(&stream);
    gate.allow(2);
    let first = client.take();
    assert_eq!(first.step, 0);
    // Batch 1 is filling (gated): a release from another thread frees a
    // slot but publishes nothing.
    let client = std::sync::Mutex::new(client);
    std::thread::scope(|s| {
        s.spawn(|| client.lock().unwrap().give_back(first.slot));
    });
    let mut client = client.into_inner().unwrap();
    assert!(client.try_take(Duration::from_millis(30)).is_none(), "a record before its batch was ready");
    gate.allow(2);
    let rec = client.take();
    assert_eq!((rec.epoch, rec.step), (0, 1));
}

#[test]
fn records_stay_in_step_order_whatever_the_clients_release_order() {
    let (gate, stream) = gated_stream(4);
    gate.allow(u64::MAX / 2);
    let mut client = Client::new(&stream);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut held: Vec<Record> = Vec::new();
    let mut steps = Vec::new();
    while steps.len() < 8 * 3 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Hold up to three batches, releasing a random one of them now and then.
        if held.len() == 3 || (!held.is_empty() && rng.is_multiple_of(3)) {
            let b = held.swap_remove((rng >> 8) as usize % held.len());
            client.give_back(b.slot);
            continue;
        }
        let rec = client.take();
        match rec.kind {
            RecordKind::Batch => {
                steps.push((rec.epoch, rec.step));
                held.push(rec);
            }
            RecordKind::EndOfEpoch => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let want: Vec<(u64, u64)> = (0..3).flat_map(|e| (0..8).map(move |s| (e, s))).collect();
    assert_eq!(steps, want);
    assert!(!stream.release(held[0].slot + 100), "a slot id that does not exist is refused");
}

#[test]
fn a_failed_batch_names_its_step_and_the_stream_moves_past_it() {
    let source = Arc::new(Panicky { fields: vec![u64_field()], panic_on: 9 });
    let stream = start(source, "p", 32, 4, 2, 1, (3, 1));
    let mut client = Client::new(&stream);
    let rec = client.take();
    assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 3, 1));
    client.give_back(rec.slot);
    let rec = client.take();
    assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Failed, 3, 2));
    assert!(matches!(stream.fetch(client.q.next_seq() - 1), Fetched::Failed { epoch: 3, step: 2, .. }));
    assert!(matches!(stream.fetch(client.q.next_seq() - 1), Fetched::Unknown), "a message is fetched once");
    let rec = client.take();
    assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 3, 3));
}

/// Fails every sample, as a dataset of values that do not decode does.
#[derive(Debug)]
struct AllBad {
    fields: Vec<FieldSpec>,
}

impl Source for AllBad {
    fn len(&self) -> u64 {
        4 * (u64::from(RECORDS) + 8)
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(&self, sample: SampleRef, _out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        Err(SourceError::Limit(format!("sample {} does not decode", sample.index)))
    }
}

#[test]
fn a_taken_failed_record_keeps_its_message_while_the_queue_fills_again() {
    // The client takes a failed record, which frees a place in the queue;
    // the daemon fills the whole queue with more failures before the
    // client's Fetch arrives. The taken record's message is still there
    // (it was dropped: "no record with details to fetch").
    let samples = 4 * (u64::from(RECORDS) + 8);
    let stream = start(Arc::new(AllBad { fields: vec![u64_field()] }), "allbad", samples, 4, 2, 1, (0, 0));
    let mut client = Client::new(&stream);
    for _ in 0..3 {
        let rec = client.take();
        assert_eq!(rec.kind, RecordKind::Failed);
        let seq = client.q.next_seq() - 1;
        let deadline = Instant::now() + Duration::from_secs(60);
        // The client's side of the protocol, without taking records.
        while stream.lock().publisher.has_room(stream.control().control()) {
            assert!(Instant::now() < deadline, "the daemon did not fill the queue");
            if client.q.take_wake(stream.control().control()) {
                stream.wake();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let Fetched::Failed { step, message, .. } = stream.fetch(seq) else {
            panic!("the message of taken record {seq} was dropped")
        };
        assert_eq!(step, rec.step);
        assert!(message.contains(&format!("sample {} does not decode", 4 * rec.step)), "{message}");
    }
}

#[test]
fn a_failed_batch_frees_its_slot_for_the_next_while_the_client_holds_the_rest() {
    // Depth 2: the client holds batch 0 while batch 1 fails; the failed
    // batch's slot must be filled again at once (nothing else will ask).
    let source = Arc::new(Panicky { fields: vec![u64_field()], panic_on: 5 });
    let stream = start(source, "held", 32, 4, 2, 1, (0, 0));
    let mut client = Client::new(&stream);
    let held = client.take();
    assert_eq!((held.kind, held.step), (RecordKind::Batch, 0));
    let failed = client.take();
    assert_eq!((failed.kind, failed.step), (RecordKind::Failed, 1));
    let next = client.try_take(Duration::from_secs(20)).expect("batch 2 while batch 0 is held").1;
    assert_eq!((next.kind, next.step), (RecordKind::Batch, 2));
    client.give_back(held.slot);
}

#[test]
fn set_epoch_discards_prefetch_reclaims_untaken_records_and_resumes_at_the_step() {
    let (gate, stream) = gated_stream(3);
    gate.allow(u64::MAX / 2);
    let mut client = Client::new(&stream);
    let rec = client.take();
    client.give_back(rec.slot);
    // Let the ring fill up with published, untaken batches.
    std::thread::sleep(Duration::from_millis(50));
    client.set_epoch(5, 6);
    let rec = client.take();
    assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 5, 6));
    assert_eq!(client.value(&rec, 0), 12);
    // Every slot came back: the untaken ones were reclaimed, so holding
    // this one the other two still fill.
    let next = client.take();
    assert_eq!((next.epoch, next.step), (5, 7));
    assert!(stream.set_epoch(5, 9).is_err(), "a step past the epoch is refused");
    assert_eq!(stream.status().depth, 3, "no extra segment was needed");
}

#[test]
fn holding_every_slot_grows_the_ring_and_shrinks_it_back() {
    let (gate, stream) = gated_stream(2);
    gate.allow(u64::MAX / 2);
    let mut client = Client::new(&stream);
    let mut held = Vec::new();
    for step in 0..8 {
        let rec = client.take();
        assert_eq!((rec.kind, rec.step), (RecordKind::Batch, step));
        assert_eq!(client.value(&rec, 1), 2 * step + 1);
        held.push(rec);
    }
    assert!(stream.status().depth >= 8, "the ring grew to hold 8 batches");
    assert!(stream.segment(held[7].slot).is_some(), "extra slots have segments");
    for rec in held.drain(..) {
        client.give_back(rec.slot);
    }
    // Back to the epoch's end and beyond, with nothing held.
    for _ in 0..20 {
        let rec = client.take();
        if rec.kind == RecordKind::Batch {
            client.give_back(rec.slot);
        }
    }
    let live = stream.status().depth;
    assert!(live <= 2 * 2 + 1, "extras beyond depth free ones are destroyed, {live} slots live");
}

#[test]
fn past_the_budget_holding_every_slot_is_an_error_until_one_comes_back() {
    let source = Arc::new(Gated {
        fields: vec![u64_field()],
        allowed: std::sync::Mutex::new(u64::MAX / 2),
        opened: std::sync::Condvar::new(),
    });
    // The ring (header + 2 slots of one page each) and one more slot.
    let stream = start_with(source, "tight", 16, 2, 2, 1, (0, 0), 3 * 4096 + 4096 + 4096);
    let mut client = Client::new(&stream);
    let held: Vec<Record> = (0..3).map(|_| client.take()).collect();
    assert!(held.iter().all(|r| r.kind == RecordKind::Batch));
    let rec = client.take();
    assert_eq!(rec.kind, RecordKind::Exhausted);
    let seq = client.q.next_seq() - 1;
    match stream.fetch(seq) {
        Fetched::Exhausted(message) => {
            assert!(message.contains("max_ring_bytes_per_client"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Asking again is answered again, at once.
    let again = client.take();
    assert_eq!(again.kind, RecordKind::Exhausted);
    // One batch comes back: the stream resumes.
    client.give_back(held[0].slot);
    assert!(matches!(stream.fetch(client.q.next_seq() - 1), Fetched::Resumed));
    let rec = client.take();
    assert_eq!((rec.kind, rec.step), (RecordKind::Batch, 3));
}

/// `len` samples, each writing its index plus `add`.
#[derive(Debug)]
struct Offset {
    fields: Vec<FieldSpec>,
    len: u64,
    add: u64,
}

impl Source for Offset {
    fn len(&self) -> u64 {
        self.len
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        out[0].data.copy_from_slice(&(sample.index + self.add).to_ne_bytes());
        Ok(())
    }
}

#[test]
fn a_rescan_stream_stops_at_the_epoch_end_and_reads_the_rescanned_source_from_set_epoch() {
    let old: Arc<dyn Source> = Arc::new(Offset { fields: vec![u64_field()], len: 8, add: 0 });
    let fields: Vec<_> = old.fields().iter().map(|f| f.decl()).collect();
    let layout = BatchLayout::new(2, fields, &LayoutLimits::DEFAULT).unwrap();
    let shm = Shm {
        ring: Ring::create("rescan", &layout, 3).unwrap(),
        control: ControlPage::create("rescan").unwrap(),
        budgets: [Budget::new(u64::MAX), Budget::new(u64::MAX), Budget::new(u64::MAX)],
        reserved: Mutex::new(Vec::new()),
        limits: LayoutLimits::DEFAULT,
    };
    let pool = Arc::new(rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap());
    let meta = StreamMeta {
        id: 1,
        client_id: 1,
        pid: 1,
        dataset: "rescan".into(),
        rank: 0,
        world_size: 1,
        counters: Default::default(),
        rescan: true,
        cursor: None,
        share: None,
    };
    let was = Generation { fingerprint: 1, files: 1, samples: 8 };
    let sampler = Sampler::new(8, 0, 1, 2, false, 0, false);
    let stream = Stream::start_at(meta, (old, sampler, was), shm, pool, 0, 0);
    let mut client = Client::new(&stream);
    for step in 0..4 {
        let rec = client.take();
        assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 0, step));
        client.give_back(rec.slot);
    }
    assert_eq!(client.take().kind, RecordKind::EndOfEpoch);
    // Nothing of epoch 1 is made from the old file list.
    assert!(client.try_take(Duration::from_millis(100)).is_none(), "a batch read ahead across a rescan");
    assert!(stream.needs_rescan(1) && !stream.needs_rescan(0));
    let new: Arc<dyn Source> = Arc::new(Offset { fields: vec![u64_field()], len: 12, add: 1000 });
    let now = Generation { fingerprint: 2, files: 2, samples: 12 };
    let sampler = Sampler::new(12, 0, 1, 2, false, 0, false);
    let skip_to = stream.set_epoch_with(1, 0, Some((new, sampler, now))).unwrap();
    client.q.skip_to(stream.control().control(), skip_to);
    assert_eq!((stream.sampler().batches_per_epoch(), stream.generation()), (6, now));
    assert!(!stream.needs_rescan(1));
    for step in 0..6 {
        let rec = client.take();
        assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 1, step));
        assert_eq!([client.value(&rec, 0), client.value(&rec, 1)], [1000 + 2 * step, 1001 + 2 * step]);
        client.give_back(rec.slot);
    }
    assert_eq!(client.take().kind, RecordKind::EndOfEpoch);
}

#[test]
fn the_last_epoch_a_u64_counts_ends_like_any_other() {
    // Epoch 2^64 - 1 had its batches and never its end: the counter wrapped.
    let source: Arc<dyn Source> = Arc::new(Offset { fields: vec![u64_field()], len: 8, add: 0 });
    for first in [u64::MAX - 1, u64::MAX] {
        let stream = start(source.clone(), "last", 8, 4, 3, 2, (first, 0));
        let mut client = Client::new(&stream);
        for epoch in first..=u64::MAX {
            for step in 0..2 {
                let rec = client.take();
                assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, epoch, step));
                client.give_back(rec.slot);
            }
            let end = client.take();
            assert_eq!((end.kind, end.epoch), (RecordKind::EndOfEpoch, epoch));
        }
        assert!(client.try_take(Duration::from_millis(100)).is_none(), "nothing after the last epoch");
        // set_epoch still moves it anywhere.
        let skip_to = stream.set_epoch(3, 1).unwrap();
        client.q.skip_to(stream.control().control(), skip_to);
        let rec = client.take();
        assert_eq!((rec.kind, rec.epoch, rec.step), (RecordKind::Batch, 3, 1));
        stream.close(false);
    }
}

#[test]
fn one_wake_does_bounded_work_whatever_the_release_queue_holds() {
    // A client kept its queue full of slot ids it does not hold: one 6-byte
    // `Wake` processed millions of them with the stream lock held.
    let source: Arc<dyn Source> = Arc::new(Offset { fields: vec![u64_field()], len: 64, add: 0 });
    let stream = start(source, "bogus", 64, 4, 2, 1, (0, 0));
    let mut client = Client::new(&stream);
    // Hold both slots: no fill runs, so the stream waits for word from the client.
    let held = [client.take(), client.take()];
    let stop = std::sync::atomic::AtomicBool::new(false);
    let pushed = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut q = Consumer::default();
            while !stop.load(Ordering::Relaxed) {
                if q.release(stream.control().control(), 9_999).is_some() {
                    pushed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let mut wakes = 0;
        while wakes < 20 || pushed.load(Ordering::Relaxed) < 100_000 {
            // Entries the daemon took from the queue during this one wake.
            let reclaimed = || stream.control().control().daemon.reclaimed.load(Ordering::Acquire);
            let before = reclaimed();
            stream.wake();
            let processed = u64::from(reclaimed().wrapping_sub(before));
            assert!(
                processed <= 2 * u64::from(stoker_proto::ctrl::RELEASES),
                "one wake took {processed} bogus releases"
            );
            wakes += 1;
        }
        stop.store(true, Ordering::Relaxed);
    });
    // The stream still works: the held batches are the first two, in order.
    assert_eq!([held[0].step, held[1].step], [0, 1]);
    stream.close(false);
}

/// Ragged values of `len` u8s for sample i: i+1 bytes, except sample 5: `big` bytes.
#[derive(Debug)]
struct Ragged {
    fields: Vec<FieldSpec>,
    big: u64,
}

impl Source for Ragged {
    fn len(&self) -> u64 {
        16
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let n = if sample.index == 5 { self.big } else { sample.index + 1 };
        let room = out[0].data.len() as u64;
        if n > room {
            return Err(SourceError::Oversize { field: 0, bytes: n, message: format!("{n} > {room}") });
        }
        out[0].data[..n as usize].fill(sample.index as u8);
        out[0].shape.as_mut().unwrap()[0] = n;
        Ok(())
    }
}

#[test]
fn a_batch_too_large_for_a_slot_gets_a_segment_of_its_own() {
    let field = FieldSpec {
        name: "v".into(),
        origin: "test".into(),
        dtype: DType::U8,
        shape: vec![0],
        max_sample_bytes: Some(64),
    };
    let source = Arc::new(Ragged { fields: vec![field], big: 50 * 64 });
    let stream = start(source, "ragged", 16, 4, 2, 1, (0, 0));
    let mut client = Client::new(&stream);
    for step in 0..4 {
        let rec = client.take();
        assert_eq!((rec.kind, rec.step), (RecordKind::Batch, step));
        let (ring, index) = {
            let st = stream.lock();
            stream.ring_of(&st, rec.slot as usize)
        };
        // Shapes and bytes as written, including the big one.
        assert_eq!(
            ring.batch_bytes(index, rec.rows),
            (0..4).map(|r| if 4 * step + r == 5 { 3200 } else { 4 * step + r + 1 }).sum::<u64>()
        );
        if step == 1 {
            assert!(rec.slot >= 2 && rec.segment != 0, "batch 1 (sample 5) is in an extra segment: {rec:?}");
            assert!(ring.layout().slot_bytes > stream.layout().slot_bytes);
        } else {
            assert!(rec.slot < 2, "{rec:?}");
        }
        client.give_back(rec.slot);
    }
    assert!(stream.status().depth <= 3, "the oversize segment is gone after its release");
}
