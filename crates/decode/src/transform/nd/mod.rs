//! The n-dimensional engine: chains over arrays of any rank (HDF5 fields,
//! windows of them) and chains with the steps the image engine lacks
//! (`vflip`, `rot90`, `cast`, `permute`, `downsample`, broadcast normalize).
//!
//! Geometry only moves a strided view (crops narrow it, flips negate a
//! stride, `rot90` swaps two axes, `permute` reorders them, a stride
//! downsample multiplies strides); element conversions (`cast`, `to_f32`,
//! `normalize`) queue up and run once, as the view is copied into the slot.
//! Only a mean downsample copies in between. Random draws are the image
//! engine's (same keys, same order), so paired fields line up whichever engine
//! runs them.

use stoker_proto::DType;

use stoker_proto::hash::splitmix64;

mod view;

use view::*;

use super::{ArrayRef, Backing, Chain, GeometryError, SampleKey, Scratch, Step, TransformError, draw, uniform};

/// The roles of axes: the spatial pair and the channel axis, by position.
#[derive(Debug, Clone, Copy)]
struct Roles {
    y: usize,
    x: usize,
    channel: Option<usize>,
}

impl Roles {
    /// The roles of a `rank`-d input under `spatial` (see [`Chain::with_spatial_axes`]).
    /// Below 2 dimensions only element steps (`cast`, `normalize`, `permute`)
    /// apply: `geometric` says whether the chain has others.
    fn of(spatial: Option<[i64; 2]>, rank: usize, geometric: bool) -> Result<Roles, GeometryError> {
        if rank < 2 {
            if geometric || spatial.is_some() {
                return Err(GeometryError::TooFewAxes { rank });
            }
            // No step reads the roles: placeholders.
            return Ok(Roles { y: 0, x: 0, channel: None });
        }
        let [a, b] = spatial.unwrap_or(if rank == 2 { [0, 1] } else { [-3, -2] });
        let at = |axis: i64| {
            let r = rank as i64;
            let p = if axis < 0 { r + axis } else { axis };
            (0..r).contains(&p).then_some(p as usize).ok_or(GeometryError::AxisOutside { axis, rank })
        };
        let (y, x) = (at(a)?, at(b)?);
        if y == x {
            return Err(GeometryError::SameAxis { a, b });
        }
        let last = rank - 1;
        Ok(Roles { y, x, channel: (rank >= 3 && last != y && last != x).then_some(last) })
    }

    /// Positions after the axes are reordered by `perm` (new axis `i` is old axis `perm[i]`).
    fn permuted(self, perm: &[usize]) -> Roles {
        // `perm` is a checked permutation; below 2 dimensions the roles are placeholders.
        let new = |old: usize| perm.iter().position(|&p| p == old).unwrap_or(old);
        Roles { y: new(self.y), x: new(self.x), channel: self.channel.map(new) }
    }
}

/// The permutation `chw` makes for `roles` over `rank` axes, or `None` when
/// there is no channel axis (a size-1 one is inserted instead).
fn chw_perm(roles: Roles, rank: usize) -> Option<Vec<usize>> {
    let c = roles.channel?;
    let mut perm: Vec<usize> = (0..rank).filter(|&a| a != c).collect();
    let first_spatial = perm.iter().position(|&a| a == roles.y || a == roles.x).expect("spatial axes remain");
    perm.insert(first_spatial, c);
    Some(perm)
}

pub(super) fn permute<T: Copy>(v: &[T], perm: &[usize]) -> Vec<T> {
    perm.iter().map(|&p| v[p]).collect()
}

/// Dtype, shape and axis roles of an array on its way through
/// [`Chain::output_nd`] (`None` marks a dimension that varies).
struct NdOutput {
    dtype: DType,
    shape: Vec<Option<u64>>,
    roles: Roles,
}

impl NdOutput {
    /// What `chw` makes of the array: the channel axis (a size-1 one inserted
    /// if there is none) before the spatial axes.
    fn chw(&mut self) {
        match chw_perm(self.roles, self.shape.len()) {
            Some(perm) => {
                self.shape = permute(&self.shape, &perm);
                self.roles = self.roles.permuted(&perm);
            }
            None => {
                let at = self.roles.y.min(self.roles.x);
                self.shape.insert(at, Some(1));
                self.roles = Roles { y: self.roles.y + 1, x: self.roles.x + 1, channel: Some(at) };
            }
        }
    }
}

