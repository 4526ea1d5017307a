//! Transforms over any source: [`Transformed`] wraps a [`Source`] whose
//! fields arrive as read (HDF5) and runs each field's [`Chain`] on them, so
//! every source shares one transform engine. A transformed field is read into
//! a per-worker buffer and the chain writes into the slot; other fields are
//! read straight into the slot as before.

use std::sync::{Arc, Mutex, PoisonError};

use crate::source::{FieldOut, FieldSpec, SampleRef, Source, SourceError};
use stoker_decode::codec::AlignedBuf;
use stoker_decode::transform::{ArrayRef, Chain, Pair, SampleKey, Scratch, Step, TransformError};
use stoker_proto::FieldTransforms;

/// The transforms of a dataset's fields from their wire form (errors name the field and step).
pub fn field_chains(defs: &[FieldTransforms]) -> Result<Vec<FieldChain>, TransformError> {
    defs.iter()
        .map(|d| {
            let steps = d.steps.iter().map(|t| Step::from_def(t, &d.field)).collect::<Result<Vec<_>, _>>()?;
            Ok(FieldChain {
                field: d.field.clone(),
                steps,
                pair: d.pair.as_ref().map(|p| Pair { with: p.with.clone(), scale: p.scale }),
                spatial_axes: d.spatial_axes,
            })
        })
        .collect()
}

/// One field's transforms as declared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FieldChain {
    /// The field.
    pub field: String,
    /// Steps in order.
    pub steps: Vec<Step>,
    /// Random draws shared with another field.
    pub pair: Option<Pair>,
    /// The axes spatial steps act on ([`Chain::with_spatial_axes`]).
    pub spatial_axes: Option<[i64; 2]>,
}

/// A source whose fields pass through transform chains.
#[derive(Debug)]
pub struct Transformed {
    inner: Arc<dyn Source>,
    /// The dataset, for messages.
    label: String,
    fields: Vec<FieldSpec>,
    /// Per field of the inner source: its chain, if any.
    chains: Vec<Option<Chain>>,
    /// Per field: the index of the field it pairs with.
    leaders: Vec<Option<usize>>,
    workers: Mutex<Vec<Worker>>,
}

/// Buffers one fill thread reuses.
#[derive(Debug, Default)]
struct Worker {
    /// Per field: the value as read, for transformed fields.
    read: Vec<AlignedBuf>,
    scratch: Scratch,
}

impl Transformed {
    /// Wraps `inner`, running `chains` (`label` names the dataset in errors;
    /// `max_bytes` is `[limits] max_sample_bytes`). Checks every chain
    /// against its field's dtype and shape now, so a bad step fails the open.
    pub fn new(
        inner: Arc<dyn Source>,
        chains: &[FieldChain],
        label: &str,
        max_bytes: u64,
    ) -> Result<Transformed, SourceError> {
        let spec_err = |message: String| SourceError::Spec { pattern: label.to_string(), message };
        let names: Vec<&str> = inner.fields().iter().map(|f| f.name.as_str()).collect();
        let mut built: Vec<Option<Chain>> = vec![None; names.len()];
        for fc in chains {
            let Some(at) = names.iter().position(|n| *n == fc.field) else {
                return Err(spec_err(format!(
                    "transforms name field {:?}, which is not one of the fields {names:?}",
                    fc.field
                )));
            };
            if built[at].is_some() {
                return Err(spec_err(format!("field {:?} has transforms given twice", fc.field)));
            }
            let chain = Chain::new(&fc.field, fc.steps.clone(), fc.pair.clone())
                .map_err(|e| spec_err(e.to_string()))?
                .with_limit(max_bytes)
                .with_spatial_axes(fc.spatial_axes);
            built[at] = Some(chain);
        }
        let mut leaders = vec![None; names.len()];
        for (i, chain) in built.iter().enumerate() {
            let Some(pair) = chain.as_ref().and_then(Chain::pair) else { continue };
            let Some(at) = names.iter().position(|n| *n == pair.with) else {
                return Err(spec_err(format!("field {:?} pairs with {:?}, which is not a field", names[i], pair.with)));
            };
            let Some(leader) = built[at].as_ref() else {
                return Err(spec_err(format!(
                    "field {:?} pairs with {:?}, which has no transforms: give it the same random steps",
                    names[i], pair.with
                )));
            };
            chain
                .as_ref()
                .expect("paired fields have chains")
                .check_pair(leader)
                .map_err(|e| spec_err(e.to_string()))?;
            leaders[i] = Some(at);
        }
        let mut fields = inner.fields().to_vec();
        for (field, chain) in fields.iter_mut().zip(&built) {
            let Some(chain) = chain else { continue };
            if field.max_sample_bytes.is_some() {
                return Err(spec_err(format!("field {:?} varies in shape; transforms need a fixed shape", field.name)));
            }
            let known: Vec<Option<u64>> = field.shape.iter().map(|&d| Some(d)).collect();
            let (dtype, shape) = chain.output(field.dtype, &known).map_err(|e| match e {
                TransformError::TooLarge { .. } => SourceError::Limit(format!("dataset {label:?}: {e}")),
                e => spec_err(format!("{e} (the field is {} {:?} as read)", field.dtype, field.shape)),
            })?;
            field.dtype = dtype;
            field.shape = shape.into_iter().map(|d| d.expect("a known shape stays known")).collect();
        }
        Ok(Transformed {
            inner,
            label: label.to_string(),
            fields,
            chains: built,
            leaders,
            workers: Mutex::new(Vec::new()),
        })
    }

