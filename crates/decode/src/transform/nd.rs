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

use super::{
    ArrayRef, Backing, Chain, GeometryError, SampleKey, Scratch, Step, TransformError, draw, f16_to_f32, uniform,
};

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

fn permute<T: Copy>(v: &[T], perm: &[usize]) -> Vec<T> {
    perm.iter().map(|&p| v[p]).collect()
}

/// A number on its way through the conversions, exact for every integer dtype.
#[derive(Debug, Clone, Copy)]
enum Num {
    I(i128),
    F(f64),
}

impl Num {
    fn f64(self) -> f64 {
        match self {
            Num::I(v) => v as f64,
            Num::F(v) => v,
        }
    }

    /// As numpy's `astype(dtype)` (for floats out of an integer type's range: saturated).
    fn cast(self, dtype: DType) -> Num {
        match (self, dtype) {
            (v, DType::Bool) => Num::I(i128::from(v.f64() != 0.0)),
            (Num::I(v), DType::U8) => Num::I(i128::from(v as u8)),
            (Num::I(v), DType::I8) => Num::I(i128::from(v as i8)),
            (Num::I(v), DType::U16) => Num::I(i128::from(v as u16)),
            (Num::I(v), DType::I16) => Num::I(i128::from(v as i16)),
            (Num::I(v), DType::U32) => Num::I(i128::from(v as u32)),
            (Num::I(v), DType::I32) => Num::I(i128::from(v as i32)),
            (Num::I(v), DType::U64) => Num::I(i128::from(v as u64)),
            (Num::I(v), DType::I64) => Num::I(i128::from(v as i64)),
            (Num::F(v), DType::U8) => Num::I(i128::from(v as u8)),
            (Num::F(v), DType::I8) => Num::I(i128::from(v as i8)),
            (Num::F(v), DType::U16) => Num::I(i128::from(v as u16)),
            (Num::F(v), DType::I16) => Num::I(i128::from(v as i16)),
            (Num::F(v), DType::U32) => Num::I(i128::from(v as u32)),
            (Num::F(v), DType::I32) => Num::I(i128::from(v as i32)),
            (Num::F(v), DType::U64) => Num::I(i128::from(v as u64)),
            (Num::F(v), DType::I64) => Num::I(i128::from(v as i64)),
            (v, DType::F16) => Num::F(half::f16::from_f64(v.f64()).to_f64()),
            (v, DType::F32) => Num::F(f64::from(v.f64() as f32)),
            (v, DType::F64) => Num::F(v.f64()),
        }
    }
}

fn read(dtype: DType, b: &[u8]) -> Num {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        b.try_into().expect("element slices have the dtype's size")
    }
    match dtype {
        DType::Bool | DType::U8 => Num::I(i128::from(b[0])),
        DType::I8 => Num::I(i128::from(b[0] as i8)),
        DType::U16 => Num::I(i128::from(u16::from_ne_bytes(arr(b)))),
        DType::I16 => Num::I(i128::from(i16::from_ne_bytes(arr(b)))),
        DType::U32 => Num::I(i128::from(u32::from_ne_bytes(arr(b)))),
        DType::I32 => Num::I(i128::from(i32::from_ne_bytes(arr(b)))),
        DType::U64 => Num::I(i128::from(u64::from_ne_bytes(arr(b)))),
        DType::I64 => Num::I(i128::from(i64::from_ne_bytes(arr(b)))),
        DType::F16 => Num::F(f64::from(f16_to_f32(u16::from_ne_bytes(arr(b))))),
        DType::F32 => Num::F(f64::from(f32::from_ne_bytes(arr(b)))),
        DType::F64 => Num::F(f64::from_ne_bytes(arr(b))),
    }
}

/// Writes `v` (already cast to `dtype`) into `out`, which holds one element.
fn write(dtype: DType, v: Num, out: &mut [u8]) {
    let v = v.cast(dtype);
    let int = |v: Num| match v {
        Num::I(i) => i,
        Num::F(f) => f as i128,
    };
    match dtype {
        DType::Bool | DType::U8 => out[0] = int(v) as u8,
        DType::I8 => out[0] = int(v) as i8 as u8,
        DType::U16 => out.copy_from_slice(&(int(v) as u16).to_ne_bytes()),
        DType::I16 => out.copy_from_slice(&(int(v) as i16).to_ne_bytes()),
        DType::U32 => out.copy_from_slice(&(int(v) as u32).to_ne_bytes()),
        DType::I32 => out.copy_from_slice(&(int(v) as i32).to_ne_bytes()),
        DType::U64 => out.copy_from_slice(&(int(v) as u64).to_ne_bytes()),
        DType::I64 => out.copy_from_slice(&(int(v) as i64).to_ne_bytes()),
        DType::F16 => out.copy_from_slice(&half::f16::from_f64(v.f64()).to_bits().to_ne_bytes()),
        DType::F32 => out.copy_from_slice(&(v.f64() as f32).to_ne_bytes()),
        DType::F64 => out.copy_from_slice(&v.f64().to_ne_bytes()),
    }
}

