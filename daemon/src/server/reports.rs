//! What `stoker status`, `stoker datasets`, `stoker cache ls/drop` and the
//! metrics scrape see: reports built from the daemon's state, filtered to
//! what the asking uid may see (root and the daemon's uid see everything).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoker_proto::{
    CacheStatus, ClientStatus, DatasetInfo, DatasetSkips, ErrorKind, Response, StatusReport, WorkerStatus,
};

use crate::stream::Stream;

use super::*;

impl Daemon {
    /// The status report as `viewer` may see it: root and the daemon's uid see
    /// everything, other users only their own clients, streams and datasets.
    /// The connection asking (`asker`) is not listed unless it has streams
    /// open: a status query is not a client.
    pub(super) fn status(&self, viewer: u32, asker: u64) -> StatusReport {
        let all = viewer == 0 || viewer == self.own_uid;
        let visible: HashMap<u64, u32> =
            lock(&self.clients).values().filter(|c| all || c.uid == viewer).map(|c| (c.id, c.uid)).collect();
        let open: Vec<Arc<Stream>> =
            lock(&self.streams).values().filter(|s| visible.contains_key(&s.meta().client_id)).cloned().collect();
        let streams: Vec<_> = open.iter().map(|s| s.status()).collect();
        let connected: HashMap<u64, Instant> = lock(&self.connected).iter().map(|(id, p)| (*id, p.since)).collect();
        let clients = lock(&self.clients)
            .values()
            .filter(|c| visible.contains_key(&c.id))
            .filter(|c| c.id != asker || streams.iter().any(|s| s.client_id == asker))
            .map(|c| {
                let own = || streams.iter().filter(|s| s.client_id == c.id);
                let connected_s = connected.get(&c.id).map_or(0.0, |t| t.elapsed().as_secs_f64());
                let wait_s = own().map(|s| s.wait_s).sum();
                ClientStatus {
                    streams: own().count() as u64,
                    connected_s,
                    wait_s,
                    stall_percent: crate::stream::percent(wait_s, connected_s),
                    ..c.clone()
                }
            })
            .collect();
        let datasets = self
            .datasets
            .status()
            .into_iter()
            .filter_map(|(mut d, source)| {
                let readers = open.iter().filter(|s| std::ptr::addr_eq(Arc::as_ptr(&s.source()), Arc::as_ptr(&source)));
                let (n, ring_bytes) = readers.fold((0u64, 0u64), |(n, b), s| (n + 1, b.saturating_add(s.shm_bytes())));
                (d.streams, d.ring_bytes) = (n, ring_bytes);
                (all || n > 0).then_some(d)
            })
            .collect();
        let visible_datasets: std::collections::HashSet<&str> = streams.iter().map(|s| s.dataset.as_str()).collect();
        StatusReport {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            worker_threads: self.pool.current_num_threads() as u64,
            clients,
            chunk_cache: cache_status(self.caches.chunks.stats()),
            sample_cache: cache_status(self.caches.samples.stats()),
            skipped: self
                .datasets
                .skips()
                .into_iter()
                .filter(|(dataset, _)| all || visible_datasets.contains(dataset.as_str()))
                .map(|(dataset, skipped)| DatasetSkips { dataset, skipped })
                .collect(),
            datasets,
            workers: self.worker_status(),
            memory: {
                let settings = self.settings();
                stoker_proto::MemoryStatus {
                    budget_bytes: settings.limits.max_memory_bytes,
                    source: settings.memory_source.clone(),
                }
            },
            streams,
        }
    }

    /// Worker utilisation over the last [`LOAD_WINDOW`] (since start until a sample is a second old).
    pub(super) fn worker_status(&self) -> WorkerStatus {
        let now = Instant::now();
        let busy = crate::stream::counters::worker_busy();
        let oldest =
            lock(&self.load).front().copied().filter(|(t, _)| now.duration_since(*t) >= Duration::from_secs(1));
        let (since, busy_before) = oldest.unwrap_or((self.started, Duration::ZERO));
        let window_s = now.duration_since(since).as_secs_f64();
        let threads = self.pool.current_num_threads() as f64;
        WorkerStatus {
            busy_s: busy.as_secs_f64(),
            busy_percent: crate::stream::percent(busy.saturating_sub(busy_before).as_secs_f64(), window_s * threads),
            window_s,
        }
    }

    pub(super) fn datasets(&self) -> Vec<DatasetInfo> {
        self.datasets.named()
    }

    /// Labels `viewer` may see: every dataset for root and the daemon's
    /// user; otherwise those named in the config and those its streams read.
    pub(super) fn visible_labels(&self, viewer: u32) -> Option<std::collections::HashSet<String>> {
        if viewer == 0 || viewer == self.own_uid {
            return None;
        }
        let mine: std::collections::HashSet<u64> =
            lock(&self.clients).values().filter(|c| c.uid == viewer).map(|c| c.id).collect();
        let mut labels: std::collections::HashSet<String> = self.settings().datasets.keys().cloned().collect();
        labels.extend(
            lock(&self.streams)
                .values()
                .filter(|s| mine.contains(&s.meta().client_id))
                .map(|s| s.meta().dataset.clone()),
        );
        Some(labels)
    }

