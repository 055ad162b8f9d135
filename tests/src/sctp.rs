//! SCTP echo without the kernel's SCTP stack (this machine's kernel, like
//! many, is built without it): packets go through raw `IPPROTO_SCTP`
//! sockets, one DATA chunk per request, with the echo protocol of
//! [`crate::echo`]. Enough to prove that real SCTP packets cross the
//! datapath both ways, translated, with CRC32c values a receiver accepts: a
//! packet whose CRC is wrong is dropped and counted, as an SCTP stack would.

use std::{
    io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{
    echo::{CLIENT_TIMEOUT, EchoReply, answer},
    netns::NetNs,
    packet::{Frame, SCTP, sctp_crc_ok},
};

/// One SCTP packet as a raw socket hands it up (IPv4 header included).
struct Packet {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    /// The CRC32c was computed (non-zero) and is right.
    crc_ok: bool,
    payload: Vec<u8>,
}

fn parse(buf: &[u8]) -> Option<Packet> {
    let ihl = usize::from(buf.first()? & 0x0f) * 4;
    if buf.get(9) != Some(&SCTP) || buf.len() < ihl + 12 {
        return None;
    }
    let ip = |o: usize| Ipv4Addr::new(buf[o], buf[o + 1], buf[o + 2], buf[o + 3]);
    let l4 = &buf[ihl..];
    let port = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
    let stored = u32::from_le_bytes(l4[8..12].try_into().ok()?);
    // The DATA chunk of [`Frame::sctp`]: 16 bytes of chunk header.
    let chunk_len = usize::from(u16::from_be_bytes([*l4.get(14)?, *l4.get(15)?]));
    let payload = l4.get(28..12 + chunk_len).unwrap_or_default().to_vec();
    Some(Packet {
        src: SocketAddrV4::new(ip(12), port(0)),
        dst: SocketAddrV4::new(ip(16), port(2)),
        crc_ok: stored != 0 && sctp_crc_ok(l4) == Some(true),
        payload,
    })
}

/// A raw SCTP socket in `ns`, with a read timeout.
fn raw_socket(ns: &NetNs, timeout: Duration) -> io::Result<OwnedFd> {
    ns.run(|| {
        // SAFETY: plain socket(2); the descriptor is owned right away.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, i32::from(SCTP)) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as _,
            tv_usec: timeout.subsec_micros() as _,
        };
        // SAFETY: valid option pointer and length.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    })
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the buffer is valid for its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Sends the SCTP packet `src` → `dst` carrying `payload`; the kernel adds
/// the IP header (its source address is the route's, which must be `src`'s).
fn send(fd: &OwnedFd, src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> io::Result<()> {
    let mut frame = Frame::sctp(src, dst);
    frame.payload = payload.to_vec();
    let l4 = frame.l4();
    let to = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(*dst.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: valid buffer and address for their lengths.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            l4.as_ptr().cast(),
            l4.len(),
            0,
            (&raw const to).cast(),
            size_of::<libc::sockaddr_in>() as u32,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An SCTP echo server on `addr`: every DATA chunk is answered, from
/// `addr`, with the echo line naming the peer it saw. Stopped on drop.
#[derive(Debug)]
pub struct SctpEcho {
    pub addr: SocketAddrV4,
    bad_crc: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SctpEcho {
    pub fn start(ns: &NetNs, name: &str, addr: SocketAddrV4) -> Self {
        let fd = raw_socket(ns, Duration::from_millis(100))
            .unwrap_or_else(|e| panic!("raw SCTP socket in {}: {e}", ns.name()));
        let stop = Arc::new(AtomicBool::new(false));
        let bad_crc = Arc::new(AtomicU64::new(0));
        let (name, stop2, bad2) = (name.to_owned(), stop.clone(), bad_crc.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stop2.load(Ordering::Relaxed) {
                let Ok(n) = recv(&fd, &mut buf) else { continue };
                let Some(p) = parse(&buf[..n]) else { continue };
                if p.dst != addr {
                    continue;
                }
                if !p.crc_ok {
                    bad2.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let request = String::from_utf8_lossy(&p.payload);
                let line = answer(&name, SocketAddr::V4(p.src), request.trim_end());
                let _ = send(&fd, addr, p.src, line.as_bytes());
            }
        });
        Self {
            addr,
            bad_crc,
            stop,
            thread: Some(thread),
        }
    }

    /// Packets to this server dropped for a wrong CRC32c.
    pub fn bad_crc(&self) -> u64 {
        self.bad_crc.load(Ordering::Relaxed)
    }
}

impl Drop for SctpEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What an SCTP request got back.
#[derive(Debug)]
pub struct SctpAnswer {
    /// The source of the answer (the address the client talked to, if the
    /// datapath reverse-translated it).
    pub from: SocketAddrV4,
    pub reply: EchoReply,
}

/// Sends one request from `src` (an address of `ns`) to `dst` and waits
/// for the answer to `src`. An answer with a wrong CRC32c is an error.
pub fn sctp_request(
    ns: &NetNs,
    src: SocketAddrV4,
    dst: SocketAddrV4,
    payload: &str,
) -> io::Result<SctpAnswer> {
    let fd = raw_socket(ns, Duration::from_millis(100))?;
    send(&fd, src, dst, payload.as_bytes())?;
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        let Ok(n) = recv(&fd, &mut buf) else { continue };
        let Some(p) = parse(&buf[..n]) else { continue };
        if p.dst != src {
            continue;
        }
        if !p.crc_ok {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("answer from {} has a wrong CRC32c", p.src),
            ));
        }
        return Ok(SctpAnswer {
            from: p.src,
            reply: EchoReply::parse(&String::from_utf8_lossy(&p.payload)),
        });
    }
    Err(io::ErrorKind::TimedOut.into())
}
