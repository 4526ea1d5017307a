//! How much memory the daemon may use, and watching it while it runs.
//!
//! The budget defaults to half of what the daemon may use: the limit of the
//! cgroup it runs in (v2 `memory.max`/`memory.high`, v1
//! `memory.limit_in_bytes`, the lowest of its cgroup and their ancestors: a
//! Slurm step's or a systemd unit's) where that is below the machine's
//! memory, else `/proc/meminfo`'s `MemTotal`. [`Limit::source`] says which,
//! for the log and `stoker validate`. While the daemon runs, [`watch`]
//! reads the cgroup's unreclaimable use (anonymous memory and shared memory:
//! the caches, the rings, the helpers) once a second and sheds cache entries
//! when it passes 85% of the limit, before the kernel's OOM killer would
//! act; and drops the caches after `[cache] idle_release_s` without a stream.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the daemon may use, and where that figure comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure came from, in words.
    pub source: String,
    /// The cgroup directory that set it (none: the machine's memory).
    pub cgroup: Option<Cgroup>,
}

/// A memory cgroup directory and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    /// Its directory under the cgroup file system.
    pub dir: PathBuf,
    /// 1 or 2.
    pub version: u8,
}

/// v1's "no limit" is a huge page-aligned number: anything from 2^60 up.
const UNLIMITED_V1: u64 = 1 << 60;

/// The memory this process may use: its cgroup's limit, else the machine's.
pub fn limit() -> Option<Limit> {
    let machine = physical_memory();
    let cgroup = cgroup_limit();
    match (machine, cgroup) {
        (Some(m), Some((bytes, dir))) if bytes < m => Some(Limit {
            bytes,
            source: format!("the limit of cgroup {} ({} bytes)", dir.dir.display(), bytes),
            cgroup: Some(dir),
        }),
        (Some(m), cg) => Some(Limit {
            bytes: m,
            source: "the machine's memory (/proc/meminfo MemTotal)".into(),
            cgroup: cg.map(|(_, dir)| dir),
        }),
        (None, Some((bytes, dir))) => Some(Limit {
            bytes,
            source: format!("the limit of cgroup {} ({} bytes)", dir.dir.display(), bytes),
            cgroup: Some(dir),
        }),
        (None, None) => None,
    }
}

/// Bytes of physical memory, from `/proc/meminfo`.
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The lowest memory limit of this process's cgroup and its ancestors, with
/// the cgroup (its own directory, for usage) it was read under.
fn cgroup_limit() -> Option<(u64, Cgroup)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_in(&text, Path::new("/sys/fs/cgroup"))
}

fn cgroup_limit_in(proc_cgroup: &str, root: &Path) -> Option<(u64, Cgroup)> {
    // v1's memory controller if it is mounted, else the v2 hierarchy.
    let v1 = proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_string())
    });
    let v2 = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string));
    let (mount, path, version) = match (v1, v2) {
        (Some(p), _) if root.join("memory").is_dir() => (root.join("memory"), p, 1u8),
        (_, Some(p)) if root.join("cgroup.controllers").is_file() => (root.to_path_buf(), p, 2u8),
        (_, Some(p)) if root.join("unified/cgroup.controllers").is_file() => (root.join("unified"), p, 2u8),
        _ => return None,
    };
    // Inside a container without its own cgroup namespace the mount's root
    // may be the container's cgroup: use the longest tail of the path that exists.
    let rel = path.trim_start_matches('/');
    let parts: Vec<&str> = rel.split('/').filter(|s| !s.is_empty()).collect();
    let own = (0..=parts.len()).map(|skip| mount.join(parts[skip..].join("/"))).find(|d| d.is_dir())?;
    let mut lowest: Option<u64> = None;
    let mut dir = own.clone();
    loop {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let here = match version {
            1 => read("memory.limit_in_bytes").and_then(|t| t.trim().parse::<u64>().ok()).filter(|&b| b < UNLIMITED_V1),
            _ => ["memory.max", "memory.high"]
                .iter()
                .filter_map(|n| read(n).and_then(|t| t.trim().parse::<u64>().ok()))
                .min(),
        };
        if let Some(b) = here {
            lowest = Some(lowest.map_or(b, |l| l.min(b)));
        }
        if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
            break;
        }
    }
    Some((lowest?, Cgroup { dir: own, version }))
}

