//! The node-wide caches: decompressed HDF5 chunks and decoded samples
//! (images and compressed values of LMDB fields), each bounded in bytes and
//! shared by every stream, client and job reading the same files.
//!
//! Entries are keyed by what they hold, not by who asked: a *space* is one
//! field of one file's identity (device, inode, size, mtime) with its decode
//! spec, so a file replaced or appended to gets a new space and is never
//! served from the old one. An entry also records which samples read it
//! ([`Uses`]: a dataset fingerprint and a range of its indices).
//!
//! Eviction is clairvoyant by default. Every stream registers a [`Cursor`]
//! (its sampler and where it is producing); the order is a keyed bijection,
//! so where a dataset index falls in a stream's current or next epoch costs
//! O(1) ([`Sampler::local_position`]). To make room the cache samples
//! [`CANDIDATES`] resident entries, computes each one's next use over every
//! registered stream of its dataset, and evicts the one used furthest in the
//! future (Belady's MIN, approximated by sampling as Redis approximates
//! LRU); an incoming entry used later than every candidate is not admitted
//! at all. Entries no registered stream will read are evicted first, least
//! recently used among them. `[cache] policy = "lru"` evicts the least
//! recently used of the same sample instead, for comparison on the same run.
//!
//! Invariants: the bytes held never exceed the capacity (an entry larger than
//! the whole cache is not kept); lock order is the cache's lock, then the
//! cursor registry's, then a cursor's; nothing here blocks on I/O.

use std::collections::HashMap;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::sampler::{Order, Sampler};

pub mod snapshot;

/// Resident entries sampled per eviction.
pub const CANDIDATES: usize = 32;

/// Indices of a multi-sample entry (a chunk) looked at for its next use; a
/// longer range is looked at this many evenly spaced points.
const MAX_PROBES: u64 = 128;

/// Datasets whose labels and counters are kept (each is a few dozen bytes;
/// clients opening ever new datasets must not grow them without bound).
const MAX_TRACKED: usize = 65_536;

/// Longest a [`Cache::get_or_load`] caller waits for another's load of the
/// same key before loading it too (a load is one chunk's read and decode).
pub const LOAD_WAIT: Duration = Duration::from_secs(5);

/// Next use of an entry no registered stream reads within its horizon.
pub const NEVER: u64 = u64::MAX;

/// Which entry to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// The entry whose next use, over every registered stream, is furthest away.
    #[default]
    Belady,
    /// The least recently used entry.
    Lru,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::Belady => "belady",
            Policy::Lru => "lru",
        })
    }
}

/// Identifies one entry: a space (a field of a file, with its decode spec)
/// and an item in it (a chunk's linear index, a sample's index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// From [`space_id`].
    pub space: u64,
    /// Item within the space.
    pub item: u64,
}

/// Which samples read an entry: indices `lo..hi` of the dataset `dataset`
/// (a [`fingerprint`]); `hi == NEVER` marks an entry every sample reads (an
/// HDF5 constant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uses {
    /// The dataset's fingerprint.
    pub dataset: u64,
    /// First index.
    pub lo: u64,
    /// One past the last index.
    pub hi: u64,
}

impl Uses {
    /// One sample.
    pub fn one(dataset: u64, index: u64) -> Uses {
        Uses { dataset, lo: index, hi: index + 1 }
    }
}

/// A stable 64-bit hash of anything hashable (spaces, fingerprints).
pub fn fingerprint(value: &impl Hash) -> u64 {
    // SipHash with fixed keys: the same within a daemon's life, which is as
    // long as any cache entry lives.
    let mut h = std::hash::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The space of one field of one file, read with one decode spec.
pub fn space_id(file: &crate::fsaccess::FileId, field: &str, spec: &impl Hash) -> u64 {
    fingerprint(&(file, field, spec))
}

/// Where one stream is: what its future reads are, for clairvoyant eviction.
#[derive(Debug)]
pub struct Cursor {
    /// The fingerprint of the dataset it reads (changes when a `rescan` stream's files do).
    dataset: AtomicU64,
    state: Mutex<CursorState>,
}

#[derive(Debug)]
struct CursorState {
    sampler: Sampler,
    epoch: u64,
    /// The rank-local sample position being produced: the first sample of
    /// the oldest batch a fill is still producing (later fills run too).
    position: u64,
    /// Permutations of `epoch` and `epoch + 1`, built once per epoch.
    perms: [Option<Order>; 2],
}

impl Cursor {
    /// Moves the cursor to batch `step` of `epoch`: the oldest batch still
    /// being produced (called as fills start and finish). Fills of later
    /// batches, into the next epoch, count as its future reads.
    pub fn set(&self, epoch: u64, step: u64) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.epoch != epoch || (st.perms[0].is_none() && st.sampler.permutation(epoch).is_some()) {
            st.perms = [st.sampler.permutation(epoch), st.sampler.permutation(epoch + 1)];
            st.epoch = epoch;
        }
        st.position = step.saturating_mul(st.sampler.batch_size());
    }

    /// The fingerprint of the dataset it reads.
    pub fn dataset(&self) -> u64 {
        self.dataset.load(Ordering::Relaxed)
    }

    /// The stream now reads the dataset `dataset` (rescanned: its files changed).
    pub fn set_dataset(&self, dataset: u64) {
        self.dataset.store(dataset, Ordering::Relaxed);
    }

    /// Replaces the sampler (a dataset rescanned at an epoch boundary).
    pub fn set_sampler(&self, sampler: Sampler) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.perms = [sampler.permutation(st.epoch), sampler.permutation(st.epoch + 1)];
        st.sampler = sampler;
    }

    /// Samples this stream produces before it reads `index`, within this
    /// epoch and the next; [`NEVER`] beyond.
    fn distance(st: &CursorState, index: u64) -> u64 {
        let s = &st.sampler;
        if let Some(q) = s.local_position(st.perms[0].as_ref(), index)
            && q >= st.position
        {
            return q - st.position;
        }
        match s.local_position(st.perms[1].as_ref(), index) {
            Some(q) => s.per_rank().saturating_sub(st.position).saturating_add(q),
            None => NEVER,
        }
    }
}

