//! A served request, sent on to the metadata service: one HTTP/1.1 request without a body to
//! the address the workload asked for, and the response passed back within the size and time
//! limits.
//!
//! Connections are kept for the next request where the service keeps them: hyper-util's pool
//! (its legacy `Client`), at most [`Limits::idle_per_upstream`] idle per address, each for at
//! most [`Limits::upstream_idle`]. The pool opens its connections through [`Upstream`], from the
//! agent's own process, so they come from the agent's cgroup, which the kernel programs let
//! through. A connection goes back to the pool only after a response the proxy judged whole: a
//! declared length within the limit, read to its end, HTTP/1.1, no `Connection: close`, not an
//! answer to `HEAD`. Anything else (an error, a timeout, no length, an informational status, a
//! body longer or shorter than it said) leaves it poisoned, and it is closed.
use std::{
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::atomic::{AtomicBool, Ordering},
    task::{Context, Poll},
};

use http::{HeaderMap, Method, Request, Response, Uri, Version, header, uri::PathAndQuery};
use http_body_util::{BodyExt, Empty, Full, LengthLimitError, Limited, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use hyper_util::{
    client::legacy::{
        Client,
        connect::{CaptureConnection, Connected, Connection, capture_connection},
    },
    rt::{TokioExecutor, TokioIo, TokioTimer},
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    time::timeout,
};

use super::{Limits, MIN_BUF, ProxyError, headers};

/// A response body as the proxy sends it: one of its own, or the metadata service's.
pub(crate) type Body = BoxBody<Bytes, BoxError>;
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connection to the metadata service.
pub(crate) trait UpstreamIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> UpstreamIo for T {}

/// A connection being opened.
pub(crate) type Connecting = Pin<Box<dyn Future<Output = io::Result<Box<dyn UpstreamIo>>> + Send>>;

/// How the proxy reaches a metadata service: over TCP ([`TcpUpstream`]), or in memory in the
/// fuzz target.
pub(crate) trait Upstream: Send + Sync + 'static {
    fn connect(&self, dst: SocketAddr) -> Connecting;
}

/// The production [`Upstream`]: a TCP connection from the agent (whose cgroup the kernel does
/// not redirect) to the destination.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TcpUpstream;

impl Upstream for TcpUpstream {
    fn connect(&self, dst: SocketAddr) -> Connecting {
        Box::pin(async move {
            let stream = TcpStream::connect(dst).await?;
            stream.set_nodelay(true)?;
            Ok(Box::new(stream) as Box<dyn UpstreamIo>)
        })
    }
}

/// A body the proxy writes itself.
pub(crate) fn text(body: String) -> Body {
    Full::new(Bytes::from(body)).map_err(|never| match never {}).boxed()
}

/// The way to the metadata services: the pool of connections, shared by every request.
pub(crate) struct Forwarder {
    client: Client<Connector, Empty<Bytes>>,
}

impl Forwarder {
    /// Connections opened through `upstream`, pooled within `limits`.
    pub(crate) fn new(upstream: std::sync::Arc<dyn Upstream>, limits: &Limits) -> Forwarder {
        let connector = Connector { upstream, connect: limits.connect };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(limits.upstream_idle)
            .pool_max_idle_per_host(limits.idle_per_upstream)
            .http1_max_buf_size(limits.max_buf.max(MIN_BUF))
            // `Host` is the proxy's own (headers::upstream), never the pool's.
            .set_host(false)
            .build(connector);
        Forwarder { client }
    }

    /// Send `method target` with the client's `headers` (rewritten by [`headers::upstream`])
    /// to `dst` and return the response to pass back, read whole (at most `max_response`
    /// bytes), so that one too long is a 502 rather than a response cut short.
    pub(crate) async fn forward(
        &self,
        limits: &Limits,
        dst: SocketAddr,
        method: &Method,
        target: &PathAndQuery,
        client: &HeaderMap,
    ) -> Result<Response<Body>, ProxyError> {
        let mut req = Request::new(Empty::<Bytes>::new());
        *req.method_mut() = method.clone();
        *req.uri_mut() = pool_uri(dst, target)?;
        *req.headers_mut() = headers::upstream(client, dst);
        let doubt = Doubt::new(capture_connection(&mut req));
        let head = method == Method::HEAD;
        let limit = limits.max_response;
        let exchange = async {
            let resp = self.client.request(req).await.map_err(|e| failed(dst, limits, e))?;
            let (parts, body) = resp.into_parts();
            if parts.status.is_informational() {
                return Err(ProxyError::UpstreamStatus { dst, status: parts.status });
            }
            let declared = declared_length(&parts.headers);
            // Judged on the head, before the body ends and the pool could hand the connection
            // to another request.
            if head || !keeps_connection(parts.version, &parts.headers, declared) {
                doubt.poison();
            }
            let body = match declared {
                _ if head => Empty::new().map_err(|never| match never {}).boxed(),
                Some(n) if n > limit => return Err(ProxyError::TooLarge { dst, limit }),
                _ => read_whole(body, dst, limit).await?,
            };
            doubt.settle();
            let mut out = Response::new(body);
            *out.status_mut() = parts.status;
            *out.headers_mut() = headers::downstream(&parts.headers);
            Ok(out)
        };
        timeout(limits.upstream, exchange)
            .await
            .map_err(|_| ProxyError::UpstreamTimeout { dst, after: limits.upstream })?
    }
}