/// Unreclaimable bytes the cgroup holds now: anonymous memory and shared
/// memory (page cache of the data files is reclaimable and not counted).
pub fn unreclaimable(cgroup: &Cgroup) -> Option<u64> {
    let stat = std::fs::read_to_string(cgroup.dir.join("memory.stat")).ok()?;
    let field = |name: &str| {
        stat.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse::<u64>().ok()).flatten()
        })
    };
    match cgroup.version {
        1 => Some(field("total_rss")?.saturating_add(field("total_shmem").unwrap_or(0))),
        _ => Some(field("anon")?.saturating_add(field("shmem").unwrap_or(0))),
    }
}

/// Share of the limit past which the caches shed entries.
const HIGH_WATER: f64 = 0.85;

/// Watches memory while `open_streams` answers (it gives `None` once the
/// daemon is gone; see the module's doc): sheds cache entries under
/// pressure, drops them after `idle_release` without a stream.
pub fn watch(
    caches: std::sync::Weak<stoker_data::cache::Caches>,
    open_streams: impl Fn() -> Option<usize>,
    limit: Option<Limit>,
    idle_release: Option<Duration>,
) {
    let mut idle_since: Option<Instant> = None;
    let mut released = false;
    while let (Some(caches), Some(streams)) = (caches.upgrade(), open_streams()) {
        let caches: Arc<stoker_data::cache::Caches> = caches;
        if let Some(Limit { bytes: limit, cgroup: Some(cgroup), .. }) = &limit
            && let Some(used) = unreclaimable(cgroup)
            && used as f64 > HIGH_WATER * *limit as f64
        {
            let held = caches.bytes();
            let (entries, bytes) = caches.shed(held / 2);
            if entries > 0 {
                tracing::warn!(
                    used,
                    limit,
                    shed_entries = entries,
                    shed_bytes = bytes,
                    "memory pressure in the daemon's cgroup: cache entries shed"
                );
            }
        }
        if let Some(after) = idle_release {
            if streams == 0 {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if !released && since.elapsed() >= after {
                    let (entries, bytes) = caches.shed(0);
                    released = true;
                    if entries > 0 {
                        tracing::info!(entries, bytes, "no stream for [cache] idle_release_s: caches released");
                    }
                }
            } else {
                idle_since = None;
                released = false;
            }
        }
        drop(caches);
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_limit_of_a_cgroup_and_its_ancestors_counts() {
        let root = tempfile::tempdir().unwrap();
        let mem = root.path().join("memory");
        let leaf = mem.join("job/step");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(mem.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(mem.join("job/memory.limit_in_bytes"), "209715200\n").unwrap();
        std::fs::write(leaf.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let (bytes, cg) = cgroup_limit_in("4:memory:/job/step\n0::/\n", root.path()).unwrap();
        assert_eq!((bytes, cg.version), (200 << 20, 1));
        assert_eq!(cg.dir, leaf);
        // No limit anywhere: none.
        std::fs::write(mem.join("job/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert!(cgroup_limit_in("4:memory:/job/step\n", root.path()).is_none());
    }

    #[test]
    fn v2_reads_max_and_high_and_a_container_s_shorter_path() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "memory\n").unwrap();
        // The container sees its own cgroup as the mount's root.
        std::fs::write(root.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(root.path().join("memory.high"), "104857600\n").unwrap();
        let (bytes, cg) = cgroup_limit_in("0::/system.slice/job.scope\n", root.path()).unwrap();
        assert_eq!((bytes, cg.version), (100 << 20, 2));
        std::fs::write(root.path().join("memory.stat"), "anon 1000\nfile 5000\nshmem 24\n").unwrap();
        assert_eq!(unreclaimable(&cg), Some(1024));
    }
}
