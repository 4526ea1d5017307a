//! Per-field transforms: a [`Chain`] of crops, resize, flip, cast/normalize
//! and HWC→CHW, applied to one decoded `[h, w]` / `[h, w, c]` array, with
//! the last step writing straight into the slot.
//!
//! Randomized steps are deterministic in `(seed, epoch, index)`: each draw is
//! a splitmix64 hash of those, the chain's *group* and the step's position,
//! never a global RNG, so any worker produces the same sample and a resumed
//! stream repeats itself. Fields are paired through the group: a chain
//! declared with [`Pair`] `{ with: "lr", scale: 4 }` draws exactly what field
//! `lr`'s chain draws, and scales the coordinates — an HR crop lies at 4× the
//! LR crop's offset, and both flip together.
//!
//! Crops and flips only move a view over the decoded pixels; pixels are
//! copied when a resize needs contiguous input and once at the end, into the
//! destination (casting, normalizing and reordering on the way).

#![forbid(unsafe_code)]

mod def;
mod error;
mod nd;
mod resize;
pub mod stats;
mod step;

use stoker_proto::DType;
use stoker_proto::hash::{fnv1a, splitmix64};

use crate::codec::AlignedBuf;
pub use error::{GeometryError, TransformError};
pub use resize::ResizeError;
pub use step::{Filter, Pair, Step};

/// A decoded array a chain reads: C-ordered, native-endian bytes of `dtype` and `shape`.
#[derive(Debug, Clone, Copy)]
pub struct ArrayRef<'a> {
    /// The elements.
    pub bytes: &'a [u8],
    /// Element type.
    pub dtype: DType,
    /// `[h, w]` or `[h, w, c]`.
    pub shape: &'a [u64],
}

/// Which sample a chain runs for; the key of every random draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleKey {
    /// The stream's seed.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// The dataset index.
    pub index: u64,
}

/// Buffers a chain reuses between samples (one per worker).
#[derive(Debug, Default)]
pub struct Scratch {
    a: AlignedBuf,
    b: AlignedBuf,
    resizer: resize::Resizer,
}

/// Largest follower-to-leader size ratio of a pair (BasicSR uses 2–4; the
/// bound keeps every product of a leader's size and the scale far from overflow).
pub const MAX_PAIR_SCALE: u64 = 64;

/// A field's transforms, validated.
#[derive(Debug, Clone)]
pub struct Chain {
    field: String,
    steps: Vec<Step>,
    pair: Option<Pair>,
    /// Hash of the field whose draws this chain makes (its own, or `pair.with`).
    group: u64,
    /// Most bytes the array may take at any step (`[limits] max_sample_bytes`).
    max_bytes: u64,
    /// The axes spatial steps act on, as given (negative from the end); `None`: the default.
    spatial: Option<[i64; 2]>,
    /// Position of this chain's first random step among its draws: 0, or 1
    /// for the rest of a chain whose random crop was applied while decoding.
    random_base: u64,
    /// [`Chain::after_leading_crop`], made once.
    rest: std::sync::OnceLock<Option<Box<Chain>>>,
}

/// Where a chain's leading crop lies in an image (see [`Chain::leading_crop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CropWindow {
    /// First row kept.
    pub top: u64,
    /// First column kept.
    pub left: u64,
    /// Rows kept.
    pub height: u64,
    /// Columns kept.
    pub width: u64,
}

