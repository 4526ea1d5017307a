//! The daemon's TOML config: the file format (`Config`, with the documented
//! defaults) and the checked form the daemon runs with (`Settings`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Errors in a config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// Config path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown or mistyped keys (the message has the line).
    #[error("invalid config {path}: {message}")]
    Parse {
        /// Config path.
        path: PathBuf,
        /// toml's message, with line and column.
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid config {path}: {message}")]
    Invalid {
        /// Config path.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Top level of `stoker.toml`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[server]`: socket and access control.
    pub server: ServerConfig,
    /// `[workers]`: the decode thread pool.
    pub workers: WorkersConfig,
    /// `[ring]`: per-stream shared-memory rings.
    pub ring: RingConfig,
    /// `[limits]`: ceilings checked before allocating anything.
    pub limits: LimitsConfig,
    /// `[cache]`: the node-wide cache of decoded data.
    pub cache: CacheConfig,
    /// `[hdf5]`: how HDF5 files are read.
    pub hdf5: Hdf5Config,
    /// `[datasets.NAME]`: datasets clients can open by name.
    pub datasets: BTreeMap<String, DatasetConfig>,
    /// `[metrics]`: the Prometheus endpoint.
    pub metrics: MetricsConfig,
}

/// `[metrics]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address (`IP:port`) serving Prometheus metrics on `GET /metrics`;
    /// unset: no metrics endpoint.
    pub listen: Option<String>,
}

/// `[server]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Unix socket the daemon listens on.
    pub socket: PathBuf,
    /// Uids served besides root and the daemon's own uid.
    pub allowed_uids: Vec<u32>,
    /// Directories under which clients may open ad-hoc datasets
    /// (`stoker.hdf5(...)`); empty means only named datasets are served.
    /// Unset: `["/"]` for a daemon that is not root and serves only its own
    /// user (no `allowed_uids`/`allowed_gids`: it reads with that user's
    /// rights, for that user alone), else empty.
    pub allowed_roots: Option<Vec<PathBuf>>,
    /// Gids (primary or supplementary) whose members are served.
    pub allowed_gids: Vec<u32>,
    /// Socket file mode as an octal string (`"0660"`). Unset: `0660` with a
    /// `socket_group`, `0666` when `allowed_uids`/`allowed_gids` name others, else `0600`.
    pub socket_mode: Option<String>,
    /// Group owning the socket file (name from /etc/group, or a number).
    pub socket_group: Option<String>,
    /// Seconds a client may take to send the rest of a message it started.
    pub frame_timeout_s: f64,
    /// Seconds SIGTERM waits for connections to hear `ShuttingDown` and close.
    pub shutdown_grace_s: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            socket: PathBuf::from(stoker_proto::DEFAULT_SOCKET),
            allowed_uids: Vec::new(),
            allowed_roots: None,
            allowed_gids: Vec::new(),
            socket_mode: None,
            socket_group: None,
            frame_timeout_s: 10.0,
            shutdown_grace_s: 5.0,
        }
    }
}

/// `[workers]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Decode threads; 0 means one per available core.
    pub threads: usize,
}

/// `[ring]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RingConfig {
    /// Batch slots per stream: how far the daemon prefetches, plus the batches a client holds.
    pub depth: u32,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig { depth: 4 }
    }
}

/// `[limits]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request frame accepted, in bytes.
    pub max_message_bytes: usize,
    /// Largest batch size a stream may ask for.
    pub max_batch_size: u64,
    /// Shared memory all of one client's rings may take together, in bytes.
    pub max_ring_bytes_per_client: u64,
    /// Streams one client connection may hold open.
    pub max_streams_per_client: usize,
    /// Connections served at once, from everyone.
    pub max_connections: usize,
    /// Connections one uid may hold at once (root and the daemon's uid are not capped).
    pub max_connections_per_uid: usize,
    /// Most bytes one sample of one field may take: in the batch (a ragged
    /// field's reserved room included), decoded, and at every transform step.
    pub max_sample_bytes: u64,
    /// Most bytes one batch (one ring slot) may take.
    pub max_batch_bytes: u64,
    /// Memory the daemon may take for the rings of all clients together plus
    /// the chunk cache's capacity, in bytes; 0 means half of the machine's
    /// physical memory.
    pub max_memory_bytes: u64,
    /// Shared memory the streams of one uid may hold together, in bytes; 0
    /// means half of what `max_memory_bytes` leaves for streams. Root and the
    /// daemon's own uid are not capped per uid.
    pub max_memory_bytes_per_uid: u64,
    /// HDF5 files open at once across all datasets (each takes two descriptors
    /// and libhdf5's caches); the least recently read beyond it are closed and
    /// reopened on their next read. Also bounded by half the descriptor limit.
    pub max_open_files: usize,
    /// Seconds a dataset no stream uses keeps its files open (and HDF5-locked)
    /// for the next stream; 0 closes them when the last stream closes.
    pub idle_close_s: f64,
}

