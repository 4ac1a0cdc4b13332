//! PyTorch's device layout with `expandable_segments:True`, emulated on a trace: how much
//! memory PyTorch's caching allocator would reserve for a recorded request stream, so that
//! a replay through pinpool can be held against it without a GPU (the torch judge holds
//! pinpool's peak device memory against this configuration on real models).
//!
//! Owns the emulation and nothing else; it follows the rules of `CUDACachingAllocator` as
//! PyTorch documents and implements them, not its code:
//! - requests round up to 512 bytes; those up to 1 MiB go to the small pool, the rest to
//!   the large pool, and each (stream, pool) has one expandable segment of its own;
//! - a request takes the smallest free mapped block of its stream's pool that holds it (the
//!   lowest address among equals); failing that, the segment maps pages at its end (2 MiB
//!   pages in the small pool, 20 MiB in the large), merged with a free block that ends
//!   there;
//! - the block is split when the rest is at least 512 bytes (small pool) or more than
//!   1 MiB (large pool); otherwise the request holds it whole;
//! - a freed block merges with free neighbours; nothing is unmapped (PyTorch unmaps only on
//!   `empty_cache` or when the driver is out of memory, neither of which a replay does).
//!
//! Streams' events and `record_stream` are not modelled: a freed block is free at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::trace::{Trace, TraceEvent};

/// Requests are rounded up to a multiple of this.
const ROUND: u64 = 512;
/// Requests up to this size are served from the small pool.
const SMALL_MAX: u64 = 1 << 20;
/// The small pool's segments map pages of this size.
const SMALL_PAGE: u64 = 2 << 20;
/// The large pool's segments map pages of this size.
const LARGE_PAGE: u64 = 20 << 20;

/// What the emulated allocator reserved and handed out over a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchLayout {
    /// The peak of bytes mapped, over all segments (PyTorch's `reserved_bytes.all.peak`).
    pub peak_reserved: u64,
    /// The peak of bytes in blocks handed out, rounding and unsplit rests included
    /// (`allocated_bytes.all.peak`).
    pub peak_allocated: u64,
}

/// A segment's key: the stream, and whether it is the small pool's.
type SegKey = (u64, bool);

/// Where an allocation lives: its segment, offset and block size.
type Placed = (SegKey, u64, u64);

/// One stream's segment of one pool.
#[derive(Default)]
struct Segment {
    /// Bytes mapped from the segment's start.
    mapped: u64,
    /// Free blocks as (size, offset).
    free: BTreeSet<(u64, u64)>,
    /// Every block, free or not: offset -> (size, free).
    blocks: BTreeMap<u64, (u64, bool)>,
}

impl Segment {
    /// Takes a block for `size` bytes (rounded); returns its offset and size.
    fn take(&mut self, size: u64, small: bool) -> (u64, u64) {
        let found = self.free.range((size, 0)..).next().copied();
        let (len, at) = match found {
            Some(f) => {
                self.free.remove(&f);
                f
            }
            None => self.extend(size, small),
        };
        let rest = len - size;
        let split = if small {
            rest >= ROUND
        } else {
            rest > SMALL_MAX
        };
        if split {
            self.blocks.insert(at, (size, false));
            self.blocks.insert(at + size, (rest, true));
            self.free.insert((rest, at + size));
            (at, size)
        } else {
            self.blocks.insert(at, (len, false));
            (at, len)
        }
    }

    /// Maps pages at the segment's end for a block of `size` bytes, taking in the free block
    /// that ends there; returns the block as (size, offset), out of the free set.
    fn extend(&mut self, size: u64, small: bool) -> (u64, u64) {
        let page = if small { SMALL_PAGE } else { LARGE_PAGE };
        let tail = self
            .blocks
            .range(..self.mapped)
            .next_back()
            .filter(|(&at, &(len, free))| free && at + len == self.mapped)
            .map(|(&at, &(len, _))| (at, len));
        let (at, have) = match tail {
            Some((at, len)) => {
                self.free.remove(&(len, at));
                self.blocks.remove(&at);
                (at, len)
            }
            None => (self.mapped, 0),
        };
        let add = (size - have).div_ceil(page) * page;
        self.mapped += add;
        (have + add, at)
    }

    /// Gives back the block at `at`, merging it with free neighbours.
    fn give(&mut self, at: u64) {
        let Some((mut len, _)) = self.blocks.remove(&at) else {
            return;
        };
        let mut start = at;
        if let Some((&next_len, true)) = self.blocks.get(&(at + len)).map(|(l, f)| (l, *f)) {
            self.blocks.remove(&(at + len));
            self.free.remove(&(next_len, at + len));
            len += next_len;
        }
        let prev = self
            .blocks
            .range(..at)
            .next_back()
            .filter(|(&p, &(plen, free))| free && p + plen == at)
            .map(|(&p, &(plen, _))| (p, plen));
        if let Some((p, plen)) = prev {
            self.blocks.remove(&p);
            self.free.remove(&(plen, p));
            start = p;
            len += plen;
        }
        self.blocks.insert(start, (len, true));
        self.free.insert((len, start));
    }
}

