//! TCP and UDP echo servers that say who they are and whom they saw, and the
//! clients that talk to them.
//!
//! Protocol (both transports): for every request line (TCP) or datagram
//! (UDP) the server answers `"<server-name> <peer-ip>:<peer-port> <request>\n"`.
//! The peer is the source address the server's socket saw, which is what
//! SNAT/source-preservation tests assert on.
//!
//! Each server is one thread running a single-threaded tokio runtime: its
//! socket is bound inside the namespace (through [`NetNs::run`]) and stays
//! there, and every connection is a task on that thread, not a thread of
//! its own. A thread per connection made the agent suite's traffic
//! generators create tens of thousands of threads per test binary, more
//! than `pid_max` (32768) so that thread ids wrapped, and one run hung for
//! good joining a thread. Dropping a server stops it at once: the listener
//! and every connection it holds are closed, the thread joined.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::Arc,
    thread::JoinHandle,
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _},
    sync::oneshot,
};

use crate::netns::NetNs;

/// How long a client waits for a connect or an answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);

/// What an echo server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoReply {
    /// The server's name (the pod name, usually).
    pub server: String,
    /// The source address the server saw.
    pub peer: SocketAddr,
    pub payload: String,
}

impl EchoReply {
    pub(crate) fn parse(line: &str) -> Self {
        let mut parts = line.trim_end_matches('\n').splitn(3, ' ');
        let server = parts.next().unwrap_or_default().to_owned();
        let peer = parts
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("malformed echo reply {line:?}"));
        let payload = parts.next().unwrap_or_default().to_owned();
        Self {
            server,
            peer,
            payload,
        }
    }
}

pub(crate) fn answer(server: &str, peer: SocketAddr, request: &str) -> String {
    format!("{server} {peer} {request}\n")
}

