//! A served request, sent on to the metadata service: a new connection from the agent to the
//! address the workload asked for, one HTTP/1.1 request without a body, and the response
//! passed back within the size and time limits.
use std::{future::Future, io, net::SocketAddr, pin::Pin};

use http::{HeaderMap, Method, Request, Response, Uri, header};
use http_body_util::{BodyExt, Empty, Full, LengthLimitError, Limited, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
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

/// Send `method target` with the client's `headers` (rewritten by [`headers::upstream`]) to
/// `dst` and return the response to pass back. A response body that declares its length is
/// streamed; one that does not is read first (at most `max_response` bytes), so that one too
/// long is a 502 rather than a response cut short.
pub(crate) async fn forward(
    upstream: &dyn Upstream,
    limits: &Limits,
    dst: SocketAddr,
    method: &Method,
    target: Uri,
    client: &HeaderMap,
) -> Result<Response<Body>, ProxyError> {
    let mut req = Request::new(Empty::<Bytes>::new());
    *req.method_mut() = method.clone();
    *req.uri_mut() = target;
    *req.headers_mut() = headers::upstream(client, dst);
    let head = method == Method::HEAD;
    let limit = limits.max_response;
    let exchange = async {
        let io = timeout(limits.connect, upstream.connect(dst))
            .await
            .map_err(|_| ProxyError::UpstreamTimeout { dst, after: limits.connect })?
            .map_err(|source| ProxyError::Connect { dst, source })?;
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(limits.max_buf.max(MIN_BUF))
            .handshake(TokioIo::new(io))
            .await
            .map_err(|source| ProxyError::Upstream { dst, source })?;
        // The connection is driven apart from the response, whose body the client may still
        // be reading after this returns; it ends with the body, or after the connection limit.
        let lifetime = limits.connection;
        tokio::spawn(async move {
            if let Ok(Err(e)) = timeout(lifetime, conn).await {
                tracing::debug!(error = %e, %dst, "metadata service connection");
            }
        });
        let resp = sender
            .send_request(req)
            .await
            .map_err(|source| ProxyError::Upstream { dst, source })?;
        let status = resp.status();
        if status.is_informational() {
            return Err(ProxyError::UpstreamStatus { dst, status });
        }
        let (parts, body) = resp.into_parts();
        let body = match declared_length(&parts.headers) {
            _ if head => Empty::new().map_err(|never| match never {}).boxed(),
            Some(n) if n > limit => return Err(ProxyError::TooLarge { dst, limit }),
            // Limited as well: a body longer than it said is cut, never passed on whole.
            Some(_) => Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).boxed(),
            None => read_whole(body, dst, limit).await?,
        };
        let mut out = Response::new(body);
        *out.status_mut() = parts.status;
        *out.headers_mut() = headers::downstream(&parts.headers);
        Ok(out)
    };
    timeout(limits.upstream, exchange)
        .await
        .map_err(|_| ProxyError::UpstreamTimeout { dst, after: limits.upstream })?
}

/// The `Content-Length` a response declares (hyper's client has rejected conflicting ones).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// A body without a declared length, read whole: at most `limit` bytes.
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
