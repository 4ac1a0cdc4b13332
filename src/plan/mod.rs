//! Planning repeated work into one arena, after PyTorch's `CPUProfilingAllocator`: record
//! the allocations of one iteration (sizes, and when each is freed), choose an offset for
//! each inside a single arena so that allocations alive at the same time never share bytes,
//! then serve later iterations from one pinned arena — every allocation becomes pointer
//! arithmetic, with no allocator work at all.
//!
//! # On the allocator
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use pinpool::PinnedAllocator;
//!
//! let allocator = PinnedAllocator::builder().build()?;
//! let stream = allocator.runtime().new_stream()?;
//!
//! // 1. Record one iteration: only allocations made through the recorder count.
//! let rec = allocator.record_plan()?;
//! let a = rec.alloc(1000).await?;
//! let b = rec.alloc(3000).await?;
//! drop(a);
//! let c = rec.alloc(900).await?;
//! drop((b, c));
//! let recording = rec.finish();
//!
//! // 2. Plan it (`Planner::Best`), checked and bound to this allocator.
//! let plan = recording.plan()?;
//! assert_eq!(plan.arena_size(), 4032);
//!
//! // 3. Optionally, check a later run against the plan without serving it.
//! let check = allocator.validate_plan(&plan)?;
//! let x = check.alloc(1000).await?;
//! drop(x);
//! assert!(check.finish().is_err()); // the run stopped after one of three allocations
//!
//! // 4. Serve iterations from one pinned arena.
//! let mut session = allocator.serve_plan(&plan).await?;
//! for _ in 0..3 {
//!     let mut a = session.alloc(1000).await?; // a view of the arena
//!     a.fill(1);
//!     let mut b = session.alloc(3000).await?;
//!     b.record_stream(&stream)?; // its bytes wait for the stream's work
//!     drop(a);
//!     let c = session.alloc(900).await?; // in a's bytes
//!     assert!(b.is_served() && c.is_served());
//!     drop((b, c));
//!     session.reset().await?; // once this iteration's buffers are gone
//! }
//! // A request the plan does not expect is served by the allocator, with a warning.
//! let odd = session.alloc(5).await?;
//! assert!(!odd.is_served() && session.mismatch().is_some());
//! # Ok(()) }
//! ```
//!
//! - **Recording** ([`PinnedAllocator::record_plan`](crate::PinnedAllocator::record_plan),
//!   or the closure forms `record_plan_with` / `record_plan_with_blocking`): a
//!   [`PlanRecorder`] allocates from the pool and notes each allocation and each free (the
//!   [`RecordedBuffer`]s it lends note their drop) on a channel, whose order is the run's
//!   order; clones record from several tasks at once.
//! - **Planning**: [`Recording::plan`] (or [`Recording::plan_with`] a [`Planner`]) gives an
//!   [`ArenaPlan`]: a plan that passed [`check`], bound to the allocator. A plan made
//!   elsewhere is bound with `adopt_plan`, which checks it the same way.
//! - **Validation**: a [`PlanValidator`] lends ordinary pool buffers and reports the first
//!   [`Mismatch`] of the run as a [`ValidationError`].
//! - **Serving**: an [`ArenaSession`] takes one [`PinnedBuffer`](crate::PinnedBuffer) of the
//!   arena's size from the pool and answers each request that matches the plan with a
//!   [`PlanBuffer`] viewing the arena at its planned offset. A request that departs from
//!   the plan (size, order of frees, one too many) is served by the pool with a
//!   `tracing::warn!`, and so is the rest of the iteration; [`ArenaSession::mismatch`] says
//!   why. `reset` starts the next iteration once every buffer of this one is dropped
//!   (`try_reset` refuses instead).
//! - **Streams**: a served buffer's recorded streams get an event when it drops. Planned
//!   bytes whose events have not completed are not handed out again in the iteration (that
//!   request is served by the pool); at a reset with such events left, the arena goes back
//!   to the pool with the streams recorded on it (so the pool reuses it only after them) and
//!   a new arena is taken from the pool. With copies in flight across iterations the pool
//!   thus alternates two cached arenas; without streams the arena is kept.
//! - **One session at a time**: an allocator runs one recording, validation or serving
//!   session at a time ([`PlanSessionError::Nested`] otherwise), and a plan serves or
//!   validates only on the allocator it was made for ([`PlanSessionError::ForeignPlan`]).
//!
//! # The planning core
//!
//! Owns [`Plan`] and the planners ([`Planner::Greedy`], after PyTorch's
//! `CPUProfilingAllocator`, and [`Planner::Best`]), the independent plan checker
//! ([`check`]), the allocator-free run-time pieces ([`Recorder`], [`PlanCursor`],
//! [`Plan::validate`]) and their typed errors. They can be used on their own, on traces:
//!
//! ```
//! use pinpool::plan::{check, Observed, Planner, Recorder};
//!
//! // Record one iteration.
//! let mut recorder = Recorder::new();
//! let a = recorder.on_alloc(1000);
//! let b = recorder.on_alloc(3000);
//! recorder.on_free(a)?;
//! let c = recorder.on_alloc(900); // may reuse `a`'s bytes
//! recorder.on_free(b)?;
//! recorder.on_free(c)?;
//! let lifetimes = recorder.finish();
//!
//! // Plan it: sizes are rounded up to 64 bytes.
//! let plan = Planner::Best.plan(&lifetimes)?;
//! assert_eq!(plan.arena_size(), 1024 + 3008);
//! assert_eq!(plan.lower_bound(), 4000);
//! check(&plan)?;
//!
//! // Serve the next iteration from the plan.
//! let mut cursor = plan.cursor();
//! let first = cursor.on_alloc(1000)?;
//! let second = cursor.on_alloc(3000)?;
//! cursor.on_free(first.number)?;
//! assert_eq!(cursor.on_alloc(900)?.offset, first.offset);
//! assert!(cursor.on_alloc(64).is_err()); // a fourth allocation was not planned
//!
//! // Or check a whole observed run at once.
//! let run = [Observed::Alloc { size: 1000 }, Observed::Alloc { size: 3000 }];
//! assert!(plan.validate(run).is_err()); // the run stops short of the plan
//! # let _ = second;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod arena;
mod best;
mod buffer;
mod check;
mod cursor;
mod greedy;
mod place;
mod problem;
mod record;
mod recorder;
mod rng;
mod serve;
mod session;