/// A running echo server; stopped (socket and connections closed, thread
/// joined) on drop.
#[derive(Debug)]
pub struct EchoServer {
    pub addr: SocketAddr,
    /// Dropped to stop the server.
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl EchoServer {
    /// Starts a TCP echo server named `name` listening on `addr` in `ns`.
    pub fn tcp(ns: &NetNs, name: &str, addr: impl Into<SocketAddr>) -> Self {
        Self::tcp_with(ns, name, addr.into(), serve_tcp)
    }

    /// A TCP server on `addr` in `ns` running `serve(name, connection,
    /// peer)` as a task per connection.
    fn tcp_with<F>(
        ns: &NetNs,
        name: &str,
        addr: SocketAddr,
        serve: fn(Arc<str>, tokio::net::TcpStream, SocketAddr) -> F,
    ) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = ns
            .run(|| std::net::TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("bind tcp {addr} in {}: {e}", ns.name()));
        let (rt, listener) = runtime_with(|| {
            listener.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(listener)
        })
        .unwrap_or_else(|e| panic!("tcp server {addr} in {}: {e}", ns.name()));
        let name: Arc<str> = name.into();
        Self::start(addr, rt, async move {
            loop {
                match listener.accept().await {
                    Ok((conn, peer)) => {
                        tokio::spawn(serve(name.clone(), conn, peer));
                    }
                    // Out of descriptors, say: try again shortly, without
                    // spinning the thread its connections share.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        })
    }

    /// Starts a UDP echo server named `name` bound to `addr` in `ns`.
    pub fn udp(ns: &NetNs, name: &str, addr: impl Into<SocketAddr>) -> Self {
        let addr = addr.into();
        let socket = ns
            .run(|| UdpSocket::bind(addr))
            .unwrap_or_else(|e| panic!("bind udp {addr} in {}: {e}", ns.name()));
        let (rt, socket) = runtime_with(|| {
            socket.set_nonblocking(true)?;
            tokio::net::UdpSocket::from_std(socket)
        })
        .unwrap_or_else(|e| panic!("udp server {addr} in {}: {e}", ns.name()));
        let name = name.to_owned();
        Self::start(addr, rt, async move {
            let mut buf = [0u8; 2048];
            loop {
                let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
                    continue;
                };
                let request = String::from_utf8_lossy(&buf[..n]);
                let _ = socket
                    .send_to(answer(&name, peer, request.trim_end()).as_bytes(), peer)
                    .await;
            }
        })
    }

    /// Runs `server` on `rt` on a thread of its own until the server is
    /// dropped; the runtime, and every task on it, goes with it.
    fn start(
        addr: SocketAddr,
        rt: tokio::runtime::Runtime,
        server: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("echo {addr}"))
            .spawn(move || {
                rt.block_on(async move {
                    tokio::select! {
                        _ = stopped => {}
                        () = server => {}
                    }
                });
            })
            .expect("spawn an echo server thread");
        Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

/// A single-threaded runtime and what `register` (a socket handed to it)
/// returned, run in the runtime's context.
fn runtime_with<T>(
    register: impl FnOnce() -> std::io::Result<T>,
) -> std::io::Result<(tokio::runtime::Runtime, T)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let registered = {
        let _context = rt.enter();
        register()?
    };
    Ok((rt, registered))
}

async fn serve_tcp(name: Arc<str>, conn: tokio::net::TcpStream, peer: SocketAddr) {
    let (read, mut write) = conn.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if write
            .write_all(answer(&name, peer, &line).as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        // Closing the channel ends the server's `select!`; dropping the
        // runtime on its thread closes its sockets.
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One TCP connection from a namespace, for several request/response rounds.
#[derive(Debug)]
pub struct TcpClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl TcpClient {
    /// Connects from `ns` to `dst` (optionally from a fixed `src`).
    pub fn connect(ns: &NetNs, dst: impl Into<SocketAddr>) -> std::io::Result<Self> {
        let dst = dst.into();
        let stream = ns.run(|| TcpStream::connect_timeout(&dst, CLIENT_TIMEOUT))?;
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Self {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
        })
    }

    /// Connects from `ns`'s IPv4 client port `port` to `dst`. The socket
    /// has SO_REUSEADDR, so the port can be taken again while an earlier
    /// connection from it (made this way) lingers in TIME_WAIT, as a busy
    /// client's ports are.
    pub fn connect_from_port(ns: &NetNs, port: u16, dst: SocketAddrV4) -> std::io::Result<Self> {
        let fd = ns.run(|| -> std::io::Result<OwnedFd> {
            // SAFETY: plain socket(2); the descriptor is owned right away.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a fresh descriptor nobody else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })?;
        let check = |rc: i32| {
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        let one: libc::c_int = 1;
        // SAFETY: valid option pointer and length.
        check(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                (&raw const one).cast(),
                size_of::<libc::c_int>() as u32,
            )
        })?;
        // connect(2) gives up after SO_SNDTIMEO.
        let tv = libc::timeval {
            tv_sec: CLIENT_TIMEOUT.as_secs() as _,
            tv_usec: 0,
        };
        // SAFETY: valid option pointer and length.
        check(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as u32,
            )
        })?;
        let sin = |a: SocketAddrV4| libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = size_of::<libc::sockaddr_in>() as u32;
        let local = sin(SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, port));
        // SAFETY: a valid address for its length.
        check(unsafe { libc::bind(fd.as_raw_fd(), (&raw const local).cast(), len) })?;
        let remote = sin(dst);
        // SAFETY: a valid address for its length.
        if unsafe { libc::connect(fd.as_raw_fd(), (&raw const remote).cast(), len) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EINPROGRESS) {
                std::io::ErrorKind::TimedOut.into()
            } else {
                e
            });
        }
        let stream = TcpStream::from(fd);
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Self {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.writer.local_addr().expect("local addr")
    }

    /// Sends one line and reads the answer.
    pub fn request(&mut self, payload: &str) -> std::io::Result<EchoReply> {
        self.writer.write_all(format!("{payload}\n").as_bytes())?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(EchoReply::parse(&line))
    }
}

/// Connects, sends one request, returns the answer, closes.
pub fn tcp_request(ns: &NetNs, dst: impl Into<SocketAddr>, payload: &str) -> std::io::Result<EchoReply> {
    TcpClient::connect(ns, dst)?.request(payload)
}

/// A UDP socket in a namespace, connected to one destination.
#[derive(Debug)]
pub struct UdpClient {
    socket: UdpSocket,
}

impl UdpClient {
    pub fn connect(ns: &NetNs, dst: impl Into<SocketAddr>) -> std::io::Result<Self> {
        let dst = dst.into();
        let socket = ns.run(|| -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind(if dst.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
            s.connect(dst)?;
            Ok(s)
        })?;
        socket.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Self { socket })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.socket.local_addr().expect("local addr")
    }

