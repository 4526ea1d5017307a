//! One socket connection: framing, fd reception, request/reply pairing.
//!
//! Replies come back in request order. A request whose wait was interrupted
//! still gets its reply later; the connection remembers how many replies it
//! owes and discards them before the next request. (Batches do not travel
//! here: they are taken from the stream's control page.)

use std::collections::VecDeque;
use std::io::Write;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use rustix::io::Errno;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use stoker_proto::{MAX_FRAME_BYTES, Request, Response};

use crate::{ClientError, INTERRUPT_POLL, Result};

#[derive(Debug)]
pub(crate) struct Conn {
    owner_pid: u32,
    reader: Mutex<Reader>,
    writer: Mutex<UnixStream>,
}

#[derive(Debug)]
struct Reader {
    sock: UnixStream,
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    /// Replies still owed to requests whose wait was interrupted.
    owed: usize,
}

impl Conn {
    pub(crate) fn new(sock: UnixStream) -> Result<Conn> {
        sock.set_read_timeout(Some(INTERRUPT_POLL))?;
        let writer = sock.try_clone()?;
        Ok(Conn {
            owner_pid: std::process::id(),
            reader: Mutex::new(Reader { sock, buf: Vec::new(), fds: VecDeque::new(), owed: 0 }),
            writer: Mutex::new(writer),
        })
    }

    pub(crate) fn check_pid(&self) -> Result<()> {
        let current = std::process::id();
        if current != self.owner_pid {
            return Err(ClientError::Forked { owner: self.owner_pid, current });
        }
        Ok(())
    }

    /// Whether the daemon closed the connection (checked without blocking
    /// and without consuming anything; `false` while another thread reads).
    pub(crate) fn peer_closed(&self) -> bool {
        let Ok(reader) = self.reader.try_lock() else { return false };
        let mut byte = [0u8; 1];
        matches!(
            rustix::net::recv(&reader.sock, &mut byte, rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT),
            Ok((0, _)) | Err(Errno::CONNRESET | Errno::PIPE)
        )
    }

    /// Sends a message that gets no reply.
    pub(crate) fn send_oneway(&self, req: &Request) -> Result<()> {
        self.check_pid()?;
        self.send(req)
    }

    fn send(&self, req: &Request) -> Result<()> {
        let frame = stoker_proto::encode_frame(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&frame).map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                ClientError::Disconnected(e.to_string())
            }
            _ => ClientError::Io(e),
        })
    }

    /// Sends `req` and waits for its reply.
    pub(crate) fn request(&self, req: &Request, interrupted: &mut dyn FnMut() -> bool) -> Result<Response> {
        Ok(self.request_inner(req, interrupted)?.0)
    }

    /// Sends `req` and waits for its reply and the fds that travel with it.
    pub(crate) fn request_with_fds(
        &self,
        req: &Request,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<(Response, Vec<OwnedFd>)> {
        self.request_inner(req, interrupted)
    }

    fn request_inner(&self, req: &Request, interrupted: &mut dyn FnMut() -> bool) -> Result<(Response, Vec<OwnedFd>)> {
        self.check_pid()?;
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        while reader.owed > 0 {
            // A reply to a request whose wait was cut short: nothing to do
            // with it (a `SetEpoch` is sent again by its stream).
            reader.read_frame(interrupted)?;
            reader.owed -= 1;
            reader.fds.clear();
        }
        self.send(req)?;
        match reader.read_frame(interrupted) {
            Ok(resp) => {
                let fds = reader.fds.drain(..).collect();
                Ok((resp, fds))
            }
            Err(ClientError::Interrupted) => {
                reader.owed += 1;
                Err(ClientError::Interrupted)
            }
            Err(e) => Err(e),
        }
    }
}

impl Reader {
    fn read_frame(&mut self, interrupted: &mut dyn FnMut() -> bool) -> Result<Response> {
        loop {
            if self.buf.len() >= 4 {
                let header: [u8; 4] = self.buf[..4].try_into().expect("four bytes");
                let len = stoker_proto::frame_len(header, MAX_FRAME_BYTES)
                    .map_err(|e| ClientError::Protocol(e.to_string()))?;
                if self.buf.len() >= 4 + len {
                    let resp = stoker_proto::decode_body(&self.buf[4..4 + len])
                        .map_err(|e| ClientError::Protocol(e.to_string()));
                    self.buf.drain(..4 + len);
                    return resp;
                }
            }
            match self.recv() {
                Ok(0) => return Err(ClientError::Disconnected("it closed the connection".into())),
                Ok(_) => {}
                Err(Errno::AGAIN | Errno::INTR) => {
                    if interrupted() {
                        return Err(ClientError::Interrupted);
                    }
                }
                Err(e @ (Errno::CONNRESET | Errno::PIPE)) => return Err(ClientError::Disconnected(e.to_string())),
                Err(e) => return Err(ClientError::Io(e.into())),
            }
        }
    }

    /// One `recvmsg` into the buffer, collecting any passed fds.
    fn recv(&mut self) -> rustix::io::Result<usize> {
        let mut chunk = [0u8; 64 * 1024];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &self.sock,
            &mut [std::io::IoSliceMut::new(&mut chunk)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                self.fds.extend(fds);
            }
        }
        self.buf.extend_from_slice(&chunk[..got.bytes]);
        Ok(got.bytes)
    }
}