/// The request's URI as the pool keys it: `http://<dst>` (the address the workload asked
/// for, never a name) and the target exactly as judged; the pool sends it in origin form.
fn pool_uri(dst: SocketAddr, target: &PathAndQuery) -> Result<Uri, ProxyError> {
    // SocketAddr's Display brackets IPv6 and leaves out a scope an authority has no room for.
    let authority = match dst {
        SocketAddr::V4(a) => a.to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    };
    Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(target.clone())
        .build()
        .map_err(|e| ProxyError::Connect {
            dst,
            source: io::Error::new(io::ErrorKind::InvalidInput, e),
        })
}

/// Whether a response leaves its connection fit for the next request, as its head says: a
/// declared length (no chunks, nothing read to the end of the connection), HTTP/1.1, and no
/// `Connection: close`.
fn keeps_connection(version: Version, headers: &HeaderMap, declared: Option<u64>) -> bool {
    // A value that is not text is as good as `close`: in doubt, the connection goes.
    let close = headers.get_all(header::CONNECTION).iter().any(|v| {
        !v.to_str().is_ok_and(|v| !v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
    });
    declared.is_some()
        && version == Version::HTTP_11
        && !close
        && !headers.contains_key(header::TRANSFER_ENCODING)
}

/// A connection's fitness for the pool, poisoned unless the exchange settles: an error, a
/// timeout or a refusal on the way out of [`Forwarder::forward`] closes it.
struct Doubt {
    captured: CaptureConnection,
    settled: AtomicBool,
}

impl Doubt {
    fn new(captured: CaptureConnection) -> Doubt {
        Doubt { captured, settled: AtomicBool::new(false) }
    }

    /// Never reuse the connection.
    fn poison(&self) {
        if let Some(c) = self.captured.connection_metadata().as_ref() {
            c.poison();
        }
    }

    /// The response was judged whole: the connection is as its head left it.
    fn settle(&self) {
        self.settled.store(true, Ordering::Relaxed);
    }
}

impl Drop for Doubt {
    fn drop(&mut self) {
        if !self.settled.load(Ordering::Relaxed) {
            self.poison();
        }
    }
}

/// A pool error as the proxy reports it: a connect that timed out is a timeout, one that
/// failed says why; anything else is the exchange's.
fn failed(dst: SocketAddr, limits: &Limits, e: hyper_util::client::legacy::Error) -> ProxyError {
    if e.is_connect() {
        let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<io::Error>());
        return match io {
            Some(io) if io.kind() == io::ErrorKind::TimedOut => {
                ProxyError::UpstreamTimeout { dst, after: limits.connect }
            }
            Some(io) => {
                ProxyError::Connect { dst, source: io::Error::new(io.kind(), io.to_string()) }
            }
            None => ProxyError::Exchange { dst, source: e },
        };
    }
    ProxyError::Exchange { dst, source: e }
}

/// The `Content-Length` a response declares (hyper's client has rejected conflicting ones).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// A body read whole: at most `limit` bytes. hyper ends one with a declared length there, and
/// fails one that ends before it.
async fn read_whole(body: Incoming, dst: SocketAddr, limit: u64) -> Result<Body, ProxyError> {
    let limited = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX));
    match limited.collect().await {
        Ok(collected) => {
            Ok(Full::new(collected.to_bytes()).map_err(|never| match never {}).boxed())
        }
        Err(e) if e.is::<LengthLimitError>() => Err(ProxyError::TooLarge { dst, limit }),
        Err(e) => match e.downcast::<hyper::Error>() {
            Ok(source) => Err(ProxyError::Upstream { dst, source: *source }),
            Err(_) => Err(ProxyError::TooLarge { dst, limit }),
        },
    }
}

/// Opens the pool's connections through the proxy's [`Upstream`], each within
/// [`Limits::connect`].
#[derive(Clone)]
struct Connector {
    upstream: std::sync::Arc<dyn Upstream>,
    connect: std::time::Duration,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Conn>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Conn>>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // The URI is [`pool_uri`]'s: its authority is the address itself.
        let dst = uri.authority().and_then(|a| a.as_str().parse::<SocketAddr>().ok());
        let (upstream, after) = (self.upstream.clone(), self.connect);
        Box::pin(async move {
            let dst = dst.ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("not an address: {uri}"))
            })?;
            let io = timeout(after, upstream.connect(dst)).await.map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, format!("no connection within {after:?}"))
            })??;
            Ok(TokioIo::new(Conn(io)))
        })
    }
}

/// A pooled connection to the metadata service.
struct Conn(Box<dyn UpstreamIo>);

impl Connection for Conn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}