/// Replays `trace` through the emulated layout.
///
/// ```
/// use pinpool_tools::trace::Trace;
/// use pinpool_tools::torch_layout::emulate;
///
/// // Two 30 MiB tensors, the first freed before a 20 MiB one that fits in its place.
/// let text = "a 0 31457280 0\na 1 31457280 0\nf 0\na 2 20971520 0\n";
/// let layout = emulate(&Trace::read_text(text.as_bytes(), "inline")?);
/// assert_eq!(layout.peak_reserved, 60 << 20); // three 20 MiB pages
/// assert_eq!(layout.peak_allocated, 60 << 20);
/// # Ok::<(), pinpool_tools::trace::TraceError>(())
/// ```
pub fn emulate(trace: &Trace) -> TorchLayout {
    let mut segments: HashMap<SegKey, Segment> = HashMap::new();
    let mut live: Vec<Option<Placed>> = vec![None; trace.allocation_count()];
    let (mut reserved, mut allocated) = (0u64, 0u64);
    let mut out = TorchLayout {
        peak_reserved: 0,
        peak_allocated: 0,
    };
    for event in trace.events() {
        match *event {
            TraceEvent::Alloc { id, bytes, stream } => {
                let size = bytes.max(1).div_ceil(ROUND) * ROUND;
                let small = size <= SMALL_MAX;
                let seg = segments.entry((stream, small)).or_default();
                let before = seg.mapped;
                let (at, len) = seg.take(size, small);
                reserved += seg.mapped - before;
                allocated += len;
                live[id] = Some(((stream, small), at, len));
                out.peak_reserved = out.peak_reserved.max(reserved);
                out.peak_allocated = out.peak_allocated.max(allocated);
            }
            TraceEvent::Free { id } => {
                if let Some((key, at, len)) = live[id].take() {
                    if let Some(seg) = segments.get_mut(&key) {
                        seg.give(at);
                    }
                    allocated -= len;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn run(text: &str) -> TorchLayout {
        emulate(&Trace::read_text(text.as_bytes(), "test").unwrap())
    }

    #[test]
    fn a_large_request_maps_whole_large_pages() {
        let l = run("a 0 1048577 0\n");
        assert_eq!(l.peak_reserved, 20 * MIB);
        assert_eq!(l.peak_allocated, MIB + 512);
    }

    #[test]
    fn small_requests_share_two_mib_pages_of_their_own_pool() {
        let l = run("a 0 1000 0\na 1 1000 0\na 2 4194304 0\n");
        assert_eq!(l.peak_reserved, 2 * MIB + 20 * MIB);
        assert_eq!(l.peak_allocated, 2 * 1024 + 4 * MIB);
    }

    #[test]
    fn a_request_takes_the_smallest_free_block_that_holds_it() {
        // 30 MiB at 0, then 2 MiB and 8 MiB in the rest of the two pages; with the 30 MiB
        // and the 8 MiB blocks free, 7.5 MiB takes the 8 MiB one (its 0.5 MiB rest stays
        // with it), so 30 MiB fits again without growth.
        let l = run(concat!(
            "a 0 31457280 0\na 1 2097152 0\na 2 8388608 0\nf 0\nf 2\n",
            "a 3 7864320 0\na 4 31457280 0\n"
        ));
        assert_eq!(l.peak_reserved, 40 * MIB);
        assert_eq!(l.peak_allocated, 40 * MIB);
    }

    #[test]
    fn growth_takes_in_the_free_block_at_the_segment_end() {
        // 15 MiB live, 5 MiB free at the end of the first page: 25 MiB maps only one page
        // more, over the free 5 MiB.
        let l = run("a 0 15728640 0\na 1 26214400 0\n");
        assert_eq!(l.peak_reserved, 40 * MIB);
    }

    #[test]
    fn neighbours_merge_on_free_so_a_larger_request_fits_without_growth() {
        let l = run("a 0 10485760 0\na 1 10485760 0\nf 0\nf 1\na 2 20971520 0\n");
        assert_eq!(l.peak_reserved, 20 * MIB);
    }

    #[test]
    fn streams_do_not_share_segments() {
        let l = run("a 0 10485760 0\nf 0\na 1 10485760 7\n");
        assert_eq!(l.peak_reserved, 40 * MIB);
    }
}