impl Chain {
    /// Validates `steps` for `field`, optionally paired with another field.
    pub fn new(field: &str, steps: Vec<Step>, pair: Option<Pair>) -> Result<Chain, TransformError> {
        let invalid = |message: String| TransformError::Invalid { field: field.to_string(), message };
        let mut chw = false;
        for step in &steps {
            match step {
                Step::CenterCrop { height, width }
                | Step::RandomCrop { height, width }
                | Step::Resize { height, width, .. }
                    if *height == 0 || *width == 0 =>
                {
                    return Err(invalid(format!("{} has a zero size", step.describe())));
                }
                Step::Normalize { mean, std } => {
                    if mean.is_empty() || mean.len() != std.len() {
                        return Err(invalid(format!(
                            "normalize needs as many std values as mean values (one per channel, or one for all); got {} and {}",
                            mean.len(),
                            std.len()
                        )));
                    }
                    if std.iter().any(|s| *s == 0.0 || !s.is_finite()) || mean.iter().any(|m| !m.is_finite()) {
                        return Err(invalid("normalize needs finite mean and non-zero finite std".into()));
                    }
                }
                Step::ToF32 { scale } if !scale.is_finite() => {
                    return Err(invalid("to_f32 scale must be finite".into()));
                }
                Step::NormalizeTrailing { mean, std, dims } => {
                    let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                    if mean.is_empty() || n != Some(mean.len() as u64) || mean.len() != std.len() {
                        return Err(invalid(format!(
                            "normalize statistics of shape {dims:?} need as many values; got {} means and {} stds",
                            mean.len(),
                            std.len()
                        )));
                    }
                    if std.iter().any(|s| *s == 0.0 || !s.is_finite()) || mean.iter().any(|m| !m.is_finite()) {
                        return Err(invalid("normalize needs finite mean and non-zero finite std".into()));
                    }
                }
                Step::Permute { axes } => {
                    let mut seen = axes.clone();
                    seen.sort_unstable();
                    if seen.iter().enumerate().any(|(i, &a)| i != a) {
                        return Err(invalid(format!("permute {axes:?} is not a permutation of 0..{}", axes.len())));
                    }
                }
                Step::NormalizeFrom { stats, .. } => {
                    return Err(invalid(format!(
                        "the statistics of {stats:?} were not read (a bug; please report it)"
                    )));
                }
                Step::Downsample { factor: 0, .. } => {
                    return Err(invalid("downsample factor must be at least 1".into()));
                }
                Step::ToChw if chw => return Err(invalid("to_chw appears twice".into())),
                Step::ToChw => chw = true,
                _ => {}
            }
            if chw && step.is_geometric() {
                return Err(invalid(format!(
                    "{} comes after chw; crops, resizes and flips go before it",
                    step.describe()
                )));
            }
        }
        if let Some(pair) = &pair {
            if pair.scale == 0 || pair.scale > MAX_PAIR_SCALE {
                return Err(invalid(format!(
                    "pair scale {} is outside 1..={MAX_PAIR_SCALE} (the follower's size over its leader's, e.g. 4 for ×4 \
                     super-resolution)",
                    pair.scale
                )));
            }
            if pair.with == field {
                return Err(invalid("a field cannot pair with itself".into()));
            }
        }
        let group = fnv1a(pair.as_ref().map_or(field, |p| p.with.as_str()).as_bytes());
        Ok(Chain {
            field: field.to_string(),
            steps,
            pair,
            group,
            max_bytes: stoker_proto::DEFAULT_MAX_SAMPLE_BYTES,
            spatial: None,
            random_base: 0,
            rest: std::sync::OnceLock::new(),
        })
    }

    /// Sets the two axes spatial steps (crops, flips, rot90, downsample) act
    /// on, as axes of the chain's input (negative counts from the end). The
    /// default: axes 0 and 1 of a 2-d array, else the two before the last
    /// (`[..., height, width, channels]`).
    pub fn with_spatial_axes(mut self, axes: Option<[i64; 2]>) -> Chain {
        self.spatial = axes;
        self.rest = std::sync::OnceLock::new();
        self
    }

    /// Whether the n-dimensional engine runs this chain on a `rank`-d input
    /// (the image engine handles `[h, w]`/`[h, w, c]` with the original steps).
    fn is_nd(&self, rank: usize) -> bool {
        self.spatial.is_some()
            || !(rank == 2 || rank == 3)
            || self.steps.iter().any(|s| {
                matches!(
                    s,
                    Step::RandomVFlip
                        | Step::RandomRot90
                        | Step::Cast { .. }
                        | Step::NormalizeTrailing { .. }
                        | Step::NormalizeFrom { .. }
                        | Step::Permute { .. }
                        | Step::Downsample { .. }
                )
            })
    }

    /// Sets the most bytes the array may take at any step; [`Chain::output`]
    /// (and so [`Chain::apply`]) checks every step against it before allocating.
    pub fn with_limit(mut self, max_bytes: u64) -> Chain {
        self.max_bytes = max_bytes;
        self.rest = std::sync::OnceLock::new();
        self
    }

