//! A stand-in for the metadata service, for the tests and the fuzz target: it records every
//! request it gets, byte for byte, and answers `200 i-0123456789abcdef0` (or what it is told
//! to). Over TCP on loopback, or in memory as an [`Upstream`].
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{Upstream, UpstreamIo, forward::Connecting};

/// What the stand-in answers unless told otherwise.
pub(crate) const BODY: &str = "i-0123456789abcdef0";

/// Longest request head recorded (a request to the stand-in never has a body).
const MAX_HEAD: usize = 64 * 1024;

/// The requests the stand-in got, and what it answers.
#[derive(Clone)]
pub(crate) struct Recorder {
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
    answer: Arc<Vec<u8>>,
}

impl Default for Recorder {
    fn default() -> Self {
        let answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
            BODY.len()
        );
        Recorder::answering(answer.into_bytes())
    }
}

impl Recorder {
    /// A stand-in that answers `answer`, raw.
    pub(crate) fn answering(answer: Vec<u8>) -> Recorder {
        Recorder { seen: Arc::default(), answer: Arc::new(answer) }
    }

    /// Every request head received so far, raw.
    pub(crate) fn requests(&self) -> Vec<Vec<u8>> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Read one request head from `io` (to the blank line, end of stream or [`MAX_HEAD`]),
    /// record it and answer.
    pub(crate) async fn answer<IO: AsyncRead + AsyncWrite + Unpin>(&self, mut io: IO) {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        if head.is_empty() {
            return;
        }
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(head);
        }
        let _ = io.write_all(&self.answer).await;
        let _ = io.shutdown().await;
    }

    /// Listen on loopback and answer every connection; the address it listens on.
    #[cfg(test)]
    pub(crate) async fn listen(&self) -> SocketAddr {
        let me = self.clone();
        on_loopback(move |stream| {
            let me = me.clone();
            async move { me.answer(stream).await }
        })
        .await
    }
}

/// Listen on loopback and hand every connection to `serve`, a task each; the address.
#[cfg(test)]
async fn on_loopback<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the stand-in");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream));
        }
    });
    addr
}

/// A metadata service that keeps its connections, for the tests of the pool: it counts the
/// connections it accepts, and answers the `n`th request (from 0) on its `c`th connection with
/// `script(c, n)`, raw; `None`: it closes that connection instead of answering.
#[cfg(test)]
#[derive(Clone)]
pub(crate) struct KeepAlive {
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    script: Arc<dyn Fn(usize, usize) -> Option<Vec<u8>> + Send + Sync>,
    /// How long it takes to answer each request.
    delay: std::time::Duration,
}

#[cfg(test)]
impl KeepAlive {
    pub(crate) fn new(
        script: impl Fn(usize, usize) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        KeepAlive { accepted: Arc::default(), script: Arc::new(script), delay: Default::default() }
    }

    /// The same, taking `delay` to answer each request.
    pub(crate) fn slow(mut self, delay: std::time::Duration) -> Self {
        self.delay = delay;
        self
    }

    /// `200` with `body` and its length: a response a connection is kept after.
    pub(crate) fn ok(body: &str) -> Vec<u8> {
        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
    }

    /// Connections accepted so far.
    pub(crate) fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Listen on loopback and serve every connection by the script; the address.
    pub(crate) async fn listen(&self) -> SocketAddr {
        let me = self.clone();
        on_loopback(move |stream| {
            let me = me.clone();
            async move { me.serve(stream).await }
        })
        .await
    }

    /// Serve one connection by the script, request after request.
    async fn serve(&self, mut stream: tokio::net::TcpStream) {
        let c = self.accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut buf = Vec::new();
        for n in 0.. {
            // One request head (none of the proxy's has a body).
            let end = loop {
                if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break at + 4;
                }
                let mut chunk = [0u8; 4096];
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                }
            };
            buf.drain(..end);
            tokio::time::sleep(self.delay).await;
            let Some(answer) = (self.script)(c, n) else { return };
            if stream.write_all(&answer).await.is_err() {
                return;
            }
        }
    }
}

/// The stand-in as an [`Upstream`], in memory: whatever the destination, a pipe to it.
pub(crate) struct InMemory(pub(crate) Recorder);

impl Upstream for InMemory {
    fn connect(&self, _dst: SocketAddr) -> Connecting {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let recorder = self.0.clone();
        tokio::spawn(async move { recorder.answer(far).await });
        Box::pin(async move { Ok(Box::new(near) as Box<dyn UpstreamIo>) })
    }
}

/// A recorded request's method and target, as its request line says.
pub(crate) fn request_line(raw: &[u8]) -> Option<(String, String)> {
    let line = raw.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (method, target) = (parts.next()?, parts.next()?);
    Some((method.to_owned(), target.to_owned()))
}

/// A recorded request's header lines, as `(lowercase name, value)`.
pub(crate) fn headers(raw: &[u8]) -> Vec<(String, String)> {
    let text = String::from_utf8_lossy(raw);
    text.split("\r\n")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect()
}
