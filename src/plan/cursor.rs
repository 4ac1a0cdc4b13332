//! Serving a later run from a plan: [`PlanCursor`] answers "allocation number k of size s"
//! with the planned offset, or with the first [`Mismatch`], in O(1) and without allocating;
//! [`Plan::validate`](super::Plan::validate) runs a whole observed event list through one.
//!
//! Allocation number k is the k-th planned allocation in start order (the input order for
//! recordings and text traces). A free may come any time before the plan needs its bytes:
//! allocation j must be freed before the first allocation that starts at or after j's end
//! (its "deadline"). Earlier frees, and reordered frees between two allocations, are fine;
//! PyTorch demands the exact recorded position instead. Unlike PyTorch's
//! `validate_allocation_plan`, which dereferences `find()`'s result before comparing it with
//! `end()`, a free of an id that was never served is reported, not undefined behaviour.

use super::Plan;

/// The first way a run departs from its plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    /// More allocations than planned.
    #[error("allocation number {number} was not planned (the plan has {planned})")]
    TooManyAllocations {
        /// The allocation's number in the run.
        number: usize,
        /// Planned allocations.
        planned: usize,
    },
    /// The run stopped before making every planned allocation.
    #[error("the run made {made} of {planned} planned allocations")]
    TooFewAllocations {
        /// Allocations made.
        made: usize,
        /// Planned allocations.
        planned: usize,
    },
    /// Allocation `number` asks for a size other than the planned one.
    #[error("allocation number {number} asks for {seen} bytes, the plan has {expected}")]
    SizeMismatch {
        /// The allocation's number in the run.
        number: usize,
        /// Planned size.
        expected: u64,
        /// Requested size.
        seen: u64,
    },
    /// Allocation `number` came while `still_live`, which the plan freed before it, is live:
    /// the frees came in an order the plan cannot serve.
    #[error("allocation number {number} came before the free of allocation {still_live}")]
    FreedLate {
        /// The allocation's number in the run.
        number: usize,
        /// The allocation that should have been freed first.
        still_live: usize,
    },
    /// A free of an allocation number the run has not made.
    #[error("free of allocation number {id}, which was not made")]
    UnknownFree {
        /// The number given.
        id: usize,
    },
    /// A second free of the same allocation.
    #[error("allocation number {id} freed twice")]
    DoubleFree {
        /// The number given.
        id: usize,
    },
}

/// The first mismatch of an observed run, and where it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("event {event}: {mismatch}")]
pub struct ValidationError {
    /// 0-based index of the event (the number of events, for a run that stops short).
    pub event: usize,
    /// What went wrong.
    pub mismatch: Mismatch,
}

/// One event of an observed run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Observed {
    /// A request for `size` bytes; it gets the next allocation number.
    Alloc {
        /// Requested bytes.
        size: u64,
    },
    /// The free of allocation number `id` of the run.
    Free {
        /// The allocation number.
        id: usize,
    },
}

/// A successfully served allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Its number in the run, to pass to [`PlanCursor::on_free`].
    pub number: usize,
    /// Its index in the plan ([`Plan::lifetimes`]).
    pub index: usize,
    /// Its offset in the arena.
    pub offset: u64,
}

/// Serves one run at a time from a plan. Calls are O(1) and allocate nothing; after a
/// mismatch the cursor is unchanged (callers typically fall back to ordinary allocation
/// until [`PlanCursor::reset`] at the next iteration).
#[derive(Clone, Debug)]
pub struct PlanCursor {
    /// Per allocation number: planned size, offset, plan index, deadline.
    size: Vec<u64>,
    offset: Vec<u64>,
    index: Vec<usize>,
    deadline: Vec<usize>,
    /// `due[k]`: how many allocations have a deadline at or before number k.
    due: Vec<usize>,
    /// Frees already made whose deadline is still ahead, counted per deadline.
    early: Vec<usize>,
    freed: Vec<bool>,
    next: usize,
    freed_due: usize,
}

