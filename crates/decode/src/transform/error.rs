//! Why a chain cannot be built for a field, or cannot run on an array.

use stoker_proto::DType;

use super::*;

/// Errors declaring a chain or applying it to an array.
#[derive(Debug, thiserror::Error)]
pub enum TransformError {
    /// The chain itself is malformed (found when it is built).
    #[error("field {field:?}: invalid transforms: {message}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The array does not suit the chain (too small to crop, wrong rank, unsupported type).
    #[error("field {field:?}: {message}")]
    Input {
        /// The field.
        field: String,
        /// What does not fit.
        message: String,
    },
    /// A resize cannot run on the array: its type or channels, or sizes beyond what resize handles.
    #[error("field {field:?}: {problem}")]
    Resize {
        /// The field.
        field: String,
        /// What does not fit.
        problem: ResizeError,
    },
    /// The spatial axes, or a crop's window, do not fit the array.
    #[error("field {field:?}: {problem}")]
    Geometry {
        /// The field.
        field: String,
        /// What does not fit.
        problem: GeometryError,
    },
    /// A `cast` names a dtype stoker does not know.
    #[error("field {field:?}: invalid transforms: cast to {name:?}: use one of {known:?}")]
    UnknownDtype {
        /// The field.
        field: String,
        /// The name given.
        name: String,
        /// The names stoker knows (numpy's).
        known: Vec<&'static str>,
    },
    /// A step would make an array larger than the limit (checked before anything is allocated).
    #[error(
        "field {field:?}: {step} makes a {dtype} {shape:?} array of {size}, more than [limits] max_sample_bytes \
         = {limit} bytes; use smaller sizes in the field's transforms (or ask the daemon's admin to raise the limit)",
        size = bytes.map_or_else(|| "more than 2^64 bytes".to_string(), |b| format!("{b} bytes"))
    )]
    TooLarge {
        /// The field.
        field: String,
        /// The step (or "the decoded value" for the chain's input).
        step: String,
        /// Element type at that point.
        dtype: DType,
        /// `[h, w, c]` at that point.
        shape: Vec<u64>,
        /// Its bytes; `None` when that does not fit in 64 bits.
        bytes: Option<u64>,
        /// The limit in force.
        limit: u64,
    },
}

/// Why the spatial axes a chain works on, or a crop's window, do not fit an array.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// Spatial steps (or pairing) on an array of fewer than 2 dimensions.
    #[error(
        "crops, flips, rotations, resizing, downsampling, chw and pairing need at least 2 dimensions (two spatial \
         axes), not {rank}; a {rank}-d field takes only cast, normalize and permute"
    )]
    TooFewAxes {
        /// The array's number of dimensions.
        rank: usize,
    },
    /// A spatial axis, as given (negative from the end), is not an axis of the array.
    #[error("spatial axis {axis} is outside a {rank}-d array")]
    AxisOutside {
        /// The axis given.
        axis: i64,
        /// The array's number of dimensions.
        rank: usize,
    },
    /// Both spatial axes name one axis.
    #[error("spatial axes {a} and {b} are the same axis")]
    SameAxis {
        /// The first axis given.
        a: i64,
        /// The second axis given.
        b: i64,
    },
    /// A crop's window lies partly outside the array (only a paired chain
    /// whose sizes are not `scale` × its leader's gets there).
    #[error(
        "crop {height}×{width} at ({top}, {left}) does not fit in {rows}×{columns}; are the paired sizes scale × \
         the leader's?"
    )]
    CropOutside {
        /// First row of the window.
        top: u64,
        /// First column of the window.
        left: u64,
        /// Rows of the window.
        height: u64,
        /// Columns of the window.
        width: u64,
        /// Rows of the array.
        rows: u64,
        /// Columns of the array.
        columns: u64,
    },
}