/// Every registered stream's cursor, by dataset; shared by the caches.
#[derive(Debug, Default)]
pub struct Futures {
    cursors: RwLock<Vec<Weak<Cursor>>>,
    labels: RwLock<HashMap<u64, String>>,
    /// Per dataset fingerprint, its files (resolved path, identity): what a
    /// cache snapshot checks again before it restores the dataset's entries.
    origins: RwLock<Origins>,
}

/// Datasets' files, at most [`MAX_ORIGIN_FILES`] in all.
#[derive(Debug, Default)]
struct Origins {
    files: usize,
    by_dataset: HashMap<u64, Arc<Vec<(std::path::PathBuf, crate::fsaccess::FileId)>>>,
}

/// Files whose identity [`Futures`] keeps for snapshots, all datasets
/// together (a dataset beyond it is not restored from a snapshot).
const MAX_ORIGIN_FILES: usize = 1 << 20;

impl Futures {
    /// A registry with no streams.
    pub fn new() -> Arc<Futures> {
        Arc::new(Futures::default())
    }

    /// Registers a stream of dataset `dataset` reading in `sampler`'s order
    /// from (`epoch`, `step`); it counts until the returned cursor drops.
    pub fn register(&self, dataset: u64, sampler: Sampler, epoch: u64, step: u64) -> Arc<Cursor> {
        let cursor = Arc::new(Cursor {
            dataset: AtomicU64::new(dataset),
            state: Mutex::new(CursorState { sampler, epoch: u64::MAX, position: 0, perms: [None, None] }),
        });
        cursor.set(epoch, step);
        let mut cursors = self.cursors.write().unwrap_or_else(PoisonError::into_inner);
        cursors.retain(|c| c.strong_count() > 0);
        cursors.push(Arc::downgrade(&cursor));
        cursor
    }

    /// Names a dataset fingerprint (the config name, or the pattern), for `stoker cache ls`.
    pub fn label(&self, dataset: u64, label: &str) {
        let live: std::collections::HashSet<u64> = {
            let cursors = self.cursors.read().unwrap_or_else(PoisonError::into_inner);
            cursors.iter().filter_map(Weak::upgrade).map(|c| c.dataset()).collect()
        };
        let mut labels = self.labels.write().unwrap_or_else(PoisonError::into_inner);
        if labels.len() >= MAX_TRACKED && !labels.contains_key(&dataset) {
            // Datasets opened over a long life: forget those no stream reads now.
            labels.retain(|d, _| live.contains(d));
        }
        if labels.len() < MAX_TRACKED || labels.contains_key(&dataset) {
            labels.insert(dataset, label.to_owned());
        }
    }

    /// Records the files of a dataset fingerprint, for snapshots.
    pub fn origins(&self, dataset: u64, files: Vec<(std::path::PathBuf, crate::fsaccess::FileId)>) {
        let mut origins = self.origins.write().unwrap_or_else(PoisonError::into_inner);
        if origins.by_dataset.contains_key(&dataset) {
            return;
        }
        if origins.files.saturating_add(files.len()) > MAX_ORIGIN_FILES {
            // Forget datasets no label names any more (see `label`).
            let labels = self.labels.read().unwrap_or_else(PoisonError::into_inner);
            origins.by_dataset.retain(|d, _| labels.contains_key(d));
            origins.files = origins.by_dataset.values().map(|v| v.len()).sum();
        }
        if origins.files.saturating_add(files.len()) <= MAX_ORIGIN_FILES {
            origins.files += files.len();
            origins.by_dataset.insert(dataset, Arc::new(files));
        }
    }

    /// The files of a dataset fingerprint, if recorded.
    pub fn origins_of(&self, dataset: u64) -> Option<Arc<Vec<(std::path::PathBuf, crate::fsaccess::FileId)>>> {
        self.origins.read().unwrap_or_else(PoisonError::into_inner).by_dataset.get(&dataset).cloned()
    }

