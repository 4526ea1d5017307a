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
    pub allowed_roots: Vec<PathBuf>,
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
            allowed_roots: Vec::new(),
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
}

impl Default for Hdf5Config {
    fn default() -> Self {
        Hdf5Config { fast_path: true }
    }
}

/// `[cache]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Bytes of decoded HDF5 chunks kept, shared by all streams (0 disables the cache).
    pub chunk_bytes: u64,
    /// Bytes of decoded samples kept (images and compressed values of LMDB
    /// fields, before random transforms), shared by all streams and jobs (0
    /// disables it). Unset: 1 GiB, or a quarter of what the memory budget
    /// leaves after the chunk cache if that is less.
    pub sample_bytes: Option<u64>,
    /// Which entry both caches evict: `"belady"` (furthest next use over
    /// every registered stream) or `"lru"`.
    pub policy: crate::cache::Policy,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig { chunk_bytes: 512 << 20, sample_bytes: None, policy: crate::cache::Policy::Belady }
    }
}

/// `[datasets.NAME]` table, by `format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "format", rename_all = "lowercase")]
// One per dataset, parsed once at start: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub enum DatasetConfig {
    /// `format = "hdf5"`.
    Hdf5(Hdf5DatasetConfig),
    /// `format = "lmdb"`: fields as `[[datasets.NAME.fields]]` tables.
    Lmdb(stoker_proto::LmdbDataset),
}

/// A `format = "hdf5"` dataset.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hdf5DatasetConfig {
    /// Absolute glob of the files; matches are taken in sorted order.
    pub files: String,
    /// Field name → HDF5 dataset path inside each file.
    pub fields: BTreeMap<String, String>,
    /// Samples are windows along axis 1 (time): `{ size = 4, stride = 1 }`.
    pub window: Option<WindowConfig>,
    /// With a window, fields delivered whole per item (`field[item]`), e.g. per-trajectory constants.
    #[serde(default)]
    pub per_item: Vec<String>,
    /// With a split window, the fields that take its first `n_steps_input` steps.
    #[serde(default)]
    pub input: Vec<String>,
    /// With a split window, the fields that take its last `n_steps_output` steps.
    #[serde(default)]
    pub output: Vec<String>,
    /// Fields without the item axis (The Well's `sample_varying = False`
    /// constants), delivered whole with every sample of their file.
    #[serde(default)]
    pub constant: Vec<String>,
    /// Windowed fields without the item axis, `[time, ...]` (The Well's
    /// `dimensions/time`): each sample gets its window's steps of them.
    #[serde(default)]
    pub time_only: Vec<String>,
    /// Field name → transform steps run in the daemon (the steps of an LMDB field's `transforms`).
    #[serde(default)]
    pub transforms: BTreeMap<String, Vec<stoker_proto::TransformDef>>,
    /// Field name → `{ with = "other", scale = 1 }`: draw random crops and flips with field `other`.
    #[serde(default)]
    pub pair: BTreeMap<String, stoker_proto::PairDef>,
    /// Field name → the two axes of its sample that spatial steps act on (default: see docs/python.md).
    #[serde(default)]
    pub spatial_axes: BTreeMap<String, [i64; 2]>,
    /// `"epoch"`: match the glob again at each new epoch (files added join,
    /// removed ones leave); `"never"` (default): once, when a stream opens.
    #[serde(default)]
    pub rescan: stoker_proto::Rescan,
}

impl Hdf5DatasetConfig {
    /// The `transforms`, `pair` and `spatial_axes` tables, one entry per field they name.
    pub fn field_transforms(&self) -> Vec<stoker_proto::FieldTransforms> {
        let mut names: Vec<&String> =
            self.transforms.keys().chain(self.pair.keys()).chain(self.spatial_axes.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| stoker_proto::FieldTransforms {
                field: name.clone(),
                steps: self.transforms.get(name).cloned().unwrap_or_default(),
                pair: self.pair.get(name).cloned(),
                spatial_axes: self.spatial_axes.get(name).copied(),
            })
            .collect()
    }
}

impl Hdf5DatasetConfig {
    /// The source spec this table describes (checked by [`Config::validate`]).
    pub fn spec(&self, fast_path: bool) -> crate::source::hdf5::Hdf5Spec {
        let (min_dt_stride, max_dt_stride) = self.window.map_or((1, 1), |w| w.dt_strides());
        crate::source::hdf5::Hdf5Spec {
            files: self.files.clone(),
            fields: self.fields.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            window: self.window.map(|w| w.window()),
            per_item: self.per_item.clone(),
            fast_path,
            sampling: stoker_proto::Hdf5Sampling {
                n_steps_input: self.window.and_then(|w| w.n_steps_input),
                min_dt_stride,
                max_dt_stride,
                input: self.input.clone(),
                output: self.output.clone(),
                constant: self.constant.clone(),
                time_only: self.time_only.clone(),
            },
            max_chunk_bytes: u64::MAX,
        }
    }
}

