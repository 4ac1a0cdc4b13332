//! Recording and validating runs against the allocator: [`PlanRecorder`] and
//! [`PlanValidator`] allocate from the ordinary pool and note each allocation and each
//! free, in order, on a channel; the [`RecordedBuffer`]s they hand out send their free when
//! dropped. The channel's order is the run's order, so several tasks can record at once
//! through clones of one recorder. Only allocations made through the recorder are noted.
//!
//! Owns the notes channel and the claim on the allocator (one plan session at a time).

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::actors::blocking;
use crate::actors::Runtime;

use super::session::{ArenaPlan, Claim, PlanSessionError, Waiter};
use super::Lifetime;
use super::{Observed, Plan, Planner, Recorder, ValidationError};
use crate::{PinnedAllocator, PinnedBuffer};

/// One noted event; `token` names the allocation until the notes are put in order.
enum Note {
    Alloc { token: usize, size: u64 },
    Free { token: usize },
}

/// State shared by the clones of a recorder.
struct Notes<R: Runtime> {
    pool: PinnedAllocator<R>,
    tx: flume::Sender<Note>,
    rx: flume::Receiver<Note>,
    next_token: AtomicUsize,
    finished: AtomicBool,
    claim: Claim,
}

impl<R: Runtime> Notes<R> {
    fn start(pool: &PinnedAllocator<R>) -> Result<Arc<Notes<R>>, PlanSessionError> {
        let claim = Claim::take(pool.engine().id())?;
        let (tx, rx) = flume::unbounded();
        Ok(Arc::new(Notes {
            pool: pool.clone(),
            tx,
            rx,
            next_token: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            claim,
        }))
    }

    fn track(
        &self,
        result: Result<PinnedBuffer<R>, crate::actors::Error>,
    ) -> Result<RecordedBuffer<R>, PlanSessionError> {
        let buf = result?;
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let _ = self.tx.send(Note::Alloc {
            token,
            size: buf.len() as u64,
        });
        Ok(RecordedBuffer {
            buf,
            token,
            tx: self.tx.clone(),
        })
    }

    /// Allocates and notes it; `who` waits for the pool.
    async fn alloc(&self, size: usize, who: Waiter) -> Result<RecordedBuffer<R>, PlanSessionError> {
        self.check_open()?;
        let result = who.alloc(&self.pool, size).await;
        self.track(result)
    }

    fn alloc_blocking(&self, size: usize) -> Result<RecordedBuffer<R>, PlanSessionError> {
        let call = ("alloc_blocking", "alloc(..).await");
        blocking::call(call, self.alloc(size, Waiter::Thread))?
    }

    fn check_open(&self) -> Result<(), PlanSessionError> {
        if self.finished.load(Ordering::Acquire) {
            return Err(PlanSessionError::Finished);
        }
        Ok(())
    }

    /// Ends the session and feeds the notes so far, in order, to `sink` as (allocation,
    /// free) events with allocation numbers `0, 1, 2, ...`.
    fn finish(&self, mut sink: impl FnMut(Observed)) {
        self.finished.store(true, Ordering::Release);
        self.claim.release();
        let mut number_of: Vec<Option<usize>> = Vec::new();
        let mut made = 0;
        while let Ok(note) = self.rx.try_recv() {
            match note {
                Note::Alloc { token, size } => {
                    if number_of.len() <= token {
                        number_of.resize(token + 1, None);
                    }
                    number_of[token] = Some(made);
                    made += 1;
                    sink(Observed::Alloc { size });
                }
                Note::Free { token } => {
                    if let Some(&Some(id)) = number_of.get(token) {
                        sink(Observed::Free { id });
                    }
                }
            }
        }
    }
}

/// A buffer lent during a recording or a validation: a [`PinnedBuffer`] (it dereferences
/// to one) whose drop is noted.
pub struct RecordedBuffer<R: Runtime> {
    buf: PinnedBuffer<R>,
    token: usize,
    tx: flume::Sender<Note>,
}

impl<R: Runtime> Deref for RecordedBuffer<R> {
    type Target = PinnedBuffer<R>;
    fn deref(&self) -> &PinnedBuffer<R> {
        &self.buf
    }
}

