//! LMDB source: samples are the keys of one or more environments, each field
//! a value decoded by a [`Codec`] and optionally transformed by a [`Chain`].
//!
//! Environments are opened once per process, read-only and without LMDB's
//! lock file (`MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD`, as BasicSR opens its
//! datasets): the daemon needs no write access to the dataset's directory,
//! and a dataset must not be written while it is served. An environment is a
//! directory holding `data.mdb` (Python `lmdb.open(path)`) or the data file
//! itself (`subdir=False`). Every read runs in its own read transaction
//! (cheap without the lock table) and decodes straight from the memory map.
//!
//! Sample order is the key order of the first field's environment (bytewise,
//! after a [`KeyFilter`]) or the order of a key file. Fields read from other
//! environments look the same key up there; every key must exist in every
//! environment (checked at open).
//!
//! # Fixed and variable fields
//!
//! The first [`LmdbSpec::probe`] keys are probed (headers only) at open. A
//! dimension equal in all of them is fixed; one that differs is *variable*.
//! Transforms may fix it again (a crop to 96×96). A field whose delivered
//! shape is fully fixed is laid out in the batch like an HDF5 field, and each
//! value is checked against that layout at read time. A field with a
//! variable dimension reports it as `0` in [`FieldSpec::shape`] (its
//! `sample_bytes()` is then 0; [`LmdbSource::shapes`] gives `None` there), is
//! left out by [`Source::read_sample`], and is read with
//! [`LmdbSource::read_into`] into a growable buffer with its shape: the
//! material for ragged delivery.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use regex::bytes::Regex;
use stoker_proto::DType;

use super::{FieldOut, FieldSpec, LmdbReadError, SampleRef, Source, SourceError};
use crate::cache::{CacheCtx, Decoded, Key, Uses};
use crate::fsaccess::FileId;
use stoker_decode::codec::{AlignedBuf, ArrayInfo, ByteOrder, Codec, CodecError, Format, Wrap};
use stoker_decode::transform::{self, ArrayRef, Chain, Pair, SampleKey, Step, TransformError};

mod guard;

use guard::{GuardError, MappedEnv, Txn};

/// The files of an LMDB dataset, opened by handle beforehand.
#[derive(Debug, Default)]
pub struct CheckedLmdb {
    /// Per environment path as the dataset names it: the identity of its data file.
    pub envs: Vec<(PathBuf, FileId)>,
    /// The key file's handle.
    pub key_file: Option<File>,
}

impl CheckedLmdb {
    /// Fails unless the environment LMDB opened for `path` (by name), whose
    /// data file is (`dev`, `ino`), is the data file checked by handle: a
    /// path swapped in between is refused.
    pub fn check_env(&self, path: &Path, dev: u64, ino: u64) -> Result<(), SourceError> {
        let Some((_, want)) = self.envs.iter().find(|(p, _)| p == path) else {
            return Ok(());
        };
        let err = |message: String| SourceError::LmdbOpen { env: path.to_owned(), message };
        if (dev, ino) != (want.dev, want.ino) {
            return Err(err("is not the file checked a moment ago: it was replaced while being opened, or a \
                 dataset opened before the replacement still holds the old one (close its Loaders and try again)"
                .into()));
        }
        Ok(())
    }
}

/// How many keys are probed at open unless the spec says otherwise.
pub const DEFAULT_PROBE: usize = 8;
/// Under `on_error = "skip"`, how many samples after a bad one are tried before giving up.
pub const MAX_SUBSTITUTES: u64 = 1024;
/// A worker whose buffers grew beyond this is dropped after its read instead
/// of pooled, so memory follows the values being read, not the largest ever.
const KEEP_WORKER_BYTES: usize = 256 << 20;

/// One field of an LMDB dataset.
#[derive(Debug, Clone)]
pub struct LmdbField {
    /// Field name delivered to the client.
    pub name: String,
    /// The environment holding the field's values.
    pub env: PathBuf,
    /// How values are decoded.
    pub codec: Codec,
    /// Transforms applied after decoding (empty: decode straight into the slot).
    pub transforms: Vec<Step>,
    /// Draw random crops and flips together with another field.
    pub pair: Option<Pair>,
    /// Room per sample when the field's shape varies (ragged delivery);
    /// default: twice the largest value probed at open, at least 1 MiB.
    pub max_sample_bytes: Option<u64>,
}

/// Which keys of the first field's environment are samples.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeyFilter {
    /// Every key except metadata ones that dataset writers commonly add:
    /// dunder keys (`__len__`, `__keys__`, `__meta__`, …), `length` and `keys`.
    #[default]
    SkipMetadata,
    /// Every key.
    All,
    /// Keys starting with this prefix.
    Prefix(String),
    /// Keys the regular expression matches (anywhere; anchor with `^…$`).
    Include(String),
    /// Keys the regular expression does not match.
    Exclude(String),
}

/// What a bad value (undecodable, wrong shape, missing) does to a read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnError {
    /// The read fails with an error naming environment, key, field and codec.
    #[default]
    Fail,
    /// The next good sample (wrapping) stands in; each bad key is logged once and counted.
    Skip,
}

/// An LMDB dataset's definition.
#[derive(Debug, Clone)]
pub struct LmdbSpec {
    /// Fields in delivery order; the first one's environment lists the keys.
    pub fields: Vec<LmdbField>,
    /// Key selection when no key file is given.
    pub filter: KeyFilter,
    /// A file listing the sample keys, one per line, in sample order; BasicSR
    /// `meta_info.txt` lines (`0001.png (480,480,3) 1`) give the name before the first dot.
    pub key_file: Option<PathBuf>,
    /// Bad values fail the read, or are skipped.
    pub on_error: OnError,
    /// Keys probed at open to learn each field's dtype and shape.
    pub probe: usize,
    /// When set, every environment and the key file must lie under one of these.
    pub allowed_roots: Option<Vec<PathBuf>>,
    /// Most bytes one value may take decoded and after every transform step
    /// (`[limits] max_sample_bytes`); checked from headers before allocating.
    pub max_value_bytes: u64,
}

impl LmdbSpec {
    /// A spec for `fields` with the defaults: metadata keys skipped, no key file, fail on error.
    pub fn new(fields: Vec<LmdbField>) -> LmdbSpec {
        LmdbSpec {
            fields,
            filter: KeyFilter::default(),
            key_file: None,
            on_error: OnError::default(),
            probe: DEFAULT_PROBE,
            allowed_roots: None,
            max_value_bytes: stoker_proto::DEFAULT_MAX_SAMPLE_BYTES,
        }
    }
}