/// A dataset's `window = { size, stride }`, or The Well's
/// `{ n_steps_input, n_steps_output, dt_stride | min_dt_stride, max_dt_stride }`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowConfig {
    /// Steps per sample (or give `n_steps_input` and `n_steps_output`).
    pub size: Option<u64>,
    /// Steps between the starts of consecutive samples.
    #[serde(default = "one")]
    pub stride: u64,
    /// Steps of each window delivered to the `input` fields (The Well's `n_steps_input`).
    pub n_steps_input: Option<u64>,
    /// Steps after those delivered to the `output` fields (The Well's `n_steps_output`).
    pub n_steps_output: Option<u64>,
    /// Fixed spacing of the steps inside a window (default 1: consecutive).
    pub dt_stride: Option<u64>,
    /// Smallest spacing when each sample draws its own (The Well's `min_dt_stride`).
    pub min_dt_stride: Option<u64>,
    /// Largest spacing when each sample draws its own (The Well's `max_dt_stride`).
    pub max_dt_stride: Option<u64>,
}

impl WindowConfig {
    /// The window: `size`, else `n_steps_input + n_steps_output` (saturating;
    /// `WindowConfig::problem` refuses an overflow).
    pub fn window(&self) -> crate::source::hdf5::Window {
        let split = self.n_steps_input.unwrap_or(0).saturating_add(self.n_steps_output.unwrap_or(0));
        crate::source::hdf5::Window { size: self.size.unwrap_or(split), stride: self.stride }
    }

    /// `(min_dt_stride, max_dt_stride)`: `dt_stride` for both, else the range (each defaulting to the other, then 1).
    pub fn dt_strides(&self) -> (u64, u64) {
        match (self.dt_stride, self.min_dt_stride, self.max_dt_stride) {
            (Some(dt), ..) => (dt, dt),
            (None, min, max) => {
                let min = min.unwrap_or(1);
                (min, max.unwrap_or(min))
            }
        }
    }

    /// What is wrong with the table, if anything.
    fn problem(&self) -> Option<String> {
        let split = (self.n_steps_input, self.n_steps_output);
        if self.size.is_some() && split != (None, None) {
            return Some("give either size or n_steps_input and n_steps_output, not both".into());
        }
        if self.size.is_none() && (split.0.is_none() || split.1.is_none()) {
            return Some(
                "needs size = N, or n_steps_input and n_steps_output (e.g. { n_steps_input = 4, n_steps_output = 1 })"
                    .into(),
            );
        }
        if let (Some(a), Some(b)) = split
            && a.checked_add(b).is_none()
        {
            return Some(format!("n_steps_input {a} + n_steps_output {b} overflows 64 bits"));
        }
        let size = self.window().size;
        if size == 0 || self.stride == 0 {
            return Some(format!("size = {size} and stride = {} must both be at least 1", self.stride));
        }
        if self.dt_stride.is_some() && (self.min_dt_stride.is_some() || self.max_dt_stride.is_some()) {
            return Some("give either dt_stride or min_dt_stride/max_dt_stride, not both".into());
        }
        let (min, max) = self.dt_strides();
        if min == 0 || max < min {
            return Some(format!(
                "step spacing min_dt_stride = {min}, max_dt_stride = {max}: both at least 1, max at least min"
            ));
        }
        None
    }
}