impl LimitsConfig {
    /// The per-sample and per-batch ceilings, as the batch layout checks them.
    pub fn layout(&self) -> stoker_proto::LayoutLimits {
        stoker_proto::LayoutLimits { max_sample_bytes: self.max_sample_bytes, max_batch_bytes: self.max_batch_bytes }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_message_bytes: 1 << 20,
            max_batch_size: 1 << 16,
            max_ring_bytes_per_client: 8 << 30,
            max_streams_per_client: 16,
            max_connections: 1024,
            max_connections_per_uid: 128,
            max_sample_bytes: stoker_proto::DEFAULT_MAX_SAMPLE_BYTES,
            max_batch_bytes: stoker_proto::DEFAULT_MAX_BATCH_BYTES,
            max_memory_bytes: 0,
            max_memory_bytes_per_uid: 0,
            max_open_files: 512,
            idle_close_s: 2.0,
        }
    }
}

/// `[hdf5]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Hdf5Config {
    /// Read contiguous and chunked data with pread and decompress in Rust on
    /// the worker threads; `false` reads everything through libhdf5 (one
    /// thread at a time, under its global lock).
    pub fast_path: bool,
    /// Seconds one request to an HDF5 helper process (an open, a chunk
    /// lookup, a library read) may take before the helper is killed and the
    /// request fails.
    pub helper_timeout_s: f64,
    /// Address space of one HDF5 helper process (one per user with open
    /// ad-hoc HDF5 datasets, one for named datasets); 0 = unbounded.
    pub helper_memory_bytes: u64,
}

impl Default for Hdf5Config {
    fn default() -> Self {
        Hdf5Config { fast_path: true, helper_timeout_s: 60.0, helper_memory_bytes: 8 << 30 }
    }
}

/// `[cache]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Bytes of decoded HDF5 chunks kept, shared by all streams (0 disables
    /// the cache). Unset: 512 MiB, or a quarter of the memory budget if that
    /// is less (a job's cgroup).
    pub chunk_bytes: Option<u64>,
    /// Bytes of decoded samples kept (images and compressed values of LMDB
    /// fields, before random transforms), shared by all streams and jobs (0
    /// disables it). Unset: 1 GiB, or a quarter of what the memory budget
    /// leaves after the chunk cache if that is less.
    pub sample_bytes: Option<u64>,
    /// Which entry both caches evict: `"belady"` (furthest next use over
    /// every registered stream) or `"lru"`.
    pub policy: stoker_data::cache::Policy,
    /// Seconds without any stream after which both caches are emptied (their
    /// memory given back); 0 keeps them for the next job.
    pub idle_release_s: f64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            chunk_bytes: None,
            sample_bytes: None,
            policy: stoker_data::cache::Policy::Belady,
            idle_release_s: 0.0,
        }
    }
}

/// `[datasets.NAME]` table, by `format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "format", rename_all = "lowercase")]
// One per dataset, parsed once at start: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub enum DatasetConfig {
    /// `format = "hdf5"`.
    Hdf5(stoker_proto::Hdf5Dataset),
    /// `format = "lmdb"`: fields as `[[datasets.NAME.fields]]` tables.
    Lmdb(stoker_proto::LmdbDataset),
}