    /// The window the chain's first step crops from an `[height, width, c]`
    /// image of `height × width` for sample `key`, drawn exactly as
    /// [`Chain::apply`] draws it; `None` unless the first step is a crop, the
    /// chain is unpaired, works on the default spatial axes, and the crop fits
    /// (otherwise `apply` on the whole image reports the error). A decoder
    /// that decodes only this window then runs [`Chain::after_leading_crop`]
    /// on it, with the same result as the whole chain on the whole image.
    pub fn leading_crop(&self, height: u64, width: u64, key: SampleKey) -> Option<CropWindow> {
        if self.pair.is_some() || self.spatial.is_some() || self.random_base != 0 {
            return None;
        }
        let (top, left, h, w) = match self.steps.first()? {
            Step::CenterCrop { height: h, width: w } if *h <= height && *w <= width => {
                ((height - h) / 2, (width - w) / 2, *h, *w)
            }
            Step::RandomCrop { height: h, width: w } if *h <= height && *w <= width => {
                let r = draw(key, self.group, 0);
                (uniform(r, height - h + 1), uniform(splitmix64(r), width - w + 1), *h, *w)
            }
            _ => return None,
        };
        Some(CropWindow { top, left, height: h, width: w })
    }

    /// The chain without its leading crop, drawing its randomness as the
    /// rest of the whole chain does (a random crop's draw comes first); for
    /// the window [`Chain::leading_crop`] gave. `None` where that gives none.
    pub fn after_leading_crop(&self) -> Option<&Chain> {
        self.rest
            .get_or_init(|| {
                if self.pair.is_some() || self.spatial.is_some() || self.random_base != 0 {
                    return None;
                }
                let random_base = match self.steps.first()? {
                    Step::CenterCrop { .. } => 0,
                    Step::RandomCrop { .. } => 1,
                    _ => return None,
                };
                Some(Box::new(Chain {
                    field: self.field.clone(),
                    steps: self.steps[1..].to_vec(),
                    pair: None,
                    group: self.group,
                    max_bytes: self.max_bytes,
                    spatial: None,
                    random_base,
                    rest: std::sync::OnceLock::new(),
                }))
            })
            .as_deref()
    }

    /// The field this chain belongs to.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The steps.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Whom this chain follows, if anyone.
    pub fn pair(&self) -> Option<&Pair> {
        self.pair.as_ref()
    }

    /// Whether the chain does nothing (decode straight into the slot instead).
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Checks that `self` can follow `leader` (the chain of `self.pair().with`):
    /// same geometric steps in the same order, each size `scale` times the leader's.
    pub fn check_pair(&self, leader: &Chain) -> Result<(), TransformError> {
        let Some(pair) = &self.pair else { return Ok(()) };
        let invalid = |message: String| TransformError::Invalid { field: self.field.clone(), message };
        if leader.pair.is_some() {
            return Err(invalid(format!(
                "pairs with {:?}, which pairs with another field itself; pair every field with the same leader",
                leader.field
            )));
        }
        if self.steps.iter().chain(&leader.steps).any(|s| matches!(s, Step::Downsample { .. })) {
            return Err(invalid(format!(
                "pairs with {:?}, and one of them downsamples: paired fields cannot downsample (pair the \
                 downsampled sizes instead)",
                leader.field
            )));
        }
        let mine: Vec<&Step> = self.steps.iter().filter(|s| s.is_geometric()).collect();
        let theirs: Vec<&Step> = leader.steps.iter().filter(|s| s.is_geometric()).collect();
        let s = pair.scale;
        let fits = mine.len() == theirs.len()
            && mine.iter().zip(&theirs).all(|(a, b)| match (a, b) {
                (Step::CenterCrop { height: h, width: w }, Step::CenterCrop { height: lh, width: lw })
                | (Step::RandomCrop { height: h, width: w }, Step::RandomCrop { height: lh, width: lw })
                | (Step::Resize { height: h, width: w, .. }, Step::Resize { height: lh, width: lw, .. }) => {
                    *h == s * lh && *w == s * lw
                }
                (Step::RandomHFlip, Step::RandomHFlip)
                | (Step::RandomVFlip, Step::RandomVFlip)
                | (Step::RandomRot90, Step::RandomRot90) => true,
                _ => false,
            });
        if !fits {
            return Err(invalid(format!(
                "pairs with {:?} at scale {s}, so its crops, resizes and flips must be {:?}'s in the same order with \
                 sizes × {s}; they are {mine:?} vs {theirs:?}",
                leader.field, leader.field
            )));
        }
        Ok(())
    }

