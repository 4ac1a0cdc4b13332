//! Peer access to mapped device memory: which devices each device's mapped memory is open
//! to, and the spans mapped so far with the devices each was opened to.
//!
//! Memory mapped with CUDA's virtual memory calls is reachable only by the devices its
//! mapping names (`cuMemSetAccess`), whatever the contexts' peer access says. When peer
//! access is granted after memory was mapped, the spans mapped before are opened to the new
//! peer too (as PyTorch's expandable segments do), so that a copy or a kernel on the peer
//! reaches every block, old or new.
//!
//! No lock: the pool actors that map and unmap never wait for a grant's driver calls. Each
//! device's spans are a published map, replaced whole on each change (a map call is rare
//! and costs milliseconds). The order that keeps every span open to every peer granted,
//! however a map and a grant interleave: a memory source maps a span open to the peers
//! granted so far, publishes it here, then reads the grants again and opens it to any
//! granted since; a grant sets its bit, then opens every span published. Between the two
//! steps of each side a full fence stands, so at least one side sees the other (both may
//! open the span: opening is idempotent). A span is taken out before it is unmapped; a grant
//! that fails to open a span no longer published ignores the failure. Grants are never
//! taken back (peer access lasts as long as the context).

use std::collections::BTreeMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

/// Mapped spans by start address: their length and the devices they are open to.
type Spans = BTreeMap<usize, (usize, u64)>;

/// One device's grants and mapped spans.
#[derive(Debug, Default)]
struct Owner {
    /// The devices given access, a bit per ordinal (devices past the 64th are left out).
    granted: AtomicU64,
    /// The spans mapped now.
    spans: ArcSwap<Spans>,
}

impl Owner {
    /// Notes that the span at `addr` of `len` bytes, if still published, is open to `peers`.
    fn opened(&self, addr: usize, len: usize, peers: u64) {
        self.spans.rcu(|spans| {
            let mut next = Spans::clone(spans);
            if let Some((l, open_to)) = next.get_mut(&addr) {
                if *l == len {
                    *open_to |= peers;
                }
            }
            next
        });
    }

    /// Whether the span at `addr` of `len` bytes is published.
    fn holds(&self, addr: usize, len: usize) -> bool {
        self.spans.load().get(&addr).is_some_and(|&(l, _)| l == len)
    }
}

/// The grants of access to each device's mapped memory, and its mapped spans.
#[derive(Debug)]
pub(crate) struct MappedAccess {
    owners: Box<[Owner]>,
}

/// The bit of device `device` in a set of devices.
fn bit(device: usize) -> u64 {
    if device < 64 {
        1 << device
    } else {
        0
    }
}

impl MappedAccess {
    /// No grants and no spans, among `count` devices.
    pub(crate) fn new(count: usize) -> Self {
        Self {
            owners: (0..count).map(|_| Owner::default()).collect(),
        }
    }

    /// The devices, besides `owner` itself, that its memory mapped now is opened to.
    pub(crate) fn granted(&self, owner: usize) -> u64 {
        self.owners
            .get(owner)
            .map_or(0, |o| o.granted.load(Ordering::SeqCst))
    }

    /// Notes `[addr, addr + len)` of `owner`'s memory, just mapped and opened to
    /// `opened` (what [`MappedAccess::granted`] said before the map). Where peers were
    /// granted since, opens the span to all of them with `open(peers)`; a failure there is
    /// logged, and the span keeps the access it has.
    pub(crate) fn mapped<E: std::fmt::Display>(
        &self,
        owner: usize,
        addr: usize,
        len: usize,
        opened: u64,
        open: impl FnOnce(u64) -> Result<(), E>,
    ) {
        let Some(o) = self.owners.get(owner) else {
            return;
        };
        o.spans.rcu(|spans| {
            let mut next = Spans::clone(spans);
            next.insert(addr, (len, opened));
            next
        });
        fence(Ordering::SeqCst);
        let granted = o.granted.load(Ordering::SeqCst);
        if granted & !opened != 0 {
            match open(granted) {
                Ok(()) => o.opened(addr, len, granted),
                Err(e) => tracing::warn!(
                    "device {owner}: {len} bytes mapped at {addr:#x} stay closed to peers \
                     granted access meanwhile: {e}"
                ),
            }
        }
    }

    /// Forgets the spans of `owner` that start in `[addr, addr + len)`: called before they
    /// are unmapped.
    pub(crate) fn unmapped(&self, owner: usize, addr: usize, len: usize) {
        if let Some(o) = self.owners.get(owner) {
            o.spans.rcu(|spans| {
                let mut next = Spans::clone(spans);
                next.retain(|&a, _| !(addr..addr.saturating_add(len)).contains(&a));
                next
            });
        }
    }

