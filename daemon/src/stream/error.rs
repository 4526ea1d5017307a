//! Why a stream cannot do what it was asked: move to a step, or grow its
//! ring by another segment.

use stoker_proto::LayoutError;

/// A stream's refusal; the wire error at the edge gives each its kind.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// `SetEpoch` (or an open) to a step beyond the epoch.
    #[error("step {step} is past the end of the epoch ({batches} batches per epoch for this rank)")]
    PastEpochEnd {
        /// The step asked for.
        step: u64,
        /// Batches per epoch for this rank.
        batches: u64,
    },
    /// A slot whose size overflows.
    #[error("a slot of {bytes} bytes does not fit in memory")]
    SlotTooLarge {
        /// Bytes of the slot.
        bytes: u64,
    },
    /// Another segment would exceed the client's budget.
    #[error(
        "another slot of {bytes} bytes would exceed this client's shared-memory budget ({used} of {limit} bytes \
         in use, [limits] max_ring_bytes_per_client)"
    )]
    ClientBudget {
        /// Bytes asked for.
        bytes: u64,
        /// Bytes in use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// Another segment would exceed this user's share of the daemon's memory.
    #[error(
        "another slot of {bytes} bytes would exceed this user's share of the daemon's memory ({used} of {limit} \
         bytes held by this uid's streams, [limits] max_memory_bytes_per_uid)"
    )]
    UserBudget {
        /// Bytes asked for.
        bytes: u64,
        /// Bytes in use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// Another segment would exceed the daemon's budget.
    #[error(
        "another slot of {bytes} bytes would exceed the daemon's memory budget ({used} of {limit} bytes in use, \
         [limits] max_memory_bytes)"
    )]
    DaemonBudget {
        /// Bytes asked for.
        bytes: u64,
        /// Bytes in use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// The memfd could not be made.
    #[error("cannot create shared memory of {bytes} bytes: {source}")]
    Shm {
        /// Bytes asked for.
        bytes: u64,
        /// Why.
        source: std::io::Error,
    },
    /// A batch layout beyond the limits (a ragged batch too large for any slot).
    #[error(transparent)]
    Layout(#[from] LayoutError),
}
