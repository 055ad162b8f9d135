//! A host-network client for the connect-time tests: joins a cgroup, then
//! talks to an echo server and prints what its socket saw.
//!
//! usage: sockclient NETNS CGROUP_PROCS tcp|udp-connected|udp-unconnected IP:PORT
//! (it joins the cgroup first, then the network namespace: `ip netns exec`
//! would hide /sys/fs/cgroup behind its own /sys mount).
//! prints `peer=IP:PORT` (getpeername or recvfrom source) and `reply=LINE`,
//! or `error=KIND` and exits 1.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, netns, procs, mode, dst] = args.as_slice() else {
        eprintln!("usage: sockclient NETNS CGROUP_PROCS tcp|udp-connected|udp-unconnected IP:PORT");
        std::process::exit(2);
    };
    std::fs::write(procs, std::process::id().to_string()).expect("join the cgroup");
    let ns = std::fs::File::open(netns).expect("open the network namespace");
    // SAFETY: plain syscall on a valid fd, single-threaded process.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    let dst: SocketAddr = dst.parse().expect("IP:PORT");
    let t = Some(Duration::from_secs(3));
    let any = if dst.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let result = (|| -> std::io::Result<(SocketAddr, String)> {
        match mode.as_str() {
            "tcp" => {
                let s = TcpStream::connect_timeout(&dst, Duration::from_secs(3))?;
                s.set_read_timeout(t)?;
                let peer = s.peer_addr()?;
                (&s).write_all(b"hello\n")?;
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line)?;
                Ok((peer, line.trim().to_owned()))
            }
            "udp-connected" => {
                let s = UdpSocket::bind(any)?;
                s.set_read_timeout(t)?;
                s.connect(dst)?;
                let peer = s.peer_addr()?;
                s.send(b"hello")?;
                let mut buf = [0u8; 512];
                let n = s.recv(&mut buf)?;
                Ok((peer, String::from_utf8_lossy(&buf[..n]).trim().to_owned()))
            }
            "udp-unconnected" => {
                let s = UdpSocket::bind(any)?;
                s.set_read_timeout(t)?;
                s.send_to(b"hello", dst)?;
                let mut buf = [0u8; 512];
                let (n, from) = s.recv_from(&mut buf)?;
                Ok((from, String::from_utf8_lossy(&buf[..n]).trim().to_owned()))
            }
            other => panic!("unknown mode {other}"),
        }
    })();
    match result {
        Ok((peer, reply)) => println!("peer={peer}\nreply={reply}"),
        Err(e) => {
            println!("error={:?}", e.kind());
            std::process::exit(1);
        }
    }
}