/// An element conversion waiting for the copy into the slot.
#[derive(Debug, Clone)]
enum Op {
    /// `x * mul + add` as float32; the coefficients are indexed by the
    /// elements' coordinates along `ids` (data axes, see [`NdView::ids`]).
    Affine {
        ids: Vec<usize>,
        dims: Vec<u64>,
        coefficients: Vec<(f64, f64)>,
    },
    Cast(DType),
}

/// A strided view: element `[i0, i1, ...]` is at `offset + Σ i_k × strides[k]`.
#[derive(Debug, Clone)]
struct NdView {
    backing: Backing,
    offset: i64,
    shape: Vec<u64>,
    strides: Vec<i64>,
    /// Which input axis each axis is (conversions bind to data axes, which
    /// `rot90` and `permute` move).
    ids: Vec<usize>,
    dtype: DType,
}

impl NdView {
    fn contiguous(backing: Backing, shape: Vec<u64>, ids: Vec<usize>, dtype: DType) -> NdView {
        let mut strides = vec![1i64; shape.len()];
        for k in (0..shape.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1] * shape[k + 1] as i64;
        }
        NdView { backing, offset: 0, shape, strides, ids, dtype }
    }

    fn flip(&mut self, axis: usize) {
        self.offset += (self.shape[axis] as i64 - 1) * self.strides[axis];
        self.strides[axis] = -self.strides[axis];
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.shape.swap(a, b);
        self.strides.swap(a, b);
        self.ids.swap(a, b);
    }

    fn permute(&mut self, perm: &[usize]) {
        self.shape = permute(&self.shape, perm);
        self.strides = permute(&self.strides, perm);
        self.ids = permute(&self.ids, perm);
    }

    /// `np.rot90(m, k, axes=(y, x))`, `k` in `0..4`.
    fn rot90(&mut self, k: u64, y: usize, x: usize) {
        match k {
            1 => {
                self.flip(x);
                self.swap(y, x);
            }
            2 => {
                self.flip(y);
                self.flip(x);
            }
            3 => {
                self.swap(y, x);
                self.flip(x);
            }
            _ => {}
        }
    }

    fn len(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Calls `f(element offset, multi-index)` for every element of `view` in C order.
fn for_each(view: &NdView, mut f: impl FnMut(i64, &[u64])) {
    if view.shape.contains(&0) {
        return;
    }
    let rank = view.shape.len();
    let mut index = vec![0u64; rank];
    let mut at = view.offset;
    loop {
        f(at, &index);
        let mut k = rank;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            at += view.strides[k];
            if index[k] < view.shape[k] {
                break;
            }
            at -= view.strides[k] * view.shape[k] as i64;
            index[k] = 0;
        }
    }
}

/// Copies `view` of `src` into `dst` in C order, running `ops`; `dst` holds
/// the view's elements as `out` (the dtype after the ops).
fn write_out(src: &[u8], view: &NdView, ops: &[Op], out: DType, dst: &mut [u8]) {
    let size = view.dtype.size();
    let rank = view.shape.len();
    if ops.is_empty() && rank > 0 && view.strides[rank - 1] == 1 {
        // Whole rows at a time.
        let row = view.shape[rank - 1] as usize * size;
        let outer = NdView {
            shape: view.shape[..rank - 1].to_vec(),
            strides: view.strides[..rank - 1].to_vec(),
            ..view.clone()
        };
        let mut chunks = dst.chunks_exact_mut(row.max(1));
        for_each(&outer, |at, _| {
            let from = at as usize * size;
            if let Some(chunk) = chunks.next() {
                chunk.copy_from_slice(&src[from..from + row]);
            }
        });
        return;
    }
    // Per conversion: (position, multiplier) pairs giving the coefficient index.
    let lookups: Vec<Vec<(usize, u64)>> = ops
        .iter()
        .map(|op| match op {
            Op::Affine { ids, dims, .. } => {
                let mut mult = 1u64;
                let mut pairs: Vec<(usize, u64)> = ids
                    .iter()
                    .zip(dims)
                    .rev()
                    .map(|(id, &d)| {
                        let pos = view.ids.iter().position(|i| i == id).expect("conversions bind to present axes");
                        let pair = (pos, mult);
                        mult *= d;
                        pair
                    })
                    .collect();
                pairs.reverse();
                pairs
            }
            Op::Cast(_) => Vec::new(),
        })
        .collect();
    if !write_rows(src, view, ops, &lookups, out, dst) && !write_tabled(src, view, ops, &lookups, out, dst) {
        write_each(src, view, ops, &lookups, out, dst);
    }
}