    /// Dtype and shape out of the chain for an input of `dtype` and `shape`
    /// (`None` marks a dimension that varies between samples). Checks the
    /// array's size after every step against the chain's limit, where the
    /// size is known (an unknown channel count counts as 1).
    pub fn output(&self, dtype: DType, shape: &[Option<u64>]) -> Result<(DType, Vec<Option<u64>>), TransformError> {
        if self.is_nd(shape.len()) {
            return self.output_nd(dtype, shape);
        }
        let input = |message: String| TransformError::Input { field: self.field.clone(), message };
        let (mut h, mut w, c, planar) = match *shape {
            [h, w] => (h, w, Some(1), true),
            [h, w, c] => (h, w, c, false),
            _ => {
                return Err(input(format!(
                    "transforms work on [height, width] or [height, width, channels] arrays, not {} dimensions",
                    shape.len()
                )));
            }
        };
        let check = |step: &dyn Fn() -> String, h: Option<u64>, w: Option<u64>, dtype: DType| {
            let (Some(h), Some(w)) = (h, w) else { return Ok(()) };
            let c = c.unwrap_or(1);
            let bytes = [w, c, dtype.size() as u64].into_iter().try_fold(h, |acc, d| acc.checked_mul(d));
            match bytes {
                Some(b) if b <= self.max_bytes => Ok(()),
                bytes => Err(TransformError::TooLarge {
                    field: self.field.clone(),
                    step: step(),
                    dtype,
                    shape: vec![h, w, c],
                    bytes,
                    limit: self.max_bytes,
                }),
            }
        };
        check(&|| "the decoded value".to_string(), h, w, dtype)?;
        let mut dtype_out = dtype;
        let mut chw = false;
        for step in &self.steps {
            match step {
                Step::CenterCrop { height, width } | Step::RandomCrop { height, width } => {
                    if let (Some(hh), Some(ww)) = (h, w)
                        && (*height > hh || *width > ww)
                    {
                        return Err(input(format!("{}: cannot crop {height}×{width} from {hh}×{ww}", step.describe())));
                    }
                    (h, w) = (Some(*height), Some(*width));
                }
                Step::Resize { height, width, .. } => {
                    resize::check(dtype_out, c).map_err(|problem| self.resize_error(problem))?;
                    (h, w) = (Some(*height), Some(*width));
                }
                Step::RandomHFlip => {}
                Step::ToF32 { .. } => dtype_out = DType::F32,
                Step::Normalize { mean, .. } => {
                    if let Some(c) = c
                        && mean.len() != 1
                        && mean.len() as u64 != c
                    {
                        return Err(input(format!("normalize has {} means for {c} channels", mean.len())));
                    }
                    dtype_out = DType::F32;
                }
                Step::ToChw => chw = true,
                _ => unreachable!("the image engine runs only chains without n-dimensional steps"),
            }
            check(&|| step.describe(), h, w, dtype_out)?;
        }
        let shape = match (chw, planar) {
            (true, _) => vec![c, h, w],
            (false, true) => vec![h, w],
            (false, false) => vec![h, w, c],
        };
        Ok((dtype_out, shape))
    }

