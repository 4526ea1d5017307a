//! Prometheus metrics: the counters the batch-fill path keeps per dataset,
//! the exposition of one scrape (values gathered from the daemon's state at
//! scrape time, encoded by `prometheus-client`'s OpenMetrics text encoder),
//! and the small HTTP/1.1 responder that serves it on `GET /metrics`
//! (`[metrics] listen`).
//!
//! The counters themselves live with the fill path that feeds them
//! ([`crate::stream::counters`]): per dataset in [`Metrics`] (kept after its
//! streams close), per stream in the stream (a series that ends with its
//! stream). This module only reads them.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::stream::Stream;
use crate::stream::counters::{DatasetCounters, worker_busy};
use stoker_data::cache::CacheStats;
use stoker_data::source::Source;

/// Datasets whose counters are kept; beyond it, those no stream uses are forgotten
/// (ad-hoc datasets are labelled by their path, so their number is the clients' choice).
const MAX_DATASETS: usize = 256;
/// Scrape connections served at once; more are closed unanswered.
const MAX_HTTP_CONNECTIONS: usize = 16;
/// Largest request head (request line and headers) read.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Time a scraper gets to send its request, and again to take the response.
const HTTP_DEADLINE: Duration = Duration::from_secs(5);
/// The OpenMetrics text format `prometheus-client` encodes.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The daemon's metric counters (the rest is read from its state at scrape time).
#[derive(Debug, Default)]
pub struct Metrics {
    datasets: Mutex<BTreeMap<String, Arc<DatasetCounters>>>,
}

/// The daemon state one scrape reports besides [`Metrics`]' own counters.
#[derive(Debug)]
pub struct Scrape {
    /// Open streams.
    pub streams: Vec<Arc<Stream>>,
    /// Open sources with their dataset label (streams' sources are added to these).
    pub sources: Vec<(String, Arc<dyn Source>)>,
    /// The chunk cache.
    pub cache: CacheStats,
    /// The sample cache.
    pub sample_cache: CacheStats,
    /// Connected clients.
    pub clients: u64,
    /// Threads in the worker pool.
    pub worker_threads: u64,
}

impl Metrics {
    /// The counters of `dataset`, created on first use.
    pub fn dataset(&self, dataset: &str) -> Arc<DatasetCounters> {
        let mut all = self.datasets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = all.get(dataset) {
            return c.clone();
        }
        if all.len() >= MAX_DATASETS {
            // Forget a dataset no stream holds (its series ends).
            if let Some(idle) = all.iter().find(|(_, c)| Arc::strong_count(c) == 1).map(|(k, _)| k.clone()) {
                all.remove(&idle);
            }
        }
        let counters = Arc::new(DatasetCounters::default());
        all.insert(dataset.to_string(), counters.clone());
        counters
    }

    /// The OpenMetrics text of one scrape.
    pub fn render(&self, scrape: Scrape) -> String {
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
                StreamRow {
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
        let snapshot = Snapshot {
            streams,
            datasets: rows,
            cache: scrape.cache,
            sample_cache: scrape.sample_cache,
            clients: scrape.clients,
            worker_threads: scrape.worker_threads,
            worker_busy_s: worker_busy().as_secs_f64(),
        };
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
}

/// One stream's values at scrape time.
#[derive(Debug)]
struct StreamRow {
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
        use MetricType::{Counter, Gauge};
        use Value::{Float, Int};
        let e = &mut encoder;

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

        let datasets: Vec<(String, &DatasetRow)> = self.datasets.iter().map(|(k, v)| (label(k), v)).collect();
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

        let streams: Vec<([(&str, String); 3], &StreamRow)> = self
            .streams
            .iter()
            .map(|s| ([("stream", s.id.to_string()), ("dataset", label(&s.dataset)), ("rank", s.rank.to_string())], s))
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

/// Binds the metrics listener (`[metrics] listen`).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen for metrics on {addr} ([metrics] listen)"))
}

/// Serves `GET /metrics` on `listener`, one response per connection, with
/// the text `render` returns. Runs until the runtime stops.
pub async fn serve(listener: TcpListener, render: impl Fn() -> String + Send + Sync + 'static) {
    let render = Arc::new(render);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving metrics on http://{addr}/metrics");
    }
    let mut last_warning: Option<Instant> = None;
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    last_warning = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Scrapers beyond the bound are closed at once: a crowd of slow
        // clients cannot queue up in front of the real scraper for long.
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "metrics: too many connections; closing");
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            respond(sock, &*render).await;
            drop(permit);
        });
    }
}

