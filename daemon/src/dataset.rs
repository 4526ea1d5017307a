//! Which dataset a stream reads: resolves a client's [`DatasetRef`] (a name
//! from the config, or an ad-hoc HDF5 or LMDB description) into an open
//! [`Source`], checks ad-hoc paths against `allowed_roots`, and keeps opened
//! sources for reuse by later streams (files stay open, caches stay warm): all
//! sources in use, plus the [`KEEP_IDLE`] most recently used idle ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use stoker_proto::{DatasetInfo, DatasetRef, ErrorKind, LmdbDataset, TransformDef};

use crate::cache::ChunkCache;
use crate::codec::{Codec, RawLayout};
use crate::config::{DatasetConfig, Hdf5DatasetConfig, Settings};
use crate::source::hdf5::{Hdf5Source, Hdf5Spec, Window};
use crate::source::lmdb::{KeyFilter, LmdbField, LmdbSource, LmdbSpec, OnError};
use crate::source::{Source, SourceError};
use crate::transform::{Filter, Pair, Step};

/// Idle sources (no open stream) kept open for the next stream that wants them.
pub const KEEP_IDLE: usize = 16;

/// An error for the client: kind and message.
pub type Refusal = (ErrorKind, String);

/// An open dataset and how `stoker status` names it.
#[derive(Debug, Clone)]
pub struct Opened {
    /// Config name, or the ad-hoc path.
    pub label: String,
    /// The source.
    pub source: Arc<dyn Source>,
}

/// Every dataset the daemon has opened.
#[derive(Debug)]
pub struct Datasets {
    /// Replaced as a whole on SIGHUP; sources already open stay as they are.
    settings: RwLock<Arc<Settings>>,
    chunk_cache: Arc<ChunkCache>,
    /// Keyed by the resolved description, with when each was last opened.
    open: Mutex<HashMap<String, (Opened, Instant)>>,
}

enum Resolved {
    Hdf5(Hdf5Spec),
    Lmdb(LmdbSpec),
}

impl Datasets {
    /// An empty registry for `settings`.
    pub fn new(settings: Settings, chunk_cache: Arc<ChunkCache>) -> Datasets {
        Datasets { settings: RwLock::new(Arc::new(settings)), chunk_cache, open: Mutex::new(HashMap::new()) }
    }

    /// Uses `settings` for datasets opened from now on.
    pub fn reload(&self, settings: Settings) {
        *self.settings.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(settings);
    }