/// The checked configuration the daemon runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Socket path.
    pub socket: PathBuf,
    /// Uids served besides root and the daemon's own.
    pub allowed_uids: Vec<u32>,
    /// Canonical roots for ad-hoc datasets.
    pub allowed_roots: Vec<PathBuf>,
    /// Gids served (primary or supplementary).
    pub allowed_gids: Vec<u32>,
    /// Mode the socket file gets.
    pub socket_mode: u32,
    /// Group the socket file gets, if any.
    pub socket_gid: Option<u32>,
    /// Deadline for the rest of a started message.
    pub frame_timeout: std::time::Duration,
    /// How long SIGTERM lets connections drain.
    pub shutdown_grace: std::time::Duration,
    /// Worker threads (resolved, ≥ 1).
    pub worker_threads: usize,
    /// Slots per ring.
    pub ring_depth: u32,
    /// Limits (`max_memory_bytes` resolved: never 0).
    pub limits: LimitsConfig,
    /// Where `limits.max_memory_bytes` comes from, in words (for the log).
    pub memory_source: String,
    /// The memory the daemon may use (its cgroup's limit or the machine's), watched while it runs.
    pub memory_limit: Option<crate::memory::Limit>,
    /// `[cache] idle_release_s`, when set.
    pub cache_idle_release: Option<std::time::Duration>,
    /// Bytes of the decoded-chunk cache.
    pub chunk_cache_bytes: u64,
    /// Bytes of the decoded-sample cache.
    pub sample_cache_bytes: u64,
    /// Eviction policy of both caches.
    pub cache_policy: stoker_data::cache::Policy,
    /// HDF5 fast path on or off.
    pub hdf5_fast_path: bool,
    /// How HDF5 helper processes run.
    pub helper_limits: crate::helper::HelperLimits,
    /// Named datasets.
    pub datasets: BTreeMap<String, DatasetConfig>,
    /// Where metrics are served, if anywhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
}