/// A response: status line and body.
struct Response {
    status: &'static str,
    content_type: &'static str,
    body: String,
    head_only: bool,
    extra: &'static str,
}

impl Response {
    fn text(status: &'static str, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
            head_only: false,
            extra: "",
        }
    }
}

/// Reads one request head, answers it, and closes the connection.
async fn respond(mut sock: TcpStream, render: &(dyn Fn() -> String + Send + Sync)) {
    let response = match tokio::time::timeout(HTTP_DEADLINE, read_head(&mut sock)).await {
        Err(_) => Response::text("408 Request Timeout", "request not received in time"),
        Ok(Err(response)) => response,
        Ok(Ok(head)) => route(&head, render),
    };
    let mut out = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
        response.status,
        response.content_type,
        response.body.len(),
        response.extra
    );
    if !response.head_only {
        out.push_str(&response.body);
    }
    let _ = tokio::time::timeout(HTTP_DEADLINE, async {
        sock.write_all(out.as_bytes()).await?;
        sock.shutdown().await?;
        // Close only once the peer has had the response: unread request
        // bytes (an oversized head) would otherwise turn the close into a
        // reset that can destroy the response in flight.
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            if sock.read(&mut sink).await? == 0 {
                break;
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}

/// The request head (up to the blank line), or the error to answer with.
async fn read_head(sock: &mut TcpStream) -> Result<String, Response> {
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    let mut len = 0;
    loop {
        let Some(free) = buf.get_mut(len..).filter(|b| !b.is_empty()) else {
            return Err(Response::text("431 Request Header Fields Too Large", "request head too large"));
        };
        let n = match sock.read(free).await {
            Ok(0) | Err(_) => return Err(Response::text("400 Bad Request", "incomplete request")),
            Ok(n) => n,
        };
        len += n;
        let head = buf.get(..len).unwrap_or_default();
        if let Some(end) = find(head, b"\r\n\r\n").or_else(|| find(head, b"\n\n")) {
            let head = head.get(..end).unwrap_or_default();
            return String::from_utf8(head.to_vec())
                .map_err(|_| Response::text("400 Bad Request", "request head is not UTF-8"));
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Answers a request head: `GET`/`HEAD /metrics` get the metrics.
fn route(head: &str, render: &(dyn Fn() -> String + Send + Sync)) -> Response {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Response::text("400 Bad Request", "malformed request line");
    };
    if !version.starts_with("HTTP/1.") {
        return Response::text("505 HTTP Version Not Supported", "HTTP/1.x only");
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Response::text("404 Not Found", "not found; metrics are at /metrics");
    }
    match method {
        "GET" | "HEAD" => Response {
            status: "200 OK",
            content_type: CONTENT_TYPE,
            body: render(),
            head_only: method == "HEAD",
            extra: "",
        },
        _ => Response { extra: "Allow: GET, HEAD\r\n", ..Response::text("405 Method Not Allowed", "use GET") },
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

    #[test]
    fn routes() {
        let render = || "x 1\n# EOF\n".to_string();
        assert_eq!(route("GET /metrics HTTP/1.1\r\nHost: a", &render).status, "200 OK");
        assert_eq!(route("GET /metrics?x=1 HTTP/1.0", &render).status, "200 OK");
        assert!(route("HEAD /metrics HTTP/1.1", &render).head_only);
        assert_eq!(route("POST /metrics HTTP/1.1", &render).status, "405 Method Not Allowed");
        assert_eq!(route("GET / HTTP/1.1", &render).status, "404 Not Found");
        assert_eq!(route("GET /metrics", &render).status, "400 Bad Request");
        assert_eq!(route("\u{0}\u{1}garbage", &render).status, "400 Bad Request");
        assert_eq!(route("GET /metrics SPDY/3", &render).status, "505 HTTP Version Not Supported");
    }

    #[test]
    fn dataset_counters_only_grow_across_replaced_sources() {
        let metrics = Metrics::default();
        let c = metrics.dataset("d");
        let busy = worker_busy();
        c.filled(Duration::from_millis(5));
        c.completed(100, false);
        c.completed(0, true);
        assert_eq!(c.bytes(), 100);
        assert_eq!(c.errors(), 1);
        assert_eq!(c.decode(), Duration::from_millis(5));
        // The one daemon-wide counter (other tests' fills may add to it too).
        assert!(worker_busy() >= busy + Duration::from_millis(5));
        assert!(Arc::ptr_eq(&c, &metrics.dataset("d")));
    }
}