pub use buffer::PlanBuffer;
pub use check::{check, Violation};
pub use cursor::{Mismatch, Observed, PlanCursor, Served, ValidationError};
pub use record::{PlanRecorder, PlanValidator, RecordedBuffer, Recording};
pub use recorder::{RecordError, Recorder};
pub use serve::{ArenaSession, ServeStats};
pub use session::{ArenaPlan, PlanSessionError};

use problem::Problem;

/// The lifetime of one allocation: live over the half-open time range `[start, end)`,
/// where time counts events (allocations and frees) of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lifetime {
    /// Allocation id.
    pub id: usize,
    /// Requested size in bytes.
    pub size: u64,
    /// Time of the allocation.
    pub start: u64,
    /// Time of the free; the end of the run (its number of events) when it is never freed.
    pub end: u64,
}

impl Lifetime {
    /// Whether two lifetimes share a point in time (so cannot share memory).
    ///
    /// ```
    /// use pinpool::plan::Lifetime;
    /// let a = Lifetime { id: 0, size: 8, start: 0, end: 2 };
    /// let b = Lifetime { id: 1, size: 8, start: 2, end: 3 };
    /// assert!(!a.overlaps(&b)); // half-open: `a` is gone when `b` arrives
    /// ```
    pub fn overlaps(&self, other: &Lifetime) -> bool {
        self.start < other.end
            && other.start < self.end
            && self.start < self.end
            && other.start < other.end
    }
}

/// Alignment used by [`Planner::plan`]: every offset is a multiple of it, and every size is
/// rounded up to it.
pub const DEFAULT_ALIGNMENT: u64 = 64;

/// Why a plan could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The alignment is not a power of two.
    #[error("alignment {alignment} is not a power of two")]
    BadAlignment {
        /// The alignment given.
        alignment: u64,
    },
    /// A lifetime ends before it starts.
    #[error("allocation {index} ends ({end}) before it starts ({start})")]
    ReversedLifetime {
        /// Index of the allocation in the input.
        index: usize,
        /// Its start.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// The aligned sizes add up to more than `u64::MAX`.
    #[error("allocation sizes add up to more than 2^64 bytes")]
    TooLarge,
    /// [`Plan::from_parts`] got a different number of offsets and lifetimes.
    #[error("{offsets} offsets for {lifetimes} allocations")]
    LengthMismatch {
        /// Number of lifetimes.
        lifetimes: usize,
        /// Number of offsets.
        offsets: usize,
    },
}

/// A planning algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Planner {
    /// PyTorch's greedy plan: events in time order, each allocation in the smallest free
    /// chunk that fits, else at the end of the arena. Fast, and the baseline.
    Greedy,
    /// Several orderings with first- and best-fit placement, then a local search on the
    /// allocations that reach the top of the arena. Never worse than `Greedy`;
    /// deterministic.
    Best,
}

impl Planner {
    /// Every planner, baseline first.
    pub const ALL: [Planner; 2] = [Planner::Greedy, Planner::Best];

