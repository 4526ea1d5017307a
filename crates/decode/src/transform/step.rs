//! The engine's steps, the interpolation filters and field pairing: what a
//! chain is made of (built from the wire's `TransformDef` in `def.rs`).

use stoker_proto::DType;

/// A transform step, in declaration order. Steps compare with `==` on their
/// parameters (floats as floats) and hash consistently with that (see the
/// `Hash` impl), so a dataset's identity is its steps' derived identity.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Crop `height × width` from the centre (offset `(H - h) / 2`, rounded down).
    CenterCrop {
        /// Rows kept.
        height: u64,
        /// Columns kept.
        width: u64,
    },
    /// Crop `height × width` at an offset drawn uniformly from every position that fits.
    RandomCrop {
        /// Rows kept.
        height: u64,
        /// Columns kept.
        width: u64,
    },
    /// Resize to `height × width` (uint8, uint16 or float32 data, 1–4 channels).
    Resize {
        /// Output rows.
        height: u64,
        /// Output columns.
        width: u64,
        /// Interpolation.
        filter: Filter,
    },
    /// Mirror left–right with probability 0.5.
    RandomHFlip,
    /// Convert to float32, multiplied by `scale` (`1/255` maps uint8 to `[0, 1]`).
    ToF32 {
        /// Factor applied while converting.
        scale: f32,
    },
    /// `(x - mean[c]) / std[c]` per channel, as float32 (one value broadcasts to all channels).
    Normalize {
        /// Per-channel mean, in the units of the input to this step.
        mean: Vec<f32>,
        /// Per-channel standard deviation.
        std: Vec<f32>,
    },
    /// Deliver `[c, h, w]` instead of `[h, w, c]` (a `[h, w]` array becomes `[1, h, w]`); on other
    /// arrays the channel axis (the last, when it is not spatial) moves before the spatial axes.
    ToChw,
    /// Mirror top–bottom with probability 0.5.
    RandomVFlip,
    /// `np.rot90(x, k, axes=spatial)` with `k` uniform in 0..4 (the spatial sizes must be equal).
    RandomRot90,
    /// Convert to `dtype` as numpy's `astype` (floats to integers saturate; NaN becomes 0).
    Cast {
        /// Target type.
        dtype: DType,
    },
    /// `(x - mean) / std` as float32, `mean` and `std` of shape `dims` broadcast against the
    /// array's trailing axes (numpy broadcasting): per-component statistics of vector or tensor fields.
    NormalizeTrailing {
        /// Means, C order.
        mean: Vec<f32>,
        /// Standard deviations, C order.
        std: Vec<f32>,
        /// Their shape.
        dims: Vec<u64>,
    },
    /// Reorder axes: axis `i` of the output is axis `axes[i]` of the input.
    Permute {
        /// A permutation of `0..rank`.
        axes: Vec<usize>,
    },
    /// Shrink both spatial axes to `floor(size / factor)`: block means (as float32, float64 for
    /// float64 input) or, with `mean: false`, every `factor`-th element (same dtype).
    Downsample {
        /// Block size, at least 1.
        factor: u64,
        /// Block mean rather than stride.
        mean: bool,
    },
    /// `normalize` whose statistics are still to be read from a file ([`super::stats`]); the dataset
    /// replaces it with the statistics before building the chain.
    NormalizeFrom {
        /// The statistics file.
        stats: String,
        /// Its entry.
        key: String,
        /// Standard deviations below this are raised to it.
        min_std: f32,
    },
}

/// A step is a map key (an open dataset's identity). Its `f32` parameters
/// make `==` non-reflexive only for NaN: a chain holding NaN never equals
/// another, so such a dataset is opened afresh, never confused with one.
impl Eq for Step {}

impl std::hash::Hash for Step {
    /// Hashes what `==` compares: the variant and every parameter, floats by
    /// their bits with `-0.0` as `0.0` (equal floats hash equal).
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        fn floats<H: std::hash::Hasher>(values: &[f32], h: &mut H) {
            values.len().hash(h);
            for v in values {
                (if *v == 0.0 { 0 } else { v.to_bits() }).hash(h);
            }
        }
        std::mem::discriminant(self).hash(h);
        match self {
            Step::CenterCrop { height, width } | Step::RandomCrop { height, width } => (height, width).hash(h),
            Step::Resize { height, width, filter } => (height, width, filter).hash(h),
            Step::ToF32 { scale } => floats(&[*scale], h),
            Step::Normalize { mean, std } => {
                floats(mean, h);
                floats(std, h);
            }
            Step::NormalizeTrailing { mean, std, dims } => {
                floats(mean, h);
                floats(std, h);
                dims.hash(h);
            }
            Step::Cast { dtype } => dtype.hash(h),
            Step::Permute { axes } => axes.hash(h),
            Step::Downsample { factor, mean } => (factor, mean).hash(h),
            Step::NormalizeFrom { stats, key, min_std } => (stats, key, min_std.to_bits()).hash(h),
            Step::RandomHFlip | Step::ToChw | Step::RandomVFlip | Step::RandomRot90 => {}
        }
    }
}

/// Interpolation for [`Step::Resize`]; convolution-based, antialiased when
/// shrinking (as Pillow's `Image.resize` and torchvision's `antialias=True`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Filter {
    /// Nearest neighbour (labels, masks).
    Nearest,
    /// Bilinear (triangle) filter.
    #[default]
    Bilinear,
    /// Catmull-Rom bicubic.
    Bicubic,
    /// Lanczos, three lobes.
    Lanczos3,
}

/// Pairing of a field's random draws with another field's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pair {
    /// The field whose draws this chain follows (its chain must have the same
    /// geometric steps, sizes divided by `scale`, and no pairing of its own).
    pub with: String,
    /// This field's size over the other's: 4 for HR paired with 4×-downscaled LR.
    pub scale: u64,
}

impl Step {
    /// The step as the config spells it, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            Step::CenterCrop { height, width } => format!("center_crop {height}×{width}"),
            Step::RandomCrop { height, width } => format!("random_crop {height}×{width}"),
            Step::Resize { height, width, .. } => format!("resize to {height}×{width}"),
            Step::RandomHFlip => "hflip".into(),
            Step::ToF32 { .. } => "to_f32".into(),
            Step::Normalize { .. } => "normalize".into(),
            Step::ToChw => "chw".into(),
            Step::RandomVFlip => "vflip".into(),
            Step::RandomRot90 => "rot90".into(),
            Step::Cast { dtype } => format!("cast to {dtype}"),
            Step::NormalizeTrailing { dims, .. } => format!("normalize over {dims:?}"),
            Step::Permute { axes } => format!("permute {axes:?}"),
            Step::Downsample { factor, mean } => {
                format!("downsample by {factor} ({})", if *mean { "mean" } else { "stride" })
            }
            Step::NormalizeFrom { stats, key, .. } => format!("normalize with {key:?} of {stats}"),
        }
    }

    /// Whether the step moves pixels (and so must match between paired chains).
    pub(super) fn is_geometric(&self) -> bool {
        matches!(
            self,
            Step::CenterCrop { .. }
                | Step::RandomCrop { .. }
                | Step::Resize { .. }
                | Step::RandomHFlip
                | Step::RandomVFlip
                | Step::RandomRot90
        )
    }
}
