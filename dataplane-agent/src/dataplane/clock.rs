//! The datapath's clock. Conntrack and affinity entries are stamped with a
//! monotonic time in ns whose resolution only has to be a fraction of their
//! one-second timeouts. `bpf_jiffies64()` is that clock at one load (the
//! verifier inlines it), where `bpf_ktime_get_coarse_ns()` is a helper call
//! that measured as a tenth of an established packet's time; but jiffies
//! count ticks of the kernel's `CONFIG_HZ`, which no interface states (and
//! `/proc/timer_list`, which shows jiffies, is masked in containers). It is
//! told here by the object's own `xdp_clock` program, run with
//! BPF_PROG_TEST_RUN on a throwaway copy of the object: it returns
//! CLOCK_MONOTONIC N and jiffies J read one after the other. Jiffies start
//! at `INITIAL_JIFFIES = 2^32 - 300 * HZ`, so for one HZ among the kernel's
//! choices `(J - INITIAL_JIFFIES) / HZ` is N in seconds. Near 300 s of
//! uptime every HZ fits (jiffies cross 2^32 then whatever HZ): a second run
//! 200 ms later tells HZ by the rate instead.
//!
//! The programs get `JIFFY_NS` (10^9 / HZ) and `JIFFIES_OFFSET_NS` (N - J *
//! JIFFY_NS, wrapping) as load-time constants and compute `J * JIFFY_NS +
//! offset`: the monotonic clock within a tick, so entries stamped by
//! programs on either clock (an upgrade, a restart) keep their ages. When
//! the probe fails, or nothing fits, they keep `bpf_ktime_get_coarse_ns()`.

use std::time::Duration;

use aya::{
    EbpfLoader,
    programs::{TestRun, TestRunOptions, Xdp},
};
use dataplane_common::names;

/// The kernel's `CONFIG_HZ` choices (x86-64, arm64 and most others).
const HZ_CHOICES: [u64; 4] = [100, 250, 300, 1000];
const NS_PER_S: u64 = 1_000_000_000;

/// Which clock the programs read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// `bpf_jiffies64() * ns_per_jiffy + offset_ns`.
    Jiffies { hz: u64, offset_ns: u64 },
    /// `bpf_ktime_get_coarse_ns()`: HZ could not be told.
    KtimeCoarse,
}

impl Clock {
    /// Tells the kernel's HZ with the `xdp_clock` probe (see the module
    /// docs), from the object `object`.
    pub fn detect(object: &[u8]) -> Self {
        let Some(probe) = Probe::load(object) else {
            return Clock::KtimeCoarse;
        };
        let Some(a) = probe.sample() else {
            return Clock::KtimeCoarse;
        };
        if let Some(c) = from_sample(a) {
            return c;
        }
        std::thread::sleep(Duration::from_millis(200));
        probe
            .sample()
            .and_then(|b| from_rate(a, b))
            .unwrap_or(Clock::KtimeCoarse)
    }

    /// The programs' load-time constants: (`JIFFY_NS`, `JIFFIES_OFFSET_NS`),
    /// (0, 0) for the coarse ktime clock.
    pub fn constants(self) -> (u64, u64) {
        match self {
            Clock::Jiffies { hz, offset_ns } => (NS_PER_S / hz, offset_ns),
            Clock::KtimeCoarse => (0, 0),
        }
    }

    pub fn describe(self) -> String {
        match self {
            Clock::Jiffies { hz, .. } => format!("jiffies (HZ={hz})"),
            Clock::KtimeCoarse => "bpf_ktime_get_coarse_ns (HZ unknown)".to_owned(),
        }
    }
}

/// CLOCK_MONOTONIC in ns: the datapath's clock, as its entries are
/// stamped (within a tick).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC exists on
    // every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * NS_PER_S + ts.tv_nsec as u64
}

/// (CLOCK_MONOTONIC in ns, jiffies), read together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sample {
    now_ns: u64,
    jiffies: u64,
}

/// A throwaway copy of the object (every map one entry, nothing pinned)
/// with only `xdp_clock` loaded.
struct Probe(aya::Ebpf);

impl Probe {
    fn load(object: &[u8]) -> Option<Self> {
        let mut loader = EbpfLoader::new();
        for map in names::ALL_MAPS {
            loader.map_max_entries(map, names::min_entries(map));
        }
        let mut ebpf = loader.load(object).ok()?;
        let prog: &mut Xdp = ebpf.program_mut(names::XDP_CLOCK)?.try_into().ok()?;
        prog.load().ok()?;
        Some(Self(ebpf))
    }

