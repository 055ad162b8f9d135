//! The node's network interfaces and addresses, as this network namespace
//! sees them.

use std::{ffi::CStr, net::Ipv4Addr};

/// Names of the interfaces in this network namespace.
pub fn interface_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// (interface, IPv4 address) of every address in this network namespace.
pub fn ipv4_addresses() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: a valid list node until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() && unsafe { (*ifa.ifa_addr).sa_family } as i32 == libc::AF_INET {
            // SAFETY: AF_INET means a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned();
            out.push((name, Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: from getifaddrs.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

/// Link notifications (RTNLGRP_LINK) from the kernel: interfaces appearing
/// and going, so pod interfaces are attached as soon as the CNI creates
/// them. The caller still rescans periodically (a notification can be lost
/// when the socket buffer overflows).
pub struct LinkWatch {
    fd: i32,
}

impl LinkWatch {
    pub fn open() -> std::io::Result<Self> {
        // SAFETY: plain socket calls with a zeroed, correctly sized address.
        unsafe {
            let fd = libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            );
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as u16;
            addr.nl_groups = libc::RTMGRP_LINK as u32;
            let rc = libc::bind(
                fd,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            );
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                return Err(e);
            }
            Ok(Self { fd })
        }
    }

    /// Drains pending notifications; true if any link changed.
    pub fn changed(&self) -> bool {
        let mut buf = [0u8; 8192];
        let mut any = false;
        loop {
            // SAFETY: reading into our own buffer.
            let n = unsafe { libc::recv(self.fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n > 0 {
                any = true;
                continue;
            }
            // EAGAIN: drained. ENOBUFS: overflowed, so something changed.
            if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS) {
                any = true;
                continue;
            }
            return any;
        }
    }
}

impl Drop for LinkWatch {
    fn drop(&mut self) {
        // SAFETY: our own fd.
        unsafe { libc::close(self.fd) };
    }
}