    /// The label of a dataset fingerprint.
    pub fn label_of(&self, dataset: u64) -> Option<String> {
        self.labels.read().unwrap_or_else(PoisonError::into_inner).get(&dataset).cloned()
    }

    /// Fingerprints labelled `label`.
    pub fn datasets_named(&self, label: &str) -> Vec<u64> {
        let labels = self.labels.read().unwrap_or_else(PoisonError::into_inner);
        labels.iter().filter(|(_, l)| l.as_str() == label).map(|(&d, _)| d).collect()
    }

    /// Streams registered now.
    pub fn streams(&self) -> usize {
        self.cursors.read().unwrap_or_else(PoisonError::into_inner).iter().filter(|c| c.strong_count() > 0).count()
    }

    /// Samples until the first registered stream of `uses.dataset` reads
    /// any of `uses.lo..uses.hi`: 0 for entries every sample reads, [`NEVER`]
    /// when no stream does within its current and next epoch.
    pub fn next_use(&self, uses: &Uses) -> u64 {
        let cursors = self.cursors.read().unwrap_or_else(PoisonError::into_inner);
        let mut best = NEVER;
        for cursor in cursors.iter().filter_map(Weak::upgrade).filter(|c| c.dataset() == uses.dataset) {
            if uses.hi == NEVER {
                return 0;
            }
            let st = cursor.state.lock().unwrap_or_else(PoisonError::into_inner);
            let span = uses.hi.saturating_sub(uses.lo);
            let stride = span.div_ceil(MAX_PROBES).max(1);
            let mut index = uses.lo;
            while index < uses.hi {
                best = best.min(Cursor::distance(&st, index));
                index += stride;
            }
        }
        best
    }
}

/// Counters of one dataset in one cache, for `stoker cache ls` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes held.
    pub bytes: u64,
    /// Entries held.
    pub entries: u64,
    /// Lookups that found their entry.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Entries offered but not admitted (used later than everything held).
    pub rejected: u64,
}

/// Counters of a whole cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes held.
    pub bytes: u64,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Entries held.
    pub entries: u64,
    /// Lookups that found their entry.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries evicted.
    pub evictions: u64,
}

/// A bounded, thread-safe cache of `V`s under a [`Policy`].
#[derive(Debug)]
pub struct Cache<V> {
    capacity: usize,
    policy: Policy,
    futures: Arc<Futures>,
    inner: Mutex<Inner<V>>,
    /// Signalled when a load [`Cache::get_or_load`] runs ends.
    loaded: Condvar,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

#[derive(Debug)]
struct Entry<V> {
    key: Key,
    value: Arc<V>,
    bytes: usize,
    uses: Uses,
    /// Tick of the last lookup or insert.
    last: u64,
}

#[derive(Debug)]
struct Inner<V> {
    entries: Vec<Entry<V>>,
    index: HashMap<Key, usize>,
    bytes: usize,
    tick: u64,
    rng: u64,
    datasets: HashMap<u64, Counters>,
    /// Keys a [`Cache::get_or_load`] caller is loading now.
    loading: HashSet<Key>,
}

/// What a [`Cache::get_or_load`] load gives: the value, its bytes and its
/// uses, or `None` for nothing to cache.
pub type Loaded<V> = Option<(Arc<V>, usize, Uses)>;

/// The cache of decompressed HDF5 chunks.
pub type ChunkCache = Cache<Vec<u8>>;

/// The cache of decoded samples.
pub type SampleCache = Cache<Decoded>;

/// One decoded value (before any random transform), as the sample cache holds it.
#[derive(Debug)]
pub struct Decoded {
    /// Its dtype and shape.
    pub info: stoker_decode::codec::ArrayInfo,
    /// Its bytes, aligned as decoders leave them.
    pub data: stoker_decode::codec::AlignedBuf,
}

impl Decoded {
    /// A copy of `bytes` laid out as `info`.
    pub fn copy_of(info: &stoker_decode::codec::ArrayInfo, bytes: &[u8]) -> Decoded {
        let mut data = stoker_decode::codec::AlignedBuf::new();
        data.resize(bytes.len()).copy_from_slice(bytes);
        Decoded { info: info.clone(), data }
    }
}

/// The daemon's caches and the registry of stream futures they evict by.
#[derive(Debug)]
pub struct Caches {
    /// Every registered stream's cursor.
    pub futures: Arc<Futures>,
    /// Decompressed HDF5 chunks.
    pub chunks: ChunkCache,
    /// Decoded samples.
    pub samples: SampleCache,
    /// Bytes of chunk decode buffers all workers hold at once
    /// ([`Caches::bound_decoding`]; unbounded until then).
    pub decode: DecodeBudget,
}

/// The bytes of decode buffers (a chunk's stored bytes and its decoded
/// bytes) every worker together may hold at once: without it each worker
/// may decode a chunk of `max_sample_bytes` at the same time, and a small
/// file of two chunks of zeros took the daemon to 1 GiB per worker. A worker
/// reserves what it will allocate before it allocates, waiting while others
/// hold the budget; what can never fit is refused at once.
#[derive(Debug)]
pub struct DecodeBudget {
    limit: std::sync::atomic::AtomicU64,
    used: Mutex<u64>,
    freed: std::sync::Condvar,
}

/// Bytes reserved from a [`DecodeBudget`], given back on drop.
#[derive(Debug)]
pub struct DecodeLease<'a> {
    budget: &'a DecodeBudget,
    bytes: u64,
}

