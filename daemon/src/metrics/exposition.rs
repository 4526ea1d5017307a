//! The exposition of one scrape: values gathered from [`Metrics`]' counters
//! and the daemon's state at scrape time ([`Scrape`]), encoded by
//! `prometheus-client`'s OpenMetrics text encoder (`Metrics::render`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use super::{Metrics, Scrape};
use crate::stream::counters::{DatasetCounters, worker_busy};
use stoker_data::cache::CacheStats;
use stoker_data::source::Source;

/// The OpenMetrics text format `prometheus-client` encodes.
pub(super) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Metrics {
    /// The OpenMetrics text of one scrape.
    pub fn render(&self, scrape: Scrape) -> String {
        let snapshot = self.snapshot(scrape);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(snapshot));
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
            // Writing into a String fails only if an encoder refuses a value.
            tracing::error!(error = %e, "cannot encode the metrics");
            text.clear();
        }
        text
    }

    /// The values one scrape reports: the per-dataset counters, every open
    /// source's open files and skips, and each stream's status.
    fn snapshot(&self, scrape: Scrape) -> Snapshot {
        let datasets: Vec<(String, Arc<DatasetCounters>)> = self
            .datasets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let counters: HashMap<&str, &Arc<DatasetCounters>> = datasets.iter().map(|(k, v)| (k.as_str(), v)).collect();
        // Every open source once (streams share them), with its dataset.
        // A rescanned stream's source is its current one: taken once here.
        let stream_sources: Vec<(&str, Arc<dyn Source>)> =
            scrape.streams.iter().map(|s| (s.meta().dataset.as_str(), s.source())).collect();
        let mut sources: HashMap<*const (), (&str, &Arc<dyn Source>)> = HashMap::new();
        for (label, source) in &scrape.sources {
            sources.insert(Arc::as_ptr(source).cast(), (label.as_str(), source));
        }
        for (label, source) in &stream_sources {
            sources.insert(Arc::as_ptr(source).cast(), (label, source));
        }
        let mut open_files: BTreeMap<&str, u64> = BTreeMap::new();
        for (label, source) in sources.values() {
            if let Some(c) = counters.get(label) {
                c.observe_skips(source);
            }
            *open_files.entry(label).or_default() += source.open_files();
        }
        let mut rows: BTreeMap<String, DatasetRow> = BTreeMap::new();
        for (label, c) in &datasets {
            rows.insert(
                label.clone(),
                DatasetRow {
                    batches: c.batches(),
                    bytes: c.bytes(),
                    decode_s: c.decode().as_secs_f64(),
                    errors: c.errors(),
                    skipped: c.skipped(),
                    open_files: 0,
                },
            );
        }
        for (label, n) in open_files {
            rows.entry(label.to_string()).or_default().open_files = n;
        }
        let streams = scrape
            .streams
            .iter()
            .map(|s| {
                let st = s.status();
                let (uid, job) = scrape.client_jobs.get(&st.client_id).cloned().unwrap_or((u32::MAX, None));
                StreamRow {
                    uid,
                    job: job.unwrap_or_else(|| "-".into()),
                    id: st.id,
                    dataset: st.dataset,
                    rank: st.rank,
                    batches: st.batches,
                    bytes: s.bytes_delivered(),
                    wait_s: st.wait_s,
                    filled: st.slots_filled,
                    leased: st.slots_leased,
                    depth: st.depth,
                }
            })
            .collect();
        Snapshot {
            streams,
            datasets: rows,
            cache: scrape.cache,
            sample_cache: scrape.sample_cache,
            clients: scrape.clients,
            worker_threads: scrape.worker_threads,
            worker_busy_s: worker_busy().as_secs_f64(),
            hdf5_helpers: scrape.hdf5_helpers,
            fills: scrape.fills,
        }
    }
}

/// One stream's values at scrape time.
#[derive(Debug)]
struct StreamRow {
    /// Its client's uid.
    uid: u32,
    /// Its client's job (`$SLURM_JOB_ID` as the client sent it), `-` if none.
    job: String,
    id: u64,
    dataset: String,
    rank: u64,
    batches: u64,
    bytes: u64,
    wait_s: f64,
    filled: u64,
    leased: u64,
    depth: u64,
}

/// One dataset's values at scrape time.
#[derive(Debug, Default)]
struct DatasetRow {
    batches: u64,
    bytes: u64,
    decode_s: f64,
    errors: u64,
    skipped: u64,
    open_files: u64,
}

/// Everything one scrape reports, encoded by [`Collector::encode`].
#[derive(Debug)]
struct Snapshot {
    streams: Vec<StreamRow>,
    datasets: BTreeMap<String, DatasetRow>,
    cache: CacheStats,
    sample_cache: CacheStats,
    clients: u64,
    worker_threads: u64,
    worker_busy_s: f64,
    hdf5_helpers: (u64, u64),
    fills: (u64, u64),
}