    /// Runs the chain on `input` and writes the
    /// result into `dst`, which must hold exactly the output's bytes.
    ///
    /// A paired chain is given the leader field's input shape for this sample
    /// (`leader_shape`): its own input must be `scale` times as high and wide.
    pub fn apply(
        &self,
        input: ArrayRef<'_>,
        key: SampleKey,
        leader_shape: Option<&[u64]>,
        scratch: &mut Scratch,
        dst: &mut [u8],
    ) -> Result<(), TransformError> {
        if self.is_nd(input.shape.len()) {
            return self.apply_nd(input, key, leader_shape, scratch, dst);
        }
        let ArrayRef { bytes: input, dtype, shape } = input;
        let err = |message: String| TransformError::Input { field: self.field.clone(), message };
        let known: Vec<Option<u64>> = shape.iter().map(|&d| Some(d)).collect();
        let (out_dtype, out_shape) = self.output(dtype, &known)?;
        let out_bytes = out_shape.iter().map(|d| d.expect("known input gives a known output")).product::<u64>()
            as usize
            * out_dtype.size();
        if dst.len() != out_bytes {
            return Err(err(format!(
                "output is {out_dtype} {out_shape:?} ({out_bytes} bytes) but the destination holds {} bytes",
                dst.len()
            )));
        }
        let (h, w, c) = (shape[0], shape[1], shape.get(2).copied().unwrap_or(1));
        if input.len() as u64 != h * w * c * dtype.size() as u64 {
            return Err(err(format!("input holds {} bytes, not {dtype} {shape:?}", input.len())));
        }
        // Geometry in the leader's units: `scale` × lead = own size.
        let scale = self.pair.as_ref().map_or(1, |p| p.scale);
        let leader = match leader_shape {
            Some(&[lh, lw, ..]) => Some((lh, lw)),
            _ => None,
        };
        let mut lead = self.lead((h, w), leader)?;

        let mut view = View { backing: Backing::Input, offset: 0, h, w, c, stride: w * c, flipped: false, dtype };
        let mut affine = Affine::identity(c as usize);
        let mut chw = false;
        let mut random = self.random_base; // position among random steps: the draw's key
        for step in &self.steps {
            match step {
                Step::CenterCrop { height, width } => {
                    let (lh, lw) = (height / scale, width / scale);
                    if lh > lead.0 || lw > lead.1 {
                        return Err(err(format!("cannot crop {height}×{width} from {}×{}", view.h, view.w)));
                    }
                    let top = (lead.0 - lh) / 2 * scale;
                    let left = (lead.1 - lw) / 2 * scale;
                    view.crop(top, left, *height, *width).map_err(|problem| self.geometry_error(problem))?;
                    lead = (lh, lw);
                }
                Step::RandomCrop { height, width } => {
                    let (lh, lw) = (height / scale, width / scale);
                    if lh > lead.0 || lw > lead.1 {
                        return Err(err(format!("cannot crop {height}×{width} from {}×{}", view.h, view.w)));
                    }
                    let r = draw(key, self.group, random);
                    random += 1;
                    let top = uniform(r, lead.0 - lh + 1) * scale;
                    let left = uniform(splitmix64(r), lead.1 - lw + 1) * scale;
                    view.crop(top, left, *height, *width).map_err(|problem| self.geometry_error(problem))?;
                    lead = (lh, lw);
                }
                Step::RandomHFlip => {
                    if draw(key, self.group, random) >> 63 == 1 {
                        view.flipped = !view.flipped;
                    }
                    random += 1;
                }
                Step::Resize { height, width, filter } => {
                    // Resize reads unflipped pixels of the working type: settle flips and casts first.
                    if view.flipped || !affine.is_identity() {
                        view = materialize_to_scratch(input, view, &affine, scratch);
                        affine = Affine::identity(c as usize);
                    }
                    view = resize::resize_to_scratch(input, view, *height, *width, *filter, scratch)
                        .map_err(|problem| self.resize_error(problem))?;
                    lead = (height / scale, width / scale);
                }
                Step::ToF32 { scale } => affine.then_scale(*scale),
                Step::Normalize { mean, std } => affine.then_normalize(mean, std),
                Step::ToChw => chw = true,
                _ => unreachable!("the image engine runs only chains without n-dimensional steps"),
            }
        }
        let src = scratch.slice(input, view.backing);
        write_out(src, &view, &affine, chw, dst);
        Ok(())
    }

    /// The spatial size `(h, w)` of this sample's input in the leader's
    /// units: itself, or for a paired chain the leader's size (`leader`,
    /// `None` when not given), which `(h, w)` must be `scale` times.
    fn lead(&self, (h, w): (u64, u64), leader: Option<(u64, u64)>) -> Result<(u64, u64), TransformError> {
        let err = |message: String| TransformError::Input { field: self.field.clone(), message };
        match (&self.pair, leader) {
            (None, _) => Ok((h, w)),
            (Some(pair), Some((lh, lw))) => {
                if Some(h) != pair.scale.checked_mul(lh) || Some(w) != pair.scale.checked_mul(lw) {
                    return Err(err(format!(
                        "is {h}×{w} but {:?} is {lh}×{lw}: at scale {} they must be {}×{}",
                        pair.with,
                        pair.scale,
                        pair.scale.saturating_mul(lh),
                        pair.scale.saturating_mul(lw)
                    )));
                }
                Ok((lh, lw))
            }
            (Some(pair), None) => Err(err(format!("pairs with {:?} but its shape was not given", pair.with))),
        }
    }

