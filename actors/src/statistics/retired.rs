//! The counts of pools that are gone: a stream's pool retired once it held nothing (see the
//! router) takes its accumulated counts (allocations made, retries, timings) and the peaks it
//! reached with it, and the engine's totals must not lose them. Its values now are all zero
//! (it held nothing), so the totals stay what they would be had the pool lived on, idle.
//!
//! Published whole (`ArcSwap`): the router adds a pool as it retires it, the engine's resets
//! start the counts over, and readers merge one snapshot.

use arc_swap::ArcSwap;

use crate::statistics::counters::Stat;
use crate::statistics::device_stats::DeviceStats;
use crate::statistics::stats::{HostStats, PoolStats};

/// What retired pools counted.
#[derive(Clone, Default)]
struct Counted {
    host: HostStats,
    device: Option<DeviceStats>,
}

impl Counted {
    /// Every statistic with a peak, host and device.
    fn stats_mut(&mut self) -> impl Iterator<Item = &mut Stat> {
        let h = &mut self.host;
        let host = [
            &mut h.allocations,
            &mut h.allocated_bytes,
            &mut h.active_requests,
            &mut h.active_bytes,
        ];
        let device = self.device.iter_mut().flat_map(|d| d.stats_mut());
        host.into_iter().chain(device)
    }
}

/// The counts of an engine's retired pools.
#[derive(Default)]
pub(crate) struct Retired(ArcSwap<Counted>);

impl Retired {
    /// Adds the counts of a pool that holds nothing and is gone.
    pub(crate) fn absorb(&self, stats: &PoolStats) {
        let (host, device) = (stats.read(), stats.read_device());
        self.0.rcu(|c| {
            let mut c = Counted::clone(c);
            c.host.merge(&host);
            match (&mut c.device, &device) {
                (Some(d), Some(o)) => d.merge(o),
                (None, Some(o)) => c.device = Some(o.clone()),
                _ => {}
            }
            c
        });
    }

    /// The host counts of the retired pools.
    pub(crate) fn host(&self) -> HostStats {
        self.0.load().host.clone()
    }

    /// The device counts of the retired pools (`None`: none retired, or no device counts).
    pub(crate) fn device(&self) -> Option<DeviceStats> {
        self.0.load().device.clone()
    }

    /// Starts every peak over (each is its value now: zero).
    pub(crate) fn reset_peaks(&self) {
        self.0.rcu(|c| {
            let mut c = Counted::clone(c);
            c.stats_mut().for_each(|s| s.peak = s.current);
            c
        });
    }

    /// Zeroes the accumulated counts, keeping the peaks.
    pub(crate) fn reset_accumulated(&self) {
        self.0.rcu(|c| {
            let mut kept = Counted::clone(c);
            let mut fresh = Counted {
                host: HostStats::default(),
                device: c.device.as_ref().map(|_| DeviceStats::default()),
            };
            for (f, k) in fresh.stats_mut().zip(kept.stats_mut()) {
                f.peak = k.peak;
            }
            fresh
        });
    }
}