    /// The caches per dataset, as `viewer` may see them (`stoker cache ls`).
    pub(super) fn cache_report(&self, viewer: u32) -> stoker_proto::CacheReport {
        let visible = self.visible_labels(viewer);
        let futures = &self.caches.futures;
        let mut datasets = Vec::new();
        let mut hidden: [Option<stoker_proto::CacheDatasetStatus>; 2] = [None, None];
        let per = [("chunks", self.caches.chunks.datasets()), ("samples", self.caches.samples.datasets())];
        for (k, (cache, rows)) in per.into_iter().enumerate() {
            for (dataset, c) in rows {
                let label = futures.label_of(dataset).unwrap_or_else(|| format!("(dataset {dataset:016x})"));
                let shown = visible.as_ref().is_none_or(|v| v.contains(&label));
                let row = stoker_proto::CacheDatasetStatus {
                    dataset: if shown { label } else { "(other users' datasets)".into() },
                    cache: cache.into(),
                    bytes: c.bytes,
                    entries: c.entries,
                    hits: c.hits,
                    misses: c.misses,
                    evictions: c.evictions,
                    rejected: c.rejected,
                };
                if shown {
                    // Reopened datasets (a changed file) share their label: one row each.
                    match datasets.iter_mut().find(|r: &&mut stoker_proto::CacheDatasetStatus| {
                        r.dataset == row.dataset && r.cache == row.cache
                    }) {
                        Some(r) => add_counts(r, &row),
                        None => datasets.push(row),
                    }
                } else {
                    match &mut hidden[k] {
                        Some(r) => add_counts(r, &row),
                        slot @ None => *slot = Some(row),
                    }
                }
            }
        }
        datasets.extend(hidden.into_iter().flatten());
        stoker_proto::CacheReport {
            policy: self.caches.chunks.policy().to_string(),
            chunks: cache_status(self.caches.chunks.stats()),
            samples: cache_status(self.caches.samples.stats()),
            streams: futures.streams() as u64,
            datasets,
        }
    }

    /// Drops the cache entries of `dataset` (every dataset with `None`, for root and the daemon's user only).
    pub(super) fn cache_drop(&self, viewer: u32, dataset: Option<&str>) -> Response {
        let visible = self.visible_labels(viewer);
        let (mut entries, mut bytes) = (0, 0);
        let mut add = |(e, b): (u64, u64)| {
            entries += e;
            bytes += b;
        };
        match dataset {
            None if visible.is_some() => {
                return Response::Error {
                    kind: ErrorKind::PermissionDenied,
                    message: "only root and the daemon's user may drop every dataset's cache entries; name a dataset \
                              (`stoker cache ls` lists those you may drop)"
                        .into(),
                };
            }
            None => {
                add(self.caches.chunks.drop_dataset(None));
                add(self.caches.samples.drop_dataset(None));
            }
            Some(label) => {
                // A named dataset's entries serve every user of the node: one
                // user dropping them would slow everyone else's jobs.
                if visible.is_some() && self.settings().datasets.contains_key(label) {
                    return Response::Error {
                        kind: ErrorKind::PermissionDenied,
                        message: format!(
                            "the cache entries of dataset {label:?} (named in the daemon's config) serve every user \
                             of the node; only root and the daemon's user may drop them"
                        ),
                    };
                }
                if visible.as_ref().is_some_and(|v| !v.contains(label)) {
                    return Response::Error {
                        kind: ErrorKind::NotFound,
                        message: format!("no cached dataset {label:?} that you may drop; see `stoker cache ls`"),
                    };
                }
                let fingerprints = self.caches.futures.datasets_named(label);
                if fingerprints.is_empty() {
                    return Response::Error {
                        kind: ErrorKind::NotFound,
                        message: format!("no cached dataset {label:?}; see `stoker cache ls`"),
                    };
                }
                for d in fingerprints {
                    add(self.caches.chunks.drop_dataset(Some(d)));
                    add(self.caches.samples.drop_dataset(Some(d)));
                }
            }
        }
        tracing::info!(uid = viewer, dataset = dataset.unwrap_or("(all)"), entries, bytes, "cache entries dropped");
        Response::CacheDropped { entries, bytes }
    }

    /// The Prometheus (OpenMetrics text) exposition of the daemon's state, for `GET /metrics`.
    pub fn metrics_text(&self) -> String {
        let streams: Vec<Arc<Stream>> = lock(&self.streams).values().cloned().collect();
        // One lock of the clients, released before rendering.
        let client_jobs: HashMap<u64, (u32, Option<String>)> =
            lock(&self.clients).iter().map(|(id, c)| (*id, (c.uid, c.job.clone()))).collect();
        self.metrics.render(crate::metrics::Scrape {
            streams,
            sources: self.datasets.sources(),
            cache: self.caches.chunks.stats(),
            sample_cache: self.caches.samples.stats(),
            clients: client_jobs.len() as u64,
            client_jobs,
            worker_threads: self.pool.current_num_threads() as u64,
            hdf5_helpers: {
                let (running, deaths) = self.datasets.helper_counts();
                (running as u64, deaths)
            },
            fills: {
                let (in_flight, waiting) = self.fair.load();
                (in_flight as u64, waiting as u64)
            },
        })
    }
}

fn cache_status(s: stoker_data::cache::CacheStats) -> CacheStatus {
    CacheStatus {
        bytes: s.bytes,
        capacity: s.capacity,
        entries: s.entries,
        hits: s.hits,
        misses: s.misses,
        evictions: s.evictions,
    }
}

fn add_counts(to: &mut stoker_proto::CacheDatasetStatus, from: &stoker_proto::CacheDatasetStatus) {
    to.bytes += from.bytes;
    to.entries += from.entries;
    to.hits += from.hits;
    to.misses += from.misses;
    to.evictions += from.evictions;
    to.rejected += from.rejected;
}