    /// A [`GeometryError`] of this chain's field.
    fn geometry_error(&self, problem: GeometryError) -> TransformError {
        TransformError::Geometry { field: self.field.clone(), problem }
    }

    /// A [`ResizeError`] of this chain's field.
    fn resize_error(&self, problem: ResizeError) -> TransformError {
        TransformError::Resize { field: self.field.clone(), problem }
    }
}

/// Where a view's pixels live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backing {
    Input,
    A,
    B,
}

/// A window onto HWC pixels: `h × w × c` elements starting at element
/// `offset`, rows `stride` elements apart, optionally mirrored left–right.
#[derive(Debug, Clone, Copy)]
struct View {
    backing: Backing,
    offset: u64,
    h: u64,
    w: u64,
    c: u64,
    stride: u64,
    flipped: bool,
    dtype: DType,
}

impl View {
    /// Narrows to `height × width` at (`top`, `left`) in displayed (flipped) coordinates.
    fn crop(&mut self, top: u64, left: u64, height: u64, width: u64) -> Result<(), GeometryError> {
        if top + height > self.h || left + width > self.w {
            // Only reachable by a paired chain whose sizes are not `scale` × its leader's.
            return Err(GeometryError::CropOutside { top, left, height, width, rows: self.h, columns: self.w });
        }
        let column = if self.flipped { self.w - left - width } else { left };
        self.offset += top * self.stride + column * self.c;
        self.h = height;
        self.w = width;
        Ok(())
    }

    /// Element offset of displayed pixel (`y`, `x`).
    #[cfg(test)]
    fn at(&self, y: u64, x: u64) -> u64 {
        let column = if self.flipped { self.w - 1 - x } else { x };
        self.offset + y * self.stride + column * self.c
    }

    /// Top and left of the view within its backing rows.
    fn origin(&self) -> (u64, u64) {
        (self.offset / self.stride, self.offset % self.stride / self.c)
    }
}

impl Scratch {
    /// A new, empty scratch.
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// Bytes the two working buffers keep between samples (the resizer's own are small).
    pub fn capacity(&self) -> usize {
        self.a.capacity().saturating_add(self.b.capacity())
    }

    fn slice<'a>(&'a self, input: &'a [u8], backing: Backing) -> &'a [u8] {
        match backing {
            Backing::Input => input,
            Backing::A => self.a.as_slice(),
            Backing::B => self.b.as_slice(),
        }
    }

    /// The buffer not holding `busy`, with the other one readable.
    fn split<'a>(&'a mut self, input: &'a [u8], busy: Backing) -> (&'a [u8], &'a mut AlignedBuf, Backing) {
        match busy {
            Backing::Input => (input, &mut self.a, Backing::A),
            Backing::A => (self.a.as_slice(), &mut self.b, Backing::B),
            Backing::B => (self.b.as_slice(), &mut self.a, Backing::A),
        }
    }
}

/// Per-channel `x * mul + add`, accumulated from ToF32 and Normalize; `None` until one appears.
#[derive(Debug, Clone)]
struct Affine {
    channels: usize,
    /// `x * mul + add` per channel (casts and `to_f32` scales, composed).
    coefficients: Option<Vec<(f64, f64)>>,
    /// Then, in order, in float32: normalizations and later scales.
    post: Vec<Post>,
}

/// A float32 stage after the composed [`Affine`] coefficients.
#[derive(Debug, Clone)]
enum Post {
    /// `(v - mean) / std` per channel, as PyTorch computes a normalization.
    SubDiv(Vec<(f32, f32)>),
    /// `v * scale`.
    Mul(f32),
}

impl Affine {
    fn identity(channels: usize) -> Affine {
        Affine { channels, coefficients: None, post: Vec::new() }
    }

    fn is_identity(&self) -> bool {
        self.coefficients.is_none() && self.post.is_empty()
    }

    /// One element of channel `ch` (already float32 through the coefficients) through the stages after them.
    #[inline]
    fn finish(&self, ch: usize, mut v: f32) -> f32 {
        for stage in &self.post {
            v = match stage {
                Post::SubDiv(params) => {
                    let (m, s) = params[ch];
                    (v - m) / s
                }
                Post::Mul(k) => v * k,
            };
        }
        v
    }