    /// Gives `accessor` access to `owner`'s memory: to what is mapped from now on, and to
    /// every span mapped so far, each opened with `open(addr, len, peers)` (`peers` all
    /// the devices granted). Stops at the first failure on a span still mapped and returns
    /// it: the spans opened before it stay open, the grant stays (a later grant of the pair
    /// tries the rest again).
    pub(crate) fn grant<E>(
        &self,
        owner: usize,
        accessor: usize,
        mut open: impl FnMut(usize, usize, u64) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(o) = self.owners.get(owner) else {
            return Ok(());
        };
        if accessor == owner {
            return Ok(());
        }
        let peers = o.granted.fetch_or(bit(accessor), Ordering::SeqCst) | bit(accessor);
        fence(Ordering::SeqCst);
        let spans = o.spans.load_full();
        for (&addr, &(len, open_to)) in spans.iter() {
            if open_to & peers == peers {
                continue;
            }
            match open(addr, len, peers) {
                Ok(()) => o.opened(addr, len, peers),
                // Unmapped meanwhile: nothing left to open.
                Err(_) if !o.holds(addr, len) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether `accessor` reaches all of `[addr, addr + len)` of `owner`'s mapped memory;
    /// `None` where no noted span holds `addr` (memory that is not mapped this way, which
    /// the contexts' peer access covers).
    pub(crate) fn reaches(
        &self,
        owner: usize,
        accessor: usize,
        addr: usize,
        len: usize,
    ) -> Option<bool> {
        if owner == accessor {
            return Some(true);
        }
        let o = self.owners.get(owner)?;
        let spans: Arc<Spans> = o.spans.load_full();
        let (&start, &(first_len, _)) = spans.range(..=addr).next_back()?;
        if addr >= start + first_len {
            return None;
        }
        // The range may run over several spans mapped back to back.
        let end = addr.saturating_add(len.max(1));
        let mut at = start;
        for (&a, &(l, open_to)) in spans.range(start..end) {
            if a != at || open_to & bit(accessor) == 0 {
                return Some(false);
            }
            at = a + l;
        }
        Some(at >= end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never(_: u64) -> Result<(), String> {
        panic!("nothing to open")
    }

    #[test]
    fn a_grant_opens_the_spans_mapped_before_it() {
        let access = MappedAccess::new(2);
        access.mapped(0, 0x1000, 0x1000, access.granted(0), never);
        assert_eq!(access.reaches(0, 1, 0x1000, 0x1000), Some(false));
        let mut opened = Vec::new();
        access
            .grant(0, 1, |a, l, p| {
                opened.push((a, l, p));
                Ok::<_, String>(())
            })
            .unwrap();
        assert_eq!(opened, vec![(0x1000, 0x1000, 0b10)]);
        assert_eq!(access.reaches(0, 1, 0x1000, 0x1000), Some(true));
        assert_eq!(access.granted(0), 0b10);
        assert_eq!(access.granted(1), 0, "grants are one way");
    }

    #[test]
    fn a_map_that_read_the_grants_before_a_grant_opens_its_span_when_noted() {
        let access = MappedAccess::new(3);
        let read_before = access.granted(0);
        access.grant(0, 2, |_, _, _| Ok::<_, String>(())).unwrap();
        let mut asked = None;
        access.mapped(0, 0x4000, 0x2000, read_before, |p| {
            asked = Some(p);
            Ok::<_, String>(())
        });
        assert_eq!(asked, Some(0b100));
        assert_eq!(access.reaches(0, 2, 0x4000, 0x2000), Some(true));
        assert_eq!(access.reaches(0, 1, 0x4000, 0x2000), Some(false));
    }

    #[test]
    fn reach_spans_back_to_back_mappings_and_stops_at_a_gap_or_an_unmap() {
        let access = MappedAccess::new(2);
        access.grant(0, 1, |_, _, _| Ok::<_, String>(())).unwrap();
        access.mapped(0, 0x1000, 0x1000, 0b10, never);
        access.mapped(0, 0x2000, 0x1000, 0b10, never);
        access.mapped(0, 0x4000, 0x1000, 0b10, never);
        assert_eq!(access.reaches(0, 1, 0x1800, 0x1000), Some(true));
        assert_eq!(access.reaches(0, 1, 0x1800, 0x2000), Some(false), "gap");
        assert_eq!(access.reaches(0, 1, 0x3000, 0x10), None, "not mapped");
        access.unmapped(0, 0x2000, 0x1000);
        assert_eq!(access.reaches(0, 1, 0x1800, 0x1000), Some(false));
        assert_eq!(access.reaches(0, 1, 0x2000, 0x10), None);
        assert_eq!(access.reaches(0, 0, 0x2000, 0x10), Some(true), "its own");
    }

    #[test]
    fn a_failed_open_is_returned_and_a_later_grant_retries_it() {
        let access = MappedAccess::new(2);
        access.mapped(0, 0x1000, 0x1000, 0, never);
        assert_eq!(access.grant(0, 1, |_, _, _| Err("refused")), Err("refused"));
        assert_eq!(access.reaches(0, 1, 0x1000, 0x1000), Some(false));
        access.grant(0, 1, |_, _, _| Ok::<_, &str>(())).unwrap();
        assert_eq!(access.reaches(0, 1, 0x1000, 0x1000), Some(true));
    }

    /// However maps and a grant interleave on threads, every span ends open to the peer.
    #[test]
    fn concurrent_maps_and_a_grant_leave_every_span_open() {
        for round in 0..50 {
            let access = std::sync::Arc::new(MappedAccess::new(2));
            let mappers: Vec<_> = (0..4)
                .map(|t| {
                    let access = access.clone();
                    std::thread::spawn(move || {
                        for i in 0..64usize {
                            let addr = (t * 64 + i + 1) * 0x1000;
                            let read = access.granted(0);
                            std::thread::yield_now();
                            access.mapped(0, addr, 0x1000, read, |_| Ok::<_, String>(()));
                        }
                    })
                })
                .collect();
            if round % 2 == 0 {
                std::thread::yield_now();
            }
            access.grant(0, 1, |_, _, _| Ok::<_, String>(())).unwrap();
            for m in mappers {
                m.join().unwrap();
            }
            for addr in (1..=256).map(|k| k * 0x1000) {
                assert_eq!(access.reaches(0, 1, addr, 0x1000), Some(true), "{addr:#x}");
            }
        }
    }
}
