//! The error a client is sent: a kind (which Python exception it becomes)
//! and a message naming the file, field, key or index involved and what to
//! do. Errors stay typed through the middle layers ([`SourceError`],
//! [`LayoutError`], [`StreamError`]) and become a [`WireError`] here, at the
//! edge, through the `From` impls: the one place that decides each kind.

use stoker_data::fsaccess::AccessError;
use stoker_data::source::SourceError;
use stoker_decode::transform::TransformError;
use stoker_proto::{ErrorKind, LayoutError, Response};

use crate::stream::StreamError;

/// An error reply: what `Response::Error` carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    /// Which class of error (the client's exception type).
    pub kind: ErrorKind,
    /// What went wrong, for the user.
    pub message: String,
}

impl WireError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> WireError {
        WireError { kind, message: message.into() }
    }
}

impl From<WireError> for Response {
    fn from(e: WireError) -> Response {
        Response::Error { kind: e.kind, message: e.message }
    }
}

impl From<SourceError> for WireError {
    /// Refused rights are `PermissionDenied`, exceeded limits `Limit`, the
    /// rest (missing files, fields and keys, bad data) `Dataset`.
    fn from(e: SourceError) -> WireError {
        let kind = match &e {
            SourceError::Access(AccessError::NotAllowed { .. } | AccessError::Rights { .. }) => {
                ErrorKind::PermissionDenied
            }
            SourceError::Access(AccessError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                ErrorKind::PermissionDenied
            }
            SourceError::Limit(_) => ErrorKind::Limit,
            _ => ErrorKind::Dataset,
        };
        WireError::new(kind, e.to_string())
    }
}

impl From<TransformError> for WireError {
    /// Transforms that cannot be built for a dataset's fields.
    fn from(e: TransformError) -> WireError {
        WireError::new(ErrorKind::Dataset, e.to_string())
    }
}

impl From<LayoutError> for WireError {
    /// A batch that does not fit the configured limits.
    fn from(e: LayoutError) -> WireError {
        WireError::new(ErrorKind::Limit, e.to_string())
    }
}

impl From<StreamError> for WireError {
    fn from(e: StreamError) -> WireError {
        let kind = match &e {
            StreamError::PastEpochEnd { .. } => ErrorKind::Protocol,
            StreamError::Shm { .. } => ErrorKind::Internal,
            StreamError::SlotTooLarge { .. }
            | StreamError::ClientBudget { .. }
            | StreamError::UserBudget { .. }
            | StreamError::DaemonBudget { .. }
            | StreamError::Layout(_) => ErrorKind::Limit,
        };
        WireError::new(kind, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn kinds_follow_the_cause() {
        let denied = SourceError::Access(AccessError::Rights { uid: 7, message: "no".into() });
        assert_eq!(WireError::from(denied).kind, ErrorKind::PermissionDenied);
        let missing = SourceError::Access(AccessError::Io {
            path: PathBuf::from("/x"),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
            hint: "",
        });
        assert_eq!(WireError::from(missing).kind, ErrorKind::Dataset);
        let past = StreamError::PastEpochEnd { step: 9, batches: 3 };
        let wire = WireError::from(past);
        assert_eq!(wire.kind, ErrorKind::Protocol);
        assert!(wire.message.contains("step 9") && wire.message.contains("3 batches"), "{}", wire.message);
        let reply: Response = WireError::new(ErrorKind::Limit, "too big").into();
        assert!(matches!(reply, Response::Error { kind: ErrorKind::Limit, ref message } if message == "too big"));
    }
}