    fn coefficients(&mut self) -> &mut Vec<(f64, f64)> {
        let channels = self.channels;
        self.coefficients.get_or_insert_with(|| vec![(1.0, 0.0); channels])
    }

    fn then_scale(&mut self, scale: f32) {
        if !self.post.is_empty() {
            self.post.push(Post::Mul(scale));
            return;
        }
        for (mul, add) in self.coefficients() {
            *mul *= f64::from(scale);
            *add *= f64::from(scale);
        }
    }

    /// `(v - mean) / std` in float32 on what came before (not folded into
    /// the coefficients: folding rounds differently from PyTorch).
    fn then_normalize(&mut self, mean: &[f32], std: &[f32]) {
        let channels = self.coefficients().len();
        let params =
            (0..channels).map(|ch| if mean.len() == 1 { (mean[0], std[0]) } else { (mean[ch], std[ch]) }).collect();
        self.post.push(Post::SubDiv(params));
    }
}

/// Copies `view` into fresh contiguous scratch memory, unflipped and with `affine` applied.
fn materialize_to_scratch(input: &[u8], view: View, affine: &Affine, scratch: &mut Scratch) -> View {
    let out_dtype = if affine.is_identity() { view.dtype } else { DType::F32 };
    let bytes = (view.h * view.w * view.c) as usize * out_dtype.size();
    let (src, buf, backing) = scratch.split(input, view.backing);
    let dst = buf.resize(bytes);
    write_out(src, &view, affine, false, dst);
    View { backing, offset: 0, stride: view.w * view.c, flipped: false, dtype: out_dtype, ..view }
}

/// Writes `view` of `src` into `dst` contiguously (HWC, or CHW when `chw`),
/// converting to float32 through `affine` when it is set.
///
/// Works a row at a time: each output row is one stored row of the view, read
/// forwards or (flipped) backwards. uint8 input, the common image case, maps
/// through a 256-entry table per channel holding exactly the values
/// `mul_add` gives, so it is byte-identical to converting each element (and
/// avoids a software `fmaf` call per element where the CPU target has no FMA).
fn write_out(src: &[u8], view: &View, affine: &Affine, chw: bool, dst: &mut [u8]) {
    let (h, w, c) = (view.h as usize, view.w as usize, view.c as usize);
    let size = view.dtype.size();
    let pixel = c * size;
    // The stored bytes of displayed row `y`, left to right as stored.
    let row = |y: usize| {
        let at = (view.offset + y as u64 * view.stride) as usize * size;
        &src[at..at + w * pixel]
    };
    match &affine.coefficients {
        None if !chw => {
            for (y, out) in dst.chunks_exact_mut(w * pixel).enumerate() {
                if view.flipped {
                    for (o, p) in out.chunks_exact_mut(pixel).zip(row(y).chunks_exact(pixel).rev()) {
                        o.copy_from_slice(p);
                    }
                } else {
                    out.copy_from_slice(row(y));
                }
            }
        }
        None => {
            let mut planes = dst.chunks_exact_mut(h * w * size);
            for ch in 0..c {
                let plane = planes.next().expect("dst holds c planes");
                for (y, out) in plane.chunks_exact_mut(w * size).enumerate() {
                    let elements = row(y).chunks_exact(pixel).map(|p| &p[ch * size..(ch + 1) * size]);
                    let mut outs = out.chunks_exact_mut(size);
                    if view.flipped {
                        elements.rev().zip(&mut outs).for_each(|(e, o)| o.copy_from_slice(e));
                    } else {
                        elements.zip(&mut outs).for_each(|(e, o)| o.copy_from_slice(e));
                    }
                }
            }
        }
        Some(coefficients) => {
            let coefficients: Vec<(f32, f32)> = coefficients.iter().map(|&(m, a)| (m as f32, a as f32)).collect();
            if view.dtype == DType::U8 {
                let tables: Vec<[f32; 256]> = coefficients
                    .iter()
                    .enumerate()
                    .map(|(ch, &(mul, add))| {
                        std::array::from_fn(|v| affine.finish(ch, f32::from(v as u8).mul_add(mul, add)))
                    })
                    .collect();
                affine_rows(view, chw, dst, row, |ch, e| tables[ch][e[0] as usize]);
            } else {
                let read = reader(view.dtype);
                affine_rows(view, chw, dst, row, |ch, e| {
                    let (mul, add) = coefficients[ch];
                    affine.finish(ch, read(e).mul_add(mul, add))
                });
            }
        }
    }
}