impl DecodeBudget {
    fn new(limit: u64) -> DecodeBudget {
        DecodeBudget {
            limit: std::sync::atomic::AtomicU64::new(limit),
            used: Mutex::new(0),
            freed: std::sync::Condvar::new(),
        }
    }

    /// The bound, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Reserves `bytes`, waiting up to `wait` for others to give theirs
    /// back; `Err(limit)` when they can never fit, or did not in time.
    pub fn acquire(&self, bytes: u64, wait: std::time::Duration) -> Result<DecodeLease<'_>, u64> {
        let limit = self.limit();
        if bytes > limit {
            return Err(limit);
        }
        let deadline = std::time::Instant::now() + wait;
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        while *used + bytes > limit {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(limit);
            }
            used = self.freed.wait_timeout(used, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        *used += bytes;
        Ok(DecodeLease { budget: self, bytes })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for DecodeLease<'_> {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(PoisonError::into_inner);
        *used = used.saturating_sub(self.bytes);
        drop(used);
        self.budget.freed.notify_all();
    }
}

impl Caches {
    /// Bounds the decode buffers all workers hold at once to `bytes`.
    pub fn bound_decoding(&self, bytes: u64) {
        self.decode.limit.store(bytes, Ordering::Relaxed);
    }

    /// Caches of `chunk_bytes` and `sample_bytes` under `policy`.
    pub fn new(chunk_bytes: u64, sample_bytes: u64, policy: Policy) -> Arc<Caches> {
        let futures = Futures::new();
        let size = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
        Arc::new(Caches {
            chunks: Cache::new(size(chunk_bytes), policy, futures.clone()),
            samples: Cache::new(size(sample_bytes), policy, futures.clone()),
            futures,
            decode: DecodeBudget::new(u64::MAX),
        })
    }

    /// Bytes both may hold.
    pub fn capacity(&self) -> u64 {
        (self.chunks.capacity() as u64).saturating_add(self.samples.capacity() as u64)
    }

    /// Bytes both hold now.
    pub fn bytes(&self) -> u64 {
        self.chunks.stats().bytes.saturating_add(self.samples.stats().bytes)
    }

    /// Evicts (by each cache's policy) until both together hold at most
    /// `target` bytes, each in proportion to what it holds; returns the
    /// entries and bytes evicted. Under memory pressure, and to give memory
    /// back when idle.
    pub fn shed(&self, target: u64) -> (u64, u64) {
        let held = self.bytes();
        if held <= target {
            return (0, 0);
        }
        let keep = |cache_bytes: u64| (cache_bytes as u128 * target as u128 / held as u128) as u64;
        let a = self.chunks.shed_to(keep(self.chunks.stats().bytes));
        let b = self.samples.shed_to(keep(self.samples.stats().bytes));
        (a.0 + b.0, a.1 + b.1)
    }
}

/// What a source needs to use the caches: them, and its dataset's fingerprint.
#[derive(Debug, Clone)]
pub struct CacheCtx {
    /// The daemon's caches.
    pub caches: Arc<Caches>,
    /// The dataset's fingerprint ([`fingerprint`] of its description and file identities).
    pub dataset: u64,
}

impl CacheCtx {
    /// Caches that keep nothing (for `stoker validate`, `inspect`, tests).
    pub fn disabled() -> CacheCtx {
        CacheCtx { caches: Caches::new(0, 0, Policy::Lru), dataset: 0 }
    }
}

