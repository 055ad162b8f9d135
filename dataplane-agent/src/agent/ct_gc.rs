//! Collects the expired copies in the assured conntrack tables
//! (`CT4_ASSURED`, `CT6_ASSURED`: hash maps that never evict, from which
//! the datapath restores an assured flow's entries a flood pushed out of
//! its LRU; see `dataplane_common::ct::assured`). The LRUs reclaim their
//! own entries.
//!
//! Its own thread, with the pinned maps opened a second time: a sweep reads
//! the tables in batches (a few tens of milliseconds at a quarter of a
//! million entries) and the control loop never waits on it. The period
//! adapts as Cilium's conntrack GC does: halved while sweeps find much to
//! collect or the table more than half full, doubled while they find
//! little, between [`MIN_INTERVAL`] and [`MAX_INTERVAL`].

use std::{
    path::Path,
    sync::mpsc::{self, RecvTimeoutError},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tracing::{debug, warn};

use super::metrics::SharedMetrics;
use crate::dataplane::{DatapathError, LbMaps, clock::monotonic_ns};

pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
pub const MAX_INTERVAL: Duration = Duration::from_secs(30);
const FIRST_INTERVAL: Duration = Duration::from_secs(10);

/// The running collector; stops (and joins) when dropped.
pub struct ConntrackGc {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ConntrackGc {
    /// Starts collecting from the maps pinned under `pins`.
    pub fn start(pins: &Path, metrics: SharedMetrics) -> Result<Self, DatapathError> {
        let (maps, _) = LbMaps::open_pins(pins)?;
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("conntrack-gc".into())
            .spawn(move || run(maps, &stopped, &metrics))
            .expect("spawning the conntrack collector");
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for ConntrackGc {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut maps: LbMaps, stopped: &mpsc::Receiver<()>, metrics: &SharedMetrics) {
    let mut interval = FIRST_INTERVAL;
    loop {
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let t0 = Instant::now();
        match maps.collect_expired_conntrack(monotonic_ns()) {
            Ok((left, collected)) => {
                let took = t0.elapsed();
                interval = next_interval(interval, left, collected, maps.conntrack_capacity() as usize);
                debug!(
                    left,
                    collected,
                    took_ms = took.as_millis() as u64,
                    next_s = interval.as_secs(),
                    "conntrack collected"
                );
                let mut m = metrics.lock().expect("metrics");
                m.conntrack_gc_seconds = took.as_secs_f64();
                m.conntrack_gc_interval_seconds = interval.as_secs_f64();
            }
            Err(e) => warn!(error = %e, "cannot collect expired conntrack entries"),
        }
    }
}

/// The next sweep's period: shorter while there is much to collect (a
/// twentieth of the table or more) or the table is more than half full
/// (of both families' tables: `capacity` is one table's), longer otherwise.
pub fn next_interval(current: Duration, left: usize, collected: usize, capacity: usize) -> Duration {
    let busy = collected >= capacity / 20 || left >= capacity / 2;
    let next = if busy { current / 2 } else { current * 2 };
    next.clamp(MIN_INTERVAL, MAX_INTERVAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_follows_the_work() {
        let cap = 262_144;
        let t = Duration::from_secs(10);
        assert_eq!(next_interval(t, 100, 10, cap), Duration::from_secs(20));
        assert_eq!(next_interval(MAX_INTERVAL, 100, 10, cap), MAX_INTERVAL);
        // Much collected, or the table half full: sooner, down to the floor.
        assert_eq!(next_interval(t, 100, cap / 20, cap), Duration::from_secs(5));
        assert_eq!(next_interval(t, cap / 2, 0, cap), Duration::from_secs(5));
        assert_eq!(next_interval(MIN_INTERVAL, cap, cap, cap), MIN_INTERVAL);
    }
}
