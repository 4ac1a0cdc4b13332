//! Plans bound to one allocator, and the rule that an allocator runs one plan session at a
//! time.
//!
//! Owns [`ArenaPlan`] (a plan that passed the checker, tagged with the allocator it is for),
//! [`PlanSessionError`], who waits in a session's call ([`Waiter`]), and the registry of
//! allocators with a session under way (an `ArcSwap` of engine ids updated by
//! read-copy-update: no lock). Serving trusts an
//! `ArenaPlan`'s offsets to make non-overlapping views, so every `ArenaPlan` went through
//! [`check`](super::check) and the extra rule below when it was made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::actors::{Error, Runtime};
use arc_swap::ArcSwap;

use super::{check, Plan, PlanError, Violation};
use crate::PinnedAllocator;

/// Why a plan session (recording, validating or serving) could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanSessionError {
    /// The allocator already has a plan session under way (recording, validating or
    /// serving); sessions do not nest.
    #[error("allocator {allocator} already has a plan session under way")]
    Nested {
        /// The allocator's id.
        allocator: u64,
    },
    /// The plan was made for another allocator.
    #[error("the plan belongs to allocator {plan_allocator}, not to allocator {allocator}")]
    ForeignPlan {
        /// The allocator the plan was made for.
        plan_allocator: u64,
        /// The allocator it was given to.
        allocator: u64,
    },
    /// The plan could not be made.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The plan fails the checker: serving it would hand out overlapping bytes.
    #[error("unsound plan: {0}")]
    Unsound(#[from] Violation),
    /// Allocation `index` takes bytes but has an empty lifetime (`start >= end`), which the
    /// checker cannot place in time.
    #[error("allocation {index} takes bytes but its lifetime is empty")]
    EmptyLifetime {
        /// The allocation.
        index: usize,
    },
    /// The arena does not fit in this machine's address space.
    #[error("an arena of {size} bytes does not fit in memory")]
    ArenaTooLarge {
        /// Bytes asked for.
        size: u64,
    },
    /// `try_reset` while buffers of the current iteration are still alive.
    #[error("{live} buffers of this iteration are still alive")]
    Busy {
        /// Buffers not yet dropped.
        live: usize,
    },
    /// `try_reset` while stream work recorded on freed buffers may still be running: the
    /// arena must be replaced, which allocates (use `reset().await` or `reset_blocking`).
    #[error("stream work on the arena may still be running; reset must replace the arena")]
    StreamsPending,
    /// The recorder was finished through another handle.
    #[error("the recording is finished")]
    Finished,
    /// The allocator failed.
    #[error(transparent)]
    Alloc(#[from] Error),
}

/// A checked plan for one allocator: what [`PinnedAllocator::serve_plan`] and
/// [`PinnedAllocator::validate_plan`] take. Made by
/// [`Recording::plan`](super::Recording::plan) or [`PinnedAllocator::adopt_plan`].
#[derive(Clone, Debug)]
pub struct ArenaPlan {
    plan: Arc<Plan>,
    allocator: u64,
}

impl ArenaPlan {
    /// Checks `plan` and binds it to allocator `allocator`.
    pub(crate) fn new(plan: Plan, allocator: u64) -> Result<ArenaPlan, PlanSessionError> {
        check(&plan)?;
        for (index, l) in plan.lifetimes().iter().enumerate() {
            if l.size > 0 && l.start >= l.end {
                return Err(PlanSessionError::EmptyLifetime { index });
            }
        }
        if usize::try_from(plan.arena_size()).is_err() {
            return Err(PlanSessionError::ArenaTooLarge {
                size: plan.arena_size(),
            });
        }
        Ok(ArenaPlan {
            plan: Arc::new(plan),
            allocator,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Bytes of the arena.
    pub fn arena_size(&self) -> u64 {
        self.plan.arena_size()
    }

    /// Id of the allocator the plan is for: a plan serves only the allocator it was made
    /// for.
    pub fn allocator_id(&self) -> u64 {
        self.allocator
    }

    pub(crate) fn check_owner<R: Runtime>(
        &self,
        pool: &PinnedAllocator<R>,
    ) -> Result<(), PlanSessionError> {
        let allocator = pool.engine().id();
        if self.allocator != allocator {
            return Err(PlanSessionError::ForeignPlan {
                plan_allocator: self.allocator,
                allocator,
            });
        }
        Ok(())
    }
}

impl<R: Runtime> PinnedAllocator<R> {
    /// Binds a plan made elsewhere (a stored plan, or one made from a trace) to this
    /// allocator, after checking it: the plan checker must accept it, and every allocation
    /// that takes bytes must have a non-empty lifetime.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use pinpool::plan::{Plan, PlanSessionError, Planner};
    /// use pinpool::plan::Lifetime;
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let l = |id, start, end| Lifetime { id, size: 64, start, end };
    /// let good = Planner::Best.plan(&[l(0, 0, 2), l(1, 1, 3)])?;
    /// assert_eq!(allocator.adopt_plan(good)?.arena_size(), 128);
    /// let overlapping = Plan::from_parts(vec![l(0, 0, 2), l(1, 1, 3)], vec![0, 0], 64, 64)?;
    /// assert!(matches!(allocator.adopt_plan(overlapping), Err(PlanSessionError::Unsound(_))));
    /// # Ok(()) }
    /// ```
    pub fn adopt_plan(&self, plan: Plan) -> Result<ArenaPlan, PlanSessionError> {
        ArenaPlan::new(plan, self.engine().id())
    }
}

fn registry() -> &'static ArcSwap<Vec<u64>> {
    static ACTIVE: OnceLock<ArcSwap<Vec<u64>>> = OnceLock::new();
    ACTIVE.get_or_init(|| ArcSwap::from_pointee(Vec::new()))
}

/// The right to run the one plan session of an allocator; given back when dropped (or by
/// [`Claim::release`]).
#[derive(Debug)]
pub(crate) struct Claim {
    allocator: u64,
    held: AtomicBool,
}

impl Claim {
    /// Claims `allocator`, or says that a session already has it.
    pub(crate) fn take(allocator: u64) -> Result<Claim, PlanSessionError> {
        let mut taken = false;
        registry().rcu(|active| {
            taken = !active.contains(&allocator);
            if taken {
                let mut next = Vec::clone(active);
                next.push(allocator);
                Arc::new(next)
            } else {
                Arc::clone(active)
            }
        });
        if !taken {
            return Err(PlanSessionError::Nested { allocator });
        }
        Ok(Claim {
            allocator,
            held: AtomicBool::new(true),
        })
    }

    /// Gives the claim back (once; later calls do nothing).
    pub(crate) fn release(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            let allocator = self.allocator;
            registry().rcu(|active| {
                Arc::new(
                    active
                        .iter()
                        .copied()
                        .filter(|&a| a != allocator)
                        .collect::<Vec<_>>(),
                )
            });
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.release();
    }
}

/// Who waits in a plan session's call: the task that awaits it, or a thread that the call's
/// blocking form has cleared to block (the blocking adapter). Each call is
/// written once, as an async function over this; its blocking form drives that function
/// on the thread with `Waiter::Thread`, whose allocations block in place (a thread's miss
/// may run the memory source's calls itself, and never needs a tokio timer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waiter {
    Task,
    Thread,
}

impl Waiter {
    /// Allocates `size` bytes from `pool`, waiting as `self` does.
    pub(crate) async fn alloc<R: Runtime>(
        self,
        pool: &PinnedAllocator<R>,
        size: usize,
    ) -> Result<crate::PinnedBuffer<R>, Error> {
        match self {
            Waiter::Task => pool.alloc(size).await,
            Waiter::Thread => pool.alloc_blocking(size),
        }
    }
}