impl Config {
    /// Reads and parses `path`; unknown keys are errors naming their line.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Config::parse(&text, path)
    }

    /// Parses config text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let mut message = e.to_string().trim_end().to_string();
            // Errors inside a `format`-tagged dataset table point at the table's
            // header; name the line of the offending key as well.
            if let Some(key) = message.split("unknown field `").nth(1).and_then(|r| r.split('`').next()) {
                let at = text
                    .lines()
                    .position(|l| l.trim_start().strip_prefix(key).is_some_and(|r| r.trim_start().starts_with('=')));
                if let Some(line) = at {
                    message.push_str(&format!(" (`{key}` is on line {})", line + 1));
                }
            }
            ConfigError::Parse { path: path.to_owned(), message }
        })
    }

    /// Checks values and resolves defaults; every problem found is named in
    /// the error (see [`Config::check`] for them one by one).
    pub fn validate(self, path: &Path) -> Result<Settings, ConfigError> {
        self.check().map_err(|problems| ConfigError::Invalid {
            path: path.to_owned(),
            message: problems.iter().map(|p| p.message.as_str()).collect::<Vec<_>>().join("; "),
        })
    }

    /// Problems of `[ring]` and `[limits]` values taken one by one.
    fn check_limits(&self, problem: &mut dyn FnMut(&[&str], String)) {
        if !(1..=1024).contains(&self.ring.depth) {
            problem(&["ring", "depth"], format!("[ring] depth = {} must be between 1 and 1024", self.ring.depth));
        }
        if self.limits.max_batch_size == 0 {
            problem(&["limits", "max_batch_size"], "[limits] max_batch_size must be at least 1".into());
        }
        if self.limits.max_message_bytes < 4096 || self.limits.max_message_bytes > stoker_proto::MAX_FRAME_BYTES {
            problem(
                &["limits", "max_message_bytes"],
                format!(
                    "[limits] max_message_bytes = {} must be between 4096 and {}",
                    self.limits.max_message_bytes,
                    stoker_proto::MAX_FRAME_BYTES
                ),
            );
        }
        if !(self.limits.idle_close_s >= 0.0 && self.limits.idle_close_s <= 86_400.0) {
            problem(
                &["limits", "idle_close_s"],
                format!("[limits] idle_close_s = {} must be between 0 and 86400", self.limits.idle_close_s),
            );
        }
        if self.limits.max_open_files == 0 {
            problem(&["limits", "max_open_files"], "[limits] max_open_files must be at least 1".into());
        }
    }

    /// Problems of the `[datasets.NAME]` tables that need no file to find
    /// (the HDF5 ones are [`stoker_proto::Hdf5Dataset::problems`]).
    fn check_datasets(&self, problem: &mut dyn FnMut(&[&str], String)) {
        for (name, ds) in &self.datasets {
            let ds = match ds {
                DatasetConfig::Hdf5(ds) => ds,
                DatasetConfig::Lmdb(ds) => {
                    if ds.fields.is_empty() {
                        problem(
                            &["datasets", name],
                            format!(
                                "[datasets.{name}] has no fields; add [[datasets.{name}.fields]] tables with name, \
                                 env and codec"
                            ),
                        );
                    }
                    for (i, f) in ds.fields.iter().enumerate() {
                        if !Path::new(&f.env).is_absolute() {
                            problem(
                                &["datasets", name, "fields", &i.to_string(), "env"],
                                format!(
                                    "[datasets.{name}] field {:?}: env = {:?} must be an absolute path",
                                    f.name, f.env
                                ),
                            );
                        }
                    }
                    if let Some(key_file) = ds.key_file.as_ref().filter(|k| !Path::new(k).is_absolute()) {
                        problem(
                            &["datasets", name, "key_file"],
                            format!("[datasets.{name}] key_file = {key_file:?} must be an absolute path"),
                        );
                    }
                    continue;
                }
            };
            for p in ds.problems() {
                problem(&["datasets", name, p.key], format!("[datasets.{name}] {}", p.message));
            }
        }
    }

    /// The socket's group and mode: as configured, else what the allowed
    /// users and groups need (0660 with a group, 0666 with other users, 0600).
    fn socket_access(server: &ServerConfig, problem: &mut dyn FnMut(&[&str], String)) -> (Option<u32>, u32) {
        let socket_gid = match &server.socket_group {
            None => None,
            Some(g) => {
                let gid = resolve_group(g);
                if gid.is_none() {
                    problem(
                        &["server", "socket_group"],
                        format!("[server] socket_group = {g:?} is neither a number nor a group in /etc/group"),
                    );
                }
                gid
            }
        };
        let socket_mode = match &server.socket_mode {
            Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
                Ok(mode) if mode <= 0o777 => mode,
                _ => {
                    problem(
                        &["server", "socket_mode"],
                        format!("[server] socket_mode = {m:?} must be octal permissions like \"0660\""),
                    );
                    0o600
                }
            },
            None if socket_gid.is_some() => 0o660,
            None if !server.allowed_uids.is_empty() || !server.allowed_gids.is_empty() => 0o666,
            None => 0o600,
        };
        (socket_gid, socket_mode)
    }

    /// Checks values and resolves defaults, collecting every problem rather
    /// than stopping at the first.
    pub fn check(self) -> Result<Settings, Vec<Problem>> {
        let mut problems = Vec::new();
        let mut problem = |at: &[&str], message: String| problems.push(Problem::new(at, message));
        self.check_limits(&mut problem);
        self.check_datasets(&mut problem);
        if self.limits.max_sample_bytes == 0 || self.limits.max_batch_bytes == 0 {
            let key = if self.limits.max_sample_bytes == 0 { "max_sample_bytes" } else { "max_batch_bytes" };
            problem(&["limits", key], "[limits] max_sample_bytes and max_batch_bytes must be at least 1".into());
        }
        let mut limits = self.limits;
        let memory_limit = crate::memory::limit();
        let memory_source = if limits.max_memory_bytes == 0 {
            limits.max_memory_bytes = memory_limit.as_ref().map_or(u64::MAX, |l| l.bytes / 2);
            memory_limit
                .as_ref()
                .map_or_else(|| "unbounded: no memory figure found".into(), |l| format!("half of {}", l.source))
        } else {
            "[limits] max_memory_bytes".into()
        };
        let chunk_bytes = self.cache.chunk_bytes.unwrap_or_else(|| (512u64 << 20).min(limits.max_memory_bytes / 4));
        let sample_bytes = self
            .cache
            .sample_bytes
            .unwrap_or_else(|| (1u64 << 30).min(limits.max_memory_bytes.saturating_sub(chunk_bytes) / 4));
        if !(self.cache.idle_release_s >= 0.0 && self.cache.idle_release_s <= 1e9) {
            problem(
                &["cache", "idle_release_s"],
                format!("[cache] idle_release_s = {} must be seconds >= 0", self.cache.idle_release_s),
            );
        }
        let cache_idle_release = (self.cache.idle_release_s > 0.0)
            .then(|| std::time::Duration::from_secs_f64(self.cache.idle_release_s.min(1e9)));
        if chunk_bytes.saturating_add(sample_bytes) >= limits.max_memory_bytes {
            let key = if sample_bytes > chunk_bytes { "sample_bytes" } else { "chunk_bytes" };
            problem(
                &["cache", key],
                format!(
                    "[cache] chunk_bytes = {} plus sample_bytes = {} leave nothing of the daemon's memory budget \
                     ([limits] max_memory_bytes = {}) for the rings; lower them or raise the budget",
                    chunk_bytes, sample_bytes, limits.max_memory_bytes
                ),
            );
        }
        let mut allowed_roots = Vec::new();
        let own_user_only = !rustix::process::geteuid().is_root()
            && self.server.allowed_uids.is_empty()
            && self.server.allowed_gids.is_empty();
        let roots = match &self.server.allowed_roots {
            Some(roots) => roots.clone(),
            None if own_user_only => vec![PathBuf::from("/")],
            None => Vec::new(),
        };
        for root in &roots {
            // A root that does not exist yet cannot hold files either; keep it as written.
            allowed_roots.push(root.canonicalize().unwrap_or_else(|_| root.clone()));
        }
        let (socket_gid, socket_mode) = Config::socket_access(&self.server, &mut problem);
        let mut seconds = |key: &str, s: f64| {
            if s.is_finite() && s > 0.0 && s <= 3600.0 {
                std::time::Duration::from_secs_f64(s)
            } else {
                problem(&["server", key], format!("[server] {key} = {s} must be between 0 and 3600 seconds"));
                std::time::Duration::ZERO
            }
        };
        let frame_timeout = seconds("frame_timeout_s", self.server.frame_timeout_s);
        let shutdown_grace = seconds("shutdown_grace_s", self.server.shutdown_grace_s);
        let helper_timeout = if self.hdf5.helper_timeout_s.is_finite()
            && self.hdf5.helper_timeout_s > 0.0
            && self.hdf5.helper_timeout_s <= 3600.0
        {
            std::time::Duration::from_secs_f64(self.hdf5.helper_timeout_s)
        } else {
            problem(
                &["hdf5", "helper_timeout_s"],
                format!("[hdf5] helper_timeout_s = {} must be between 0 and 3600 seconds", self.hdf5.helper_timeout_s),
            );
            std::time::Duration::ZERO
        };
        if limits.max_connections == 0 || limits.max_connections_per_uid == 0 {
            let key = if limits.max_connections == 0 { "max_connections" } else { "max_connections_per_uid" };
            problem(&["limits", key], "[limits] max_connections and max_connections_per_uid must be at least 1".into());
        }
        let metrics_listen = match &self.metrics.listen {
            None => None,
            Some(addr) => match addr.parse() {
                Ok(addr) => Some(addr),
                Err(_) => {
                    problem(
                        &["metrics", "listen"],
                        format!(
                            "[metrics] listen = {addr:?} must be an IP address and port, like \"127.0.0.1:9464\" or \
                             \"[::1]:9464\""
                        ),
                    );
                    None
                }
            },
        };
        if !problems.is_empty() {
            return Err(problems);
        }
        let worker_threads = match self.workers.threads {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        };
        Ok(Settings {
            socket: self.server.socket,
            allowed_uids: self.server.allowed_uids,
            allowed_roots,
            allowed_gids: self.server.allowed_gids,
            socket_mode,
            socket_gid,
            frame_timeout,
            shutdown_grace,
            worker_threads,
            ring_depth: self.ring.depth,
            limits,
            chunk_cache_bytes: chunk_bytes,
            memory_source,
            memory_limit,
            cache_idle_release,
            sample_cache_bytes: sample_bytes,
            cache_policy: self.cache.policy,
            hdf5_fast_path: self.hdf5.fast_path,
            helper_limits: crate::helper::HelperLimits {
                timeout: helper_timeout,
                memory_bytes: self.hdf5.helper_memory_bytes,
            },
            datasets: self.datasets,
            metrics_listen,
        })
    }
}