/// [`write_out`]'s float32 case: `convert(channel, element bytes)` for every
/// element, rows from `row(y)`, written HWC or CHW.
fn affine_rows<'s>(
    view: &View,
    chw: bool,
    dst: &mut [u8],
    row: impl Fn(usize) -> &'s [u8],
    convert: impl Fn(usize, &[u8]) -> f32,
) {
    let (h, w, c) = (view.h as usize, view.w as usize, view.c as usize);
    let size = view.dtype.size();
    let pixel = c * size;
    if chw {
        let mut planes = dst.chunks_exact_mut(h * w * 4);
        for ch in 0..c {
            let plane = planes.next().expect("dst holds c planes");
            for (y, out) in plane.chunks_exact_mut(w * 4).enumerate() {
                let elements = row(y).chunks_exact(pixel).map(|p| convert(ch, &p[ch * size..(ch + 1) * size]));
                let mut outs = out.chunks_exact_mut(4);
                if view.flipped {
                    elements.rev().zip(&mut outs).for_each(|(v, o)| o.copy_from_slice(&v.to_ne_bytes()));
                } else {
                    elements.zip(&mut outs).for_each(|(v, o)| o.copy_from_slice(&v.to_ne_bytes()));
                }
            }
        }
    } else {
        for (y, out) in dst.chunks_exact_mut(w * c * 4).enumerate() {
            let write = |(p, o): (&[u8], &mut [u8])| {
                for (ch, o) in o.chunks_exact_mut(4).enumerate() {
                    o.copy_from_slice(&convert(ch, &p[ch * size..(ch + 1) * size]).to_ne_bytes());
                }
            };
            let pixels = row(y).chunks_exact(pixel);
            if view.flipped {
                pixels.rev().zip(out.chunks_exact_mut(c * 4)).for_each(write);
            } else {
                pixels.zip(out.chunks_exact_mut(c * 4)).for_each(write);
            }
        }
    }
}

/// Reads one native-endian element of `dtype` as f32.
fn reader(dtype: DType) -> fn(&[u8]) -> f32 {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        b.try_into().expect("element slices have the dtype's size")
    }
    match dtype {
        DType::Bool | DType::U8 => |b| f32::from(b[0]),
        DType::I8 => |b| f32::from(b[0] as i8),
        DType::U16 => |b| f32::from(u16::from_ne_bytes(arr(b))),
        DType::I16 => |b| f32::from(i16::from_ne_bytes(arr(b))),
        DType::U32 => |b| u32::from_ne_bytes(arr(b)) as f32,
        DType::I32 => |b| i32::from_ne_bytes(arr(b)) as f32,
        DType::U64 => |b| u64::from_ne_bytes(arr(b)) as f32,
        DType::I64 => |b| i64::from_ne_bytes(arr(b)) as f32,
        DType::F16 => |b| f16_to_f32(u16::from_ne_bytes(arr(b))),
        DType::F32 => |b| f32::from_ne_bytes(arr(b)),
        DType::F64 => |b| f64::from_ne_bytes(arr(b)) as f32,
    }
}

/// IEEE 754 half → single, exact (including subnormals, infinities, NaN).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1F);
    let frac = u32::from(h & 0x3FF);
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value = frac × 2^-24, exactly representable in f32.
            let value = frac as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -value } else { value };
        }
        (0x1F, _) => sign | 0x7F80_0000 | (frac << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// The random word for the `step`-th random step of `group` in sample `key`.
fn draw(key: SampleKey, group: u64, step: u64) -> u64 {
    [key.epoch, key.index, group, step].into_iter().fold(splitmix64(key.seed), |h, v| splitmix64(h ^ v))
}

/// Maps a random word to `0..n` (multiply-high; bias below 2^-32 for any realistic `n`).
fn uniform(r: u64, n: u64) -> u64 {
    ((u128::from(r) * u128::from(n)) >> 64) as u64
}

#[cfg(test)]
mod tests;