/// A chain's run on one array by [`Chain::apply_nd`], between steps.
struct NdRun {
    /// Where the current elements are, in which order.
    view: NdView,
    /// Conversions waiting for the copy out.
    ops: Vec<Op>,
    /// The dtype after `ops`.
    converted: DType,
    roles: Roles,
    /// The spatial sizes in the leader's units (`scale` × lead = own size).
    lead: (u64, u64),
    /// Position among random steps: the draw's key.
    random: u64,
}

/// `(mean, std)` per entry, for `normalize` as `(x - mean) / std` in float32.
fn normalize_coefficients(mean: &[f32], std: &[f32]) -> Vec<(f64, f64)> {
    mean.iter().zip(std).map(|(&m, &s)| (f64::from(m), f64::from(s))).collect()
}

impl Chain {
    /// Whether a step (or a pairing) works on the spatial axes: everything
    /// but the element conversions and `permute`.
    fn geometric(&self) -> bool {
        self.pair.is_some()
            || self.steps.iter().any(|s| {
                !matches!(
                    s,
                    Step::Cast { .. }
                        | Step::ToF32 { .. }
                        | Step::Normalize { .. }
                        | Step::NormalizeTrailing { .. }
                        | Step::NormalizeFrom { .. }
                        | Step::Permute { .. }
                )
            })
    }

    /// [`Chain::output`] for the n-dimensional engine.
    pub(super) fn output_nd(
        &self,
        dtype: DType,
        shape: &[Option<u64>],
    ) -> Result<(DType, Vec<Option<u64>>), TransformError> {
        let roles = Roles::of(self.spatial, shape.len(), self.geometric()).map_err(|p| self.geometry_error(p))?;
        let mut out = NdOutput { dtype, shape: shape.to_vec(), roles };
        self.check_size_nd(&|| "the value as read".to_string(), &out.shape, dtype)?;
        for step in &self.steps {
            self.output_step_nd(step, &mut out)?;
            self.check_size_nd(&|| step.describe(), &out.shape, out.dtype)?;
        }
        Ok((out.dtype, out.shape))
    }

