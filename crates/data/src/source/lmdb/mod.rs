//! LMDB source: samples are the keys of one or more environments, each field
//! a value decoded by a [`Codec`] and optionally transformed by a [`Chain`].
//!
//! Environments are opened once per process, read-only and without LMDB's
//! lock file (`MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD`, as BasicSR opens its
//! datasets): the daemon needs no write access to the dataset's directory,
//! and a dataset must not be written while it is served. An environment is a
//! directory holding `data.mdb` (Python `lmdb.open(path)`) or the data file
//! itself (`subdir=False`). Every read runs in its own read transaction
//! (cheap without the lock table); a value is copied out of the map under the
//! fault guard (`guard.rs`) and decoded from that copy.
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

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use stoker_proto::DType;

use super::{FieldOut, FieldSpec, SampleRef, Source, SourceError};
use crate::cache::CacheCtx;
use crate::fsaccess::FileId;
use stoker_decode::codec::{AlignedBuf, ArrayInfo, Codec};
use stoker_decode::transform::{self, Chain, Pair, SampleKey, Step};

mod env;
mod guard;
mod keys;
mod open;
mod read;
mod scan;

use env::SharedEnv;
use keys::*;
use open::*;
pub use scan::{EnvScan, scan};

use guard::{GuardError, MappedEnv, Txn};

/// The files of an LMDB dataset, opened by handle beforehand.
#[derive(Debug, Default)]
pub struct CheckedLmdb {
    /// Per environment path as the dataset names it: the identity of its data file.
    pub envs: Vec<(PathBuf, FileId)>,
    /// The key file's handle.
    pub key_file: Option<File>,
    /// Per environment path: its data file, opened by handle (what LMDB
    /// maps; no path is opened again).
    pub data: Vec<(PathBuf, File)>,
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OnError {
    /// The read fails with an error naming environment, key, field and codec.
    #[default]
    Fail,
    /// The next good sample (wrapping) stands in; each bad key is logged once and counted.
    Skip,
}

/// An LMDB dataset's definition.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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

#[cfg(test)]
#[allow(unsafe_code)] // opens environments with heed, whose open is unsafe
mod tests;