/// Where [`LmdbSource::read_into`] puts one field of a sample.
#[derive(Debug)]
pub enum LmdbOut<'a> {
    /// Exactly the field's fixed sample bytes (a slot row).
    Fixed(&'a mut [u8]),
    /// A buffer resized to the value, and its shape.
    Variable {
        /// The decoded (and transformed) value, C order, native-endian.
        bytes: &'a mut Vec<u8>,
        /// Its shape.
        shape: &'a mut Vec<u64>,
    },
    /// A ragged slot row: the values go at the start of `data` (its length is
    /// the row's capacity), the shape into `shape`.
    Ragged {
        /// The row's region.
        data: &'a mut [u8],
        /// The row's shape entry (one per dimension).
        shape: &'a mut [u64],
    },
    /// Leave the field out.
    Skip,
}

/// An open LMDB dataset.
pub struct LmdbSource {
    keys: Keys,
    fields: Vec<FieldSpec>,
    plans: Vec<FieldPlan>,
    envs: Vec<Arc<SharedEnv>>,
    on_error: OnError,
    probe: usize,
    max_value_bytes: u64,
    skipped: AtomicU64,
    logged: Mutex<HashSet<u64>>,
    workers: Mutex<Vec<Worker>>,
    /// The sample cache, and this dataset's fingerprint.
    cache: Option<CacheCtx>,
}

impl fmt::Debug for LmdbSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LmdbSource")
            .field("envs", &self.envs.iter().map(|e| &e.path).collect::<Vec<_>>())
            .field("keys", &self.keys.len())
            .field("fields", &self.fields)
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

/// How one field is read.
#[derive(Debug)]
struct FieldPlan {
    name: String,
    /// Index into `LmdbSource::envs`.
    env: usize,
    codec: Codec,
    /// `None` when there are no transforms.
    chain: Option<Chain>,
    /// Index of the field this one pairs with.
    leader: Option<usize>,
    /// Whether some other field pairs with this one (and needs its shape per sample).
    has_followers: bool,
    /// The decoded layout when every probed value agreed.
    decoded: Option<ArrayInfo>,
    /// Delivered dtype and shape (`None`: varies by sample).
    dtype: DType,
    shape: Vec<Option<u64>>,
    /// Room per row when the shape varies.
    max_sample_bytes: u64,
}

impl Worker {
    /// Bytes the worker's buffers keep between reads.
    fn retained_bytes(&self) -> usize {
        [self.scratch.capacity(), self.decoded.capacity(), self.transform.capacity()]
            .into_iter()
            .fold(0, usize::saturating_add)
    }
}

impl FieldPlan {
    fn fixed_shape(&self) -> Option<Vec<u64>> {
        self.shape.iter().copied().collect()
    }
}

/// Per-worker buffers, pooled so concurrent reads never share one.
#[derive(Debug, Default)]
struct Worker {
    /// The value being decoded, copied out of the map (see `guard`).
    value: Vec<u8>,
    scratch: Vec<u8>,
    decoded: AlignedBuf,
    transform: transform::Scratch,
    shapes: Vec<Option<Vec<u64>>>,
}

impl LmdbSource {
    /// Opens the environments of `spec` (each once per process), selects the
    /// keys, checks every environment holds them, and probes the field layouts.
    pub fn open(spec: &LmdbSpec) -> Result<LmdbSource, SourceError> {
        LmdbSource::open_checked(spec, &CheckedLmdb::default())
    }