    /// Short name: `"greedy"` or `"best"`.
    pub fn name(self) -> &'static str {
        match self {
            Planner::Greedy => "greedy",
            Planner::Best => "best",
        }
    }

    /// Plans `lifetimes` (one allocation each, in the order the plan's offsets will have)
    /// with [`DEFAULT_ALIGNMENT`].
    pub fn plan(self, lifetimes: &[Lifetime]) -> Result<Plan, PlanError> {
        self.plan_aligned(lifetimes, DEFAULT_ALIGNMENT)
    }

    /// Plans `lifetimes` with the given power-of-two `alignment`.
    ///
    /// ```
    /// use pinpool::plan::Planner;
    /// use pinpool::plan::Lifetime;
    /// let lifetimes = [Lifetime { id: 0, size: 10, start: 0, end: 1 }];
    /// assert_eq!(Planner::Greedy.plan_aligned(&lifetimes, 16)?.arena_size(), 16);
    /// assert!(Planner::Greedy.plan_aligned(&lifetimes, 12).is_err());
    /// # Ok::<(), pinpool::plan::PlanError>(())
    /// ```
    pub fn plan_aligned(self, lifetimes: &[Lifetime], alignment: u64) -> Result<Plan, PlanError> {
        let problem = Problem::new(lifetimes, alignment)?;
        let offsets = match self {
            Planner::Greedy => greedy::plan(&problem),
            Planner::Best => best::plan(&problem),
        };
        // Every allocation lies inside the arena, those that are never live too (a size
        // with an empty lifetime, placed but taking no bytes at any time), so that every
        // plan a planner makes passes `check`.
        let arena_size = (0..problem.len())
            .map(|i| offsets[i] + problem.size[i])
            .max()
            .unwrap_or(0);
        Ok(Plan {
            lifetimes: lifetimes.to_vec(),
            offsets,
            alignment,
            arena_size,
        })
    }
}

/// Peak live bytes of `lifetimes` (requested sizes): the maximum over time of the sum of the
/// sizes of the allocations live then. No plan can use a smaller arena. Saturates at
/// `u64::MAX`.
///
/// ```
/// use pinpool::plan::Lifetime;
/// let l = |size, start, end| Lifetime { id: 0, size, start, end };
/// assert_eq!(pinpool::plan::lower_bound(&[l(5, 0, 2), l(7, 1, 3), l(9, 2, 4)]), 16);
/// ```
pub fn lower_bound(lifetimes: &[Lifetime]) -> u64 {
    let mut events: Vec<(u64, bool, u64)> = Vec::with_capacity(2 * lifetimes.len());
    for l in lifetimes.iter().filter(|l| l.start < l.end) {
        events.push((l.start, true, l.size));
        events.push((l.end, false, l.size));
    }
    events.sort_unstable();
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, is_alloc, size) in events {
        if is_alloc {
            live = live.saturating_add(size);
            peak = peak.max(live);
        } else {
            live = live.saturating_sub(size);
        }
    }
    peak
}

/// An offset in one arena for each planned allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    lifetimes: Vec<Lifetime>,
    offsets: Vec<u64>,
    alignment: u64,
    arena_size: u64,
}

impl Plan {
    /// Assembles a plan from its parts (for plans made elsewhere, or stored). Nothing but the
    /// lengths and the alignment is checked here: run [`check`] on the result.
    pub fn from_parts(
        lifetimes: Vec<Lifetime>,
        offsets: Vec<u64>,
        alignment: u64,
        arena_size: u64,
    ) -> Result<Plan, PlanError> {
        problem::check_alignment(alignment)?;
        if lifetimes.len() != offsets.len() {
            return Err(PlanError::LengthMismatch {
                lifetimes: lifetimes.len(),
                offsets: offsets.len(),
            });
        }
        Ok(Plan {
            lifetimes,
            offsets,
            alignment,
            arena_size,
        })
    }

    /// The planned allocations, as given to the planner.
    pub fn lifetimes(&self) -> &[Lifetime] {
        &self.lifetimes
    }

    /// Offset of each allocation in the arena, indexed like [`Plan::lifetimes`].
    pub fn offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// Bytes the arena needs.
    pub fn arena_size(&self) -> u64 {
        self.arena_size
    }

    /// Alignment of every offset, and granularity of every size.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Number of planned allocations.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether the plan has no allocations.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Size of allocation `index` rounded up to the alignment; `None` if out of range or
    /// if rounding overflows.
    pub fn aligned_size(&self, index: usize) -> Option<u64> {
        problem::align_up(self.lifetimes.get(index)?.size, self.alignment)
    }

    /// [`lower_bound`] of the planned allocations.
    pub fn lower_bound(&self) -> u64 {
        lower_bound(&self.lifetimes)
    }

    /// A cursor that serves a later run of the same work from this plan.
    pub fn cursor(&self) -> PlanCursor {
        PlanCursor::new(self)
    }

    /// Checks the events of a later run against the plan and reports the first mismatch.
    /// A free names the allocation by its number in the run (0 for its first allocation).
    /// The run must make every planned allocation.
    pub fn validate(
        &self,
        events: impl IntoIterator<Item = Observed>,
    ) -> Result<(), ValidationError> {
        cursor::validate(self, events)
    }
}