/// Most coefficient sets [`write_tabled`] tabulates (256 entries each).
const MAX_TABLES: usize = 64;

/// [`write_out`] for one-byte input (uint8, int8, bool) through any ops whose
/// coefficients share one index (the common `to_f32` then per-channel
/// `normalize`): every (coefficient set, byte value) is run through the ops
/// once, as [`write_each`] would, into a table, and rows copy from it. False
/// when the input is wider or the ops index coefficients differently.
fn write_tabled(
    src: &[u8],
    view: &NdView,
    ops: &[Op],
    lookups: &[Vec<(usize, u64)>],
    out: DType,
    dst: &mut [u8],
) -> bool {
    let rank = view.shape.len();
    if view.dtype.size() != 1 || ops.is_empty() || rank == 0 || view.shape.contains(&0) {
        return false;
    }
    // The one index all indexed ops share (none: every op has one coefficient).
    let mut indexed = lookups.iter().filter(|l| !l.is_empty());
    let lookup = indexed.next().map_or(&[][..], Vec::as_slice);
    if indexed.any(|l| l.as_slice() != lookup) {
        return false;
    }
    let sets = ops
        .iter()
        .map(|op| match op {
            Op::Affine { coefficients, .. } => coefficients.len(),
            Op::Cast(_) => 1,
        })
        .max()
        .unwrap_or(1);
    if sets > MAX_TABLES {
        return false;
    }
    let out_size = out.size();
    let mut table = vec![0u8; sets * 256 * out_size];
    for (i, entry) in table.chunks_exact_mut(out_size).enumerate() {
        let (set, byte) = (i / 256, [(i % 256) as u8]);
        let mut v = read(view.dtype, &byte);
        for op in ops {
            v = match op {
                Op::Cast(dtype) => v.cast(*dtype),
                Op::Affine { coefficients, .. } => {
                    let (mul, add) = coefficients[if coefficients.len() == 1 { 0 } else { set }];
                    Num::F(f64::from((v.f64() * mul + add) as f32))
                }
            };
        }
        write(out, v, entry);
    }
    let last = rank - 1;
    let (n, stride) = (view.shape[last] as usize, view.strides[last]);
    let m_last: u64 = lookup.iter().filter(|&&(pos, _)| pos == last).map(|&(_, m)| m).sum();
    let outer = NdView { shape: view.shape[..last].to_vec(), strides: view.strides[..last].to_vec(), ..view.clone() };
    let rows = dst.chunks_exact_mut(n * out_size);
    let bases = |index: &[u64]| lookup.iter().filter(|&&(pos, _)| pos != last).map(|&(pos, m)| index[pos] * m).sum();
    match out_size {
        1 => tabled_rows::<1>(src, &outer, &table, stride, m_last, rows, bases),
        2 => tabled_rows::<2>(src, &outer, &table, stride, m_last, rows, bases),
        4 => tabled_rows::<4>(src, &outer, &table, stride, m_last, rows, bases),
        _ => tabled_rows::<8>(src, &outer, &table, stride, m_last, rows, bases),
    }
    true
}

/// [`write_tabled`]'s rows, for `N`-byte output elements (a fixed-size copy
/// per element, not a `memcpy` call): element `k` of the row at `at` is
/// table entry (`base(index)` + `k` × `m_last`, its byte).
fn tabled_rows<'d, const N: usize>(
    src: &[u8],
    outer: &NdView,
    table: &[u8],
    stride: i64,
    m_last: u64,
    mut rows: impl Iterator<Item = &'d mut [u8]>,
    base: impl Fn(&[u64]) -> u64,
) {
    let (entries, _) = table.as_chunks::<N>();
    for_each(outer, |at, index| {
        let Some(row) = rows.next() else { return };
        let (outs, _) = row.as_chunks_mut::<N>();
        let base = base(index) as usize * 256;
        let m_last = m_last as usize * 256;
        for (k, d) in outs.iter_mut().enumerate() {
            let byte = src[(at + k as i64 * stride) as usize] as usize;
            *d = entries[base + k * m_last + byte];
        }
    });
}

