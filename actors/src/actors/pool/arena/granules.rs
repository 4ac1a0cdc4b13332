//! The books of an arena's mapped granules: which are mapped and by which map call, how
//! many lent pieces touch each and when one last did, which are idle (mapped, touched by
//! no lent piece), and the map calls that map a run of granules.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::{Arena, Granule};
use crate::vocab::runtime::Runtime;

/// A run is mapped in units of at least this share of it (and a power of two granules),
/// however small the pool's peak still is: a large block's first run is a few map calls
/// even before the peak has grown (the ResNet-50 replay: 51 calls a run instead of 95, peak
/// reserved over peak live 1.06; at a quarter, 1.11).
const UNITS_PER_RUN: usize = 8;

impl<R: Runtime> Arena<R> {
    /// Enters granules just mapped by one map call, held by the one piece that needed them.
    pub(in crate::actors::pool) fn mapped(&mut self, granules: &[usize]) {
        if granules.is_empty() {
            return;
        }
        let map = self.next_map;
        self.next_map += 1;
        self.maps.insert(map, granules.len());
        for &i in granules {
            self.granules.insert(
                i,
                Granule {
                    refs: 1,
                    used: self.clock,
                    map,
                },
            );
            self.mapped_bits.set(i, true);
        }
        if let Some(m) = self.segment.arena_map() {
            granules.iter().for_each(|&i| m.set(i, true));
            m.set_start(granules[0], true);
            m.live_maps.fetch_add(1, Ordering::Relaxed);
        }
        self.refit_granules(granules, true);
    }

    /// Enters `granules` (in order) as mapped or unmapped in the index of fits, and refits
    /// the spans they cover.
    pub(super) fn refit_granules(&mut self, granules: &[usize], mapped: bool) {
        let g = self.granule;
        for (o, l) in self.runs(granules) {
            if mapped {
                self.fits.map(o / g, (o + l) / g);
            } else {
                self.fits.unmap(o / g, (o + l) / g);
            }
            self.refit(o, o + l);
        }
    }

    /// Map calls none of whose granules a lent piece touches, as (last use, first granule,
    /// granules).
    pub(super) fn idle_calls(&self) -> Vec<(u64, usize, usize)> {
        let mut calls: HashMap<u64, (u64, usize, usize, bool)> = HashMap::new();
        for (&i, gr) in &self.granules {
            let e = calls.entry(gr.map).or_insert((0, i, 0, true));
            e.0 = e.0.max(gr.used);
            e.1 = e.1.min(i);
            e.2 += 1;
            e.3 &= gr.refs == 0;
        }
        calls
            .into_values()
            .filter(|c| c.3)
            .map(|(used, first, n, _)| (used, first, n))
            .collect()
    }

    /// Strikes unmapped granules; returns how many map calls have no granule mapped any more.
    pub(in crate::actors::pool) fn unmapped(&mut self, granules: &[usize]) -> usize {
        let mut ended = 0;
        for i in granules {
            let Some(gr) = self.granules.remove(i) else {
                continue;
            };
            self.mapped_bits.set(*i, false);
            if let Some(m) = self.segment.arena_map() {
                m.set(*i, false);
                m.set_start(*i, false);
            }
            if let Some(n) = self.maps.get_mut(&gr.map) {
                *n -= 1;
                if *n == 0 {
                    self.maps.remove(&gr.map);
                    ended += 1;
                }
            }
        }
        if let Some(m) = self.segment.arena_map() {
            m.live_maps.fetch_sub(ended, Ordering::Relaxed);
        }
        let mut gone = granules.to_vec();
        gone.sort_unstable();
        self.refit_granules(&gone, false);
        ended
    }

    /// The ranges to unmap to give back `bytes` of idle memory (all of it for `usize::MAX`),
    /// least recently used first: runs of idle granules, or, when the source unmaps only
    /// whole map calls, the runs of map calls none of whose granules a lent piece touches;
    /// only memory last used before the arena's clock read `before` (see [`Self::clock`]).
    pub(in crate::actors::pool) fn idle_runs(
        &self,
        bytes: usize,
        before: u64,
    ) -> Vec<(usize, usize)> {
        if !self.whole {
            return self.runs(&self.idle_granules(bytes, before));
        }
        let mut idle = self.idle_calls();
        idle.retain(|c| c.0 < before);
        idle.sort_unstable();
        let mut out = Vec::new();
        let mut freed = 0;
        for (_, first, n) in idle {
            if freed >= bytes {
                break;
            }
            out.push((first * self.granule, n * self.granule));
            freed = freed.saturating_add(n * self.granule);
        }
        out
    }

    /// Mapped granules that no lent piece touches, last used before the clock read `before`,
    /// least recently used first, until they make `bytes` (all of them when `bytes` is
    /// `usize::MAX`).
    pub(in crate::actors::pool) fn idle_granules(&self, bytes: usize, before: u64) -> Vec<usize> {
        let mut idle: Vec<(u64, usize)> = self
            .granules
            .iter()
            .filter(|(_, gr)| gr.refs == 0 && gr.used < before)
            .map(|(&i, gr)| (gr.used, i))
            .collect();
        idle.sort_unstable();
        let n = bytes.div_ceil(self.granule).min(idle.len());
        let mut out: Vec<usize> = idle[..n].iter().map(|&(_, i)| i).collect();
        out.sort_unstable();
        out
    }

    /// The calls that map `granules`, one per maximal run, as (offset, bytes, unit): each
    /// unit is one mapping. Where the source unmaps only whole mappings, runs of at least
    /// `whole_from` bytes are one unit, and shorter ones are cut into units of a power of two
    /// granules up to `max_unit` bytes or an eighth of the run, whichever is more (see
    /// `UNITS_PER_RUN`), largest first, so that idle units fit the places of later runs (see
    /// `plan_moves`); elsewhere a run is one unit.
    pub(in crate::actors::pool) fn map_calls(
        &self,
        granules: &[usize],
        whole_from: usize,
        max_unit: usize,
    ) -> Vec<(usize, usize, usize)> {
        let g = self.granule;
        let max_units = (max_unit / g).max(1);
        let mut out = Vec::new();
        for (o, l) in self.runs(granules) {
            if !self.whole || l >= whole_from {
                out.push((o, l, l));
                continue;
            }
            let (mut at, end) = (o / g, (o + l) / g);
            let most = max_units.max((end - at) / UNITS_PER_RUN).max(1);
            while at < end {
                let n = 1usize << (usize::BITS - 1 - (end - at).min(most).leading_zeros());
                out.push((at * g, n * g, n * g));
                at += n;
            }
        }
        out
    }

    /// Maximal runs of consecutive granules, as (offset, bytes).
    pub(in crate::actors::pool) fn runs(&self, granules: &[usize]) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &i in granules {
            match runs.last_mut() {
                Some((o, l)) if *o + *l == i * self.granule => *l += self.granule,
                _ => runs.push((i * self.granule, self.granule)),
            }
        }
        runs
    }
}