impl<R: Runtime> DerefMut for RecordedBuffer<R> {
    fn deref_mut(&mut self) -> &mut PinnedBuffer<R> {
        &mut self.buf
    }
}

impl<R: Runtime> Drop for RecordedBuffer<R> {
    fn drop(&mut self) {
        // The session may be over; a free after it is not part of the run.
        let _ = self.tx.send(Note::Free { token: self.token });
    }
}

impl<R: Runtime> std::fmt::Debug for RecordedBuffer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordedBuffer")
            .field("buf", &self.buf)
            .field("token", &self.token)
            .finish()
    }
}

/// Records one run's allocations (their sizes, and when each is freed) to plan them.
/// Cheap to clone: clones record into the same run, from any task or thread.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let allocator = pinpool::PinnedAllocator::builder().build()?;
/// let rec = allocator.record_plan()?;
/// let a = rec.alloc(1000).await?;
/// let outside = allocator.alloc(64).await?; // not part of the recording
/// let b = rec.alloc(3000).await?;
/// drop(a);
/// drop(b);
/// let recording = rec.finish();
/// let sizes: Vec<u64> = recording.lifetimes().iter().map(|l| l.size).collect();
/// assert_eq!(sizes, [1000, 3000]);
/// # drop(outside);
/// # Ok(()) }
/// ```
pub struct PlanRecorder<R: Runtime> {
    notes: Arc<Notes<R>>,
}

impl<R: Runtime> Clone for PlanRecorder<R> {
    fn clone(&self) -> Self {
        PlanRecorder {
            notes: Arc::clone(&self.notes),
        }
    }
}

impl<R: Runtime> PlanRecorder<R> {
    /// Allocates `size` bytes from the pool and notes it.
    pub async fn alloc(&self, size: usize) -> Result<RecordedBuffer<R>, PlanSessionError> {
        self.notes.alloc(size, Waiter::Task).await
    }

    /// [`PlanRecorder::alloc`] for threads outside the tokio runtime
    /// ([`crate::Error::WouldDeadlock`] where blocking would deadlock: see
    /// [blocking calls](crate#blocking-calls)).
    pub fn alloc_blocking(&self, size: usize) -> Result<RecordedBuffer<R>, PlanSessionError> {
        self.notes.alloc_blocking(size)
    }

    /// Ends the recording. Buffers still alive live to its end; frees after it, and
    /// allocations through other clones after it, are not part of it (those fail with
    /// [`PlanSessionError::Finished`]). The allocator can start another session at once.
    pub fn finish(self) -> Recording {
        let mut recorder = Recorder::new();
        let mut ids = Vec::new();
        self.notes.finish(|event| match event {
            Observed::Alloc { size } => ids.push(recorder.on_alloc(size)),
            Observed::Free { id } => {
                // Each number is freed at most once: buffers drop once.
                let _ = recorder.on_free(ids[id]);
            }
        });
        Recording {
            lifetimes: recorder.finish(),
            allocator: self.notes.pool.engine().id(),
        }
    }
}

/// What a [`PlanRecorder`] saw: one lifetime per allocation, in allocation order, with time
/// counted in events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recording {
    lifetimes: Vec<Lifetime>,
    allocator: u64,
}

impl Recording {
    /// The recorded allocations, in order.
    pub fn lifetimes(&self) -> &[Lifetime] {
        &self.lifetimes
    }

    /// Id of the allocator it was recorded on.
    pub fn allocator_id(&self) -> u64 {
        self.allocator
    }

    /// Plans the recording with [`Planner::Best`].
    pub fn plan(&self) -> Result<ArenaPlan, PlanSessionError> {
        self.plan_with(Planner::Best)
    }

    /// Plans the recording with `planner`; the plan is checked and bound to the allocator
    /// it was recorded on.
    pub fn plan_with(&self, planner: Planner) -> Result<ArenaPlan, PlanSessionError> {
        let plan: Plan = planner.plan(&self.lifetimes)?;
        ArenaPlan::new(plan, self.allocator)
    }
}