/// [`write_out`] an element at a time: any dtypes, any conversions.
fn write_each(src: &[u8], view: &NdView, ops: &[Op], lookups: &[Vec<(usize, u64)>], out: DType, dst: &mut [u8]) {
    let size = view.dtype.size();
    let out_size = out.size();
    let mut n = 0usize;
    for_each(view, |at, index| {
        let from = at as usize * size;
        let mut v = read(view.dtype, &src[from..from + size]);
        for (op, lookup) in ops.iter().zip(lookups) {
            v = match op {
                Op::Cast(dtype) => v.cast(*dtype),
                Op::Affine { coefficients, .. } => {
                    let i = lookup.iter().map(|&(pos, m)| index[pos] * m).sum::<u64>() as usize;
                    let (mul, add) = coefficients[i];
                    Num::F(f64::from((v.f64() * mul + add) as f32))
                }
            };
        }
        write(out, v, &mut dst[n * out_size..(n + 1) * out_size]);
        n += 1;
    });
}

/// [`write_out`]'s common cases a row (the last axis) at a time, with no
/// per-element dispatch: a plain copy along any strides, and float32 through
/// one affine conversion (normalize, `to_f32` scaling) into float32, computed
/// exactly as the general path does (in f64, rounded to f32 once). False when
/// neither applies.
fn write_rows(
    src: &[u8],
    view: &NdView,
    ops: &[Op],
    lookups: &[Vec<(usize, u64)>],
    out: DType,
    dst: &mut [u8],
) -> bool {
    let rank = view.shape.len();
    if rank == 0 || view.shape.contains(&0) {
        return false;
    }
    let (coefficients, lookup) = match (ops, lookups) {
        ([], _) if out == view.dtype => (None, &[][..]),
        ([Op::Affine { coefficients, .. }], [lookup]) if view.dtype == DType::F32 && out == DType::F32 => {
            (Some(coefficients.as_slice()), lookup.as_slice())
        }
        _ => return false,
    };
    let size = view.dtype.size();
    let last = rank - 1;
    let (n, stride) = (view.shape[last] as usize, view.strides[last]);
    // The coefficient index is Σ index[pos] × m: the last axis's term varies along a row.
    let m_last: u64 = lookup.iter().filter(|&&(pos, _)| pos == last).map(|&(_, m)| m).sum();
    let outer = NdView { shape: view.shape[..last].to_vec(), strides: view.strides[..last].to_vec(), ..view.clone() };
    let mut rows = dst.chunks_exact_mut(n * out.size());
    for_each(&outer, |at, index| {
        let Some(row) = rows.next() else { return };
        let element = |k: usize| (at + k as i64 * stride) as usize * size;
        match coefficients {
            None => {
                for (k, d) in row.chunks_exact_mut(size).enumerate() {
                    let from = element(k);
                    d.copy_from_slice(&src[from..from + size]);
                }
            }
            Some(coefficients) => {
                let base: u64 = lookup.iter().filter(|&&(pos, _)| pos != last).map(|&(pos, m)| index[pos] * m).sum();
                for (k, d) in row.chunks_exact_mut(4).enumerate() {
                    let from = element(k);
                    let v = f32::from_ne_bytes(src[from..from + 4].try_into().expect("four bytes"));
                    let (mul, add) = coefficients[(base + k as u64 * m_last) as usize];
                    d.copy_from_slice(&((f64::from(v) * mul + add) as f32).to_ne_bytes());
                }
            }
        }
    });
    true
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

/// `(1 / std, -mean / std)` per entry: `normalize` as `x * mul + add`.
fn normalize_coefficients(mean: &[f32], std: &[f32]) -> Vec<(f64, f64)> {
    mean.iter().zip(std).map(|(&m, &s)| (1.0 / f64::from(s), -f64::from(m) / f64::from(s))).collect()
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
                run.ops.push(Op::Affine { ids: vec![], dims: vec![], coefficients: vec![(s, 0.0)] });
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
                run.ops.push(Op::Affine { ids, dims, coefficients: normalize_coefficients(mean, std) });
                run.converted = DType::F32;
            }
            Step::NormalizeTrailing { mean, std, dims } => {
                let ids = run.view.ids[run.view.ids.len() - dims.len()..].to_vec();
                run.ops.push(Op::Affine { ids, dims: dims.clone(), coefficients: normalize_coefficients(mean, std) });
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
        let affine =
            Op::Affine { ids: vec![3], dims: vec![2], coefficients: vec![(1.0 / 1.5, -0.1 / 1.5), (2.0, 0.4)] };
        for ops in [vec![], vec![affine]] {
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
        let scale = Op::Affine { ids: vec![], dims: vec![], coefficients: vec![(1.0 / 255.0, 0.0)] };
        let normalize = Op::Affine {
            ids: vec![2],
            dims: vec![3],
            coefficients: vec![(1.0 / 0.229, -0.485 / 0.229), (1.0 / 0.224, -0.456 / 0.224), (0.5, 0.25)],
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