/// One problem found in a config: what is wrong, and the key or table it is
/// about (for the line `stoker validate` prints with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Key path: tables, keys and array indices, e.g. `["datasets", "a", "fields", "1", "env"]`.
    pub at: Vec<String>,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl Problem {
    pub(crate) fn new(at: &[&str], message: String) -> Problem {
        Problem { at: at.iter().map(|s| s.to_string()).collect(), message }
    }

    /// The 1-based line in `text` (the config the problem was found in) of
    /// the key it is about, or of the nearest enclosing table written there.
    pub fn line(&self, text: &str) -> Option<usize> {
        use toml::de::{DeTable, DeValue};
        let doc = DeTable::parse(text).ok()?;
        let mut span = None;
        let mut table = Some(doc.get_ref());
        let mut array: Option<&[toml::Spanned<DeValue<'_>>]> = None;
        for seg in &self.at {
            let value = if let Some(t) = table {
                let Some((key, value)) = t.iter().find(|(k, _)| k.get_ref().as_ref() == seg.as_str()) else { break };
                span = Some(key.span());
                value
            } else if let Some(items) = array {
                let Some(value) = seg.parse::<usize>().ok().and_then(|i| items.get(i)) else { break };
                span = Some(value.span());
                value
            } else {
                break;
            };
            (table, array) = match value.get_ref() {
                DeValue::Table(t) => (Some(t), None),
                DeValue::Array(a) => (None, Some(&a[..])),
                _ => (None, None),
            };
        }
        let offset = span?.start;
        Some(text.get(..offset)?.matches('\n').count() + 1)
    }
}

/// A group name (looked up in /etc/group; no NSS) or a numeric gid.
fn resolve_group(group: &str) -> Option<u32> {
    if let Ok(gid) = group.parse() {
        return Some(gid);
    }
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|line| {
        let mut parts = line.split(':');
        (parts.next()? == group).then_some(())?;
        parts.nth(1)?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_key_names_its_line() {
        let err = Config::parse("[ring]\ndepth = 4\ndeepth = 5\n", Path::new("x.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains("deepth"), "{msg}");
    }

    #[test]
    fn unknown_key_in_a_dataset_table_names_its_line() {
        let text =
            "[datasets.x]\nformat = \"lmdb\"\n[[datasets.x.fields]]\nname = \"a\"\nenv = \"/e\"\ncodex = \"png\"\n";
        let msg = Config::parse(text, Path::new("x.toml")).unwrap_err().to_string();
        assert!(msg.contains("codex") && msg.contains("line 6"), "{msg}");
    }

    #[test]
    fn shipped_default_config_is_valid_and_matches_defaults() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/stoker.toml"));
        let cfg = Config::load(path).unwrap();
        assert_eq!(cfg.ring.depth, RingConfig::default().depth);
        assert_eq!(cfg.server.socket, ServerConfig::default().socket);
        assert_eq!(cfg.limits.max_batch_size, LimitsConfig::default().max_batch_size);
        let (shipped, default) = (&cfg.limits, LimitsConfig::default());
        assert_eq!(
            (shipped.max_sample_bytes, shipped.max_batch_bytes, shipped.max_memory_bytes),
            (default.max_sample_bytes, default.max_batch_bytes, default.max_memory_bytes)
        );
        assert_eq!(shipped.max_ring_bytes_per_client, default.max_ring_bytes_per_client);
        assert_eq!(shipped.max_memory_bytes_per_uid, default.max_memory_bytes_per_uid);
        cfg.validate(path).unwrap();
    }

    #[test]
    fn commented_examples_in_the_shipped_config_are_valid() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/stoker.toml"));
        let text = std::fs::read_to_string(path).unwrap();
        // Uncomment every `# [datasets.…` example block (up to the next blank `#` line
        // that is followed by prose) and parse the result.
        let mut uncommented = String::new();
        let mut in_example = false;
        for line in text.lines() {
            let body = line.strip_prefix("# ").or_else(|| line.strip_prefix('#'));
            match body {
                Some(b) if b.starts_with("[datasets.") || b.starts_with("[[datasets.") => {
                    in_example = true;
                    uncommented.push_str(b);
                }
                Some(b) if in_example && (b.is_empty() || b.contains(" = ")) => uncommented.push_str(b),
                _ => {
                    in_example = false;
                    uncommented.push_str(line);
                }
            }
            uncommented.push('\n');
        }
        let cfg = Config::parse(&uncommented, path).unwrap();
        let names: Vec<_> = cfg.datasets.keys().cloned().collect();
        assert_eq!(names, ["div2k", "imagenet", "replay", "shear_flow", "shear_flow_split", "train"]);
        let Some(DatasetConfig::Hdf5(replay)) = cfg.datasets.get("replay") else { panic!("replay is HDF5") };
        assert_eq!(replay.rescan, stoker_proto::Rescan::Epoch);
        cfg.validate(path).unwrap();
    }

    #[test]
    fn metrics_listen_is_an_address() {
        let parse = |text: &str| Config::parse(text, Path::new("c.toml")).unwrap().validate(Path::new("c.toml"));
        assert_eq!(parse("").unwrap().metrics_listen, None);
        let on = parse("[metrics]\nlisten = \"127.0.0.1:9464\"\n").unwrap();
        assert_eq!(on.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        let err = parse("[metrics]\nlisten = \"localhost\"\n").unwrap_err().to_string();
        assert!(err.contains("[metrics] listen") && err.contains("localhost"), "{err}");
    }

    #[test]
    fn every_problem_is_reported_with_the_line_of_its_key() {
        let text = "[ring]\ndepth = 0\n\n[limits]\nmax_batch_size = 0\n\n[datasets.a]\nformat = \"hdf5\"\n\
                    files = \"rel/*.h5\"\nfields = { x = \"x\" }\n\n[datasets.b]\nformat = \"lmdb\"\n\
                    [[datasets.b.fields]]\nname = \"p\"\nenv = \"/abs\"\ncodec = \"png\"\n\
                    [[datasets.b.fields]]\nname = \"q\"\nenv = \"rel\"\ncodec = \"png\"\n";
        let problems = Config::parse(text, Path::new("c.toml")).unwrap().check().unwrap_err();
        let lines: Vec<Option<usize>> = problems.iter().map(|p| p.line(text)).collect();
        assert_eq!(lines, [Some(2), Some(5), Some(9), Some(20)], "{problems:#?}");
        let msg = Config::parse(text, Path::new("c.toml")).unwrap().validate(Path::new("c.toml")).unwrap_err();
        let msg = msg.to_string();
        assert!(msg.contains("depth") && msg.contains("max_batch_size") && msg.contains("\"rel\""), "{msg}");
    }

    #[test]
    fn problem_lines_fall_back_to_the_enclosing_table() {
        let text = "[server]\nsocket = \"/s\"\n\n[cache]\n";
        let at = |path: &[&str]| Problem::new(path, String::new()).line(text);
        assert_eq!(at(&["server", "socket"]), Some(2));
        assert_eq!(at(&["server", "socket_mode"]), Some(1), "a default: the table's line");
        assert_eq!(at(&["cache", "chunk_bytes"]), Some(4));
        assert_eq!(at(&["limits", "max_batch_size"]), None, "nothing written: no line");
        let inline = "datasets.a = { format = \"hdf5\", files = \"x\",\n  fields = { y = \"y\" } }\n";
        let p = Problem::new(&["datasets", "a", "fields", "y"], String::new());
        assert_eq!(p.line(inline), Some(2));
    }

    #[test]
    fn relative_dataset_glob_is_rejected() {
        let text = "[datasets.a]\nformat = \"hdf5\"\nfiles = \"data/*.h5\"\nfields = { x = \"x\" }\n";
        let err = Config::parse(text, Path::new("c.toml")).unwrap().validate(Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("datasets.a"), "{err}");
    }
}