fn one() -> u64 {
    1
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
    /// Bytes of the decoded-chunk cache.
    pub chunk_cache_bytes: u64,
    /// Bytes of the decoded-sample cache.
    pub sample_cache_bytes: u64,
    /// Eviction policy of both caches.
    pub cache_policy: crate::cache::Policy,
    /// HDF5 fast path on or off.
    pub hdf5_fast_path: bool,
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

    /// Checks values and resolves defaults, collecting every problem rather
    /// than stopping at the first.
    pub fn check(self) -> Result<Settings, Vec<Problem>> {
        let mut problems = Vec::new();
        let mut problem = |at: &[&str], message: String| problems.push(Problem::new(at, message));
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
            if !Path::new(&ds.files).is_absolute() {
                problem(
                    &["datasets", name, "files"],
                    format!("[datasets.{name}] files = {:?} must be an absolute path or glob", ds.files),
                );
            }
            if let Some(message) = ds.window.and_then(|w| w.problem()) {
                problem(&["datasets", name, "window"], format!("[datasets.{name}] window {message}"));
            }
            for (key, names) in
                [("input", &ds.input), ("output", &ds.output), ("constant", &ds.constant), ("time_only", &ds.time_only)]
            {
                if let Some(unknown) = names.iter().find(|f| !ds.fields.contains_key(*f)) {
                    problem(
                        &["datasets", name, key],
                        format!("[datasets.{name}] {key} names {unknown:?}, which is not in fields"),
                    );
                }
            }
            if let Some(unknown) = ds.per_item.iter().find(|f| !ds.fields.contains_key(*f)) {
                problem(
                    &["datasets", name, "per_item"],
                    format!("[datasets.{name}] per_item names {unknown:?}, which is not in fields"),
                );
            } else if !ds.per_item.is_empty() && ds.window.is_none() {
                problem(
                    &["datasets", name, "per_item"],
                    format!(
                        "[datasets.{name}] per_item is set but there is no window; without a window every field \
                         is per item (add window = {{ size = 4, stride = 1 }} or remove per_item)"
                    ),
                );
            }
            if ds.fields.is_empty() {
                problem(
                    &["datasets", name, "fields"],
                    format!(
                        "[datasets.{name}] fields is empty; map at least one field name to an HDF5 path, \
                         e.g. fields = {{ x = \"data\" }}"
                    ),
                );
            }
        }
        if self.limits.max_sample_bytes == 0 || self.limits.max_batch_bytes == 0 {
            let key = if self.limits.max_sample_bytes == 0 { "max_sample_bytes" } else { "max_batch_bytes" };
            problem(&["limits", key], "[limits] max_sample_bytes and max_batch_bytes must be at least 1".into());
        }
        let mut limits = self.limits;
        if limits.max_memory_bytes == 0 {
            limits.max_memory_bytes = physical_memory().map_or(u64::MAX, |bytes| bytes / 2);
        }
        let sample_bytes = self
            .cache
            .sample_bytes
            .unwrap_or_else(|| (1u64 << 30).min(limits.max_memory_bytes.saturating_sub(self.cache.chunk_bytes) / 4));
        if self.cache.chunk_bytes.saturating_add(sample_bytes) >= limits.max_memory_bytes {
            let key = if sample_bytes > self.cache.chunk_bytes { "sample_bytes" } else { "chunk_bytes" };
            problem(
                &["cache", key],
                format!(
                    "[cache] chunk_bytes = {} plus sample_bytes = {} leave nothing of the daemon's memory budget \
                     ([limits] max_memory_bytes = {}) for the rings; lower them or raise the budget",
                    self.cache.chunk_bytes, sample_bytes, limits.max_memory_bytes
                ),
            );
        }
        let mut allowed_roots = Vec::new();
        for root in &self.server.allowed_roots {
            // A root that does not exist yet cannot hold files either; keep it as written.
            allowed_roots.push(root.canonicalize().unwrap_or_else(|_| root.clone()));
        }
        let socket_gid = match &self.server.socket_group {
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
        let socket_mode = match &self.server.socket_mode {
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
            None if !self.server.allowed_uids.is_empty() || !self.server.allowed_gids.is_empty() => 0o666,
            None => 0o600,
        };
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
            chunk_cache_bytes: self.cache.chunk_bytes,
            sample_cache_bytes: sample_bytes,
            cache_policy: self.cache.policy,
            hdf5_fast_path: self.hdf5.fast_path,
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
    fn new(at: &[&str], message: String) -> Problem {
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

impl Config {
    /// Opens every named dataset as the daemon would when a client asks for
    /// it (its files by handle, read-only; LMDB environments mapped without
    /// the lock file), serving nothing: globs that match no file, files or
    /// environments that do not open, missing fields and keys become
    /// problems, one per dataset, plus one per LMDB environment or key file
    /// that is missing. Used by `stoker validate`; the daemon opens datasets
    /// on demand.
    pub fn check_files(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (name, ds) in &self.datasets {
            let problem = match ds {
                DatasetConfig::Hdf5(ds) => self.check_hdf5(ds),
                DatasetConfig::Lmdb(ds) => {
                    let missing = check_lmdb_paths(ds);
                    if missing.is_empty() {
                        self.check_lmdb(ds)
                    } else {
                        for (at, message) in missing {
                            let at: Vec<&str> =
                                ["datasets", name].into_iter().chain(at.iter().map(String::as_str)).collect();
                            problems.push(Problem::new(&at, format!("[datasets.{name}] {message}")));
                        }
                        None
                    }
                }
            };
            if let Some((at, message)) = problem {
                let at: Vec<&str> = ["datasets", name].into_iter().chain(at.iter().map(String::as_str)).collect();
                problems.push(Problem::new(&at, format!("[datasets.{name}] {message}")));
            }
        }
        problems
    }

    /// Opens an HDF5 dataset's files and fields; the problem and the key it is about.
    fn check_hdf5(&self, ds: &Hdf5DatasetConfig) -> Option<(Vec<String>, String)> {
        use crate::source::SourceError;
        use crate::source::hdf5::{self, Hdf5Source, OpenFiles};
        let mut spec = ds.spec(self.hdf5.fast_path);
        spec.max_chunk_bytes = self.limits.max_sample_bytes;
        let mut chains = match crate::dataset::field_chains(&ds.field_transforms()) {
            Ok(chains) => chains,
            Err(message) => return Some((vec!["transforms".to_string()], message)),
        };
        let opened = hdf5::check_files(&spec, None).and_then(|files| {
            let cache = crate::cache::CacheCtx::disabled();
            let source = Hdf5Source::open(&spec, files, cache, OpenFiles::new(self.limits.max_open_files))?;
            if chains.is_empty() {
                return Ok(());
            }
            crate::dataset::load_stats(chains.iter_mut().flat_map(|c| c.steps.iter_mut()), None)?;
            let source: std::sync::Arc<dyn crate::source::Source> = std::sync::Arc::new(source);
            crate::transform::transformed::Transformed::new(source, &chains, &spec.files, self.limits.max_sample_bytes)
                .map(drop)
        });
        let e = opened.err()?;
        let at = match &e {
            SourceError::MissingField { field, .. }
            | SourceError::Dtype { field, .. }
            | SourceError::Inconsistent { field, .. } => vec!["fields".to_string(), field.clone()],
            SourceError::Spec { .. } => Vec::new(),
            _ => vec!["files".to_string()],
        };
        Some((at, e.to_string()))
    }

    /// Opens an LMDB dataset (environments, keys, probed values); the problem and the key it is about.
    fn check_lmdb(&self, ds: &stoker_proto::LmdbDataset) -> Option<(Vec<String>, String)> {
        use crate::source::{SourceError, lmdb::LmdbSource};
        let mut spec = match crate::dataset::lmdb_spec(ds, None) {
            Ok(spec) => spec,
            Err((_, message)) => return Some((Vec::new(), message)),
        };
        spec.max_value_bytes = self.limits.max_sample_bytes;
        if let Err(e) = crate::dataset::load_stats(spec.fields.iter_mut().flat_map(|f| f.transforms.iter_mut()), None) {
            return Some((Vec::new(), e.to_string()));
        }
        let e = LmdbSource::open(&spec).err()?;
        let field_at = |i: usize| vec!["fields".to_string(), i.to_string()];
        let at = match &e {
            SourceError::LmdbKeyFile { .. } => vec!["key_file".to_string()],
            SourceError::LmdbField { field, .. } => {
                ds.fields.iter().position(|f| &f.name == field).map_or_else(Vec::new, field_at)
            }
            SourceError::LmdbOpen { env, .. } | SourceError::LmdbEmpty { env, .. } => {
                match ds.fields.iter().position(|f| Path::new(&f.env) == env) {
                    Some(i) => [field_at(i), vec!["env".to_string()]].concat(),
                    None => Vec::new(),
                }
            }
            _ => Vec::new(),
        };
        Some((at, e.to_string()))
    }
}

/// Every environment and key file of an LMDB dataset that cannot be opened
/// (missing, unreadable, a directory without `data.mdb`), with the key naming it.
fn check_lmdb_paths(ds: &stoker_proto::LmdbDataset) -> Vec<(Vec<String>, String)> {
    use crate::fsaccess::{self, Want};
    let mut missing = Vec::new();
    for (i, f) in ds.fields.iter().enumerate() {
        let opened = fsaccess::open(Path::new(&f.env), None, Want::FileOrDir)
            .and_then(|env| if env.is_dir { fsaccess::open_in(&env, "data.mdb").map(drop) } else { Ok(()) });
        if let Err(e) = opened {
            missing.push((
                vec!["fields".to_string(), i.to_string(), "env".to_string()],
                format!("field {:?}: LMDB environment: {e}", f.name),
            ));
        }
    }
    if let Some(path) = &ds.key_file
        && let Err(e) = fsaccess::open(Path::new(path), None, Want::File)
    {
        missing.push((vec!["key_file".to_string()], format!("key_file: {e}")));
    }
    missing
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

/// Bytes of physical memory, from `/proc/meminfo` (`None` where it cannot be read).
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
