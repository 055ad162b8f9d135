//! What a network device is: its driver and bus, through the ethtool ioctl
//! (`ETHTOOL_GDRVINFO`), which answers for the calling thread's network
//! namespace (sysfs would show the namespace it was mounted in).

/// `struct ethtool_drvinfo` (linux/ethtool.h).
#[repr(C)]
struct DrvInfo {
    cmd: u32,
    driver: [u8; 32],
    version: [u8; 32],
    fw_version: [u8; 32],
    bus_info: [u8; 32],
    erom_version: [u8; 32],
    reserved2: [u8; 12],
    n_priv_flags: u32,
    n_stats: u32,
    testinfo_len: u32,
    eedump_len: u32,
    regdump_len: u32,
}

const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;
// `Ioctl`: c_ulong on glibc, c_int on musl.
const SIOCETHTOOL: libc::Ioctl = 0x8946;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// e.g. `veth`, `virtio_net`, `mlx5_core`.
    pub driver: String,
    /// e.g. `0000:00:03.0`; empty or `N/A` for virtual devices.
    pub bus: String,
}

/// The driver and bus of `device`, or `None` if it does not exist or does
/// not answer ethtool.
pub fn driver_info(device: &str) -> Option<DriverInfo> {
    if device.len() >= libc::IFNAMSIZ {
        return None;
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        version: [0; 32],
        fw_version: [0; 32],
        bus_info: [0; 32],
        erom_version: [0; 32],
        reserved2: [0; 12],
        n_priv_flags: 0,
        n_stats: 0,
        testinfo_len: 0,
        eedump_len: 0,
        regdump_len: 0,
    };
    // SAFETY: a zeroed ifreq naming the device and pointing at `info`,
    // which outlives the ioctl; the socket is closed before returning.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(device.bytes()) {
            *dst = src as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
        let rc = libc::ioctl(fd, SIOCETHTOOL, &mut ifr);
        libc::close(fd);
        if rc != 0 {
            return None;
        }
    }
    let text =
        |b: &[u8]| String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or_default()).into_owned();
    Some(DriverInfo {
        driver: text(&info.driver),
        bus: text(&info.bus_info),
    })
}

/// The index of `device` (a name or an altname) in the calling thread's
/// network namespace.
pub fn ifindex(device: &str) -> Option<u32> {
    let name = std::ffi::CString::new(device).ok()?;
    // SAFETY: a NUL-terminated name; returns 0 when there is no such device.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (i != 0).then_some(i)
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_has_no_driver_bus() {
        // `lo` answers with no bus (or not at all); a missing device never.
        assert!(super::driver_info("lo").is_none_or(|i| i.bus.is_empty() || i.bus == "N/A"));
        assert_eq!(super::driver_info("no-such-dev0"), None);
    }
}
