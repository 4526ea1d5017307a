//! The small HTTP/1.1 responder that serves the metrics on `GET /metrics`
//! (`[metrics] listen`): one request per connection, bounded in connections,
//! request size and time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::exposition::CONTENT_TYPE;

/// Scrape connections served at once; more are closed unanswered.
const MAX_HTTP_CONNECTIONS: usize = 16;
/// Largest request head (request line and headers) read.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Time a scraper gets to send its request, and again to take the response.
const HTTP_DEADLINE: Duration = Duration::from_secs(5);

/// Binds the metrics listener (`[metrics] listen`).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen for metrics on {addr} ([metrics] listen)"))
}

/// Serves `GET /metrics` on `listener`, one response per connection, with
/// the text `render` returns. Runs until the runtime stops.
pub async fn serve(listener: TcpListener, render: impl Fn() -> String + Send + Sync + 'static) {
    let render = Arc::new(render);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    let waiting = Arc::new(Waiting::default());
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving metrics on http://{addr}/metrics");
    }
    let mut last_warning: Option<Instant> = None;
    let mut next_id = 0u64;
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    last_warning = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // Full: the connection that has waited longest without sending
            // its request makes room (idle connections cannot lock the
            // scraper out); if every one is being answered, this one goes.
            Err(_) => {
                if !waiting.evict_oldest() {
                    tracing::debug!(%peer, "metrics: too many connections; closing");
                    continue;
                }
                match tokio::time::timeout(Duration::from_millis(200), permits.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => permit,
                    _ => continue,
                }
            }
        };
        next_id += 1;
        let (id, cancel) = (next_id, waiting.register(next_id));
        let (render, waiting) = (render.clone(), waiting.clone());
        tokio::spawn(async move {
            respond(sock, &*render, cancel, || waiting.forget(id)).await;
            drop(permit);
        });
    }
}

/// Connections that have not sent their request yet, oldest first, each with
/// the sender that cancels it.
#[derive(Default)]
struct Waiting(std::sync::Mutex<std::collections::VecDeque<(u64, tokio::sync::oneshot::Sender<()>)>>);

impl Waiting {
    fn register(&self, id: u64) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back((id, tx));
        rx
    }

    fn forget(&self, id: u64) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|(i, _)| *i != id);
    }

    /// Cancels the connection that has waited longest; false if none waits.
    fn evict_oldest(&self) -> bool {
        let oldest = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front();
        oldest.is_some_and(|(_, cancel)| cancel.send(()).is_ok())
    }
}

struct Response {
    status: &'static str,
    content_type: &'static str,
    body: String,
    head_only: bool,
    extra: &'static str,
}

impl Response {
    fn text(status: &'static str, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
            head_only: false,
            extra: "",
        }
    }
}

/// Reads one request head, answers it, and closes the connection; `cancel`
/// drops it while it waits for its request (another needs the slot);
/// `received` is called once the head is in (or the wait is over).
async fn respond(
    mut sock: TcpStream,
    render: &(dyn Fn() -> String + Send + Sync),
    cancel: tokio::sync::oneshot::Receiver<()>,
    received: impl FnOnce(),
) {
    let head = tokio::select! {
        head = tokio::time::timeout(HTTP_DEADLINE, read_head(&mut sock)) => head,
        _ = cancel => return,
    };
    received();
    let response = match head {
        Err(_) => Response::text("408 Request Timeout", "request not received in time"),
        Ok(Err(response)) => response,
        Ok(Ok(head)) => route(&head, render),
    };
    let mut out = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
        response.status,
        response.content_type,
        response.body.len(),
        response.extra
    );
    if !response.head_only {
        out.push_str(&response.body);
    }
    let _ = tokio::time::timeout(HTTP_DEADLINE, async {
        sock.write_all(out.as_bytes()).await?;
        sock.shutdown().await?;
        // Close only once the peer has had the response: unread request
        // bytes (an oversized head) would otherwise turn the close into a
        // reset that can destroy the response in flight.
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            if sock.read(&mut sink).await? == 0 {
                break;
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}

/// The request head (up to the blank line), or the error to answer with.
async fn read_head(sock: &mut TcpStream) -> Result<String, Response> {
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    let mut len = 0;
    loop {
        let Some(free) = buf.get_mut(len..).filter(|b| !b.is_empty()) else {
            return Err(Response::text("431 Request Header Fields Too Large", "request head too large"));
        };
        let n = match sock.read(free).await {
            Ok(0) | Err(_) => return Err(Response::text("400 Bad Request", "incomplete request")),
            Ok(n) => n,
        };
        len += n;
        let head = buf.get(..len).unwrap_or_default();
        if let Some(end) = find(head, b"\r\n\r\n").or_else(|| find(head, b"\n\n")) {
            let head = head.get(..end).unwrap_or_default();
            return String::from_utf8(head.to_vec())
                .map_err(|_| Response::text("400 Bad Request", "request head is not UTF-8"));
        }
    }
}

/// Where `needle` first occurs in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Answers a request head: `GET`/`HEAD /metrics` get the metrics.
fn route(head: &str, render: &(dyn Fn() -> String + Send + Sync)) -> Response {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Response::text("400 Bad Request", "malformed request line");
    };
    if !version.starts_with("HTTP/1.") {
        return Response::text("505 HTTP Version Not Supported", "HTTP/1.x only");
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Response::text("404 Not Found", "not found; metrics are at /metrics");
    }
    match method {
        "GET" | "HEAD" => Response {
            status: "200 OK",
            content_type: CONTENT_TYPE,
            body: render(),
            head_only: method == "HEAD",
            extra: "",
        },
        _ => Response { extra: "Allow: GET, HEAD\r\n", ..Response::text("405 Method Not Allowed", "use GET") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let render = || "x 1\n# EOF\n".to_string();
        assert_eq!(route("GET /metrics HTTP/1.1\r\nHost: a", &render).status, "200 OK");
        assert_eq!(route("GET /metrics?x=1 HTTP/1.0", &render).status, "200 OK");
        assert!(route("HEAD /metrics HTTP/1.1", &render).head_only);
        assert_eq!(route("POST /metrics HTTP/1.1", &render).status, "405 Method Not Allowed");
        assert_eq!(route("GET / HTTP/1.1", &render).status, "404 Not Found");
        assert_eq!(route("GET /metrics", &render).status, "400 Bad Request");
        assert_eq!(route("\u{0}\u{1}garbage", &render).status, "400 Bad Request");
        assert_eq!(route("GET /metrics SPDY/3", &render).status, "505 HTTP Version Not Supported");
    }
}
