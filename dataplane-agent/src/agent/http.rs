//! The agent's HTTP servers (proxy health, healthCheckNodePorts, metrics):
//! hyper's HTTP/1.1 server on a small tokio runtime of their own, so no
//! client (slow, idle or hostile) delays another's answer and none waits
//! for the sync loop.
//!
//! Per server: concurrent connections with HTTP/1.1 keep-alive; request
//! headers limited in size and count (hyper answers 431 beyond them); a
//! request whose header has not arrived [`Limits::header_read_timeout`]
//! after its first byte is dropped; a connection idle for
//! [`Limits::idle_timeout`] is closed; and at most
//! [`Limits::max_connections`] are kept: a new connection beyond the cap
//! sheds an old one, the longest idle first, then the oldest one still
//! sending its header (never one whose request is being answered).

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU8, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Request,
    body::Incoming,
    header::{HeaderName, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::oneshot,
    task::{AbortHandle, JoinSet},
};

/// What a handler answers.
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Response {
    pub fn json(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "application/json",
            headers: vec![("X-Content-Type-Options", "nosniff".into())],
            body,
        }
    }
}

/// Answers a request for a path (with its query); any method.
pub type Handler = Arc<dyn Fn(&str) -> Response + Send + Sync>;

/// Per-server protection against slow, idle and excess clients.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    /// From a request's first byte to the end of its header.
    pub header_read_timeout: Duration,
    /// Without a request on a connection (fresh or kept alive).
    pub idle_timeout: Duration,
    /// Request line and headers together.
    pub max_header_bytes: usize,
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_read_timeout: Duration::from_secs(10),
            // Longer than the usual Prometheus scrape intervals, so scrapes
            // reuse their connection.
            idle_timeout: Duration::from_secs(90),
            max_header_bytes: 16 * 1024,
            max_headers: 64,
        }
    }
}

/// The tokio runtime the servers run on: two worker threads, owned by the
/// agent; dropping it stops every server.
pub struct ServerRuntime {
    runtime: tokio::runtime::Runtime,
}

impl ServerRuntime {
    /// Starts the runtime. Also raises this process's open-file soft limit
    /// to its hard limit (as Go's runtime does): each connection is a file.
    pub fn start() -> std::io::Result<Self> {
        raise_nofile_limit();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("http")
            .enable_all()
            .build()?;
        Ok(Self { runtime })
    }

    pub fn handle(&self) -> tokio::runtime::Handle {
        self.runtime.handle().clone()
    }
}

fn raise_nofile_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid, initialised struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// A listening server; closed (with its connections) on drop.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    stopped: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Server {
    /// Binds `addr` now (errors are the caller's to report) and serves it
    /// on `runtime`.
    pub fn bind(
        runtime: &tokio::runtime::Handle,
        addr: impl std::net::ToSocketAddrs,
        limits: Limits,
        handler: Handler,
    ) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(listener)?
        };
        let (stop, stop_rx) = oneshot::channel();
        let (stopped_tx, stopped) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            serve(listener, limits, handler, stop_rx).await;
            // Listener and connections are dropped by now.
            drop(stopped_tx);
        });
        Ok(Self {
            addr,
            stop: Some(stop),
            stopped: std::sync::Mutex::new(stopped),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // The port is free once this returns (a Service's health port may
        // be bound again at once). Bounded: the accept loop stops at its
        // next poll; a runtime already shut down has dropped it.
        if let Ok(stopped) = self.stopped.lock() {
            let _ = stopped.recv_timeout(Duration::from_secs(2));
        }
    }
}

/// Where a connection is in its request cycle.
const IDLE: u8 = 0;
const READING_HEADER: u8 = 1;
const ANSWERING: u8 = 2;

/// A connection's state, shared between its task and the accept loop.
struct ConnState {
    state: AtomicU8,
    /// Milliseconds since the server's epoch at the last state change.
    since: AtomicU64,
    epoch: Instant,
}

impl ConnState {
    fn new(epoch: Instant) -> Self {
        let s = Self {
            state: AtomicU8::new(IDLE),
            since: AtomicU64::new(0),
            epoch,
        };
        s.set(IDLE);
        s
    }

    fn set(&self, state: u8) {
        self.since
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.state.store(state, Ordering::Relaxed);
    }

    fn get(&self) -> u8 {
        self.state.load(Ordering::Relaxed)
    }
}

struct Conn {
    state: Arc<ConnState>,
    /// Accept order (ties in `since` go to the older connection).
    seq: u64,
    abort: AbortHandle,
}

