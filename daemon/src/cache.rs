//! The node-wide cache of decoded HDF5 chunks, bounded in bytes, shared by
//! every stream and client, so a chunk holding many samples is decompressed
//! once rather than once per sample. Least-recently-used eviction.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;

/// Identifies one chunk of one field of one open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    /// Field-of-file id from [`ChunkCache::new_id`].
    pub field: u64,
    /// Linear chunk index in the dataset's chunk grid.
    pub chunk: u64,
}

/// A bounded, thread-safe cache of decoded chunks.
#[derive(Debug)]
pub struct ChunkCache {
    capacity: usize,
    inner: Mutex<Inner>,
    next_id: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    map: LruCache<ChunkKey, Arc<Vec<u8>>>,
    bytes: usize,
}

/// Counters for `stoker status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes held.
    pub bytes: u64,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Chunks held.
    pub entries: u64,
    /// Lookups that found their chunk.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
}

impl ChunkCache {
    /// A cache holding at most `capacity` bytes of decoded chunks (0 disables it).
    pub fn new(capacity: usize) -> ChunkCache {
        ChunkCache {
            capacity,
            inner: Mutex::new(Inner { map: LruCache::unbounded(), bytes: 0 }),
            next_id: AtomicU64::new(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// A fresh id for one field of one opened file.
    pub fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The chunk, if cached.
    pub fn get(&self, key: &ChunkKey) -> Option<Arc<Vec<u8>>> {
        let hit = self.lock().map.get(key).cloned();
        let counter = if hit.is_some() { &self.hits } else { &self.misses };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Caches a decoded chunk, evicting the least recently used ones to stay within capacity.
    pub fn insert(&self, key: ChunkKey, data: Arc<Vec<u8>>) {
        if data.len() > self.capacity {
            return;
        }
        let mut inner = self.lock();
        if let Some(old) = inner.map.put(key, data.clone()) {
            inner.bytes -= old.len();
        }
        inner.bytes += data.len();
        while inner.bytes > self.capacity {
            match inner.map.pop_lru() {
                Some((_, evicted)) => inner.bytes -= evicted.len(),
                None => break,
            }
        }
    }

    /// Current counters.
    pub fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            bytes: inner.bytes as u64,
            capacity: self.capacity as u64,
            entries: inner.map.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_capacity_evicting_least_recent() {
        let cache = ChunkCache::new(10);
        let key = |chunk| ChunkKey { field: 1, chunk };
        cache.insert(key(0), Arc::new(vec![0u8; 4]));
        cache.insert(key(1), Arc::new(vec![1u8; 4]));
        assert!(cache.get(&key(0)).is_some()); // 0 is now more recent than 1
        cache.insert(key(2), Arc::new(vec![2u8; 4]));
        assert!(cache.get(&key(1)).is_none());
        assert!(cache.get(&key(0)).is_some() && cache.get(&key(2)).is_some());
        let stats = cache.stats();
        assert_eq!((stats.bytes, stats.entries), (8, 2));
        cache.insert(key(3), Arc::new(vec![3u8; 11])); // larger than the whole cache: not kept
        assert!(cache.get(&key(3)).is_none());
    }
}