    /// Checks an array of `shape` (an unknown dimension counts as 1) and
    /// `dtype` after `step` against the chain's limit.
    fn check_size_nd(
        &self,
        step: &dyn Fn() -> String,
        shape: &[Option<u64>],
        dtype: DType,
    ) -> Result<(), TransformError> {
        let known: Vec<u64> = shape.iter().map(|d| d.unwrap_or(1)).collect();
        let bytes = known.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d));
        match bytes {
            Some(b) if b <= self.max_bytes => Ok(()),
            bytes => Err(TransformError::TooLarge {
                field: self.field.clone(),
                step: step(),
                dtype,
                shape: known,
                bytes,
                limit: self.max_bytes,
            }),
        }
    }

    /// What `step` makes of an array of `out`'s dtype and shape, checking that it suits the step.
    fn output_step_nd(&self, step: &Step, out: &mut NdOutput) -> Result<(), TransformError> {
        let input = |message: String| TransformError::Input { field: self.field.clone(), message };
        let NdOutput { dtype: dtype_out, shape, roles } = out;
        let (y, x) = (roles.y, roles.x);
        match step {
            Step::CenterCrop { height, width } | Step::RandomCrop { height, width } => {
                if let (Some(hh), Some(ww)) = (shape[y], shape[x])
                    && (*height > hh || *width > ww)
                {
                    return Err(input(format!(
                        "{}: cannot crop {height}×{width} from {hh}×{ww} (axes {y} and {x} of {})",
                        step.describe(),
                        fmt_shape(shape)
                    )));
                }
                (shape[y], shape[x]) = (Some(*height), Some(*width));
            }
            Step::NormalizeFrom { .. } => return Err(input(format!("{} was not resolved", step.describe()))),
            Step::Resize { .. } => {
                return Err(input(
                    "resize works on [h, w] and [h, w, c] images with crops, hflip, to_f32, normalize and chw \
                     only; use downsample for other arrays"
                        .into(),
                ));
            }
            Step::RandomHFlip | Step::RandomVFlip => {}
            Step::RandomRot90 => {
                if let (Some(h), Some(w)) = (shape[y], shape[x])
                    && h != w
                {
                    return Err(input(format!(
                        "rot90 needs equal spatial sizes, not {h}×{w} (axes {y} and {x} of {}); crop a square first",
                        fmt_shape(shape)
                    )));
                }
            }
            Step::ToF32 { .. } => *dtype_out = DType::F32,
            Step::Cast { dtype } => *dtype_out = *dtype,
            Step::Normalize { mean, .. } => {
                if mean.len() > 1 {
                    let last = shape.last().copied().flatten();
                    if shape.is_empty() || last.is_some_and(|c| c != mean.len() as u64) {
                        return Err(input(format!(
                            "normalize has {} means for the last axis of {}; give one per element of that axis, \
                             or one for all",
                            mean.len(),
                            fmt_shape(shape)
                        )));
                    }
                }
                *dtype_out = DType::F32;
            }
            Step::NormalizeTrailing { dims, .. } => {
                let fits = dims.len() <= shape.len()
                    && shape[shape.len() - dims.len()..].iter().zip(dims).all(|(s, d)| s.is_none_or(|s| s == *d));
                if !fits {
                    return Err(input(format!(
                        "normalize statistics of shape {dims:?} do not match the trailing axes of {}",
                        fmt_shape(shape)
                    )));
                }
                *dtype_out = DType::F32;
            }
            Step::Permute { axes } => {
                if axes.len() != shape.len() {
                    return Err(input(format!(
                        "permute {axes:?} names {} axes but the array is {}",
                        axes.len(),
                        fmt_shape(shape)
                    )));
                }
                *shape = permute(shape, axes);
                *roles = roles.permuted(axes);
            }
            Step::ToChw => out.chw(),
            Step::Downsample { factor, mean } => self.downsample_output_nd(*factor, *mean, out)?,
        }
        Ok(())
    }

    /// What a `downsample` by `factor` (a block mean with `mean`) makes of
    /// `out`; refuses one that leaves nothing of a spatial axis.
    fn downsample_output_nd(&self, factor: u64, mean: bool, out: &mut NdOutput) -> Result<(), TransformError> {
        let (y, x) = (out.roles.y, out.roles.x);
        for a in [y, x] {
            if let Some(d) = out.shape[a] {
                if d / factor == 0 {
                    let message =
                        format!("downsample by {factor} leaves nothing of axis {a} ({d}) of {}", fmt_shape(&out.shape));
                    return Err(TransformError::Input { field: self.field.clone(), message });
                }
                out.shape[a] = Some(d / factor);
            }
        }
        if mean && out.dtype != DType::F64 {
            out.dtype = DType::F32;
        }
        Ok(())
    }

    /// [`Chain::apply`] for the n-dimensional engine.
    pub(super) fn apply_nd(
        &self,
        input: ArrayRef<'_>,
        key: SampleKey,
        leader_shape: Option<&[u64]>,
        scratch: &mut Scratch,
        dst: &mut [u8],
    ) -> Result<(), TransformError> {
        let ArrayRef { bytes: input, dtype, shape } = input;
        let out_dtype = self.check_buffers_nd(dtype, shape, input.len(), dst.len())?;
        let rank = shape.len();
        let roles = Roles::of(self.spatial, rank, self.geometric()).map_err(|p| self.geometry_error(p))?;
        let (h, w) = if rank >= 2 { (shape[roles.y], shape[roles.x]) } else { (1, 1) };
        let leader = match (&self.pair, leader_shape) {
            (Some(_), Some(leader)) => {
                let lroles = Roles::of(self.spatial, leader.len(), true).map_err(|p| self.geometry_error(p))?;
                Some((leader[lroles.y], leader[lroles.x]))
            }
            _ => None,
        };
        let mut run = NdRun {
            view: NdView::contiguous(Backing::Input, shape.to_vec(), (0..rank).collect(), dtype),
            ops: Vec::new(),
            converted: dtype,
            roles,
            lead: self.lead((h, w), leader)?,
            random: self.random_base,
        };
        for step in &self.steps {
            self.apply_step_nd(&mut run, step, key, input, scratch)?;
        }
        let src = scratch.slice(input, run.view.backing);
        write_out(src, &run.view, &run.ops, out_dtype, dst);
        Ok(())
    }

    /// The output dtype for an input of `dtype` and `shape`, after checking
    /// that the input holds `input_len` bytes and the destination `dst_len`.
    fn check_buffers_nd(
        &self,
        dtype: DType,
        shape: &[u64],
        input_len: usize,
        dst_len: usize,
    ) -> Result<DType, TransformError> {
        let err = |message: String| TransformError::Input { field: self.field.clone(), message };
        let known: Vec<Option<u64>> = shape.iter().map(|&d| Some(d)).collect();
        let (out_dtype, out_shape) = self.output_nd(dtype, &known)?;
        let out_elems: u64 = out_shape.iter().map(|d| d.expect("known input gives a known output")).product();
        if dst_len as u64 != out_elems * out_dtype.size() as u64 {
            return Err(err(format!("output is {out_dtype} {out_shape:?} but the destination holds {dst_len} bytes")));
        }
        let elems: u64 = shape.iter().product();
        if input_len as u64 != elems * dtype.size() as u64 {
            return Err(err(format!("input holds {input_len} bytes, not {dtype} {shape:?}")));
        }
        Ok(out_dtype)
    }

    /// Runs one step on `run`: geometry moves the view, conversions queue
    /// up, a mean downsample materializes into `scratch`.
    fn apply_step_nd(
        &self,
        run: &mut NdRun,
        step: &Step,
        key: SampleKey,
        input: &[u8],
        scratch: &mut Scratch,
    ) -> Result<(), TransformError> {
        let (y, x) = (run.roles.y, run.roles.x);
        match step {
            Step::CenterCrop { height, width } | Step::RandomCrop { height, width } => {
                self.crop_nd(run, matches!(step, Step::RandomCrop { .. }), *height, *width, key)?;
            }
            Step::RandomHFlip | Step::RandomVFlip => {
                if draw(key, self.group, run.random) >> 63 == 1 {
                    run.view.flip(if matches!(step, Step::RandomHFlip) { x } else { y });
                }
                run.random += 1;
            }
            Step::RandomRot90 => {
                run.view.rot90(draw(key, self.group, run.random) >> 62, y, x);
                run.random += 1;
            }
            Step::ToF32 { scale } => {
                let s = f64::from(*scale);
                run.ops.push(Op::Affine { ids: vec![], dims: vec![], coefficients: vec![(s, 0.0)], sub_div: false });
                run.converted = DType::F32;
            }
            Step::Cast { dtype } => {
                run.ops.push(Op::Cast(*dtype));
                run.converted = *dtype;
            }
            Step::Normalize { mean, std } => {
                let ids = &run.view.ids;
                let (ids, dims) = if mean.len() == 1 {
                    (vec![], vec![])
                } else {
                    (vec![ids[ids.len() - 1]], vec![mean.len() as u64])
                };
                run.ops.push(Op::Affine { ids, dims, coefficients: normalize_coefficients(mean, std), sub_div: true });
                run.converted = DType::F32;
            }
            Step::NormalizeTrailing { mean, std, dims } => {
                let ids = run.view.ids[run.view.ids.len() - dims.len()..].to_vec();
                run.ops.push(Op::Affine {
                    ids,
                    dims: dims.clone(),
                    coefficients: normalize_coefficients(mean, std),
                    sub_div: true,
                });
                run.converted = DType::F32;
            }
            Step::Permute { axes } => {
                run.view.permute(axes);
                run.roles = run.roles.permuted(axes);
            }
            Step::ToChw => match chw_perm(run.roles, run.view.shape.len()) {
                Some(perm) => {
                    run.view.permute(&perm);
                    run.roles = run.roles.permuted(&perm);
                }
                None => {
                    let at = y.min(x);
                    run.view.shape.insert(at, 1);
                    run.view.strides.insert(at, 0);
                    run.view.ids.insert(at, usize::MAX);
                    run.roles = Roles { y: y + 1, x: x + 1, channel: Some(at) };
                }
            },
            Step::Downsample { factor, mean: false } => {
                let f = *factor;
                for a in [y, x] {
                    run.view.shape[a] /= f;
                    run.view.strides[a] *= f as i64;
                }
                run.lead = (run.lead.0 / f, run.lead.1 / f);
            }
            Step::Downsample { factor, mean: true } => {
                run.view = self.block_mean(input, &run.view, &run.ops, run.converted, *factor, (y, x), scratch);
                run.ops.clear();
                run.converted = run.view.dtype;
                run.lead = (run.lead.0 / factor, run.lead.1 / factor);
            }
            Step::Resize { .. } | Step::NormalizeFrom { .. } => {
                let message = format!("{} is not supported here", step.describe());
                return Err(TransformError::Input { field: self.field.clone(), message });
            }
        }
        Ok(())
    }

    /// A centre (or, with `random`, a drawn) crop of `height × width` from
    /// the view's spatial axes, placed in the leader's units.
    fn crop_nd(
        &self,
        run: &mut NdRun,
        random: bool,
        height: u64,
        width: u64,
        key: SampleKey,
    ) -> Result<(), TransformError> {
        let (y, x) = (run.roles.y, run.roles.x);
        let (rows, columns) = (run.view.shape[y], run.view.shape[x]);
        let scale = self.pair.as_ref().map_or(1, |p| p.scale);
        let (lh, lw) = (height / scale, width / scale);
        let lead = run.lead;
        if lh > lead.0 || lw > lead.1 || height > rows || width > columns {
            let message = format!("cannot crop {height}×{width} from {rows}×{columns}");
            return Err(TransformError::Input { field: self.field.clone(), message });
        }
        let (top, left) = if random {
            let r = draw(key, self.group, run.random);
            run.random += 1;
            (uniform(r, lead.0 - lh + 1) * scale, uniform(splitmix64(r), lead.1 - lw + 1) * scale)
        } else {
            ((lead.0 - lh) / 2 * scale, (lead.1 - lw) / 2 * scale)
        };
        if top + height > rows || left + width > columns {
            return Err(self.geometry_error(GeometryError::CropOutside { top, left, height, width, rows, columns }));
        }
        run.view.offset += top as i64 * run.view.strides[y] + left as i64 * run.view.strides[x];
        run.view.shape[y] = height;
        run.view.shape[x] = width;
        run.lead = (lh, lw);
        Ok(())
    }

    /// Materializes `view` with `ops`, then means `factor × factor` blocks of
    /// its spatial axes `(y, x)` into fresh scratch memory.
    #[allow(clippy::too_many_arguments)]
    fn block_mean(
        &self,
        input: &[u8],
        view: &NdView,
        ops: &[Op],
        converted: DType,
        factor: u64,
        (y, x): (usize, usize),
        scratch: &mut Scratch,
    ) -> NdView {
        let flat = {
            let bytes = view.len() as usize * converted.size();
            let (src, buf, backing) = scratch.split(input, view.backing);
            write_out(src, view, ops, converted, buf.resize(bytes));
            NdView::contiguous(backing, view.shape.clone(), view.ids.clone(), converted)
        };
        let out_dtype = if converted == DType::F64 { DType::F64 } else { DType::F32 };
        let mut out_shape = flat.shape.clone();
        out_shape[y] /= factor;
        out_shape[x] /= factor;
        let reduced = NdView { shape: out_shape.clone(), ..flat.clone() };
        let bytes = reduced.len() as usize * out_dtype.size();
        let (src, buf, backing) = scratch.split(input, flat.backing);
        let dst = buf.resize(bytes);
        let size = flat.dtype.size();
        let (sy, sx) = (flat.strides[y], flat.strides[x]);
        let f = factor as i64;
        let area = (factor * factor) as f64;
        let mut n = 0usize;
        // `reduced` walks block corners with the flat strides times the factor.
        let corners = NdView {
            strides: flat.strides.iter().enumerate().map(|(k, &s)| if k == y || k == x { s * f } else { s }).collect(),
            ..reduced
        };
        for_each(&corners, |at, _| {
            let mut sum = 0.0f64;
            for dy in 0..f {
                for dx in 0..f {
                    let from = (at + dy * sy + dx * sx) as usize * size;
                    sum += read(flat.dtype, &src[from..from + size]).f64();
                }
            }
            let o = out_dtype.size();
            write(out_dtype, Num::F(sum / area), &mut dst[n * o..(n + 1) * o]);
            n += 1;
        });
        NdView::contiguous(backing, out_shape, flat.ids, out_dtype)
    }
}