    fn settings(&self) -> Arc<Settings> {
        self.settings.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Opens (or reuses) the dataset. Blocking: call it off the async threads.
    pub fn open(&self, dataset: &DatasetRef) -> Result<Opened, Refusal> {
        let (label, mut resolved) = self.resolve(dataset)?;
        if let Resolved::Lmdb(spec) = &mut resolved {
            spec.max_value_bytes = self.settings().limits.max_sample_bytes;
        }
        let key = match &resolved {
            Resolved::Hdf5(spec) => format!("hdf5 {spec:?}"),
            Resolved::Lmdb(spec) => format!("lmdb {spec:?}"),
        };
        // A poisoned source (its file found truncated or corrupt) is opened afresh.
        if let Some((opened, used)) = self.lock().get_mut(&key).filter(|(o, _)| o.source.poisoned().is_none()) {
            *used = Instant::now();
            return Ok(Opened { label, source: opened.source.clone() });
        }
        let source: Arc<dyn Source> = match resolved {
            Resolved::Hdf5(spec) => {
                let settings = self.settings();
                let roots = (!matches!(dataset, DatasetRef::Named(_))).then_some(settings.allowed_roots.as_slice());
                Arc::new(Hdf5Source::open(&spec, roots, self.chunk_cache.clone()).map_err(refuse)?)
            }
            Resolved::Lmdb(spec) => Arc::new(LmdbSource::open(&spec).map_err(refuse)?),
        };
        tracing::info!(dataset = %label, samples = source.len(), "opened dataset");
        let opened = Opened { label, source };
        let mut open = self.lock();
        open.insert(key, (opened.clone(), Instant::now()));
        evict_idle(&mut open);
        Ok(opened)
    }

    /// Datasets named in the config, for `stoker datasets`, with skip counts of those opened.
    pub fn named(&self) -> Vec<DatasetInfo> {
        let open = self.lock();
        let skipped = |name: &str| {
            open.values().filter(|(o, _)| o.label == name).map(|(o, _)| o.source.skipped()).max().unwrap_or(0)
        };
        self.settings()
            .datasets
            .iter()
            .map(|(name, ds)| match ds {
                DatasetConfig::Hdf5(ds) => DatasetInfo {
                    name: name.clone(),
                    format: "hdf5".into(),
                    files: ds.files.clone(),
                    fields: ds.fields.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    window: ds.window.map(|w| (w.size, w.stride)),
                    per_item: ds.per_item.clone(),
                    skipped: skipped(name),
                },
                DatasetConfig::Lmdb(ds) => DatasetInfo {
                    name: name.clone(),
                    format: "lmdb".into(),
                    files: ds.fields.iter().map(|f| f.env.as_str()).collect::<Vec<_>>().join(" "),
                    fields: ds.fields.iter().map(|f| (f.name.clone(), f.codec.clone())).collect(),
                    window: None,
                    per_item: Vec::new(),
                    skipped: skipped(name),
                },
            })
            .collect()
    }

    /// `(label, samples skipped)` of every open dataset that skipped any.
    pub fn skips(&self) -> Vec<(String, u64)> {
        self.lock().values().map(|(o, _)| (o.label.clone(), o.source.skipped())).filter(|(_, n)| *n > 0).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Opened, Instant)>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn resolve(&self, dataset: &DatasetRef) -> Result<(String, Resolved), Refusal> {
        let settings = self.settings();
        match dataset {
            DatasetRef::Named(name) => match settings.datasets.get(name) {
                Some(DatasetConfig::Hdf5(ds)) => Ok((name.clone(), Resolved::Hdf5(self.hdf5_named(ds)))),
                Some(DatasetConfig::Lmdb(ds)) => Ok((name.clone(), Resolved::Lmdb(lmdb_spec(ds, None)?))),
                None => {
                    let known: Vec<_> = settings.datasets.keys().collect();
                    Err((
                        ErrorKind::NotFound,
                        format!(
                            "no dataset named {name:?} in the daemon's config (known: {known:?}); see `stoker datasets`"
                        ),
                    ))
                }
            },
            DatasetRef::Hdf5 { files, fields, window, per_item } => {
                self.check_ad_hoc()?;
                if !Path::new(files).is_absolute() {
                    return Err((ErrorKind::Dataset, format!("ad-hoc dataset path {files:?} must be absolute")));
                }
                if fields.is_empty() {
                    return Err((ErrorKind::Dataset, format!("ad-hoc dataset {files:?} has no fields")));
                }
                if let Some(dup) = duplicate(fields.iter().map(|(n, _)| n.as_str())) {
                    return Err((ErrorKind::Dataset, format!("field {dup:?} is given twice")));
                }
                let spec = Hdf5Spec {
                    files: files.clone(),
                    fields: fields.clone(),
                    window: window.map(|(size, stride)| Window { size, stride }),
                    per_item: per_item.clone(),
                    fast_path: settings.hdf5_fast_path,
                };
                Ok((files.clone(), Resolved::Hdf5(spec)))
            }
            DatasetRef::Lmdb(ds) => {
                self.check_ad_hoc()?;
                let label = ds.fields.first().map_or_else(String::new, |f| f.env.clone());
                Ok((label, Resolved::Lmdb(lmdb_spec(ds, Some(settings.allowed_roots.clone()))?)))
            }
        }
    }

    fn check_ad_hoc(&self) -> Result<(), Refusal> {
        if self.settings().allowed_roots.is_empty() {
            return Err((
                ErrorKind::PermissionDenied,
                "this daemon serves only the datasets named in its config ([server] allowed_roots is empty); use a \
                 name from `stoker datasets`, or ask the admin to set allowed_roots"
                    .to_string(),
            ));
        }
        Ok(())
    }

    fn hdf5_named(&self, ds: &Hdf5DatasetConfig) -> Hdf5Spec {
        Hdf5Spec {
            files: ds.files.clone(),
            fields: ds.fields.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            window: ds.window.map(|w| Window { size: w.size, stride: w.stride }),
            per_item: ds.per_item.clone(),
            fast_path: self.settings().hdf5_fast_path,
        }
    }
}

/// Closes the least recently used idle sources beyond [`KEEP_IDLE`]. A source
/// is idle when only this registry holds it (no stream, no fill in flight).
fn evict_idle(open: &mut HashMap<String, (Opened, Instant)>) {
    let mut idle: Vec<(Instant, String)> = open
        .iter()
        .filter(|(_, (o, _))| Arc::strong_count(&o.source) == 1)
        .map(|(k, (_, used))| (*used, k.clone()))
        .collect();
    if idle.len() <= KEEP_IDLE {
        return;
    }
    idle.sort();
    for (_, key) in &idle[..idle.len() - KEEP_IDLE] {
        if let Some((o, _)) = open.remove(key) {
            tracing::info!(dataset = %o.label, "closed idle dataset");
        }
    }
}

fn refuse(e: SourceError) -> Refusal {
    let kind = match e {
        SourceError::NotAllowed { .. } => ErrorKind::PermissionDenied,
        SourceError::Limit(_) => ErrorKind::Limit,
        _ => ErrorKind::Dataset,
    };
    (kind, e.to_string())
}

fn duplicate<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|n| !seen.insert(*n))
}