impl<V> Cache<V> {
    /// A cache holding at most `capacity` bytes (0 disables it).
    pub fn new(capacity: usize, policy: Policy, futures: Arc<Futures>) -> Cache<V> {
        Cache {
            capacity,
            policy,
            futures,
            inner: Mutex::new(Inner {
                entries: Vec::new(),
                index: HashMap::new(),
                bytes: 0,
                tick: 0,
                rng: 0x853c_49e6_748f_ea9b,
                datasets: HashMap::new(),
                loading: HashSet::new(),
            }),
            loaded: Condvar::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The eviction policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the cache keeps anything at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// The entry, if held; counted against `dataset`.
    pub fn get(&self, key: &Key, dataset: u64) -> Option<Arc<V>> {
        if !self.enabled() {
            return None;
        }
        let mut inner = self.lock();
        let hit = Self::find(&mut inner, key);
        self.count(&mut inner, dataset, hit.is_some());
        hit
    }

    /// The entry, or else `load`'s value, offered to the cache. Concurrent
    /// callers for one key load it once: the others wait for that load (at
    /// most [`LOAD_WAIT`], then load themselves) and take the entry it left
    /// (two workers filling neighbouring rows of one HDF5 chunk decompress
    /// it once). `load` gives the value, its bytes and its uses, or `None`
    /// for nothing to cache; it runs without the cache's lock.
    pub fn get_or_load<E>(
        &self,
        key: &Key,
        dataset: u64,
        load: impl FnOnce() -> Result<Loaded<V>, E>,
    ) -> Result<Option<Arc<V>>, E> {
        if !self.enabled() {
            return Ok(load()?.map(|(value, _, _)| value));
        }
        let mut inner = self.lock();
        let deadline = Instant::now() + LOAD_WAIT;
        while inner.loading.contains(key) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            inner = self.loaded.wait_timeout(inner, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        let hit = Self::find(&mut inner, key);
        self.count(&mut inner, dataset, hit.is_some());
        if let Some(hit) = hit {
            return Ok(Some(hit));
        }
        // The one loader of `key` (unless a wait timed out): whatever happens
        // to `load`, the guard lets the waiters go.
        let claimed = inner.loading.insert(*key);
        drop(inner);
        struct Claim<'a, V> {
            cache: &'a Cache<V>,
            key: Option<Key>,
        }
        impl<V> Drop for Claim<'_, V> {
            fn drop(&mut self) {
                if let Some(key) = self.key {
                    self.cache.lock().loading.remove(&key);
                    self.cache.loaded.notify_all();
                }
            }
        }
        let _claim = Claim { cache: self, key: claimed.then_some(*key) };
        Ok(load()?.map(|(value, bytes, uses)| {
            self.insert(*key, value.clone(), bytes, uses);
            value
        }))
    }

    /// The entry under `key`, marked as just used.
    fn find(inner: &mut Inner<V>, key: &Key) -> Option<Arc<V>> {
        inner.tick += 1;
        let tick = inner.tick;
        let at = inner.index.get(key).copied()?;
        inner.entries[at].last = tick;
        Some(inner.entries[at].value.clone())
    }

    /// Counts one lookup of `dataset`.
    fn count(&self, inner: &mut Inner<V>, dataset: u64, hit: bool) {
        if inner.datasets.len() >= MAX_TRACKED && !inner.datasets.contains_key(&dataset) {
            // Counters of datasets with nothing cached go first.
            inner.datasets.retain(|_, c| c.entries > 0);
        }
        let counters = inner.datasets.entry(dataset).or_default();
        if hit {
            counters.hits += 1;
            self.hits.fetch_add(1, Ordering::Relaxed);
        } else {
            counters.misses += 1;
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether an entry of `bytes` read by `uses` would be admitted now
    /// (so a caller can skip copying a value the cache would refuse). Under
    /// Belady, also false when the cache is full of entries all used sooner.
    pub fn wants(&self, bytes: usize, uses: &Uses) -> bool {
        if !self.enabled() || bytes > self.capacity {
            return false;
        }
        let inner = self.lock();
        if inner.bytes + bytes <= self.capacity || self.policy == Policy::Lru {
            return true;
        }
        drop(inner);
        // A cheap look: the incoming entry against a few residents.
        let incoming = self.futures.next_use(uses);
        if incoming == NEVER {
            return false;
        }
        let mut inner = self.lock();
        let n = inner.entries.len();
        (0..4.min(n)).any(|_| {
            let at = (inner.next_random() % n as u64) as usize;
            self.futures.next_use(&inner.entries[at].uses) >= incoming
        })
    }

    /// Offers an entry; returns whether it was admitted. Evicts by the policy
    /// to stay within capacity.
    pub fn insert(&self, key: Key, value: Arc<V>, bytes: usize, uses: Uses) -> bool {
        if !self.enabled() || bytes > self.capacity {
            return false;
        }
        let incoming = match self.policy {
            Policy::Belady => self.futures.next_use(&uses),
            Policy::Lru => 0,
        };
        let mut inner = self.lock();
        if inner.index.contains_key(&key) {
            return true;
        }
        while inner.bytes + bytes > self.capacity {
            let Some(victim) = self.victim(&mut inner) else { break };
            let victim_next = match self.policy {
                Policy::Belady => self.futures.next_use(&inner.entries[victim].uses),
                Policy::Lru => NEVER,
            };
            if self.policy == Policy::Belady && victim_next < incoming
                || (victim_next == NEVER && incoming == NEVER && self.policy == Policy::Belady)
            {
                // Everything sampled is read sooner than the incoming entry
                // (or nobody reads either): keep what is held.
                inner.datasets.entry(uses.dataset).or_default().rejected += 1;
                return false;
            }
            self.remove_at(&mut inner, victim);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        inner.tick += 1;
        let last = inner.tick;
        let at = inner.entries.len();
        inner.entries.push(Entry { key, value, bytes, uses, last });
        inner.index.insert(key, at);
        inner.bytes += bytes;
        let c = inner.datasets.entry(uses.dataset).or_default();
        c.bytes += bytes as u64;
        c.entries += 1;
        true
    }

    /// The entry to evict next among a random sample of residents.
    fn victim(&self, inner: &mut Inner<V>) -> Option<usize> {
        let n = inner.entries.len();
        if n == 0 {
            return None;
        }
        let picks: Vec<usize> = if n <= CANDIDATES {
            (0..n).collect()
        } else {
            (0..CANDIDATES).map(|_| (inner.next_random() % n as u64) as usize).collect()
        };
        let score = |at: usize| {
            let e = &inner.entries[at];
            let next = match self.policy {
                Policy::Belady => self.futures.next_use(&e.uses),
                Policy::Lru => 0,
            };
            // Furthest next use first; among equals, least recently used.
            (next, u64::MAX - e.last)
        };
        picks.into_iter().max_by_key(|&at| score(at))
    }

    fn remove_at(&self, inner: &mut Inner<V>, at: usize) {
        let e = inner.entries.swap_remove(at);
        inner.index.remove(&e.key);
        if let Some(moved) = inner.entries.get(at) {
            inner.index.insert(moved.key, at);
        }
        inner.bytes -= e.bytes;
        let c = inner.datasets.entry(e.uses.dataset).or_default();
        c.bytes = c.bytes.saturating_sub(e.bytes as u64);
        c.entries = c.entries.saturating_sub(1);
        c.evictions += 1;
    }

    /// Evicts entries (the policy's victims) until at most `target` bytes
    /// are held; returns the entries and bytes evicted.
    pub fn shed_to(&self, target: u64) -> (u64, u64) {
        let mut inner = self.lock();
        let (mut entries, mut bytes) = (0u64, 0u64);
        while inner.bytes as u64 > target {
            let Some(victim) = self.victim(&mut inner) else { break };
            entries += 1;
            bytes += inner.entries[victim].bytes as u64;
            self.remove_at(&mut inner, victim);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        (entries, bytes)
    }

    /// Drops every entry of `dataset` (all entries with `None`); returns (entries, bytes) dropped.
    pub fn drop_dataset(&self, dataset: Option<u64>) -> (u64, u64) {
        let mut inner = self.lock();
        let (mut entries, mut bytes) = (0u64, 0u64);
        let mut at = 0;
        while at < inner.entries.len() {
            if dataset.is_none_or(|d| inner.entries[at].uses.dataset == d) {
                entries += 1;
                bytes += inner.entries[at].bytes as u64;
                self.remove_at(&mut inner, at);
            } else {
                at += 1;
            }
        }
        // A drop is not an eviction, and the hit rate counts from the drop
        // on: a dataset just dropped shows no hits (not its old 100%).
        for (d, c) in inner.datasets.iter_mut() {
            if dataset.is_none_or(|only| only == *d) {
                *c = Counters { bytes: c.bytes, entries: c.entries, ..Counters::default() };
            }
        }
        (entries, bytes)
    }

    /// Every entry (its key, value and uses), for [`Caches::export`].
    pub fn snapshot(&self) -> Vec<(Key, Arc<V>, Uses)> {
        self.lock().entries.iter().map(|e| (e.key, e.value.clone(), e.uses)).collect()
    }

    /// Per-dataset counters.
    pub fn datasets(&self) -> Vec<(u64, Counters)> {
        let inner = self.lock();
        let mut out: Vec<(u64, Counters)> = inner.datasets.iter().map(|(&d, &c)| (d, c)).collect();
        out.sort_by_key(|&(d, _)| d);
        out
    }

    /// Whole-cache counters.
    pub fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            bytes: inner.bytes as u64,
            capacity: self.capacity as u64,
            entries: inner.entries.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<V>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<V> Inner<V> {
    fn next_random(&mut self) -> u64 {
        // xorshift64*: cheap, and good enough to pick eviction candidates.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(item: u64) -> Key {
        Key { space: 1, item }
    }

    #[test]
    fn lru_stays_within_capacity_evicting_least_recent() {
        let cache: Cache<Vec<u8>> = Cache::new(10, Policy::Lru, Futures::new());
        let ins = |i: u64, n: usize| cache.insert(key(i), Arc::new(vec![i as u8; n]), n, Uses::one(7, i));
        ins(0, 4);
        ins(1, 4);
        assert!(cache.get(&key(0), 7).is_some()); // 0 is now more recent than 1
        ins(2, 4);
        assert!(cache.get(&key(1), 7).is_none());
        assert!(cache.get(&key(0), 7).is_some() && cache.get(&key(2), 7).is_some());
        let stats = cache.stats();
        assert_eq!((stats.bytes, stats.entries), (8, 2));
        assert!(!ins(3, 11)); // larger than the whole cache: not kept
        assert!(cache.get(&key(3), 7).is_none());
        let per = cache.datasets();
        assert_eq!(per.len(), 1);
        assert_eq!((per[0].1.bytes, per[0].1.entries, per[0].1.evictions), (8, 2, 1));
        assert!(cache.get(&key(0), 7).is_some());
        assert_eq!(cache.drop_dataset(Some(7)), (2, 8));
        assert_eq!(cache.stats().bytes, 0);
        // Its counters start over: no eviction for the drop, no old hits.
        let per = cache.datasets();
        assert_eq!((per[0].1.hits, per[0].1.misses, per[0].1.evictions), (0, 0, 0));
    }

    #[test]
    fn shedding_evicts_down_to_the_target_in_proportion() {
        let caches = Caches::new(1000, 1000, Policy::Lru);
        for i in 0..10 {
            caches.chunks.insert(key(i), Arc::new(vec![0u8; 60]), 60, Uses::one(7, i));
            caches.samples.insert(key(i), Arc::new(Decoded::copy_of(&sample_info(), &[0u8; 40])), 40, Uses::one(7, i));
        }
        assert_eq!(caches.bytes(), 1000);
        assert_eq!(caches.shed(2000), (0, 0));
        let (entries, bytes) = caches.shed(500);
        assert_eq!((entries, bytes), (10, 500));
        assert_eq!((caches.chunks.stats().bytes, caches.samples.stats().bytes), (300, 200));
        assert_eq!(caches.shed(0).1, 500);
        assert_eq!(caches.bytes(), 0);
    }

    fn sample_info() -> stoker_decode::codec::ArrayInfo {
        stoker_decode::codec::ArrayInfo { dtype: stoker_proto::DType::U8, shape: vec![40] }
    }

    #[test]
    fn samples_of_fills_in_flight_are_read_now_across_the_epoch_boundary() {
        // Unshuffled, 100 samples, batches of 10. The oldest fill still
        // running is batch 4 (batches 5..7 run too): samples 40..80 are read
        // now, not next epoch (refusing them re-decoded a chunk per sample).
        let futures = Futures::new();
        let sampler = Sampler::new(100, 0, 1, 10, false, 0, false);
        let cursor = futures.register(9, sampler, 0, 0);
        cursor.set(0, 4);
        let next = |lo: u64| futures.next_use(&Uses { dataset: 9, lo, hi: lo + 5 });
        assert_eq!(next(45), 5);
        assert_eq!(next(40), 0);
        assert_eq!(next(75), 35);
        assert_eq!(next(30), 100 - 40 + 30); // before the oldest fill: next epoch
        // A full cache of entries read next epoch admits what a fill in flight reads.
        let cache: Cache<Vec<u8>> = Cache::new(2, Policy::Belady, futures.clone());
        let ins = |lo: u64| cache.insert(key(lo), Arc::new(vec![0]), 1, Uses { dataset: 9, lo, hi: lo + 5 });
        assert!(ins(10) && ins(20));
        assert!(ins(45));
        assert!(cache.get(&key(20), 9).is_none(), "the furthest (20, next epoch) goes");
        // Epoch 1 began (its batch 1 started) while epoch 0's batch 8 still fills.
        cursor.set(0, 8);
        assert_eq!(next(90), 10);
        assert_eq!(next(5), 100 - 80 + 5); // epoch 1's first batch: read soon
        // The old fill is done: the cursor moves into epoch 1.
        cursor.set(1, 1);
        assert_eq!(next(90), 80);
        assert_eq!(next(70), 70 - 10);
    }

    /// The error of a load that fails, in the tests.
    #[derive(Debug)]
    struct Unreadable;

    #[test]
    fn concurrent_loads_of_one_key_run_once_and_failures_release_the_waiters() {
        use std::sync::atomic::AtomicUsize;
        let cache: Cache<Vec<u8>> = Cache::new(100, Policy::Lru, Futures::new());
        let loads = AtomicUsize::new(0);
        let load = || {
            loads.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            Ok::<_, Unreadable>(Some((Arc::new(vec![7u8; 10]), 10, Uses::one(1, 0))))
        };
        std::thread::scope(|s| {
            let got: Vec<_> = (0..4).map(|_| s.spawn(|| cache.get_or_load(&key(1), 1, load))).collect();
            for g in got {
                assert_eq!(*g.join().unwrap().unwrap().unwrap(), vec![7u8; 10]);
            }
        });
        assert_eq!(loads.load(Ordering::SeqCst), 1, "one load for four callers");
        assert_eq!((cache.stats().hits, cache.stats().misses), (3, 1));
        // A load that fails, or panics, lets the waiters go: each loads itself.
        for panics in [false, true] {
            let k = key(if panics { 3 } else { 2 });
            let tries = AtomicUsize::new(0);
            let failing = || -> Result<Loaded<Vec<u8>>, Unreadable> {
                let n = tries.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                if n == 0 {
                    assert!(!panics, "the first load panics");
                    return Err(Unreadable);
                }
                Ok(None)
            };
            let started = Instant::now();
            std::thread::scope(|s| {
                let got: Vec<_> = (0..3)
                    .map(|_| s.spawn(|| std::panic::catch_unwind(|| cache.get_or_load(&k, 1, failing))))
                    .collect();
                let outcomes: Vec<_> = got.into_iter().map(|g| g.join().unwrap()).collect();
                assert_eq!(outcomes.iter().filter(|o| matches!(o, Ok(Ok(None)))).count(), 2);
            });
            assert_eq!(tries.load(Ordering::SeqCst), 3);
            assert!(started.elapsed() < LOAD_WAIT, "nobody waited out the timeout");
            assert!(cache.lock().loading.is_empty());
        }
    }

    #[test]
    fn belady_keeps_what_the_stream_reads_soonest() {
        let futures = Futures::new();
        // One unshuffled stream over 100 samples, producing sample 50 now.
        let sampler = Sampler::new(100, 0, 1, 10, false, 0, false);
        let _cursor = futures.register(9, sampler, 0, 5);
        let cache: Cache<Vec<u8>> = Cache::new(3, Policy::Belady, futures.clone());
        let ins = |i: u64| cache.insert(key(i), Arc::new(vec![0]), 1, Uses::one(9, i));
        assert!(ins(60) && ins(90) && ins(10)); // 10 is read next epoch: furthest
        assert!(ins(55)); // sooner than 10: 10 goes
        assert!(cache.get(&key(10), 9).is_none());
        assert!(!ins(95 - 50)); // 45: read next epoch, later than everything held: refused
        assert!(ins(70)); // 90 goes
        assert!(cache.get(&key(90), 9).is_none());
        for i in [55, 60, 70] {
            assert!(cache.get(&key(i), 9).is_some(), "{i}");
        }
        // An entry of a dataset nobody reads is refused while everything held is read.
        assert!(!cache.insert(Key { space: 2, item: 0 }, Arc::new(vec![0]), 1, Uses::one(8, 0)));
        assert_eq!(cache.stats().bytes, 3);
    }

    /// Hit rate of one shuffled stream reading `epochs` epochs of `n`
    /// samples through a cache of `capacity` entries.
    fn simulate(policy: Policy, n: u64, capacity: usize, epochs: u64, exact: bool) -> f64 {
        let futures = Futures::new();
        let sampler = Sampler::new(n, 0, 1, 1, true, 3, false);
        let cursor = futures.register(1, sampler.clone(), 0, 0);
        let cache: Cache<()> = Cache::new(capacity, policy, futures.clone());
        let (mut hits, mut total) = (0u64, 0u64);
        for epoch in 0..epochs {
            let perm = sampler.permutation(epoch);
            for step in 0..n {
                cursor.set(epoch, step);
                let i = sampler.index(perm.as_ref(), step, 0);
                total += u64::from(epoch > 0);
                if cache.get(&key(i), 1).is_some() {
                    hits += u64::from(epoch > 0);
                    continue;
                }
                if exact && cache.stats().bytes as usize >= capacity {
                    // Exact MIN: scan every resident.
                    let mut inner = cache.lock();
                    let incoming = futures.next_use(&Uses::one(1, i));
                    let (at, next) = (0..inner.entries.len())
                        .map(|at| (at, futures.next_use(&inner.entries[at].uses)))
                        .max_by_key(|&(_, next)| next)
                        .expect("full");
                    if next >= incoming {
                        cache.remove_at(&mut inner, at);
                    }
                }
                cache.insert(key(i), Arc::new(()), 1, Uses::one(1, i));
            }
        }
        hits as f64 / total as f64
    }

    #[test]
    fn sampled_belady_is_close_to_exact_and_far_above_lru() {
        let (n, epochs) = (2000u64, 3u64);
        for fraction in [0.25, 0.5] {
            let capacity = (n as f64 * fraction) as usize;
            let exact = simulate(Policy::Belady, n, capacity, epochs, true);
            let sampled = simulate(Policy::Belady, n, capacity, epochs, false);
            let lru = simulate(Policy::Lru, n, capacity, epochs, false);
            assert!(exact >= fraction * 0.9, "exact MIN {exact:.3} at {fraction}");
            assert!(sampled >= exact - 0.05, "sampled {sampled:.3} vs exact {exact:.3} at {fraction}");
            assert!(sampled >= 2.0 * lru, "sampled {sampled:.3} vs LRU {lru:.3} at {fraction}");
        }
    }

    #[test]
    fn next_use_spans_epochs_and_ranks() {
        let futures = Futures::new();
        let s = Sampler::new(10, 1, 2, 1, false, 0, false);
        let _c = futures.register(4, s, 2, 1); // rank 1 reads 1, 3, 5, 7, 9; now at its 2nd sample (3)
        assert_eq!(futures.next_use(&Uses::one(4, 3)), 0);
        assert_eq!(futures.next_use(&Uses::one(4, 7)), 2);
        assert_eq!(futures.next_use(&Uses::one(4, 1)), 4); // next epoch's first
        assert_eq!(futures.next_use(&Uses::one(4, 2)), NEVER); // rank 0's
        assert_eq!(futures.next_use(&Uses::one(5, 3)), NEVER); // another dataset
        assert_eq!(futures.next_use(&Uses { dataset: 4, lo: 0, hi: NEVER }), 0);
        assert_eq!(futures.next_use(&Uses { dataset: 4, lo: 4, hi: 8 }), 1); // 5
    }
}