    /// The source beneath.
    pub fn inner(&self) -> &Arc<dyn Source> {
        &self.inner
    }
}

impl Source for Transformed {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn skipped(&self) -> u64 {
        self.inner.skipped()
    }

    fn open_files(&self) -> u64 {
        self.inner.open_files()
    }

    fn poisoned(&self) -> Option<String> {
        self.inner.poisoned()
    }

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let mut worker = self.workers.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default();
        let result = self.read_with(&mut worker, sample, out);
        self.workers.lock().unwrap_or_else(PoisonError::into_inner).push(worker);
        result
    }
}

impl Transformed {
    fn read_with(&self, worker: &mut Worker, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let inner_fields = self.inner.fields();
        worker.read.resize_with(inner_fields.len(), AlignedBuf::default);
        let Worker { read, scratch } = worker;
        // Transformed fields are read into the worker's buffers, the rest into the slot.
        let mut pending: Vec<(usize, &mut FieldOut<'_>)> = Vec::new();
        {
            let mut inner_out: Vec<FieldOut<'_>> = Vec::with_capacity(out.len());
            let mut bufs = read.iter_mut();
            for (i, (dst, spec)) in out.iter_mut().zip(inner_fields).enumerate() {
                let buf = bufs.next().expect("one buffer per field");
                if self.chains[i].is_some() {
                    let bytes = spec.shape.iter().product::<u64>() as usize * spec.dtype.size();
                    inner_out.push(FieldOut { data: buf.resize(bytes), shape: None });
                    pending.push((i, dst));
                } else {
                    inner_out.push(FieldOut { data: &mut *dst.data, shape: dst.shape.as_deref_mut() });
                }
            }
            self.inner.read_sample(sample, &mut inner_out)?;
        }
        let key = SampleKey { seed: sample.seed, epoch: sample.epoch, index: sample.index };
        for (i, dst) in pending {
            let chain = self.chains[i].as_ref().expect("pending fields have chains");
            let spec = &inner_fields[i];
            let leader = self.leaders[i].map(|l| inner_fields[l].shape.as_slice());
            let input = ArrayRef { bytes: read[i].as_slice(), dtype: spec.dtype, shape: &spec.shape };
            chain.apply(input, key, leader, scratch, dst.data).map_err(|e| SourceError::Spec {
                pattern: self.label.clone(),
                message: format!("sample {}: {e}", sample.index),
            })?;
        }
        Ok(())
    }
}
