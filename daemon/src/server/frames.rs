//! Frames on the socket: reading length-prefixed requests with a bounded
//! size and a deadline for the rest of a started frame, and sending a reply
//! with file descriptors attached (`SCM_RIGHTS`).

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use stoker_proto::Request;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::mpsc;

/// Why reading a frame stopped.
pub(super) enum ReadEnd {
    /// The peer closed the connection (or it broke).
    Closed,
    /// The frame is unacceptable.
    Refused(BadFrame),
}

/// A frame the connection cannot take; the client is told why and the
/// connection closes.
#[derive(Debug, thiserror::Error)]
pub(super) enum BadFrame {
    /// The length prefix is beyond the limit (nothing was allocated for it).
    #[error("{0} ([limits] max_message_bytes)")]
    TooLarge(stoker_proto::FrameError),
    /// A message was begun and not finished in time.
    #[error("a message was started but not finished within {secs:.0} s ([server] frame_timeout_s); closing")]
    Unfinished {
        /// The deadline, in seconds.
        secs: f64,
    },
    /// The body is not a request of this protocol.
    #[error("{0}; is the client the same stoker version?")]
    Undecodable(stoker_proto::FrameError),
}

/// Reads frames into `tx`. Waiting for a message to begin is unbounded (an
/// idle client costs nothing), but a message once begun must arrive whole
/// within `deadline`, and its buffer grows only as its bytes arrive.
pub(super) async fn read_frames(
    mut reader: OwnedReadHalf,
    tx: mpsc::Sender<Result<Request, BadFrame>>,
    limit: usize,
    deadline: Duration,
) {
    loop {
        let mut header = [0u8; stoker_proto::FRAME_HEADER_BYTES];
        match reader.read(&mut header[..1]).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let rest = async {
            reader.read_exact(&mut header[1..]).await.map_err(|_| ReadEnd::Closed)?;
            let len = stoker_proto::frame_len(header, limit).map_err(|e| ReadEnd::Refused(BadFrame::TooLarge(e)))?;
            let mut body = Vec::new();
            (&mut reader).take(len as u64).read_to_end(&mut body).await.map_err(|_| ReadEnd::Closed)?;
            if body.len() < len {
                return Err(ReadEnd::Closed);
            }
            Ok(body)
        };
        let body = match tokio::time::timeout(deadline, rest).await {
            Ok(Ok(body)) => body,
            Ok(Err(ReadEnd::Closed)) => return,
            Ok(Err(ReadEnd::Refused(bad))) => {
                let _ = tx.send(Err(bad)).await;
                return;
            }
            Err(_) => {
                let bad = BadFrame::Unfinished { secs: deadline.as_secs_f64() };
                tracing::warn!("{bad}");
                let _ = tx.send(Err(bad)).await;
                return;
            }
        };
        let msg = stoker_proto::decode_body(&body).map_err(BadFrame::Undecodable);
        let failed = msg.is_err();
        if tx.send(msg).await.is_err() || failed {
            return;
        }
    }
}

pub(super) fn send_part(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)?;
    Ok(n)
}
