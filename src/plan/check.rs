//! The plan checker, written independently of the planners: a sweep over time that keeps
//! the live address ranges in an ordered map and looks at the neighbours of each new range.
//! O(n log n). Every plan a test produces goes through it.

use std::collections::BTreeMap;

use super::problem::align_up;
use super::Plan;

/// How a plan is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// An offset is not a multiple of the plan's alignment.
    #[error("allocation {index} at offset {offset} is not aligned to {alignment}")]
    Misaligned {
        /// The allocation.
        index: usize,
        /// Its offset.
        offset: u64,
        /// The plan's alignment.
        alignment: u64,
    },
    /// An allocation (with its size rounded up to the alignment) ends past the arena.
    #[error("allocation {index} at offset {offset} of {size} bytes ends past the arena ({arena_size} bytes)")]
    OutOfArena {
        /// The allocation.
        index: usize,
        /// Its offset.
        offset: u64,
        /// Its aligned size (saturated if rounding overflows).
        size: u64,
        /// The plan's arena size.
        arena_size: u64,
    },
    /// Two allocations live at the same time share bytes.
    #[error("allocations {first} and {second} are live at the same time and overlap in the arena")]
    Overlap {
        /// One allocation.
        first: usize,
        /// The other.
        second: usize,
    },
}

/// Checks that `plan` is sound: every offset aligned, every allocation inside the arena,
/// and no two allocations whose lifetimes overlap share an address.
///
/// ```
/// use pinpool::plan::{check, Plan, Violation};
/// use pinpool::plan::Lifetime;
/// let l = |id, start, end| Lifetime { id, size: 64, start, end };
/// let plan = Plan::from_parts(vec![l(0, 0, 2), l(1, 1, 3)], vec![0, 0], 64, 64)?;
/// assert_eq!(check(&plan), Err(Violation::Overlap { first: 0, second: 1 }));
/// # Ok::<(), pinpool::plan::PlanError>(())
/// ```
pub fn check(plan: &Plan) -> Result<(), Violation> {
    let alignment = plan.alignment();
    let arena_size = plan.arena_size();
    let mut sizes = Vec::with_capacity(plan.len());
    for (index, (lifetime, &offset)) in plan.lifetimes().iter().zip(plan.offsets()).enumerate() {
        if offset % alignment != 0 {
            return Err(Violation::Misaligned {
                index,
                offset,
                alignment,
            });
        }
        let size = align_up(lifetime.size, alignment).unwrap_or(u64::MAX);
        if offset
            .checked_add(size)
            .map_or(true, |end| end > arena_size)
        {
            return Err(Violation::OutOfArena {
                index,
                offset,
                size,
                arena_size,
            });
        }
        sizes.push(size);
    }

    // (time, 0 = end / 1 = start, index): at equal times ends come first (half-open).
    let mut events = Vec::with_capacity(2 * plan.len());
    for (index, lifetime) in plan.lifetimes().iter().enumerate() {
        if sizes[index] > 0 && lifetime.start < lifetime.end {
            events.push((lifetime.start, 1u8, index));
            events.push((lifetime.end, 0u8, index));
        }
    }
    events.sort_unstable();

    // Live ranges: start offset -> (end offset, allocation). Disjoint by construction.
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for (_, kind, index) in events {
        let lo = plan.offsets()[index];
        let hi = lo + sizes[index];
        if kind == 0 {
            live.remove(&lo);
            continue;
        }
        if let Some((_, &(below_end, other))) = live.range(..=lo).next_back() {
            if below_end > lo {
                return Err(overlap(index, other));
            }
        }
        if let Some((&above_start, &(_, other))) = live.range(lo..).next() {
            if above_start < hi {
                return Err(overlap(index, other));
            }
        }
        live.insert(lo, (hi, index));
    }
    Ok(())
}

fn overlap(a: usize, b: usize) -> Violation {
    Violation::Overlap {
        first: a.min(b),
        second: a.max(b),
    }
}
