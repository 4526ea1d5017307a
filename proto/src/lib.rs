//! Wire protocol of stoker: the messages exchanged over the daemon's Unix
//! socket, the layout of a batch inside a shared-memory slot, the protocol
//! version and the limits both sides enforce. Pure data, no I/O.
//!
//! A frame is a little-endian `u32` byte count followed by that many bytes of
//! bincode 2 (standard configuration). The first exchange on a connection is
//! [`Request::Hello`] / [`Response::Hello`]; a peer speaking another
//! [`PROTOCOL_VERSION`] gets [`ErrorKind::Version`] and the connection closes.
#![forbid(unsafe_code)]

pub mod ctrl;
pub mod hash;
mod hdf5;
mod layout;
mod message;
mod steps;

pub use hdf5::{FieldPaths, Hdf5Dataset, Hdf5Problem, WindowDef};
pub use layout::{
    BatchLayout, DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_SAMPLE_BYTES, DType, FIELD_ALIGN, FieldDecl, FieldLayout,
    LayoutError, LayoutLimits, RING_HEADER_BYTES, RING_LAYOUT_VERSION, RING_MAGIC, Ragged, RingError, RingHeader,
    SLOT_ALIGN,
};
pub use message::BlockShuffle;
pub use message::{
    BatchReady, CacheDatasetStatus, CacheReport, CacheStatus, ClientStatus, DatasetInfo, DatasetRef, DatasetSkips,
    DatasetStatus, ErrorKind, FieldTransforms, Generation, Hdf5Sampling, LmdbDataset, LmdbFieldDef, MemoryStatus,
    OpenStream, PairDef, Request, Rescan, Response, StatusReport, StreamInfo, StreamStatus, TransformDef, WorkerStatus,
};
pub use steps::{step_from_json, step_names};

/// Version of the wire protocol; bumped on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 9;

/// Longest path a Unix socket may be bound or reached at (`sun_path` holds
/// 108 bytes with its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Why `path` cannot name a Unix socket (too long), in words; `None` if it can.
pub fn socket_path_problem(path: &std::path::Path) -> Option<String> {
    let n = path.as_os_str().len();
    (n > MAX_SOCKET_PATH).then(|| {
        format!(
            "the path is {n} bytes long and a Unix socket path may have at most {MAX_SOCKET_PATH}; use a shorter \
             one (under /tmp or /run, say)"
        )
    })
}

/// Socket path used when neither `--socket`, `$STOKER_SOCKET` nor a config says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/stoker/stoker.sock";

/// Environment variable naming the daemon's socket for clients.
pub const SOCKET_ENV: &str = "STOKER_SOCKET";

/// Hard ceiling on one frame's body; the daemon's configured limit may be lower.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Bytes of the length prefix in front of every frame.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Errors from encoding or decoding a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The frame's declared length exceeds the limit in force.
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Declared body length.
        len: usize,
        /// Limit in force.
        limit: usize,
    },
    /// The body is not a valid message of this protocol version.
    #[error("malformed frame: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    /// The message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(#[from] bincode::error::EncodeError),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// Encodes `msg` as one frame (length prefix included).
pub fn encode_frame<T: serde::Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; FRAME_HEADER_BYTES];
    bincode::serde::encode_into_std_write(msg, &mut out, config())?;
    let len = out.len() - FRAME_HEADER_BYTES;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len, limit: MAX_FRAME_BYTES });
    }
    out[..FRAME_HEADER_BYTES].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Reads the body length from a frame header, checking it against `limit`.
pub fn frame_len(header: [u8; FRAME_HEADER_BYTES], limit: usize) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > limit.min(MAX_FRAME_BYTES) {
        return Err(FrameError::TooLarge { len, limit: limit.min(MAX_FRAME_BYTES) });
    }
    Ok(len)
}

/// Decodes a frame body (without its length prefix).
pub fn decode_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (msg, _) = bincode::serde::decode_from_slice(body, config())?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let req = Request::Next { stream: 7 };
        let frame = encode_frame(&req).unwrap();
        let len = frame_len(frame[..4].try_into().unwrap(), MAX_FRAME_BYTES).unwrap();
        assert_eq!(len, frame.len() - 4);
        let back: Request = decode_body(&frame[4..]).unwrap();
        assert!(matches!(back, Request::Next { stream: 7 }));
    }

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let err = frame_len((1u32 << 30).to_le_bytes(), 1 << 20).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }));
    }

    #[test]
    fn garbage_body_is_an_error_not_a_panic() {
        assert!(decode_body::<Request>(&[0xff; 9]).is_err());
    }
}