impl PlanCursor {
    /// A cursor at the start of a run of `plan`. O(n log n).
    pub fn new(plan: &Plan) -> PlanCursor {
        let lifetimes = plan.lifetimes();
        let n = lifetimes.len();
        let mut index: Vec<usize> = (0..n).collect();
        index.sort_by_key(|&i| (lifetimes[i].start, i));
        let starts: Vec<u64> = index.iter().map(|&i| lifetimes[i].start).collect();
        let deadline: Vec<usize> = index
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let l = &lifetimes[i];
                if l.size == 0 {
                    return n; // takes no bytes, so it is never in the way
                }
                starts.partition_point(|&s| s < l.end).max(k + 1).min(n)
            })
            .collect();
        let mut due = vec![0usize; n + 1];
        for &d in &deadline {
            due[d] += 1;
        }
        for k in 1..=n {
            due[k] += due[k - 1];
        }
        PlanCursor {
            size: index.iter().map(|&i| lifetimes[i].size).collect(),
            offset: index.iter().map(|&i| plan.offsets()[i]).collect(),
            index,
            deadline,
            due,
            early: vec![0; n + 1],
            freed: vec![false; n],
            next: 0,
            freed_due: 0,
        }
    }

    /// Serves the run's next allocation, of `size` bytes.
    pub fn on_alloc(&mut self, size: u64) -> Result<Served, Mismatch> {
        let number = self.next;
        let planned = self.size.len();
        if number >= planned {
            return Err(Mismatch::TooManyAllocations { number, planned });
        }
        if self.size[number] != size {
            return Err(Mismatch::SizeMismatch {
                number,
                expected: self.size[number],
                seen: size,
            });
        }
        if self.freed_due != self.due[number] {
            return Err(Mismatch::FreedLate {
                number,
                still_live: self.first_late(number),
            });
        }
        self.next = number + 1;
        self.freed_due += self.early[self.next];
        Ok(Served {
            number,
            index: self.index[number],
            offset: self.offset[number],
        })
    }

    /// Records the free of allocation number `id` of this run.
    pub fn on_free(&mut self, id: usize) -> Result<(), Mismatch> {
        if id >= self.next {
            return Err(Mismatch::UnknownFree { id });
        }
        if self.freed[id] {
            return Err(Mismatch::DoubleFree { id });
        }
        self.freed[id] = true;
        let deadline = self.deadline[id];
        if deadline <= self.next {
            self.freed_due += 1;
        } else {
            self.early[deadline] += 1;
        }
        Ok(())
    }

    /// Number of allocations served so far in this run.
    pub fn served(&self) -> usize {
        self.next
    }

    /// `Ok` once every planned allocation was served.
    pub fn finish(&self) -> Result<(), Mismatch> {
        if self.next < self.size.len() {
            return Err(Mismatch::TooFewAllocations {
                made: self.next,
                planned: self.size.len(),
            });
        }
        Ok(())
    }

    /// Starts a new run. O(n), allocates nothing.
    pub fn reset(&mut self) {
        self.next = 0;
        self.freed_due = 0;
        self.freed.iter_mut().for_each(|f| *f = false);
        self.early.iter_mut().for_each(|e| *e = 0);
    }

    /// The first allocation due before `number` that is still live (the slow path of a
    /// mismatch).
    fn first_late(&self, number: usize) -> usize {
        (0..number)
            .find(|&j| self.deadline[j] <= number && !self.freed[j])
            .unwrap_or(number)
    }
}

pub(super) fn validate(
    plan: &Plan,
    events: impl IntoIterator<Item = Observed>,
) -> Result<(), ValidationError> {
    let mut cursor = PlanCursor::new(plan);
    let mut count = 0;
    for (event, observed) in events.into_iter().enumerate() {
        let result = match observed {
            Observed::Alloc { size } => cursor.on_alloc(size).map(drop),
            Observed::Free { id } => cursor.on_free(id),
        };
        result.map_err(|mismatch| ValidationError { event, mismatch })?;
        count = event + 1;
    }
    cursor.finish().map_err(|mismatch| ValidationError {
        event: count,
        mismatch,
    })
}