    fn sample(&self) -> Option<Sample> {
        let prog: &Xdp = self.0.program(names::XDP_CLOCK)?.try_into().ok()?;
        // An Ethernet header's worth at least; the program writes 16 bytes.
        let input = [0u8; 64];
        let mut out = [0u8; 64];
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(&input),
                data_out: Some(&mut out),
                repeat: 1,
                ..Default::default()
            })
            .ok()?;
        const XDP_PASS: u32 = 2;
        if r.return_value != XDP_PASS {
            return None;
        }
        let word = |i: usize| u64::from_ne_bytes(out[i..i + 8].try_into().expect("8 bytes"));
        Some(Sample {
            now_ns: word(0),
            jiffies: word(8),
        })
    }
}

/// `INITIAL_JIFFIES` of a kernel with this HZ (64-bit jiffies).
fn initial_jiffies(hz: u64) -> u64 {
    (1u64 << 32) - 300 * hz
}

fn jiffies_clock(hz: u64, s: Sample) -> Clock {
    Clock::Jiffies {
        hz,
        offset_ns: s.now_ns.wrapping_sub(s.jiffies.wrapping_mul(NS_PER_S / hz)),
    }
}

/// The one HZ whose jiffies since boot match the uptime (within 0.1 % and
/// a second: jiffies lag the monotonic clock by up to a tick, and drift
/// from it by a few ppm), or `None` when several or none do.
fn from_sample(s: Sample) -> Option<Clock> {
    let mut fits = HZ_CHOICES.iter().copied().filter(|&hz| {
        let Some(ticks) = s.jiffies.checked_sub(initial_jiffies(hz)) else {
            return false;
        };
        let uptime_ns = ticks as u128 * (NS_PER_S / hz) as u128;
        uptime_ns.abs_diff(s.now_ns as u128) <= (s.now_ns / 1000 + NS_PER_S) as u128
    });
    match (fits.next(), fits.next()) {
        (Some(hz), None) => Some(jiffies_clock(hz, s)),
        _ => None,
    }
}

/// HZ from the rate of two samples: the choice within 10 % of it.
fn from_rate(a: Sample, b: Sample) -> Option<Clock> {
    let dt = b.now_ns.checked_sub(a.now_ns).filter(|d| *d >= NS_PER_S / 10)?;
    let rate = (b.jiffies.checked_sub(a.jiffies)? as f64) * NS_PER_S as f64 / dt as f64;
    HZ_CHOICES
        .iter()
        .copied()
        .find(|&hz| (rate - hz as f64).abs() <= hz as f64 / 10.0)
        .map(|hz| jiffies_clock(hz, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(hz: u64, uptime_ns: u64) -> Sample {
        Sample {
            now_ns: uptime_ns,
            jiffies: initial_jiffies(hz) + uptime_ns / (NS_PER_S / hz),
        }
    }

    /// Figures read from this machine's /proc/timer_list: HZ 250, 16 h up,
    /// jiffies 0.26 s behind the monotonic clock.
    #[test]
    fn tells_hz_from_one_sample() {
        let s = Sample {
            now_ns: 57_495_911_557_665,
            jiffies: 4_309_266_208,
        };
        let c = from_sample(s).expect("one HZ fits");
        assert!(matches!(c, Clock::Jiffies { hz: 250, .. }), "{c:?}");
        // The programs' clock reads the monotonic time at that jiffy.
        let (tick, offset) = c.constants();
        assert_eq!(s.jiffies.wrapping_mul(tick).wrapping_add(offset), s.now_ns);
        for hz in HZ_CHOICES {
            for uptime_s in [20, 400, 3600, 86_400 * 400] {
                let c = from_sample(at(hz, uptime_s * NS_PER_S));
                assert!(
                    matches!(c, Some(Clock::Jiffies { hz: h, .. }) if h == hz),
                    "{hz} {uptime_s}: {c:?}"
                );
            }
        }
    }

    /// Around 300 s of uptime jiffies are near 2^32 whatever HZ: one sample
    /// cannot tell, two can.
    #[test]
    fn near_300_s_the_rate_tells() {
        for hz in HZ_CHOICES {
            let (a, b) = (at(hz, 300 * NS_PER_S), at(hz, 300 * NS_PER_S + NS_PER_S / 5));
            assert_eq!(from_sample(a), None, "{hz}");
            let c = from_rate(a, b);
            assert!(
                matches!(c, Some(Clock::Jiffies { hz: h, .. }) if h == hz),
                "{hz}: {c:?}"
            );
        }
        // Too short an interval, or time going backwards: no answer.
        assert_eq!(from_rate(at(250, NS_PER_S), at(250, NS_PER_S + 1_000_000)), None);
        assert_eq!(from_rate(at(250, 2 * NS_PER_S), at(250, NS_PER_S)), None);
    }
}