/// Turns the wire/config description of an LMDB dataset into the source's spec.
pub fn lmdb_spec(ds: &LmdbDataset, allowed_roots: Option<Vec<PathBuf>>) -> Result<LmdbSpec, Refusal> {
    let bad = |message: String| (ErrorKind::Dataset, message);
    if ds.fields.is_empty() {
        return Err(bad("an LMDB dataset needs at least one field".into()));
    }
    if let Some(dup) = duplicate(ds.fields.iter().map(|f| f.name.as_str())) {
        return Err(bad(format!("field {dup:?} is given twice")));
    }
    let mut fields = Vec::with_capacity(ds.fields.len());
    for f in &ds.fields {
        let field_err = |message: String| bad(format!("field {:?} ({}): {message}", f.name, f.env));
        if !Path::new(&f.env).is_absolute() {
            return Err(field_err("the environment path must be absolute".into()));
        }
        let raw = match (&f.dtype, &f.shape) {
            (Some(dtype), Some(shape)) => {
                Some(RawLayout::new(dtype, shape.clone()).map_err(|e| field_err(e.to_string()))?)
            }
            (None, None) => None,
            _ => return Err(field_err("raw values need both dtype and shape".into())),
        };
        let codec = Codec::parse(&f.codec, raw).map_err(|e| field_err(e.to_string()))?;
        let transforms = f.transforms.iter().map(step).collect::<Result<Vec<_>, _>>().map_err(field_err)?;
        fields.push(LmdbField {
            name: f.name.clone(),
            env: PathBuf::from(&f.env),
            codec,
            transforms,
            pair: f.pair.as_ref().map(|p| Pair { with: p.with.clone(), scale: p.scale }),
            max_sample_bytes: f.max_sample_bytes,
        });
    }
    let mut spec = LmdbSpec::new(fields);
    spec.filter = match (&ds.key_prefix, &ds.key_regex) {
        (Some(_), Some(_)) => return Err(bad("give key_prefix or key_regex, not both".into())),
        (Some(prefix), None) => KeyFilter::Prefix(prefix.clone()),
        (None, Some(regex)) => KeyFilter::Include(regex.clone()),
        (None, None) => KeyFilter::SkipMetadata,
    };
    spec.key_file = ds.key_file.as_ref().map(PathBuf::from);
    spec.on_error = match ds.on_error.as_deref() {
        None | Some("fail") => OnError::Fail,
        Some("skip") => OnError::Skip,
        Some(other) => return Err(bad(format!("on_error = {other:?}: use \"fail\" or \"skip\""))),
    };
    if let Some(probe) = ds.probe {
        spec.probe = probe.max(1) as usize;
    }
    spec.allowed_roots = allowed_roots;
    Ok(spec)
}

fn step(t: &TransformDef) -> Result<Step, String> {
    Ok(match t {
        TransformDef::CenterCrop { height, width } => Step::CenterCrop { height: *height, width: *width },
        TransformDef::RandomCrop { height, width } => Step::RandomCrop { height: *height, width: *width },
        TransformDef::Resize { height, width, filter } => Step::Resize {
            height: *height,
            width: *width,
            filter: match filter.as_deref() {
                None | Some("bilinear") => Filter::Bilinear,
                Some("nearest") => Filter::Nearest,
                Some("bicubic") => Filter::Bicubic,
                Some("lanczos3") | Some("lanczos") => Filter::Lanczos3,
                Some(other) => {
                    return Err(format!("resize filter {other:?}: use nearest, bilinear, bicubic or lanczos3"));
                }
            },
        },
        TransformDef::Hflip => Step::RandomHFlip,
        TransformDef::ToF32 { scale } => Step::ToF32 { scale: scale.unwrap_or(1.0) },
        TransformDef::Normalize { mean, std } => Step::Normalize { mean: mean.clone(), std: std.clone() },
        TransformDef::Chw => Step::ToChw,
    })
}