fn fmt_shape(shape: &[Option<u64>]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.map_or_else(|| "?".to_string(), |d| d.to_string())).collect();
    format!("[{}]", dims.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-at-a-time paths write exactly what the element-at-a-time one does.
    #[test]
    fn row_paths_equal_the_general_path_through_permutes_flips_and_normalize() {
        // [t=3, x=5, y=4, c=2] float32 → flip y, then channels-first [t, c, x, y].
        let shape = vec![3u64, 5, 4, 2];
        let n: u64 = shape.iter().product();
        let src: Vec<u8> = (0..n).flat_map(|i| ((i as f32 - 37.5) * 0.37).to_ne_bytes()).collect();
        let mut view = NdView::contiguous(Backing::Input, shape, vec![0, 1, 2, 3], DType::F32);
        view.flip(2);
        view.permute(&[0, 3, 1, 2]);
        let affine = |sub_div| Op::Affine {
            ids: vec![3],
            dims: vec![2],
            coefficients: vec![(1.0 / 1.5, -0.1 / 1.5), (2.0, 0.4)],
            sub_div,
        };
        for ops in [vec![], vec![affine(false)], vec![affine(true)]] {
            let lookups: Vec<Vec<(usize, u64)>> = match ops.first() {
                Some(Op::Affine { .. }) => vec![vec![(1, 1)]], // axis id 3 sits at position 1 after the permute
                _ => vec![],
            };
            let (mut fast, mut slow) = (vec![0u8; src.len()], vec![0u8; src.len()]);
            assert!(write_rows(&src, &view, &ops, &lookups, DType::F32, &mut fast));
            write_each(&src, &view, &ops, &lookups, DType::F32, &mut slow);
            assert_eq!(fast, slow, "ops {ops:?}");
        }
        // Conversions it does not cover go the general way.
        let cast = [Op::Cast(DType::F64)];
        assert!(!write_rows(&src, &view, &cast, &[vec![]], DType::F64, &mut vec![0u8; src.len() * 2]));
    }

    #[test]
    fn byte_tables_equal_the_general_path() {
        // [x=5, y=4, c=3] bytes → rot90-like swap and flip, channels first.
        let shape = vec![5u64, 4, 3];
        let n: u64 = shape.iter().product();
        let src: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
        let scale = Op::Affine { ids: vec![], dims: vec![], coefficients: vec![(1.0 / 255.0, 0.0)], sub_div: false };
        let normalize = Op::Affine {
            ids: vec![2],
            dims: vec![3],
            coefficients: vec![(0.485, 0.229), (0.456, 0.224), (-0.5, 2.0)],
            sub_div: true,
        };
        for dtype in [DType::U8, DType::I8, DType::Bool] {
            let mut view = NdView::contiguous(Backing::Input, shape.clone(), vec![0, 1, 2], dtype);
            view.swap(0, 1);
            view.flip(1);
            view.permute(&[2, 0, 1]);
            // Axis id 2 (channels) sits at position 0 after the permute.
            type Lookups = Vec<Vec<(usize, u64)>>;
            let cases: Vec<(Vec<Op>, Lookups, DType)> = vec![
                (vec![scale.clone()], vec![vec![]], DType::F32),
                (vec![scale.clone(), normalize.clone()], vec![vec![], vec![(0, 1)]], DType::F32),
                (vec![Op::Cast(DType::F64), normalize.clone()], vec![vec![], vec![(0, 1)]], DType::F32),
                (vec![normalize.clone(), Op::Cast(DType::I16)], vec![vec![(0, 1)], vec![]], DType::I16),
                (vec![Op::Cast(DType::U16)], vec![vec![]], DType::U16),
            ];
            for (ops, lookups, out) in cases {
                let bytes = n as usize * out.size();
                let (mut fast, mut slow) = (vec![0xAAu8; bytes], vec![0x55u8; bytes]);
                assert!(write_tabled(&src, &view, &ops, &lookups, out, &mut fast), "{dtype} {ops:?}");
                write_each(&src, &view, &ops, &lookups, out, &mut slow);
                assert_eq!(fast, slow, "{dtype} ops {ops:?}");
            }
        }
        // Wider input, or ops indexing coefficients differently, go the general way.
        let view = NdView::contiguous(Backing::Input, shape.clone(), vec![0, 1, 2], DType::U16);
        assert!(!write_tabled(&src, &view, &[scale], &[vec![]], DType::F32, &mut vec![0u8; n as usize * 4]));
    }
}