/// Checks a run against a plan without serving it from an arena: allocations come from the
/// pool as usual, and [`PlanValidator::finish`] reports the first departure from the plan.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use pinpool::plan::Mismatch;
/// let allocator = pinpool::PinnedAllocator::builder().build()?;
/// let rec = allocator.record_plan()?;
/// drop(rec.alloc(1000).await?);
/// let plan = rec.finish().plan()?;
///
/// let check = allocator.validate_plan(&plan)?;
/// drop(check.alloc(999).await?);
/// let err = check.finish().unwrap_err();
/// assert_eq!(err.mismatch, Mismatch::SizeMismatch { number: 0, expected: 1000, seen: 999 });
/// # Ok(()) }
/// ```
pub struct PlanValidator<R: Runtime> {
    notes: Arc<Notes<R>>,
    plan: ArenaPlan,
}

impl<R: Runtime> Clone for PlanValidator<R> {
    fn clone(&self) -> Self {
        PlanValidator {
            notes: Arc::clone(&self.notes),
            plan: self.plan.clone(),
        }
    }
}

impl<R: Runtime> PlanValidator<R> {
    /// Allocates `size` bytes from the pool and notes it.
    pub async fn alloc(&self, size: usize) -> Result<RecordedBuffer<R>, PlanSessionError> {
        self.notes.alloc(size, Waiter::Task).await
    }

    /// [`PlanValidator::alloc`] for threads outside the tokio runtime
    /// ([`crate::Error::WouldDeadlock`] where blocking would deadlock).
    pub fn alloc_blocking(&self, size: usize) -> Result<RecordedBuffer<R>, PlanSessionError> {
        self.notes.alloc_blocking(size)
    }

    /// Ends the run and checks it: `Ok` if the plan can serve it, else the first mismatch
    /// (which event, which allocation, what size was expected).
    pub fn finish(self) -> Result<(), ValidationError> {
        let mut events = Vec::new();
        self.notes.finish(|event| events.push(event));
        self.plan.plan().validate(events)
    }
}

impl<R: Runtime> PinnedAllocator<R> {
    /// Starts recording a run to plan ([`PlanRecorder`]). Fails with
    /// [`PlanSessionError::Nested`] while another plan session of this allocator is under
    /// way.
    pub fn record_plan(&self) -> Result<PlanRecorder<R>, PlanSessionError> {
        Ok(PlanRecorder {
            notes: Notes::start(self)?,
        })
    }

    /// Records the allocations that `body` makes through the recorder it is given, and
    /// returns its output with the recording.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let (n, recording) = allocator
    ///     .record_plan_with(|rec| async move {
    ///         let a = rec.alloc(4096).await?;
    ///         Ok::<_, pinpool::plan::PlanSessionError>(a.len())
    ///     })
    ///     .await?;
    /// assert_eq!((n?, recording.lifetimes().len()), (4096, 1));
    /// # Ok(()) }
    /// ```
    pub async fn record_plan_with<T, F, Fut>(
        &self,
        body: F,
    ) -> Result<(T, Recording), PlanSessionError>
    where
        F: FnOnce(PlanRecorder<R>) -> Fut,
        Fut: Future<Output = T>,
    {
        let rec = self.record_plan()?;
        let out = body(rec.clone()).await;
        Ok((out, rec.finish()))
    }

    /// [`PinnedAllocator::record_plan_with`] for synchronous code.
    pub fn record_plan_with_blocking<T>(
        &self,
        body: impl FnOnce(&PlanRecorder<R>) -> T,
    ) -> Result<(T, Recording), PlanSessionError> {
        let rec = self.record_plan()?;
        let out = body(&rec);
        Ok((out, rec.finish()))
    }

    /// Starts checking a run against `plan` without serving it ([`PlanValidator`]).
    /// [`PlanSessionError::ForeignPlan`] if the plan is for another allocator,
    /// [`PlanSessionError::Nested`] while another plan session is under way.
    pub fn validate_plan(&self, plan: &ArenaPlan) -> Result<PlanValidator<R>, PlanSessionError> {
        plan.check_owner(self)?;
        Ok(PlanValidator {
            notes: Notes::start(self)?,
            plan: plan.clone(),
        })
    }
}
