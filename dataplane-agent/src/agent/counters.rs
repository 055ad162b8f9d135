//! The datapath's counters for `/metrics`, read when a scrape asks for them
//! (at most once per [`MIN_INTERVAL`]) on the metrics server's thread, from
//! the pinned maps opened a second time. The control loop never waits on a
//! walk of a hundred thousand per-CPU counters (tens of milliseconds at 100k
//! Services: a change arriving meanwhile would wait as long), and an agent
//! nobody scrapes spends nothing on them.

use std::{
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use dataplane_common::stats::{Event as DpEvent, Hook};
use tracing::warn;

use super::metrics::SharedMetrics;
use crate::dataplane::{DatapathError, LbMaps};

/// Scrapes closer together than this get the counters read for the last
/// one.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

pub struct DatapathCounters {
    /// The maps, and when they were last read.
    maps: Mutex<(LbMaps, Option<Instant>)>,
}

/// Folds a new estimate of conntrack evictions into `m` (the counter never
/// goes down; the pressure is its rate since the last read, `elapsed` ago).
fn record_evictions(m: &mut super::metrics::Metrics, estimate: u64, elapsed: Option<Duration>) {
    let before = m.conntrack_evictions;
    m.conntrack_evictions = before.max(estimate);
    m.conntrack_pressure = match elapsed {
        Some(d) if !d.is_zero() => (m.conntrack_evictions - before) as f64 / d.as_secs_f64(),
        _ => 0.0,
    };
}

impl DatapathCounters {
    /// Opens the maps pinned under `pins` (the running agent's) for reading.
    pub fn open(pins: &Path) -> Result<Self, DatapathError> {
        let (maps, _) = LbMaps::open_pins(pins)?;
        Ok(Self {
            maps: Mutex::new((maps, None)),
        })
    }

    /// Reads the counters into `metrics`, unless they were read less than
    /// [`MIN_INTERVAL`] ago: batched reads of the counter arrays, one lookup
    /// per Service port that saw traffic (for its name), and the conntrack
    /// and affinity maps' sizes.
    pub fn refresh(&self, metrics: &SharedMetrics) {
        let mut guard = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let (maps, last) = &mut *guard;
        if last.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
            return;
        }
        let elapsed = last.map(|t| t.elapsed());
        *last = Some(Instant::now());
        let mut events = Vec::new();
        for hook in Hook::ALL {
            for event in DpEvent::ALL {
                if let Ok(c) = maps.hook_counter(hook, event)
                    && c.packets > 0
                {
                    events.push((
                        hook.name().to_owned(),
                        event.name().to_owned(),
                        c.packets,
                        c.bytes,
                    ));
                }
            }
        }
        let (max_services, _, _) = maps.capacities();
        let traffic: Vec<(String, u64, u64)> = match maps.all_service_stats(max_services) {
            // Only ids that saw traffic are named.
            Ok(stats) => stats
                .into_iter()
                .filter_map(|(id, c)| {
                    let n = maps.service_name(id).ok().flatten()?;
                    Some((format!("{n}/{}", n.proto), c.packets, c.bytes))
                })
                .collect(),
            Err(e) => {
                warn!(error = %e, "cannot read the per-service counters");
                Vec::new()
            }
        };
        let flows: Vec<(&'static str, u64)> = match maps.flow_stats() {
            Ok(f) => f.into_iter().map(|(s, n)| (s.name(), n)).collect(),
            Err(e) => {
                warn!(error = %e, "cannot read the flow counters");
                Vec::new()
            }
        };
        let occupancy = maps.occupancy();
        let evictions = maps.ct_evictions();
        let mut m = metrics.lock().expect("metrics");
        match evictions {
            Ok(n) => record_evictions(&mut m, n, elapsed),
            Err(e) => warn!(error = %e, "cannot read the conntrack counters"),
        }
        m.flow_events = flows;
        m.datapath_events = events;
        m.service_traffic = traffic;
        m.map_occupancy.extend(occupancy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evictions_never_decrease_and_their_rate_is_the_pressure() {
        let mut m = super::super::metrics::Metrics::default();
        record_evictions(&mut m, 100, None);
        assert_eq!((m.conntrack_evictions, m.conntrack_pressure), (100, 0.0));
        record_evictions(&mut m, 300, Some(Duration::from_secs(2)));
        assert_eq!((m.conntrack_evictions, m.conntrack_pressure), (300, 100.0));
        // A read skewed low (entries written during the walk) keeps the
        // count and reads as no pressure.
        record_evictions(&mut m, 290, Some(Duration::from_secs(1)));
        assert_eq!((m.conntrack_evictions, m.conntrack_pressure), (300, 0.0));
    }
}