    /// [`LmdbSource::open`] over files already opened by handle: each
    /// environment must still be the file `checked` identified, and the key
    /// file is read from its handle.
    pub fn open_checked(spec: &LmdbSpec, checked: &CheckedLmdb) -> Result<LmdbSource, SourceError> {
        let first = spec.fields.first().ok_or_else(|| SourceError::LmdbField {
            env: PathBuf::new(),
            field: String::new(),
            codec: String::new(),
            message: "an LMDB dataset needs at least one field".into(),
        })?;
        let field_err = |field: &LmdbField, message: String| SourceError::LmdbField {
            env: field.env.clone(),
            field: field.name.clone(),
            codec: field.codec.to_string(),
            message,
        };
        let mut seen = HashSet::new();
        for field in &spec.fields {
            if !seen.insert(field.name.as_str()) {
                return Err(field_err(field, "the field name appears twice".into()));
            }
        }
        if let Some(roots) = &spec.allowed_roots {
            let paths = spec.fields.iter().map(|f| &f.env).chain(spec.key_file.as_ref());
            for path in paths {
                let real = path.canonicalize().unwrap_or_else(|_| path.clone());
                if !roots.iter().any(|root| real.starts_with(root)) {
                    let refused = crate::fsaccess::AccessError::NotAllowed { path: path.clone(), roots: roots.clone() };
                    return Err(SourceError::Access(refused));
                }
            }
        }

        // Environments, each opened once even when several fields read it.
        let mut envs: Vec<Arc<SharedEnv>> = Vec::new();
        let mut env_of = Vec::with_capacity(spec.fields.len());
        for field in &spec.fields {
            let env = SharedEnv::open(&field.env)?;
            let (dev, ino, _) = env.env.file_id().map_err(|e| SourceError::LmdbOpen {
                env: field.env.clone(),
                message: format!("cannot check its data file: {e}"),
            })?;
            checked.check_env(&field.env, dev, ino)?;
            let at = envs.iter().position(|e| Arc::ptr_eq(e, &env)).unwrap_or_else(|| {
                envs.push(env);
                envs.len() - 1
            });
            env_of.push(at);
        }

        // Sample keys.
        let primary = &envs[env_of[0]];
        let keys = match &spec.key_file {
            Some(path) => read_key_file(path, checked.key_file.as_ref())?,
            None => primary.keys(&spec.filter)?,
        };
        if keys.is_empty() {
            let detail = match (&spec.key_file, &spec.filter) {
                (Some(path), _) => format!("(key file {} lists none)", path.display()),
                (None, filter) => format!("after filter {filter:?}"),
            };
            return Err(SourceError::LmdbEmpty { env: first.env.clone(), detail });
        }
        for (field, &env) in spec.fields.iter().zip(&env_of) {
            let listed_here = env == env_of[0] && spec.key_file.is_none();
            if !listed_here {
                envs[env].check_has(&keys, &field.name)?;
            }
        }

        // Transform chains and pairing.
        let mut chains = Vec::with_capacity(spec.fields.len());
        for field in &spec.fields {
            let chain = Chain::new(&field.name, field.transforms.clone(), field.pair.clone())
                .map_err(|e| field_err(field, e.to_string()))?
                .with_limit(spec.max_value_bytes);
            chains.push(chain);
        }
        let mut leaders = Vec::with_capacity(spec.fields.len());
        for (field, chain) in spec.fields.iter().zip(&chains) {
            let leader = match chain.pair() {
                None => None,
                Some(pair) => {
                    let Some(at) = spec.fields.iter().position(|f| f.name == pair.with) else {
                        return Err(field_err(field, format!("pairs with {:?}, which is not a field", pair.with)));
                    };
                    chain.check_pair(&chains[at]).map_err(|e| field_err(field, e.to_string()))?;
                    Some(at)
                }
            };
            leaders.push(leader);
        }

        // Layouts from the first keys.
        let probe = spec.probe.max(1).min(keys.len());
        let mut plans = Vec::with_capacity(spec.fields.len());
        for (i, (field, chain)) in spec.fields.iter().zip(chains).enumerate() {
            let env = &envs[env_of[i]];
            let (dtype, decoded_shape, largest) =
                probe_field(env, field, &keys, probe, spec.on_error, spec.max_value_bytes)?;
            let decoded =
                decoded_shape.iter().copied().collect::<Option<Vec<u64>>>().map(|shape| ArrayInfo { dtype, shape });
            let decoded_dtype = dtype;
            let (dtype, shape) = if chain.is_empty() {
                (dtype, decoded_shape)
            } else {
                chain.output(dtype, &decoded_shape).map_err(|e| match e {
                    // A transform that makes values too large is a limit, not a malformed field.
                    TransformError::TooLarge { .. } => SourceError::Limit(format!(
                        "LMDB environment {} (codec {}): {e}",
                        field.env.display(),
                        field.codec
                    )),
                    e => field_err(field, e.to_string()),
                })?
            };
            plans.push(FieldPlan {
                name: field.name.clone(),
                env: env_of[i],
                codec: field.codec.clone(),
                chain: (!chain.is_empty()).then_some(chain),
                leader: leaders[i],
                has_followers: leaders.contains(&Some(i)),
                decoded,
                max_sample_bytes: field.max_sample_bytes.unwrap_or_else(|| {
                    // Casting to a wider type (to f32, say) widens every value.
                    // Never more than a value may take at all.
                    let widen = (dtype.size() as u64).div_ceil(decoded_dtype.size() as u64).max(1);
                    largest.saturating_mul(2).saturating_mul(widen).max(1 << 20).min(spec.max_value_bytes)
                }),
                dtype,
                shape,
            });
        }
        let fields = plans
            .iter()
            .zip(&spec.fields)
            .map(|(plan, field)| FieldSpec {
                name: plan.name.clone(),
                origin: format!("{} ({})", field.env.display(), field.codec),
                dtype: plan.dtype,
                shape: plan.shape.iter().map(|d| d.unwrap_or(0)).collect(),
                max_sample_bytes: plan.fixed_shape().is_none().then_some(plan.max_sample_bytes),
            })
            .collect();
        for plan in plans.iter().filter(|p| p.fixed_shape().is_none()) {
            tracing::info!(field = %plan.name, shape = ?plan.shape, "LMDB field has a variable shape");
        }
        Ok(LmdbSource {
            keys,
            fields,
            plans,
            envs,
            on_error: spec.on_error,
            probe,
            max_value_bytes: spec.max_value_bytes,
            skipped: AtomicU64::new(0),
            logged: Mutex::new(HashSet::new()),
            workers: Mutex::new(Vec::new()),
            cache: None,
        })
    }

    /// Keeps decoded values of costly fields (images, compressed values) in
    /// the daemon's sample cache. Cheap ones (raw and `.npy` values, read
    /// from the page cache at memory speed) are never cached.
    pub fn with_cache(mut self, cache: CacheCtx) -> LmdbSource {
        self.cache = cache.caches.samples.enabled().then_some(cache);
        self
    }

    /// The cache and key for field `i`'s value of sample `index`, when the field is worth caching.
    fn cache_slot(&self, i: usize, index: u64) -> Option<(&CacheCtx, Key)> {
        let cache = self.cache.as_ref()?;
        let plan = &self.plans[i];
        let costly = matches!(plan.codec.format, Format::Png | Format::Jpeg) || plan.codec.wrap != Wrap::None;
        // The field's decode spec is in the dataset fingerprint (its codec,
        // mode and transforms); the field's position names it within.
        costly.then(|| (cache, Key { space: crate::cache::fingerprint(&(cache.dataset, i)), item: index }))
    }

    /// Delivered shape of each field; `None` marks a dimension that varies by sample.
    pub fn shapes(&self) -> Vec<Vec<Option<u64>>> {
        self.plans.iter().map(|p| p.shape.clone()).collect()
    }

    /// Whether field `field` has a fixed shape (is laid out in the batch).
    pub fn is_fixed(&self, field: usize) -> bool {
        self.plans[field].fixed_shape().is_some()
    }

    /// The key of sample `index`.
    pub fn key(&self, index: u64) -> &[u8] {
        self.keys.get(index as usize)
    }

