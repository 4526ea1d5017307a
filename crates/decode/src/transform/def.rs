//! Steps from their one definition, the wire's [`TransformDef`] (which the
//! config and Python also deserialize into): each becomes the engine's
//! [`Step`], or a [`TransformError::Invalid`] naming the field and saying
//! what to write instead.

use stoker_proto::{DType, TransformDef};

/// `WellDataset`'s floor on standard deviations read from a statistics file
/// (`ZScoreNormalization(min_value=1e-4)`).
pub const WELL_MIN_STD: f32 = 1e-4;

use super::{Filter, Step, TransformError};

impl Step {
    /// One step of the wire/config form as the engine runs it (`field` is
    /// the default entry of a statistics file).
    pub fn from_def(t: &TransformDef, field: &str) -> Result<Step, TransformError> {
        let invalid = |message: String| TransformError::Invalid { field: field.to_string(), message };
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
                        return Err(invalid(format!(
                            "resize filter {other:?}: use nearest, bilinear, bicubic or lanczos3"
                        )));
                    }
                },
            },
            TransformDef::Hflip => Step::RandomHFlip,
            TransformDef::ToF32 { scale } => Step::ToF32 { scale: scale.unwrap_or(1.0) },
            TransformDef::Normalize { mean, std, stats: None, min_std, .. } => {
                let floor = min_std.unwrap_or(f32::NEG_INFINITY);
                Step::Normalize { mean: mean.clone(), std: std.iter().map(|s| s.max(floor)).collect() }
            }
            TransformDef::Normalize { mean, std, stats: Some(stats), key, min_std } => {
                if !mean.is_empty() || !std.is_empty() {
                    return Err(invalid(format!(
                        "normalize takes mean and std, or stats, not both (stats = {stats:?})"
                    )));
                }
                if !stats.starts_with('/') {
                    return Err(invalid(format!("normalize stats path {stats:?} must be absolute")));
                }
                Step::NormalizeFrom {
                    stats: stats.clone(),
                    key: key.clone().unwrap_or_else(|| field.to_string()),
                    min_std: min_std.unwrap_or(WELL_MIN_STD),
                }
            }
            TransformDef::Chw => Step::ToChw,
            TransformDef::Vflip => Step::RandomVFlip,
            TransformDef::Rot90 => Step::RandomRot90,
            TransformDef::Cast { dtype } => Step::Cast {
                dtype: DType::from_numpy(dtype).ok_or_else(|| TransformError::UnknownDtype {
                    field: field.to_string(),
                    name: dtype.clone(),
                    known: DType::ALL.iter().map(|d| d.numpy_name()).collect(),
                })?,
            },
            TransformDef::Permute { axes } => {
                Step::Permute { axes: axes.iter().map(|&a| usize::try_from(a).unwrap_or(usize::MAX)).collect() }
            }
            TransformDef::Downsample { factor, mode } => Step::Downsample {
                factor: *factor,
                mean: match mode.as_deref() {
                    None | Some("mean") => true,
                    Some("stride") => false,
                    Some(other) => {
                        return Err(invalid(format!("downsample mode {other:?}: use \"mean\" or \"stride\"")));
                    }
                },
            },
        })
    }
}
