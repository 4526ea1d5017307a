//! The strided view a chain's geometry moves, the element conversions queued
//! on it, and the kernels that copy it into the slot once (row at a time where
//! rows are contiguous, through a lookup table for one-byte input).

use stoker_proto::DType;

use super::super::{Backing, f16_to_f32};
use super::permute;

/// A number on its way through the conversions, exact for every integer dtype.
#[derive(Debug, Clone, Copy)]
pub(super) enum Num {
    I(i128),
    F(f64),
}

impl Num {
    pub(super) fn f64(self) -> f64 {
        match self {
            Num::I(v) => v as f64,
            Num::F(v) => v,
        }
    }

    /// As numpy's `astype(dtype)` (for floats out of an integer type's range: saturated).
    pub(super) fn cast(self, dtype: DType) -> Num {
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

pub(super) fn read(dtype: DType, b: &[u8]) -> Num {
    pub(super) fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
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
pub(super) fn write(dtype: DType, v: Num, out: &mut [u8]) {
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
pub(super) enum Op {
    /// `x * mul + add` as float32; the coefficients are indexed by the
    /// elements' coordinates along `ids` (data axes, see [`NdView::ids`]).
    /// With `sub_div` the pairs are `(mean, std)` and the element becomes
    /// `(x - mean) / std` computed in float32, exactly as PyTorch (and The
    /// Well's `WellDataset`) compute a normalization.
    Affine {
        ids: Vec<usize>,
        dims: Vec<u64>,
        coefficients: Vec<(f64, f64)>,
        sub_div: bool,
    },
    Cast(DType),
}

/// One element through one [`Op::Affine`] pair.
#[inline]
pub(super) fn affine(v: f64, (a, b): (f64, f64), sub_div: bool) -> f32 {
    if sub_div { (v as f32 - a as f32) / b as f32 } else { (v * a + b) as f32 }
}

/// A strided view: element `[i0, i1, ...]` is at `offset + Σ i_k × strides[k]`.
#[derive(Debug, Clone)]
pub(super) struct NdView {
    pub(super) backing: Backing,
    pub(super) offset: i64,
    pub(super) shape: Vec<u64>,
    pub(super) strides: Vec<i64>,
    /// Which input axis each axis is (conversions bind to data axes, which
    /// `rot90` and `permute` move).
    pub(super) ids: Vec<usize>,
    pub(super) dtype: DType,
}

impl NdView {
    pub(super) fn contiguous(backing: Backing, shape: Vec<u64>, ids: Vec<usize>, dtype: DType) -> NdView {
        let mut strides = vec![1i64; shape.len()];
        for k in (0..shape.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1] * shape[k + 1] as i64;
        }
        NdView { backing, offset: 0, shape, strides, ids, dtype }
    }

    pub(super) fn flip(&mut self, axis: usize) {
        self.offset += (self.shape[axis] as i64 - 1) * self.strides[axis];
        self.strides[axis] = -self.strides[axis];
    }

    pub(super) fn swap(&mut self, a: usize, b: usize) {
        self.shape.swap(a, b);
        self.strides.swap(a, b);
        self.ids.swap(a, b);
    }

    pub(super) fn permute(&mut self, perm: &[usize]) {
        self.shape = permute(&self.shape, perm);
        self.strides = permute(&self.strides, perm);
        self.ids = permute(&self.ids, perm);
    }

    /// `np.rot90(m, k, axes=(y, x))`, `k` in `0..4`.
    pub(super) fn rot90(&mut self, k: u64, y: usize, x: usize) {
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

    pub(super) fn len(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Calls `f(element offset, multi-index)` for every element of `view` in C order.
pub(super) fn for_each(view: &NdView, mut f: impl FnMut(i64, &[u64])) {
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
pub(super) fn write_out(src: &[u8], view: &NdView, ops: &[Op], out: DType, dst: &mut [u8]) {
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
pub(super) const MAX_TABLES: usize = 64;

/// [`write_out`] for one-byte input (uint8, int8, bool) through any ops whose
/// coefficients share one index (the common `to_f32` then per-channel
/// `normalize`): every (coefficient set, byte value) is run through the ops
/// once, as [`write_each`] would, into a table, and rows copy from it. False
/// when the input is wider or the ops index coefficients differently.
pub(super) fn write_tabled(
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
                Op::Affine { coefficients, sub_div, .. } => {
                    let pair = coefficients[if coefficients.len() == 1 { 0 } else { set }];
                    Num::F(f64::from(affine(v.f64(), pair, *sub_div)))
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
pub(super) fn tabled_rows<'d, const N: usize>(
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
pub(super) fn write_each(
    src: &[u8],
    view: &NdView,
    ops: &[Op],
    lookups: &[Vec<(usize, u64)>],
    out: DType,
    dst: &mut [u8],
) {
    let size = view.dtype.size();
    let out_size = out.size();
    let mut n = 0usize;
    for_each(view, |at, index| {
        let from = at as usize * size;
        let mut v = read(view.dtype, &src[from..from + size]);
        for (op, lookup) in ops.iter().zip(lookups) {
            v = match op {
                Op::Cast(dtype) => v.cast(*dtype),
                Op::Affine { coefficients, sub_div, .. } => {
                    let i = lookup.iter().map(|&(pos, m)| index[pos] * m).sum::<u64>() as usize;
                    Num::F(f64::from(affine(v.f64(), coefficients[i], *sub_div)))
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
pub(super) fn write_rows(
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
    let (coefficients, lookup, sub_div) = match (ops, lookups) {
        ([], _) if out == view.dtype => (None, &[][..], false),
        ([Op::Affine { coefficients, sub_div, .. }], [lookup]) if view.dtype == DType::F32 && out == DType::F32 => {
            (Some(coefficients.as_slice()), lookup.as_slice(), *sub_div)
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
                    let pair = coefficients[(base + k as u64 * m_last) as usize];
                    d.copy_from_slice(&affine(f64::from(v), pair, sub_div).to_ne_bytes());
                }
            }
        }
    });
    true
}