    /// The sample keys, in sample order.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.iter()
    }

    /// Why one of the dataset's environments is unusable, once a read found
    /// its file truncated or corrupt. Such a source fails every read; open
    /// the dataset again (a fresh mapping of the file) instead of reusing it.
    pub fn poisoned(&self) -> Option<String> {
        self.envs.iter().find_map(|env| env.env.poisoned().map(|why| format!("{}: {why}", env.path.display())))
    }

    /// Bad samples skipped so far (each substitution counts once).
    pub fn skipped(&self) -> u64 {
        // Relaxed: a statistic, ordered with nothing.
        self.skipped.load(Ordering::Relaxed)
    }

    /// Reads every field of `sample` into `out` (one entry per field) and
    /// returns the index actually read: `sample.index`, or under
    /// `on_error = "skip"` the next good sample after it (wrapping).
    /// Transforms are keyed by the index read.
    pub fn read_into(&self, sample: SampleRef, out: &mut [LmdbOut<'_>]) -> Result<u64, SourceError> {
        assert_eq!(out.len(), self.plans.len(), "one output per field");
        let n = self.len();
        let attempts = match self.on_error {
            OnError::Fail => 1,
            OnError::Skip => n.min(MAX_SUBSTITUTES),
        };
        let mut first_error = None;
        for k in 0..attempts {
            let index = (sample.index % n + k) % n;
            match self.read_index(SampleRef { index, ..sample }, out) {
                Ok(()) => return Ok(index),
                Err(e) if self.on_error == OnError::Fail => return Err(e),
                // Not a bad value: the stream retries the batch in a bigger slot.
                Err(e @ SourceError::Oversize { .. }) => return Err(e),
                // A truncated or corrupt file fails every read alike: nothing to skip to.
                Err(e) if self.poisoned().is_some() => return Err(e),
                Err(e) => {
                    self.skipped.fetch_add(1, Ordering::Relaxed);
                    let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
                    if logged.insert(index) {
                        tracing::warn!(error = %e, "skipping a bad LMDB sample; the next good one stands in");
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        let mut first = first_error.expect("at least one attempt failed");
        if let SourceError::LmdbRead(read) = &mut first {
            read.message =
                format!("{} (on_error = skip, but the next {} samples failed too)", read.message, attempts - 1);
        }
        Err(first)
    }

    fn read_index(&self, sample: SampleRef, out: &mut [LmdbOut<'_>]) -> Result<(), SourceError> {
        let mut worker = self.workers.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default();
        let result = self.read_with(&mut worker, sample, out);
        // One huge value must not pin its buffers for the life of the dataset.
        if worker.retained_bytes() <= KEEP_WORKER_BYTES {
            self.workers.lock().unwrap_or_else(PoisonError::into_inner).push(worker);
        }
        result
    }

    fn read_with(&self, worker: &mut Worker, sample: SampleRef, out: &mut [LmdbOut<'_>]) -> Result<(), SourceError> {
        let key = self.keys.get(sample.index as usize);
        let txns = self
            .envs
            .iter()
            .enumerate()
            .map(|(i, env)| {
                env.env.txn().map_err(|e| {
                    // Name a field read from this environment.
                    let plan = self.plans.iter().find(|p| p.env == i);
                    let (field, codec) = plan.map_or(("", String::new()), |p| (p.name.as_str(), p.codec.to_string()));
                    read_error(&env.path, key, field, &codec, sample.index, e.to_string())
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        worker.shapes.clear();
        worker.shapes.resize(self.plans.len(), None);
        // Leaders before followers, so a follower knows its leader's shape.
        for followers in [false, true] {
            for (i, plan) in self.plans.iter().enumerate() {
                if plan.leader.is_some() == followers {
                    self.read_field(worker, &txns, i, key, sample, &mut out[i])?;
                }
            }
        }
        Ok(())
    }

    fn read_field(
        &self,
        worker: &mut Worker,
        txns: &[Txn<'_>],
        i: usize,
        key: &[u8],
        sample: SampleRef,
        out: &mut LmdbOut<'_>,
    ) -> Result<(), SourceError> {
        let plan = &self.plans[i];
        let env = &self.envs[plan.env];
        let err = |message: String| read_error(&env.path, key, &plan.name, &plan.codec, sample.index, message);
        let Worker { value, scratch, decoded, transform, shapes } = worker;
        let cached = self.cache_slot(i, sample.index);
        let hit = match (cached, &*out) {
            (Some((cache, key)), out) if !matches!(out, LmdbOut::Skip) || plan.has_followers => {
                cache.caches.samples.get(&key, cache.dataset)
            }
            _ => None,
        };
        if let Some(hit) = &hit {
            return self.serve_cached(plan, i, hit, key_of(sample), shapes, transform, out, &err);
        }
        let txn = &txns[plan.env];
        let found = txn
            .get(key)
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| err("the key is missing from this environment".into()))?;
        // Native-order raw bytes of the laid-out size go straight from the map
        // into the slot row: the one copy decoding would make anyway.
        if let (None, LmdbOut::Fixed(dst), Some(layout)) = (&plan.chain, &mut *out, &plan.decoded) {
            let plain = matches!(&plan.codec, Codec { wrap: Wrap::None, format: Format::Raw(raw), .. }
                if raw.order == ByteOrder::NATIVE || raw.dtype.size() == 1);
            if plain && found.len() == dst.len() {
                txn.copy(found, dst).map_err(|e| err(e.to_string()))?;
                shapes[i] = Some(layout.shape.clone());
                return Ok(());
            }
        }
        // Decoding reads a copy: the map may fault (see `guard`), Rust code must not.
        value.resize(found.len(), 0);
        txn.copy(found, value).map_err(|e| err(e.to_string()))?;
        let value: &[u8] = value;
        let codec_err = |e: CodecError| match (&e, &plan.decoded) {
            (CodecError::Mismatch { .. }, Some(layout)) if plan.chain.is_none() => err(format!(
                "{e}; the field was laid out as {layout} from the first {} keys — declare a crop or resize \
                 transform, or deliver the field ragged",
                self.probe
            )),
            _ => err(e.to_string()),
        };

        let offer = |info: &ArrayInfo, bytes: &[u8]| {
            if let Some((cache, key)) = cached {
                let uses = Uses::one(cache.dataset, sample.index);
                if cache.caches.samples.wants(bytes.len(), &uses) {
                    let entry = Arc::new(Decoded::copy_of(info, bytes));
                    cache.caches.samples.insert(key, entry, bytes.len(), uses);
                }
            }
        };
        let Some(chain) = &plan.chain else {
            let info = match out {
                LmdbOut::Fixed(dst) => {
                    let layout =
                        plan.decoded.as_ref().expect("a fixed field without transforms has a fixed decoded layout");
                    plan.codec.decode_into(value, layout, dst, scratch).map_err(codec_err)?;
                    offer(layout, dst);
                    layout.clone()
                }
                LmdbOut::Variable { bytes, shape } => {
                    let info = plan.codec.decode(value, *bytes, scratch, self.max_value_bytes).map_err(codec_err)?;
                    offer(&info, bytes);
                    shape.clone_from(&info.shape);
                    info
                }
                LmdbOut::Ragged { data, shape } => {
                    let info = plan.codec.probe(value).map_err(codec_err)?;
                    let n = fits(plan, &info.shape, info.dtype, data.len(), self.max_value_bytes)
                        .map_err(|f| f.into_error(i, &err))?;
                    plan.codec.decode_into(value, &info, &mut data[..n], scratch).map_err(codec_err)?;
                    offer(&info, &data[..n]);
                    shape.copy_from_slice(&info.shape);
                    info
                }
                LmdbOut::Skip if plan.has_followers => plan.codec.probe(value).map_err(codec_err)?,
                LmdbOut::Skip => return Ok(()),
            };
            shapes[i] = Some(info.shape);
            return Ok(());
        };

        if let LmdbOut::Skip = out {
            // Left out; a follower may still need the decoded shape.
            if plan.has_followers {
                shapes[i] = Some(plan.codec.probe(value).map_err(codec_err)?.shape);
            }
            return Ok(());
        }
        let key = SampleKey { seed: sample.seed, epoch: sample.epoch, index: sample.index };
        // A JPEG whose chain starts by shrinking it decodes DCT-scaled; one
        // whose chain starts with a crop decodes only the crop's window, drawn
        // as the chain draws it (not for paired fields: their geometry is
        // checked against the full size).
        let solo = plan.leader.is_none() && !plan.has_followers;
        // A value the sample cache would keep is decoded whole (later epochs
        // crop it afresh); a cropped decode serves one epoch only.
        let keep = cached.is_some_and(|(cache, _)| {
            let bytes = plan.decoded.as_ref().map_or(0, |d| d.bytes());
            cache.caches.samples.wants(bytes, &Uses::one(cache.dataset, sample.index))
        });
        let mut window = None; // the decoded window's shape, where only that was decoded
        let info = match (leading_shrink(chain), chain.after_leading_crop()) {
            (Some(size), _) if solo => plan.codec.decode_at_least(value, decoded, scratch, self.max_value_bytes, size),
            (None, Some(_)) if solo && !keep => {
                let crop = |h, w| chain.leading_crop(h, w, key).map(|c| (c.top, c.left, c.height, c.width));
                plan.codec.decode_cropped(value, decoded, scratch, self.max_value_bytes, crop).map(|(info, shape)| {
                    window = shape;
                    info
                })
            }
            _ => plan.codec.decode(value, decoded, scratch, self.max_value_bytes),
        }
        .map_err(codec_err)?;
        if window.is_none() {
            offer(&info, decoded.as_slice());
        }
        let window = window.as_deref();
        self.transform_into(plan, i, &info, decoded.as_slice(), window, key, shapes, transform, out, &err)
    }

    /// Serves field `i` from a cached decoded value: copied as is, or through the field's chain.
    #[allow(clippy::too_many_arguments)]
    fn serve_cached(
        &self,
        plan: &FieldPlan,
        i: usize,
        hit: &Decoded,
        key: SampleKey,
        shapes: &mut [Option<Vec<u64>>],
        transform: &mut transform::Scratch,
        out: &mut LmdbOut<'_>,
        err: &dyn Fn(String) -> SourceError,
    ) -> Result<(), SourceError> {
        let (info, bytes) = (&hit.info, hit.data.as_slice());
        if plan.chain.is_some() && !matches!(out, LmdbOut::Skip) {
            return self.transform_into(plan, i, info, bytes, None, key, shapes, transform, out, err);
        }
        match out {
            LmdbOut::Fixed(dst) => {
                if plan.decoded.as_ref() != Some(info) || dst.len() != bytes.len() {
                    return Err(err(format!(
                        "cached value is {info}, but the field was laid out as {:?}",
                        plan.decoded
                    )));
                }
                dst.copy_from_slice(bytes);
            }
            LmdbOut::Variable { bytes: dst, shape } => {
                dst.clear();
                dst.extend_from_slice(bytes);
                shape.clone_from(&info.shape);
            }
            LmdbOut::Ragged { data, shape } => {
                let n = fits(plan, &info.shape, info.dtype, data.len(), self.max_value_bytes)
                    .map_err(|f| f.into_error(i, err))?;
                data[..n].copy_from_slice(&bytes[..n]);
                shape.copy_from_slice(&info.shape);
            }
            LmdbOut::Skip => {}
        }
        shapes[i] = Some(info.shape.clone());
        Ok(())
    }

    /// Applies field `i`'s chain to its decoded value (`info`; or only the
    /// window of shape `window` of it, decoded by a cropping decoder, to
    /// which the chain after its leading crop applies) and writes the result into `out`.
    #[allow(clippy::too_many_arguments)]
    fn transform_into(
        &self,
        plan: &FieldPlan,
        i: usize,
        info: &ArrayInfo,
        decoded: &[u8],
        window: Option<&[u64]>,
        key: SampleKey,
        shapes: &mut [Option<Vec<u64>>],
        transform: &mut transform::Scratch,
        out: &mut LmdbOut<'_>,
        err: &dyn Fn(String) -> SourceError,
    ) -> Result<(), SourceError> {
        let chain = plan.chain.as_ref().expect("called for fields with a chain");
        if let LmdbOut::Skip = out {
            shapes[i] = Some(info.shape.clone());
            return Ok(());
        }
        let (run, input_shape) = match (window, chain.after_leading_crop()) {
            (Some(shape), Some(rest)) => (rest, shape),
            _ => (chain, info.shape.as_slice()),
        };
        let leader_shape = plan.leader.and_then(|l| shapes[l].as_deref());
        let known: Vec<Option<u64>> = info.shape.iter().map(|&d| Some(d)).collect();
        let (out_dtype, out_shape) = chain.output(info.dtype, &known).map_err(|e| err(e.to_string()))?;
        let out_shape: Vec<u64> = out_shape.into_iter().map(|d| d.expect("known input, known output")).collect();
        let apply = |dst: &mut [u8], transform: &mut transform::Scratch| {
            run.apply(
                ArrayRef { bytes: decoded, dtype: info.dtype, shape: input_shape },
                key,
                leader_shape,
                transform,
                dst,
            )
            .map_err(|e| err(e.to_string()))
        };
        match out {
            LmdbOut::Fixed(dst) => {
                if plan.fixed_shape().as_deref() != Some(&out_shape[..]) || out_dtype != plan.dtype {
                    return Err(err(format!(
                        "value is {info} and transforms to {out_dtype} {out_shape:?}, but the field was laid out \
                         as {} {:?} from the first {} keys",
                        plan.dtype, plan.shape, self.probe
                    )));
                }
                apply(dst, transform)?;
            }
            LmdbOut::Variable { bytes, shape } => {
                bytes.clear();
                bytes.resize(out_shape.iter().product::<u64>() as usize * out_dtype.size(), 0);
                apply(bytes, transform)?;
                shape.clone_from(&out_shape);
            }
            LmdbOut::Ragged { data, shape } => {
                let n = fits(plan, &out_shape, out_dtype, data.len(), self.max_value_bytes)
                    .map_err(|f| f.into_error(i, err))?;
                apply(&mut data[..n], transform)?;
                shape.copy_from_slice(&out_shape);
            }
            LmdbOut::Skip => unreachable!("left-out fields return above"),
        }
        shapes[i] = Some(info.shape.clone());
        Ok(())
    }
}

/// What a sample's randomized transform steps are keyed by.
fn key_of(sample: SampleRef) -> SampleKey {
    SampleKey { seed: sample.seed, epoch: sample.epoch, index: sample.index }
}

/// The size a chain's first step resizes to, when that step is an
/// interpolating resize (a nearest-neighbour one keeps exact pixel values,
/// which a scaled decode would not).
fn leading_shrink(chain: &transform::Chain) -> Option<(u64, u64)> {
    match chain.steps().first() {
        Some(transform::Step::Resize { height, width, filter }) if *filter != transform::Filter::Nearest => {
            Some((*height, *width))
        }
        _ => None,
    }
}

impl Source for LmdbSource {
    fn len(&self) -> u64 {
        self.keys.len() as u64
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn skipped(&self) -> u64 {
        LmdbSource::skipped(self)
    }

    fn open_files(&self) -> u64 {
        let mut envs: Vec<*const SharedEnv> = self.envs.iter().map(Arc::as_ptr).collect();
        envs.sort_unstable();
        envs.dedup();
        envs.len() as u64
    }

    fn poisoned(&self) -> Option<String> {
        LmdbSource::poisoned(self)
    }

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let mut outs: Vec<LmdbOut<'_>> = out
            .iter_mut()
            .map(|o| match o.shape.as_deref_mut() {
                Some(shape) => LmdbOut::Ragged { data: &mut o.data[..], shape },
                None => LmdbOut::Fixed(&mut o.data[..]),
            })
            .collect();
        self.read_into(sample, &mut outs).map(drop)
    }
}

/// An environment open in this process, shared by every dataset that reads it.
struct SharedEnv {
    path: PathBuf,
    env: MappedEnv,
}

impl fmt::Debug for SharedEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedEnv").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Environments open in this process, by canonical path: one mapping per
/// environment, until a read finds its file truncated or corrupt.
static OPEN_ENVS: LazyLock<Mutex<HashMap<PathBuf, Weak<SharedEnv>>>> = LazyLock::new(Default::default);

impl SharedEnv {
    fn open(path: &Path) -> Result<Arc<SharedEnv>, SourceError> {
        let open_err = |message: String| SourceError::LmdbOpen { env: path.to_owned(), message };
        let canonical = path.canonicalize().map_err(|e| open_err(format!("{e}")))?;
        let mut open = OPEN_ENVS.lock().unwrap_or_else(PoisonError::into_inner);
        // A poisoned environment is never handed out again: the file may have
        // been restored since, and a fresh mapping reads it anew.
        // Nor is one whose file was written since it was mapped (a dataset
        // opened again to see new keys): beginning a transaction checks that.
        let current = |e: &Arc<SharedEnv>| e.env.poisoned().is_none() && e.env.txn().is_ok();
        if let Some(env) = open.get(&canonical).and_then(Weak::upgrade).filter(current) {
            return Ok(env);
        }
        let single_file = canonical.is_file();
        if !single_file && !canonical.join("data.mdb").is_file() {
            return Err(open_err(
                "is a directory without data.mdb; give the environment directory, or its data file for \
                 environments written with subdir=False"
                    .into(),
            ));
        }
        // Read-only and without the lock file (MDB_NOLOCK): a served dataset
        // is not written (documented at the top of this module), so no
        // writer recycles pages under our readers.
        let env = MappedEnv::open(&canonical, single_file).map_err(|e| match e {
            GuardError::Corrupt(message) => open_err(message),
            GuardError::Lmdb(message) => {
                let data = if single_file { canonical.clone() } else { canonical.join("data.mdb") };
                match std::fs::metadata(&data) {
                    // Two meta pages of at least 4 KiB start every environment.
                    Ok(meta) if meta.len() < 8192 => open_err(format!(
                        "not a readable LMDB environment ({message}): its data file {} is only {} bytes, \
                         truncated or not LMDB; rebuild or restore the environment",
                        data.display(),
                        meta.len()
                    )),
                    _ => open_err(format!("not a readable LMDB environment: {message}")),
                }
            }
        })?;
        let shared = Arc::new(SharedEnv { path: path.to_owned(), env });
        open.insert(canonical, Arc::downgrade(&shared));
        Ok(shared)
    }

    /// The keys `filter` keeps, in LMDB order.
    fn keys(&self, filter: &KeyFilter) -> Result<Keys, SourceError> {
        let regex = |pattern: &str| {
            Regex::new(pattern).map_err(|e| SourceError::LmdbOpen {
                env: self.path.clone(),
                message: format!("invalid key regex {pattern:?}: {e}"),
            })
        };
        let keep: KeyTest = match filter {
            KeyFilter::SkipMetadata => Box::new(|k| !is_metadata_key(k)),
            KeyFilter::All => Box::new(|_| true),
            KeyFilter::Prefix(prefix) => {
                let prefix = prefix.as_bytes().to_vec();
                Box::new(move |k| k.starts_with(&prefix))
            }
            KeyFilter::Include(pattern) => {
                let re = regex(pattern)?;
                Box::new(move |k| re.is_match(k))
            }
            KeyFilter::Exclude(pattern) => {
                let re = regex(pattern)?;
                Box::new(move |k| !re.is_match(k))
            }
        };
        let err =
            |e: GuardError| SourceError::LmdbOpen { env: self.path.clone(), message: format!("listing keys: {e}") };
        let txn = self.env.txn().map_err(err)?;
        let mut cursor = txn.cursor().map_err(err)?;
        let (mut keys, mut dropped) = (Keys::default(), 0u64);
        while let Some((key, _)) = cursor.next_entry(false).map_err(err)? {
            if keep(key) {
                keys.push(key);
            } else {
                dropped += 1;
            }
        }
        if dropped > 0 {
            tracing::info!(env = %self.path.display(), kept = keys.len(), dropped, ?filter, "LMDB key filter");
        }
        Ok(keys)
    }

    /// Fails naming the first of `keys` this environment lacks.
    fn check_has(&self, keys: &Keys, field: &str) -> Result<(), SourceError> {
        let err = |e: GuardError| SourceError::LmdbOpen { env: self.path.clone(), message: e.to_string() };
        let txn = self.env.txn().map_err(err)?;
        let mut first = None;
        let mut missing = 0u64;
        for key in keys.iter() {
            if txn.get(key).map_err(err)?.is_none() {
                missing += 1;
                first.get_or_insert(key);
            }
        }
        match first {
            None => Ok(()),
            Some(key) => Err(SourceError::LmdbMissingKey {
                env: self.path.clone(),
                field: field.to_string(),
                key: show_key(key),
                missing,
                total: keys.len() as u64,
            }),
        }
    }
}

/// Dtype and per-dimension shape (`None` where values differ) of a field, from its first `probe` keys.
fn probe_field(
    env: &SharedEnv,
    field: &LmdbField,
    keys: &Keys,
    probe: usize,
    on_error: OnError,
    max_bytes: u64,
) -> Result<(DType, Vec<Option<u64>>, u64), SourceError> {
    let field_err = |message: String| SourceError::LmdbField {
        env: field.env.clone(),
        field: field.name.clone(),
        codec: field.codec.to_string(),
        message,
    };
    let txn = env.env.txn().map_err(|e| field_err(e.to_string()))?;
    let mut value = Vec::new();
    let mut merged: Option<(DType, Vec<Option<u64>>, String)> = None;
    let mut largest = 0u64;
    for index in 0..probe {
        let key = keys.get(index);
        let read_err = |message: String| read_error(&field.env, key, &field.name, &field.codec, index as u64, message);
        let probed = txn
            .read(key, &mut value)
            .map_err(|e| read_err(e.to_string()))
            .and_then(|found| if found { Ok(()) } else { Err(read_err("the key is missing".into())) })
            .and_then(|()| field.codec.probe(&value).map_err(|e| read_err(e.to_string())))
            .and_then(|info| match info.check_size(max_bytes) {
                Ok(_) => Ok(info),
                Err(e) => Err(read_err(e.to_string())),
            });
        let info = match (probed, on_error) {
            (Ok(info), _) => info,
            (Err(e), OnError::Fail) => return Err(e),
            // A truncated or corrupt file is not a bad value to skip.
            (Err(e), OnError::Skip) if env.env.poisoned().is_some() => return Err(e),
            (Err(e), OnError::Skip) => {
                tracing::warn!(error = %e, "LMDB probe: skipping a bad value");
                continue;
            }
        };
        largest = largest.max(info.checked_bytes().unwrap_or(u64::MAX));
        match &mut merged {
            None => merged = Some((info.dtype, info.shape.iter().map(|&d| Some(d)).collect(), show_key(key))),
            Some((dtype, shape, first_key)) => {
                if *dtype != info.dtype || shape.len() != info.shape.len() {
                    return Err(field_err(format!(
                        "key {first_key:?} holds {dtype} with {} dimensions but key {:?} holds {info}; a field's \
                         values must share dtype and number of dimensions",
                        shape.len(),
                        show_key(key)
                    )));
                }
                for (d, &e) in shape.iter_mut().zip(&info.shape) {
                    if *d != Some(e) {
                        *d = None;
                    }
                }
            }
        }
    }
    let (dtype, shape, _) =
        merged.ok_or_else(|| field_err(format!("none of the first {probe} values could be decoded")))?;
    Ok((dtype, shape, largest))
}

/// Why a value does not go into its ragged row.
enum Misfit {
    /// Wrong dtype or number of dimensions, or beyond `[limits] max_sample_bytes`.
    Bad(String),
    /// Larger than the row's room: this many bytes.
    Larger(u64, String),
}

impl Misfit {
    /// The source error for field `field`; `err` adds the file, key and field.
    fn into_error(self, field: usize, err: &dyn Fn(String) -> SourceError) -> SourceError {
        match self {
            Misfit::Bad(message) => err(message),
            Misfit::Larger(bytes, message) => SourceError::Oversize { field, bytes, message: err(message).to_string() },
        }
    }
}

/// Bytes of a `shape` array of `dtype`, if it fits in a ragged row of `room`
/// bytes and has the field's dtype and number of dimensions (`plan`).
fn fits(plan: &FieldPlan, shape: &[u64], dtype: DType, room: usize, limit: u64) -> Result<usize, Misfit> {
    if dtype != plan.dtype || shape.len() != plan.shape.len() {
        let laid_out: Vec<String> = plan.shape.iter().map(|d| d.map_or("*".into(), |d| d.to_string())).collect();
        return Err(Misfit::Bad(format!(
            "the value is {dtype} {shape:?} but this variable-shape field was laid out as {} [{}] from the first \
             keys; a field's values must share dtype and number of dimensions",
            plan.dtype,
            laid_out.join(", ")
        )));
    }
    let n = shape.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d));
    match n.and_then(|n| usize::try_from(n).ok()) {
        Some(n) if n <= room => Ok(n),
        Some(n) if n as u64 <= limit => Err(Misfit::Larger(
            n as u64,
            format!(
                "the value is {dtype} {shape:?} ({n} bytes), more than the {room} bytes reserved per sample of this \
                 variable-shape field"
            ),
        )),
        _ => Err(Misfit::Bad(format!(
            "the value is {dtype} {shape:?} ({}), more than [limits] max_sample_bytes = {limit}",
            n.map_or_else(|| "more than 2^64 bytes".to_string(), |n| format!("{n} bytes"))
        ))),
    }
}

/// What `stoker inspect` reports about one environment.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EnvScan {
    /// Entries in the main database.
    pub entries: u64,
    /// Keys that look like metadata (`__len__`, `length`, …), skipped by default.
    pub metadata_keys: Vec<String>,
    /// Key shapes (digits as `#`, letters as `a`) and how many keys have each.
    pub key_patterns: Vec<(String, u64)>,
    /// First and last sample keys.
    pub first_keys: Vec<String>,
    /// Value formats among the values probed: `png`, `jpeg`, `npy`, `lz4+npy`, …, `unknown`.
    pub formats: Vec<(String, u64)>,
    /// Decoded dtype and shape among the values probed, with counts.
    pub shapes: Vec<(String, u64)>,
    /// Values probed (the first ones in key order).
    pub probed: u64,
    /// Each probed key with its decoded shape (for pairing environments by image size).
    #[serde(skip)]
    pub probed_shapes: Vec<(Vec<u8>, Vec<u64>)>,
}

/// Scans an environment for `stoker inspect`: counts keys, sniffs the
/// format of the first `probe` sample values and probes their shapes.
pub fn scan(path: &Path, probe: usize) -> Result<EnvScan, SourceError> {
    let env = SharedEnv::open(path)?;
    let err = |e: GuardError| SourceError::LmdbOpen { env: path.to_owned(), message: e.to_string() };
    let txn = env.env.txn().map_err(err)?;
    let mut cursor = txn.cursor().map_err(err)?;
    let mut value = Vec::new();
    let mut scan = EnvScan::default();
    let mut patterns: BTreeMap<String, u64> = BTreeMap::new();
    let mut formats: BTreeMap<String, u64> = BTreeMap::new();
    let mut shapes: BTreeMap<String, u64> = BTreeMap::new();
    let mut last = None;
    loop {
        let want_value = (scan.probed as usize) < probe;
        let Some((key, value_at)) = cursor.next_entry(want_value).map_err(err)? else { break };
        scan.entries += 1;
        if is_metadata_key(key) {
            scan.metadata_keys.push(show_key(key));
            continue;
        }
        let pattern: String = String::from_utf8_lossy(key)
            .chars()
            .map(|c| {
                if c.is_ascii_digit() {
                    '#'
                } else if c.is_alphabetic() {
                    'a'
                } else {
                    c
                }
            })
            .collect();
        *patterns.entry(pattern).or_default() += 1;
        if scan.first_keys.len() < 3 {
            scan.first_keys.push(show_key(key));
        } else {
            last = Some(show_key(key));
        }
        if let Some(value_at) = value_at {
            scan.probed += 1;
            value.clear();
            value.resize(value_at.len(), 0);
            txn.copy(value_at, &mut value).map_err(err)?;
            let (format, info) = sniff_value(&value);
            *formats.entry(format).or_default() += 1;
            if let Some(info) = info {
                *shapes.entry(info.to_string()).or_default() += 1;
                scan.probed_shapes.push((key.to_vec(), info.shape));
            }
        }
    }
    scan.first_keys.extend(last);
    let by_count = |m: BTreeMap<String, u64>| {
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(8);
        v
    };
    scan.key_patterns = by_count(patterns);
    scan.formats = by_count(formats);
    scan.shapes = by_count(shapes);
    Ok(scan)
}

/// The codec name a value seems to need, and its decoded layout when a codec probes it.
fn sniff_value(value: &[u8]) -> (String, Option<ArrayInfo>) {
    let outer = stoker_decode::codec::sniff(value);
    let candidates: Vec<String> = match outer {
        "lz4" | "zstd" => ["npy", "png", "jpeg"].iter().map(|inner| format!("{outer}+{inner}")).collect(),
        "unknown" => return ("unknown".into(), None),
        format => vec![format.to_string()],
    };
    for name in &candidates {
        if let Ok(info) = Codec::parse(name, None).and_then(|codec| codec.probe(value)) {
            return (name.clone(), Some(info));
        }
    }
    (format!("{outer}+?"), None)
}

/// A read error naming the environment, key, field and codec involved.
fn read_error(
    env: &Path,
    key: &[u8],
    field: &str,
    codec: &dyn fmt::Display,
    index: u64,
    message: String,
) -> SourceError {
    SourceError::LmdbRead(Box::new(LmdbReadError {
        env: env.to_owned(),
        key: show_key(key),
        field: field.to_string(),
        codec: codec.to_string(),
        index,
        message,
    }))
}

/// A predicate on keys.
type KeyTest = Box<dyn Fn(&[u8]) -> bool>;

/// Whether `key` looks like metadata a dataset writer added beside the samples.
fn is_metadata_key(key: &[u8]) -> bool {
    (key.len() > 4 && key.starts_with(b"__") && key.ends_with(b"__")) || key == b"length" || key == b"keys"
}

/// Reads a key file: one key per line, or BasicSR `meta_info.txt` lines.
fn read_key_file(path: &Path, opened: Option<&std::fs::File>) -> Result<Keys, SourceError> {
    let err = |e: std::io::Error| SourceError::LmdbKeyFile { path: path.to_owned(), message: e.to_string() };
    // Opened here when not beforehand: a regular file only (a FIFO would block).
    let own = match opened {
        Some(_) => None,
        None => Some(
            crate::fsaccess::open(path, None, crate::fsaccess::Want::File)
                .map_err(|e| SourceError::LmdbKeyFile { path: path.to_owned(), message: e.to_string() })?
                .file,
        ),
    };
    let mut text = String::new();
    if let Some(mut file) = opened.or(own.as_ref()) {
        std::io::Read::read_to_string(&mut file, &mut text).map_err(err)?;
    }
    let mut keys = Keys::default();
    for line in text.lines() {
        let line = line.trim();
        if !line.is_empty() {
            keys.push(basicsr_key(line).unwrap_or(line).as_bytes());
        }
    }
    Ok(keys)
}

/// The key of a BasicSR `meta_info.txt` line `NAME.EXT (h,w,c) LEVEL`: NAME
/// up to its first dot, as BasicSR's `line.split('.')[0]`. `None` for other lines.
fn basicsr_key(line: &str) -> Option<&str> {
    let (name, rest) = line.split_once(char::is_whitespace)?;
    let inside = rest.trim_start().strip_prefix('(')?.split_once(')')?.0;
    let dims_ok = inside.split(',').map(str::trim).filter(|d| !d.is_empty()).all(|d| d.parse::<u64>().is_ok());
    (dims_ok && !inside.trim().is_empty()).then(|| name.split('.').next().unwrap_or(name))
}

/// A key for messages: as text when it is UTF-8, escaped otherwise.
fn show_key(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) => text.to_string(),
        Err(_) => key.escape_ascii().to_string(),
    }
}

/// Keys packed into one allocation (a million keys cost their bytes plus 8 each).
#[derive(Debug, Default)]
struct Keys {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Keys {
    fn push(&mut self, key: &[u8]) {
        self.bytes.extend_from_slice(key);
        self.ends.push(self.bytes.len());
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.get(i))
    }
}

#[cfg(test)]
#[allow(unsafe_code)] // opens environments with heed, whose open is unsafe
mod tests;
