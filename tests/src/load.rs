//! Load that saturates the path it crosses, not its own ends: an
//! event-driven line server and a concurrent connection generator, each a
//! single-threaded tokio runtime on a thread inside its network namespace
//! (the sockets stay there).
//!
//! Protocol: for every line the server answers
//! `"<name> <peer-ip>:<peer-port> <line>\n"` (the echo servers' format), then
//! closes first — as an HTTP server answering `Connection: close` does, so
//! TIME_WAIT sits on the server side — unless the line starts with `keep`
//! (a long-lived connection).

use std::{
    net::{SocketAddr, SocketAddrV4},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream},
};

use crate::netns::NetNs;

/// A running line server; stopped on drop.
pub struct LineServer {
    pub addr: SocketAddrV4,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
}

impl LineServer {
    pub fn start(ns: &NetNs, name: &str, addr: SocketAddrV4) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let (name, stop2, accepted2) = (name.to_owned(), stop.clone(), accepted.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = ns.spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = match TcpListener::bind(addr).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let name: Arc<str> = name.into();
                while !stop2.load(Ordering::Relaxed) {
                    let accept = tokio::time::timeout(Duration::from_millis(50), listener.accept()).await;
                    let Ok(Ok((conn, peer))) = accept else { continue };
                    accepted2.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(serve(conn, peer, name.clone()));
                }
            });
        });
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("bind {addr} in {}: {e}", ns.name()),
            Err(_) => panic!("line server thread in {} died", ns.name()),
        }
        Self {
            addr,
            stop,
            thread: Some(thread),
            accepted,
        }
    }
}

async fn serve(conn: TcpStream, peer: SocketAddr, name: Arc<str>) {
    let _ = conn.set_nodelay(true);
    let (read, mut write) = conn.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if write
            .write_all(format!("{name} {peer} {line}\n").as_bytes())
            .await
            .is_err()
            || !line.starts_with("keep")
        {
            break;
        }
    }
}

impl Drop for LineServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a churn run did.
#[derive(Clone, Debug, Default)]
pub struct ChurnReport {
    pub ok: u64,
    pub failed: u64,
    /// The first few failures, for the assertion message.
    pub errors: Vec<String>,
    pub elapsed: Duration,
    /// Connect-to-answer latency of each successful connection, µs, sorted.
    pub latencies_us: Vec<u32>,
}

impl ChurnReport {
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    pub fn percentile_us(&self, p: f64) -> u32 {
        if self.latencies_us.is_empty() {
            return 0;
        }
        let i = ((self.latencies_us.len() - 1) as f64 * p).round() as usize;
        self.latencies_us[i]
    }
}

/// How long a churn runs.
#[derive(Clone, Copy, Debug)]
pub enum Amount {
    Connections(u64),
    For(Duration),
}

/// Opens connections from `ns` to `dst`, `concurrency` in flight, each
/// sending one line and reading the answer (then closing, or letting the
/// server close first). A connection that is refused, reset, or not
/// answered within `timeout` counts as failed.
pub fn churn(
    ns: &NetNs,
    dst: SocketAddrV4,
    amount: Amount,
    concurrency: usize,
    timeout: Duration,
) -> ChurnReport {
    ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .expect("tokio runtime");
        rt.block_on(async move {
            let started = Instant::now();
            let issued = Arc::new(AtomicU64::new(0));
            let mut workers = Vec::new();
            for _ in 0..concurrency {
                let issued = issued.clone();
                workers.push(tokio::spawn(async move {
                    let mut r = ChurnReport::default();
                    loop {
                        let more = match amount {
                            Amount::Connections(n) => issued.fetch_add(1, Ordering::Relaxed) < n,
                            Amount::For(d) => started.elapsed() < d,
                        };
                        if !more {
                            break r;
                        }
                        let t0 = Instant::now();
                        match tokio::time::timeout(timeout, one(dst)).await {
                            Ok(Ok(())) => {
                                r.ok += 1;
                                r.latencies_us
                                    .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                            }
                            Ok(Err(e)) => fail(&mut r, e.to_string()),
                            Err(_) => fail(&mut r, format!("no answer within {timeout:?}")),
                        }
                    }
                }));
            }
            let mut total = ChurnReport::default();
            for w in workers {
                let r = w.await.expect("worker");
                total.ok += r.ok;
                total.failed += r.failed;
                total.latencies_us.extend(r.latencies_us);
                for e in r.errors {
                    if total.errors.len() < 5 {
                        total.errors.push(e);
                    }
                }
            }
            total.elapsed = started.elapsed();
            total.latencies_us.sort_unstable();
            total
        })
    })
}

fn fail(r: &mut ChurnReport, e: String) {
    r.failed += 1;
    if r.errors.len() < 5 {
        r.errors.push(e);
    }
}

/// One connection: a line out, the answer back, then the server's close
/// (so that TIME_WAIT stays on the server side, as with HTTP's
/// `Connection: close`, and the client's ports never run out).
async fn one(dst: SocketAddrV4) -> std::io::Result<()> {
    let conn = TcpStream::connect(dst).await?;
    conn.set_nodelay(true)?;
    let (read, mut write) = conn.into_split();
    write.write_all(b"x\n").await?;
    let mut reader = BufReader::new(read);
    let mut line = String::new();
    if reader.read_line(&mut line).await? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    // EOF: the server closed first.
    line.clear();
    reader.read_line(&mut line).await?;
    Ok(())
}
