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
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            socket: PathBuf::from(stoker_proto::DEFAULT_SOCKET),
            allowed_uids: Vec::new(),
            allowed_roots: Vec::new(),
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
    /// HDF5 files open at once across all datasets (each takes two descriptors
    /// and libhdf5's caches); the least recently read beyond it are closed and
    /// reopened on their next read. Also bounded by half the descriptor limit.
    pub max_open_files: usize,
    /// Seconds a dataset no stream uses keeps its files open (and HDF5-locked)
    /// for the next stream; 0 closes them when the last stream closes.
    pub idle_close_s: f64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_message_bytes: 1 << 20,
            max_batch_size: 1 << 16,
            max_ring_bytes_per_client: 8 << 30,
            max_streams_per_client: 16,
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
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig { chunk_bytes: 512 << 20 }
    }
}

/// `[datasets.NAME]` table, by `format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "format", rename_all = "lowercase")]
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
}

/// A dataset's `window = { size, stride }`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowConfig {
    /// Consecutive steps per sample.
    pub size: u64,
    /// Steps between the starts of consecutive samples.
    #[serde(default = "one")]
    pub stride: u64,
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
    /// Worker threads (resolved, ≥ 1).
    pub worker_threads: usize,
    /// Slots per ring.
    pub ring_depth: u32,
    /// Limits.
    pub limits: LimitsConfig,
    /// Bytes of the decoded-chunk cache.
    pub chunk_cache_bytes: u64,
    /// HDF5 fast path on or off.
    pub hdf5_fast_path: bool,
    /// Named datasets.
    pub datasets: BTreeMap<String, DatasetConfig>,
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

    /// Checks values and resolves defaults.
    pub fn validate(self, path: &Path) -> Result<Settings, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        if !(1..=1024).contains(&self.ring.depth) {
            return Err(invalid(format!("[ring] depth = {} must be between 1 and 1024", self.ring.depth)));
        }
        if self.limits.max_batch_size == 0 {
            return Err(invalid("[limits] max_batch_size must be at least 1".into()));
        }
        if self.limits.max_message_bytes < 4096 || self.limits.max_message_bytes > stoker_proto::MAX_FRAME_BYTES {
            return Err(invalid(format!(
                "[limits] max_message_bytes = {} must be between 4096 and {}",
                self.limits.max_message_bytes,
                stoker_proto::MAX_FRAME_BYTES
            )));
        }
        if !(self.limits.idle_close_s >= 0.0 && self.limits.idle_close_s <= 86_400.0) {
            return Err(invalid(format!(
                "[limits] idle_close_s = {} must be between 0 and 86400",
                self.limits.idle_close_s
            )));
        }
        if self.limits.max_open_files == 0 {
            return Err(invalid("[limits] max_open_files must be at least 1".into()));
        }
        for (name, ds) in &self.datasets {
            let ds = match ds {
                DatasetConfig::Hdf5(ds) => ds,
                DatasetConfig::Lmdb(ds) => {
                    if ds.fields.is_empty() {
                        return Err(invalid(format!(
                            "[datasets.{name}] has no fields; add [[datasets.{name}.fields]] tables with name, env and codec"
                        )));
                    }
                    if let Some(f) = ds.fields.iter().find(|f| !Path::new(&f.env).is_absolute()) {
                        return Err(invalid(format!(
                            "[datasets.{name}] field {:?}: env = {:?} must be an absolute path",
                            f.name, f.env
                        )));
                    }
                    continue;
                }
            };
            if !Path::new(&ds.files).is_absolute() {
                return Err(invalid(format!(
                    "[datasets.{name}] files = {:?} must be an absolute path or glob",
                    ds.files
                )));
            }
            if let Some(w) = ds.window.filter(|w| w.size == 0 || w.stride == 0) {
                return Err(invalid(format!(
                    "[datasets.{name}] window size = {} and stride = {} must both be at least 1",
                    w.size, w.stride
                )));
            }
            if let Some(unknown) = ds.per_item.iter().find(|f| !ds.fields.contains_key(*f)) {
                return Err(invalid(format!("[datasets.{name}] per_item names {unknown:?}, which is not in fields")));
            }
            if ds.fields.is_empty() {
                return Err(invalid(format!(
                    "[datasets.{name}] fields is empty; map at least one field name to an HDF5 path, \
                     e.g. fields = {{ x = \"data\" }}"
                )));
            }
        }
        let mut allowed_roots = Vec::new();
        for root in &self.server.allowed_roots {
            // A root that does not exist yet cannot hold files either; keep it as written.
            allowed_roots.push(root.canonicalize().unwrap_or_else(|_| root.clone()));
        }
        let worker_threads = match self.workers.threads {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        };
        Ok(Settings {
            socket: self.server.socket,
            allowed_uids: self.server.allowed_uids,
            allowed_roots,
            worker_threads,
            ring_depth: self.ring.depth,
            limits: self.limits,
            chunk_cache_bytes: self.cache.chunk_bytes,
            hdf5_fast_path: self.hdf5.fast_path,
            datasets: self.datasets,
        })
    }
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
        assert_eq!(names, ["div2k", "imagenet", "shear_flow", "train"]);
        cfg.validate(path).unwrap();
    }

    #[test]
    fn relative_dataset_glob_is_rejected() {
        let text = "[datasets.a]\nformat = \"hdf5\"\nfiles = \"data/*.h5\"\nfields = { x = \"x\" }\n";
        let err = Config::parse(text, Path::new("c.toml")).unwrap().validate(Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("datasets.a"), "{err}");
    }
}
