//! The address pre-filter: one array read tells whether a packet can be
//! ours before any hash lookup (see `dataplane_common::filter`).

use dataplane_common::{
    addr::Addr,
    config::{DpConfig, config_flags},
    filter::slot,
};

use crate::maps::ADDR_FILTER;

/// `false` when `addr` is certainly not in `set`.
#[inline(always)]
pub fn maybe<A: Addr>(cfg: &DpConfig, set: u32, addr: &A) -> bool {
    // Until the agent has written the bitmaps, everything may be ours.
    if cfg.flags & config_flags::FILTER_READY == 0 {
        return true;
    }
    let (word, bit) = slot(set, addr.fold());
    ADDR_FILTER.get(word).is_none_or(|w| *w & bit != 0)
}