    /// Sends one datagram and waits for the answer. An ICMP error from the
    /// path surfaces as the `io::Error` (e.g. `ConnectionRefused`).
    pub fn request(&self, payload: &str) -> std::io::Result<EchoReply> {
        self.socket.send(payload.as_bytes())?;
        let mut buf = [0u8; 2048];
        let n = self.socket.recv(&mut buf)?;
        Ok(EchoReply::parse(&String::from_utf8_lossy(&buf[..n])))
    }
}

/// One UDP request/response from a fresh socket.
pub fn udp_request(ns: &NetNs, dst: impl Into<SocketAddr>, payload: &str) -> std::io::Result<EchoReply> {
    UdpClient::connect(ns, dst)?.request(payload)
}

/// A tiny HTTP server: every GET is answered `200 OK` with the body
/// `"<name> saw <peer-ip>:<peer-port>\n"`. Stopped on drop.
#[derive(Debug)]
pub struct HttpServer {
    inner: EchoServer,
}

impl HttpServer {
    pub fn start(ns: &NetNs, name: &str, addr: impl Into<SocketAddr>) -> Self {
        Self {
            inner: EchoServer::tcp_with(ns, name, addr.into(), serve_http),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }
}

async fn serve_http(name: Arc<str>, conn: tokio::net::TcpStream, peer: SocketAddr) {
    let mut conn = tokio::io::BufReader::new(conn);
    let mut line = String::new();
    // The request line and headers, up to the empty line.
    while conn.read_line(&mut line).await.is_ok_and(|n| n > 2) {
        line.clear();
    }
    let body = format!("{name} saw {peer}\n");
    let _ = conn
        .get_mut()
        .write_all(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
}

/// GET / from `ns`; the response body.
pub fn http_get(ns: &NetNs, dst: impl Into<SocketAddr>) -> std::io::Result<String> {
    let dst = dst.into();
    let stream = ns.run(|| TcpStream::connect_timeout(&dst, CLIENT_TIMEOUT))?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    (&stream).write_all(format!("GET / HTTP/1.1\r\nHost: {dst}\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut &stream, &mut text)?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.trim_end().to_owned())
        .unwrap_or_default())
}

/// Runs the `sockclient` helper (`bin`, the test's
/// `env!("CARGO_BIN_EXE_sockclient")`) as a process of the network
/// namespace at `netns` joined to the cgroup whose `cgroup.procs` is
/// `procs`, talking to the echo server at `dst` in `mode` (`tcp`,
/// `udp-connected`, `udp-unconnected`): (the peer its socket reports, the
/// reply), or what it printed instead (its `error=` kind when it has one).
pub fn sockclient(
    bin: &str,
    netns: &std::path::Path,
    procs: &std::path::Path,
    mode: &str,
    dst: impl Into<SocketAddr>,
) -> Result<(String, String), String> {
    let out = std::process::Command::new(bin)
        .arg(netns)
        .arg(procs)
        .args([mode, &dst.into().to_string()])
        .output()
        .expect("run sockclient");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)).map(str::to_owned);
    match (field("peer="), field("reply=")) {
        (Some(p), Some(r)) => Ok((p, r)),
        _ => {
            Err(field("error=").unwrap_or_else(|| format!("{text}{}", String::from_utf8_lossy(&out.stderr))))
        }
    }
}
