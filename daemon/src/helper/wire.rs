//! The daemon ↔ HDF5 helper protocol: length-prefixed bincode frames over a
//! Unix socket pair; a file to open travels with its request as a descriptor
//! (`SCM_RIGHTS`), and library reads answer with a header and the raw bytes.
//!
//! Requests are answered in order, one at a time (the daemon holds the
//! helper's lock for the round trip), except `Close`, which is not answered.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage};
use serde::{Deserialize, Serialize};
use stoker_data::source::hdf5::{FieldFacts, Location, ProbeError};

/// The largest control frame either side accepts (facts of a file's fields,
/// chunk coordinates); library data travels outside frames, sized by the
/// request.
pub(crate) const MAX_FRAME: usize = 16 << 20;

/// What the daemon asks a helper.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request {
    /// Open the file passed with this frame and probe the datasets at these paths.
    Open { h5paths: Vec<String>, fast_path: bool },
    /// Where the chunk of `field` starting at `chunk` is stored.
    Locate { handle: u64, field: u32, chunk: Vec<u64> },
    /// `H5Dread` of the block (`start`, `count`): exactly `bytes` bytes.
    Read { handle: u64, field: u32, start: Vec<u64>, count: Vec<u64>, bytes: u64 },
    /// Forget the file (not answered).
    Close { handle: u64 },
}

/// What a helper answers.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Reply {
    /// The file is open as `handle`; its fields' facts.
    Opened { handle: u64, facts: Vec<FieldFacts> },
    /// The file could not be opened or probed.
    OpenFailed(ProbeError),
    /// A chunk's location.
    Located(Location),
    /// The block's bytes follow, exactly as many as asked.
    Data,
    /// The request failed (the message).
    Failed(String),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME>()
}

/// Writes `msg` as one frame, with `fd` attached when given.
pub(crate) fn send<T: Serialize>(sock: &UnixStream, msg: &T, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    let body = bincode::serde::encode_to_vec(msg, config()).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    let mut at = 0;
    if let Some(fd) = fd {
        let fds = [fd];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        at = rustix::net::sendmsg(sock, &[IoSlice::new(&frame)], &mut control, rustix::net::SendFlags::NOSIGNAL)?;
    }
    (&*sock).write_all(&frame[at..])
}

/// Reads one frame; `None` at a clean end of stream. Descriptors that
/// arrive with it are appended to `fds` (at most 4 per read are kept).
pub(crate) fn recv<T: for<'de> Deserialize<'de>>(
    sock: &UnixStream,
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    if !recv_exact(sock, &mut len, fds, true)? {
        return Ok(None);
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    recv_exact(sock, &mut body, fds, false)?;
    let (msg, _) = bincode::serde::decode_from_slice(&body, config())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(Some(msg))
}

/// Fills `buf`, collecting passed descriptors; `false` when the stream
/// ended before the first byte and `eof_ok`.
fn recv_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>, eof_ok: bool) -> std::io::Result<bool> {
    let mut at = 0;
    while at < buf.len() {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf[at..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(passed) = msg {
                for fd in passed {
                    if fds.len() < 4 {
                        fds.push(fd);
                    }
                }
            }
        }
        if got.bytes == 0 {
            if at == 0 && eof_ok {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        at += got.bytes;
    }
    Ok(true)
}

/// Reads exactly `buf.len()` raw bytes (library data after [`Reply::Data`]).
pub(crate) fn recv_data(sock: &UnixStream, buf: &mut [u8]) -> std::io::Result<()> {
    (&*sock).read_exact(buf)
}

/// Writes raw bytes (library data after [`Reply::Data`]).
pub(crate) fn send_data(sock: &UnixStream, buf: &[u8]) -> std::io::Result<()> {
    (&*sock).write_all(buf)
}

/// A descriptor as passed (for [`send`]).
pub(crate) fn borrowed(file: &impl AsFd) -> BorrowedFd<'_> {
    file.as_fd()
}