/// A dataset's label: a named dataset's name; an ad-hoc dataset's path never
/// (anyone who can reach the endpoint would learn other users' file paths,
/// which `stoker status` shows only to their owner and root), but
/// `adhoc-` and the FNV-1a hash of the path, hex.
fn dataset_label(value: &str) -> String {
    if value.starts_with('/') {
        let mut h = stoker_proto::hash::Fnv1a::default();
        h.write(value.as_bytes());
        return format!("adhoc-{:016x}", h.finish());
    }
    label(value)
}

/// A label value as the text format needs it: `prometheus-client` writes
/// label values verbatim, and dataset labels are paths a client chose.
fn label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Values a family can hold (counters are non-negative).
#[derive(Debug, Clone, Copy)]
enum Value {
    Int(u64),
    Float(f64),
}

/// Encodes one metric family: `rows` of (labels, value).
fn family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    rows: impl IntoIterator<Item = (L, Value)>,
) -> std::fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, unit, kind)?;
    for (labels, value) in rows {
        put(metric.encode_family(&labels)?, kind, value)?;
    }
    Ok(())
}

/// Encodes a family of one series without labels.
fn single(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    value: Value,
) -> std::fmt::Result {
    put(encoder.encode_descriptor(name, help, unit, kind)?, kind, value)
}

/// Writes one series' `value` as a `kind` (counter or gauge).
fn put(metric: MetricEncoder<'_>, kind: MetricType, value: Value) -> std::fmt::Result {
    match (kind, value) {
        (MetricType::Counter, Value::Int(v)) => ConstCounter::new(v).encode(metric),
        (MetricType::Counter, Value::Float(v)) => ConstCounter::new(v).encode(metric),
        (_, Value::Int(v)) => ConstGauge::new(v).encode(metric),
        (_, Value::Float(v)) => ConstGauge::new(v).encode(metric),
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        self.encode_daemon(&mut encoder)?;
        self.encode_caches(&mut encoder)?;
        self.encode_datasets(&mut encoder)?;
        self.encode_streams(&mut encoder)
    }
}

impl Snapshot {
    /// The daemon-wide families: build, clients, streams, worker pool.
    fn encode_daemon(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        use Value::{Float, Int};
        family(
            e,
            "stoker_build_info",
            "Version of the running daemon (always 1)",
            None,
            Gauge,
            [([("version", env!("CARGO_PKG_VERSION"))], Int(1))],
        )?;
        single(e, "stoker_clients", "Client connections open", None, Gauge, Int(self.clients))?;
        single(e, "stoker_streams", "Streams open", None, Gauge, Int(self.streams.len() as u64))?;
        single(e, "stoker_worker_threads", "Threads in the worker pool", None, Gauge, Int(self.worker_threads))?;
        single(
            e,
            "stoker_worker_busy",
            "Thread-time the worker pool spent filling batches (utilisation = rate / stoker_worker_threads)",
            Some(&Unit::Seconds),
            Counter,
            Float(self.worker_busy_s),
        )?;
        single(
            e,
            "stoker_hdf5_helpers",
            "HDF5 helper processes running (one per user with open ad-hoc HDF5 datasets, one for named ones)",
            None,
            Gauge,
            Int(self.hdf5_helpers.0),
        )?;
        single(
            e,
            "stoker_hdf5_helper_deaths",
            "HDF5 helper processes killed after a crash, a hang or a protocol error (a crafted or corrupt file)",
            None,
            Counter,
            Int(self.hdf5_helpers.1),
        )?;
        single(
            e,
            "stoker_fills_in_flight",
            "Batch fills queued on or running in the worker pool (at most four per worker per user)",
            None,
            Gauge,
            Int(self.fills.0),
        )?;
        single(
            e,
            "stoker_streams_waiting",
            "Streams waiting for their user's turn to fill (their user has its share of fills in flight)",
            None,
            Gauge,
            Int(self.fills.1),
        )?;
        Ok(())
    }

