//! Prometheus metrics: [`Metrics`], the registry of per-dataset counters, and
//! [`Scrape`], the daemon state one scrape reads; `exposition` renders a
//! scrape as OpenMetrics text, `http` serves it on `GET /metrics`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::stream::Stream;
use crate::stream::counters::DatasetCounters;
use stoker_data::cache::CacheStats;
use stoker_data::source::Source;

mod exposition;
mod http;

pub use http::{bind, serve};

/// Datasets whose counters are kept; beyond it, those no stream uses are forgotten
/// (ad-hoc datasets are labelled by their path, so their number is the clients' choice).
const MAX_DATASETS: usize = 256;

/// The daemon's metric counters (the rest is read from its state at scrape time).
///
/// The counters themselves live with the fill path that feeds them
/// ([`crate::stream::counters`]): per dataset here (kept after its streams
/// close), per stream in the stream (a series that ends with its stream).
/// This module only hands them out and reads them.
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
    /// Per connection id: the client's uid and job, for stream labels.
    pub client_jobs: std::collections::HashMap<u64, (u32, Option<String>)>,
    /// Threads in the worker pool.
    pub worker_threads: u64,
    /// HDF5 helper processes running, and helper deaths since start.
    pub hdf5_helpers: (u64, u64),
    /// Fills in flight (queued or running), and streams waiting for their
    /// user's turn (the fair gate's bounds).
    pub fills: (u64, u64),
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
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::stream::counters::worker_busy;

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
