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

/// The client's side of the socket against a test thread playing the
/// daemon on the other end of a `UnixStream::pair()`: real frames, real fds.
#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{IoSlice, Read};
    use std::os::fd::AsFd;
    use std::thread::JoinHandle;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use stoker_proto::{ErrorKind, FRAME_HEADER_BYTES, PROTOCOL_VERSION};

    use super::*;
    use crate::Client;

    /// An interrupt check that gives up after about five seconds of polls, so
    /// that a client waiting for bytes that never come fails the test instead
    /// of hanging it.
    fn patience() -> impl FnMut() -> bool {
        let mut polls = 0;
        move || {
            polls += 1;
            polls > 100
        }
    }

    /// Reads one request frame, as the daemon does.
    fn read_request(sock: &mut UnixStream) -> Request {
        let mut header = [0u8; FRAME_HEADER_BYTES];
        sock.read_exact(&mut header).unwrap();
        let mut body = vec![0u8; stoker_proto::frame_len(header, MAX_FRAME_BYTES).unwrap()];
        sock.read_exact(&mut body).unwrap();
        stoker_proto::decode_body(&body).unwrap()
    }

    fn frame(resp: &Response) -> Vec<u8> {
        stoker_proto::encode_frame(resp).unwrap()
    }

    /// A connection whose daemon end runs `daemon` in a thread; the thread
    /// gives its socket back, so it stays open until the test joins it.
    fn with_daemon(daemon: impl FnOnce(&mut UnixStream) + Send + 'static) -> (Conn, JoinHandle<UnixStream>) {
        let (client, mut sock) = UnixStream::pair().unwrap();
        let thread = std::thread::spawn(move || {
            daemon(&mut sock);
            sock
        });
        (Conn::new(client).unwrap(), thread)
    }

    #[test]
    fn a_reply_and_its_fds_arrive_with_it() {
        let (conn, daemon) = with_daemon(|sock| {
            assert!(matches!(read_request(sock), Request::Status));
            let fd = rustix::fs::memfd_create("conn-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::fs::ftruncate(&fd, 4096).unwrap();
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [fd.as_fd()];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            let bytes = frame(&Response::Done);
            let n = rustix::net::sendmsg(&*sock, &[IoSlice::new(&bytes)], &mut control, SendFlags::empty()).unwrap();
            assert_eq!(n, bytes.len());
        });
        let (resp, fds) = conn.request_with_fds(&Request::Status, &mut patience()).unwrap();
        assert!(matches!(resp, Response::Done), "{resp:?}");
        assert_eq!(fds.len(), 1);
        assert_eq!(File::from(fds.into_iter().next().unwrap()).metadata().unwrap().len(), 4096);
        daemon.join().unwrap();
    }

    #[test]
    fn an_oversized_length_prefix_is_refused_before_its_body() {
        for len in [MAX_FRAME_BYTES as u32 + 1, u32::MAX] {
            // Only the prefix comes, and the daemon stays: a client that waited
            // for (or made room for) the body would hang or allocate.
            let (conn, daemon) = with_daemon(move |sock| {
                read_request(sock);
                sock.write_all(&len.to_le_bytes()).unwrap();
            });
            let err = conn.request(&Request::Status, &mut patience()).unwrap_err();
            assert!(
                matches!(&err, ClientError::Protocol(m) if m.contains(&format!("frame of {len} bytes exceeds the limit"))),
                "{err:?}"
            );
            let reader = conn.reader.lock().unwrap();
            assert_eq!(reader.buf.len(), FRAME_HEADER_BYTES, "nothing past the prefix was read");
            assert!(reader.buf.capacity() < 64 * 1024, "no room made for the body: {}", reader.buf.capacity());
            drop(reader);
            daemon.join().unwrap();
        }
    }

    #[test]
    fn a_frame_of_the_limit_is_awaited_and_a_daemon_leaving_mid_body_is_a_lost_connection() {
        let (conn, daemon) = with_daemon(|sock| {
            read_request(sock);
            sock.write_all(&(MAX_FRAME_BYTES as u32).to_le_bytes()).unwrap();
            sock.write_all(&[0u8; 100]).unwrap();
            sock.shutdown(std::net::Shutdown::Both).unwrap();
        });
        let err = conn.request(&Request::Status, &mut patience()).unwrap_err();
        assert!(matches!(err, ClientError::Disconnected(_)), "{err:?}");
        daemon.join().unwrap();
    }

    #[test]
    fn a_truncated_frame_is_an_error() {
        let whole = frame(&Response::Hello { version: PROTOCOL_VERSION, server: "stoker test".into() });
        // Cut inside the length prefix, and inside the body, then the daemon leaves.
        for cut in [2, FRAME_HEADER_BYTES + 3, whole.len() - 1] {
            let part = whole[..cut].to_vec();
            let (conn, daemon) = with_daemon(move |sock| {
                read_request(sock);
                sock.write_all(&part).unwrap();
                sock.shutdown(std::net::Shutdown::Both).unwrap();
            });
            let err = conn.request(&Request::Status, &mut patience()).unwrap_err();
            assert!(matches!(err, ClientError::Disconnected(_)), "cut at {cut}: {err:?}");
            daemon.join().unwrap();
        }
        // A body cut short whose prefix says so: it does not decode.
        let mut short = whole[..whole.len() - 1].to_vec();
        short[..FRAME_HEADER_BYTES].copy_from_slice(&((whole.len() - 1 - FRAME_HEADER_BYTES) as u32).to_le_bytes());
        let (conn, daemon) = with_daemon(move |sock| {
            read_request(sock);
            sock.write_all(&short).unwrap();
        });
        let err = conn.request(&Request::Status, &mut patience()).unwrap_err();
        assert!(matches!(&err, ClientError::Protocol(m) if m.contains("malformed frame")), "{err:?}");
        daemon.join().unwrap();
    }

    #[test]
    fn a_reply_owed_to_an_interrupted_request_is_not_taken_for_the_next() {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (conn, daemon) = with_daemon(move |sock| {
            read_request(sock);
            // Answer the first request only once the client gave up on it.
            wait.recv().unwrap();
            sock.write_all(&frame(&Response::Done)).unwrap();
            assert!(matches!(read_request(sock), Request::Datasets));
            sock.write_all(&frame(&Response::Datasets(vec![]))).unwrap();
        });
        let err = conn.request(&Request::Status, &mut || true).unwrap_err();
        assert!(matches!(err, ClientError::Interrupted), "{err:?}");
        go.send(()).unwrap();
        let resp = conn.request(&Request::Datasets, &mut patience()).unwrap();
        assert!(matches!(resp, Response::Datasets(ref d) if d.is_empty()), "{resp:?}");
        daemon.join().unwrap();
    }

    /// Plays a daemon that answers `Hello` with `reply`, checking the client's `Hello`.
    fn handshake_against(reply: Response) -> Result<Client> {
        let (client, mut sock) = UnixStream::pair().unwrap();
        let daemon = std::thread::spawn(move || {
            let hello = read_request(&mut sock);
            assert!(matches!(hello, Request::Hello { version: PROTOCOL_VERSION, .. }), "{hello:?}");
            sock.write_all(&frame(&reply)).unwrap();
            sock
        });
        let got = Client::handshake(client, &mut patience());
        daemon.join().unwrap();
        got
    }

    #[test]
    fn a_daemon_of_the_same_protocol_is_greeted() {
        handshake_against(Response::Hello { version: PROTOCOL_VERSION, server: "stoker test".into() }).unwrap();
    }

    #[test]
    fn a_protocol_version_mismatch_is_a_typed_error() {
        // The daemon refuses this client's version (what stoker's daemon does) ...
        let refused = Response::Error { kind: ErrorKind::Version, message: "client speaks protocol 1".into() };
        let err = handshake_against(refused).unwrap_err();
        assert!(
            matches!(&err, ClientError::Daemon { kind: ErrorKind::Version, message } if message.contains("protocol 1"))
        );
        // ... or greets it with another version: the client refuses it.
        let other = PROTOCOL_VERSION + 1;
        let err = handshake_against(Response::Hello { version: other, server: "stoker 9".into() }).unwrap_err();
        let ClientError::Daemon { kind: ErrorKind::Version, message } = &err else {
            panic!("a version error: {err:?}")
        };
        assert!(message.contains(&format!("protocol {other}")) && message.contains("stoker 9"), "{message}");
        assert!(message.contains(&format!("this client speaks {PROTOCOL_VERSION}")), "{message}");
        // Anything else in reply to Hello is a protocol error.
        let err = handshake_against(Response::Done).unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err:?}");
    }
}
