//! Reading samples: per-worker transactions and buffers, the decoded-sample
//! cache, codecs and transforms into the slot (or a growable buffer for
//! variable fields), and `on_error = "skip"` substitution.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use crate::cache::{CacheCtx, Decoded, Key, Uses};
use crate::source::{SampleRef, SourceError};
use stoker_decode::codec::{ArrayInfo, ByteOrder, Codec, CodecError, Format, Wrap};
use stoker_decode::transform::{self, ArrayRef, SampleKey};

use super::*;

impl LmdbSource {
    /// Keeps decoded values of costly fields (images, compressed values) in
    /// the daemon's sample cache. Cheap ones (raw and `.npy` values, read
    /// from the page cache at memory speed) are never cached.
    pub fn with_cache(mut self, cache: CacheCtx) -> LmdbSource {
        self.cache = cache.caches.samples.enabled().then_some(cache);
        self
    }

    /// The cache and key for field `i`'s value of sample `index`, when the field is worth caching.
    pub(super) fn cache_slot(&self, i: usize, index: u64) -> Option<(&CacheCtx, Key)> {
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

    pub(super) fn read_index(&self, sample: SampleRef, out: &mut [LmdbOut<'_>]) -> Result<(), SourceError> {
        let mut worker = self.workers.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default();
        let result = self.read_with(&mut worker, sample, out);
        // One huge value must not pin its buffers for the life of the dataset.
        if worker.retained_bytes() <= KEEP_WORKER_BYTES {
            self.workers.lock().unwrap_or_else(PoisonError::into_inner).push(worker);
        }
        result
    }

    pub(super) fn read_with(
        &self,
        worker: &mut Worker,
        sample: SampleRef,
        out: &mut [LmdbOut<'_>],
    ) -> Result<(), SourceError> {
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

    pub(super) fn read_field(
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
        let Some(chain) = &plan.chain else {
            if let Some(info) = self.decode_plain(i, value, cached, sample.index, scratch, out, &err)? {
                shapes[i] = Some(info.shape);
            }
            return Ok(());
        };

        if let LmdbOut::Skip = out {
            // Left out; a follower may still need the decoded shape.
            if plan.has_followers {
                shapes[i] = Some(plan.codec.probe(value).map_err(|e| self.codec_error(plan, e, &err))?.shape);
            }
            return Ok(());
        }
        let key = key_of(sample);
        let (info, window) = self
            .decode_for_chain(plan, chain, value, decoded, scratch, key, cached)
            .map_err(|e| self.codec_error(plan, e, &err))?;
        if window.is_none() {
            offer(cached, sample.index, &info, decoded.as_slice());
        }
        let window = window.as_deref();
        self.transform_into(plan, i, &info, decoded.as_slice(), window, key, shapes, transform, out, &err)
    }

    /// Decodes the value of field `i`, which has no transforms, into `out`
    /// as its kind of output takes it, and offers it to the sample cache
    /// (`cached`, for sample `index`). The value's dtype and shape; `None`
    /// for a left-out field no other field follows.
    #[allow(clippy::too_many_arguments)]
    fn decode_plain(
        &self,
        i: usize,
        value: &[u8],
        cached: Option<(&CacheCtx, Key)>,
        index: u64,
        scratch: &mut Vec<u8>,
        out: &mut LmdbOut<'_>,
        err: &dyn Fn(String) -> SourceError,
    ) -> Result<Option<ArrayInfo>, SourceError> {
        let plan = &self.plans[i];
        let codec_err = |e| self.codec_error(plan, e, err);
        let info = match out {
            LmdbOut::Fixed(dst) => {
                let layout =
                    plan.decoded.as_ref().expect("a fixed field without transforms has a fixed decoded layout");
                plan.codec.decode_into(value, layout, dst, scratch).map_err(codec_err)?;
                offer(cached, index, layout, dst);
                layout.clone()
            }
            LmdbOut::Variable { bytes, shape } => {
                let info = plan.codec.decode(value, *bytes, scratch, self.max_value_bytes).map_err(codec_err)?;
                offer(cached, index, &info, bytes);
                shape.clone_from(&info.shape);
                info
            }
            LmdbOut::Ragged { data, shape } => {
                let info = plan.codec.probe(value).map_err(codec_err)?;
                let n = fits(plan, &info.shape, info.dtype, data.len(), self.max_value_bytes)
                    .map_err(|f| f.into_error(i, err))?;
                plan.codec.decode_into(value, &info, &mut data[..n], scratch).map_err(codec_err)?;
                offer(cached, index, &info, &data[..n]);
                shape.copy_from_slice(&info.shape);
                info
            }
            LmdbOut::Skip if plan.has_followers => plan.codec.probe(value).map_err(codec_err)?,
            LmdbOut::Skip => return Ok(None),
        };
        Ok(Some(info))
    }

    /// Decodes the value of `plan`'s field for its `chain` into `decoded`:
    /// a JPEG whose chain starts by shrinking it DCT-scaled; one whose chain
    /// starts with a crop only the crop's window, drawn as the chain draws it
    /// for sample `key` (its shape is returned too); anything else whole.
    /// Paired fields decode whole (their geometry is checked against the full
    /// size), and so do values the sample cache (`cached`) would keep (later
    /// epochs crop them afresh; a cropped decode serves one epoch only).
    #[allow(clippy::too_many_arguments)]
    fn decode_for_chain(
        &self,
        plan: &FieldPlan,
        chain: &Chain,
        value: &[u8],
        decoded: &mut AlignedBuf,
        scratch: &mut Vec<u8>,
        key: SampleKey,
        cached: Option<(&CacheCtx, Key)>,
    ) -> Result<(ArrayInfo, Option<Vec<u64>>), CodecError> {
        let solo = plan.leader.is_none() && !plan.has_followers;
        let keep = cached.is_some_and(|(cache, _)| {
            let bytes = plan.decoded.as_ref().map_or(0, |d| d.bytes());
            cache.caches.samples.wants(bytes, &Uses::one(cache.dataset, key.index))
        });
        match (leading_shrink(chain), chain.after_leading_crop()) {
            (Some(size), _) if solo => {
                Ok((plan.codec.decode_at_least(value, decoded, scratch, self.max_value_bytes, size)?, None))
            }
            (None, Some(_)) if solo && !keep => {
                let crop = |h, w| chain.leading_crop(h, w, key).map(|c| (c.top, c.left, c.height, c.width));
                plan.codec.decode_cropped(value, decoded, scratch, self.max_value_bytes, crop)
            }
            _ => Ok((plan.codec.decode(value, decoded, scratch, self.max_value_bytes)?, None)),
        }
    }

    /// A codec error of `plan`'s value as a read error (`err`); a value that
    /// does not match the layout the first keys gave says what to declare.
    fn codec_error(&self, plan: &FieldPlan, e: CodecError, err: &dyn Fn(String) -> SourceError) -> SourceError {
        match (&e, &plan.decoded) {
            (CodecError::Mismatch { .. }, Some(layout)) if plan.chain.is_none() => err(format!(
                "{e}; the field was laid out as {layout} from the first {} keys — declare a crop or resize \
                 transform, or deliver the field ragged",
                self.probe
            )),
            _ => err(e.to_string()),
        }
    }

    /// Serves field `i` from a cached decoded value: copied as is, or through the field's chain.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn serve_cached(
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
    pub(super) fn transform_into(
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
                let len = out_shape
                    .iter()
                    .try_fold(out_dtype.size() as u64, |n, &d| n.checked_mul(d))
                    .filter(|&n| n <= self.max_value_bytes)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        err(format!(
                            "value {info} transforms to {out_dtype} {out_shape:?}, more than [limits] \
                             max_sample_bytes = {} bytes; use smaller sizes in the field's transforms",
                            self.max_value_bytes
                        ))
                    })?;
                bytes.clear();
                bytes.resize(len, 0);
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

/// Offers the decoded value `bytes` (`info`) of sample `index` to the sample
/// cache, which keeps it if it wants it; `cached`: the field's cache and key,
/// when the field is worth caching.
fn offer(cached: Option<(&CacheCtx, Key)>, index: u64, info: &ArrayInfo, bytes: &[u8]) {
    if let Some((cache, key)) = cached {
        let uses = Uses::one(cache.dataset, index);
        if cache.caches.samples.wants(bytes.len(), &uses) {
            let entry = Arc::new(Decoded::copy_of(info, bytes));
            cache.caches.samples.insert(key, entry, bytes.len(), uses);
        }
    }
}