/// Sheds one connection: the longest idle, else the one that has been
/// sending its header longest. False when every connection is answering.
fn shed_one(conns: &mut HashMap<tokio::task::Id, Conn>) -> bool {
    let victim = conns
        .iter()
        .filter(|(_, c)| c.state.get() != ANSWERING)
        .min_by_key(|(_, c)| (c.state.get(), c.state.since.load(Ordering::Relaxed), c.seq))
        .map(|(id, _)| *id);
    match victim.and_then(|id| conns.remove(&id)) {
        Some(c) => {
            c.abort.abort();
            true
        }
        None => false,
    }
}

async fn serve(listener: TcpListener, limits: Limits, handler: Handler, mut stop: oneshot::Receiver<()>) {
    let epoch = Instant::now();
    let mut tasks = JoinSet::new();
    let mut conns: HashMap<tokio::task::Id, Conn> = HashMap::new();
    let mut seq = 0u64;
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .title_case_headers(true)
        .header_read_timeout(limits.idle_timeout)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_header_bytes.max(8192));
    let builder = Arc::new(builder);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => break,
            Some(done) = tasks.join_next_with_id() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                conns.remove(&id);
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    if conns.len() >= limits.max_connections && !shed_one(&mut conns) {
                        continue; // every connection is being answered: refuse this one
                    }
                    let _ = stream.set_nodelay(true);
                    let state = Arc::new(ConnState::new(epoch));
                    let abort = tasks.spawn(connection(stream, state.clone(), limits, builder.clone(), handler.clone()));
                    seq += 1;
                    conns.insert(abort.id(), Conn { state, seq, abort });
                }
                // Out of file descriptors: make room, or wait for some.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                    if !shed_one(&mut conns) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Err(_) => {}
            },
        }
    }
    tasks.abort_all();
}

async fn connection(
    stream: TcpStream,
    state: Arc<ConnState>,
    limits: Limits,
    builder: Arc<http1::Builder>,
    handler: Handler,
) {
    let io = TrackedIo {
        inner: stream,
        state: state.clone(),
        header_timeout: limits.header_read_timeout,
        deadline: None,
    };
    let service = service_fn(move |req: Request<Incoming>| {
        state.set(ANSWERING);
        let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
        let r = handler(path);
        state.set(IDLE);
        std::future::ready(Ok::<_, Infallible>(to_hyper(r)))
    });
    let _ = builder.serve_connection(TokioIo::new(io), service).await;
}

fn to_hyper(r: Response) -> hyper::Response<Full<Bytes>> {
    let mut out = hyper::Response::new(Full::new(Bytes::from(r.body)));
    *out.status_mut() =
        hyper::StatusCode::from_u16(r.status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let headers = out.headers_mut();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static(r.content_type),
    );
    for (k, v) in r.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(&v)) {
            headers.insert(k, v);
        }
    }
    out
}

/// The connection's socket, noting when a request starts arriving (for
/// shedding) and failing the read when its header takes longer than the
/// header timeout.
struct TrackedIo {
    inner: TcpStream,
    state: Arc<ConnState>,
    header_timeout: Duration,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let got_bytes = matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before;
        match this.state.get() {
            IDLE if got_bytes => {
                this.state.set(READING_HEADER);
                this.deadline = Some(Box::pin(tokio::time::sleep(this.header_timeout)));
            }
            ANSWERING => this.deadline = None,
            _ => {}
        }
        if polled.is_pending()
            && this.state.get() == READING_HEADER
            && let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(std::io::ErrorKind::TimedOut.into()));
        }
        polled
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shedding_takes_the_longest_idle_then_the_oldest_slow_header_never_one_being_answered() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let epoch = Instant::now();
        let mut tasks = JoinSet::new();
        let mut conns = HashMap::new();
        // (name, state, since in ms)
        let spec = [
            ("answering", ANSWERING, 0),
            ("slow-old", READING_HEADER, 1),
            ("idle-new", IDLE, 9),
            ("slow-new", READING_HEADER, 5),
            ("idle-old", IDLE, 3),
        ];
        let mut names = HashMap::new();
        for (seq, (name, state, since)) in spec.into_iter().enumerate() {
            let s = Arc::new(ConnState::new(epoch));
            s.state.store(state, Ordering::Relaxed);
            s.since.store(since, Ordering::Relaxed);
            let abort = tasks.spawn_on(std::future::pending::<()>(), rt.handle());
            names.insert(abort.id(), name);
            conns.insert(
                abort.id(),
                Conn {
                    state: s,
                    seq: seq as u64,
                    abort,
                },
            );
        }
        let mut order = Vec::new();
        while shed_one(&mut conns) {
            let gone: Vec<_> = names
                .keys()
                .filter(|id| !conns.contains_key(id))
                .copied()
                .collect();
            for id in gone {
                order.push(names.remove(&id).unwrap());
            }
        }
        assert_eq!(order, ["idle-old", "idle-new", "slow-old", "slow-new"]);
        assert_eq!(conns.len(), 1, "the connection being answered stays");
    }
}