    /// The chunk cache's and the sample cache's families.
    fn encode_caches(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        use Value::Int;
        let c = &self.cache;
        single(e, "stoker_chunk_cache_hits", "Chunk cache lookups that found their chunk", None, Counter, Int(c.hits))?;
        single(e, "stoker_chunk_cache_misses", "Chunk cache lookups that did not", None, Counter, Int(c.misses))?;
        single(e, "stoker_chunk_cache", "Decoded chunk bytes held", Some(&Unit::Bytes), Gauge, Int(c.bytes))?;
        single(
            e,
            "stoker_chunk_cache_capacity",
            "Chunk cache capacity ([cache] chunk_bytes)",
            Some(&Unit::Bytes),
            Gauge,
            Int(c.capacity),
        )?;
        single(e, "stoker_chunk_cache_entries", "Chunks held", None, Gauge, Int(c.entries))?;
        single(e, "stoker_chunk_cache_evictions", "Chunks evicted to make room", None, Counter, Int(c.evictions))?;
        let c = &self.sample_cache;
        single(
            e,
            "stoker_sample_cache_hits",
            "Sample cache lookups that found their value",
            None,
            Counter,
            Int(c.hits),
        )?;
        single(e, "stoker_sample_cache_misses", "Sample cache lookups that did not", None, Counter, Int(c.misses))?;
        single(e, "stoker_sample_cache", "Decoded sample bytes held", Some(&Unit::Bytes), Gauge, Int(c.bytes))?;
        single(
            e,
            "stoker_sample_cache_capacity",
            "Sample cache capacity ([cache] sample_bytes)",
            Some(&Unit::Bytes),
            Gauge,
            Int(c.capacity),
        )?;
        single(e, "stoker_sample_cache_entries", "Decoded samples held", None, Gauge, Int(c.entries))?;
        single(e, "stoker_sample_cache_evictions", "Samples evicted to make room", None, Counter, Int(c.evictions))?;
        Ok(())
    }

    /// The families labelled by dataset.
    fn encode_datasets(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        use Value::{Float, Int};
        let datasets: Vec<(String, &DatasetRow)> = self.datasets.iter().map(|(k, v)| (dataset_label(k), v)).collect();
        let per_dataset = |f: fn(&DatasetRow) -> Value| {
            datasets.iter().map(move |(name, row)| ([("dataset", name.as_str())], f(row)))
        };
        family(e, "stoker_dataset_batches", "Batches produced", None, Counter, per_dataset(|r| Int(r.batches)))?;
        family(
            e,
            "stoker_dataset_read",
            "Sample bytes read and decoded into batches",
            Some(&Unit::Bytes),
            Counter,
            per_dataset(|r| Int(r.bytes)),
        )?;
        family(
            e,
            "stoker_dataset_decode",
            "Worker thread-time spent reading and decoding samples",
            Some(&Unit::Seconds),
            Counter,
            per_dataset(|r| Float(r.decode_s)),
        )?;
        family(
            e,
            "stoker_dataset_errors",
            "Batches that failed (a sample could not be read or decoded; the daemon's log names it)",
            None,
            Counter,
            per_dataset(|r| Int(r.errors)),
        )?;
        family(
            e,
            "stoker_dataset_skipped_samples",
            "Bad samples replaced by the next good one (on_error = \"skip\")",
            None,
            Counter,
            per_dataset(|r| Int(r.skipped)),
        )?;
        family(
            e,
            "stoker_dataset_open_files",
            "Files the dataset holds open (HDF5 files, LMDB environments)",
            None,
            Gauge,
            per_dataset(|r| Int(r.open_files)),
        )?;
        Ok(())
    }

    /// The families labelled by stream (with its dataset, rank, Slurm job
    /// and uid: `sum by (slurm_job)` follows one job across its streams; not
    /// `job`, which Prometheus sets to the scrape job's name).
    fn encode_streams(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        use Value::{Float, Int};
        let streams: Vec<([(&str, String); 5], &StreamRow)> = self
            .streams
            .iter()
            .map(|s| {
                (
                    [
                        ("stream", s.id.to_string()),
                        ("dataset", dataset_label(&s.dataset)),
                        ("rank", s.rank.to_string()),
                        ("slurm_job", s.job.clone()),
                        ("uid", s.uid.to_string()),
                    ],
                    s,
                )
            })
            .collect();
        let per_stream = |f: fn(&StreamRow) -> Value| streams.iter().map(move |(labels, row)| (labels.clone(), f(row)));
        family(
            e,
            "stoker_stream_batches",
            "Batches delivered to the client",
            None,
            Counter,
            per_stream(|r| Int(r.batches)),
        )?;
        family(
            e,
            "stoker_stream_delivered",
            "Sample bytes delivered to the client",
            Some(&Unit::Bytes),
            Counter,
            per_stream(|r| Int(r.bytes)),
        )?;
        family(
            e,
            "stoker_stream_data_wait",
            "Time the client waited for a batch that was not ready (its data stall)",
            Some(&Unit::Seconds),
            Counter,
            per_stream(|r| Float(r.wait_s)),
        )?;
        family(
            e,
            "stoker_stream_slots_filled",
            "Ring slots filled, waiting for the client",
            None,
            Gauge,
            per_stream(|r| Int(r.filled)),
        )?;
        family(
            e,
            "stoker_stream_slots_leased",
            "Ring slots the client holds",
            None,
            Gauge,
            per_stream(|r| Int(r.leased)),
        )?;
        family(e, "stoker_stream_slots", "Ring slots ([ring] depth)", None, Gauge, per_stream(|r| Int(r.depth)))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("/data/a\"b\\c\nd.h5"), "/data/a\\\"b\\\\c\\nd.h5");
        assert_eq!(label("plain"), "plain");
    }
}
