//! The miss path: what a request does when the cached path found no ready block.
//!
//! It asks the pool actor (one round trip); on "need room" — fresh memory would pass the cap,
//! or the memory source is out of memory — the requesting task (never an actor, so no actor
//! ever waits on another) first runs the free-memory callbacks, if any are attached, on a
//! blocking thread, and asks again if one of them freed something (once per request); where
//! the engine lends between streams, a request of a stream's pool then borrows a block of memory another stream's pool holds,
//! handed over by ordering its stream after the other's queued work (no driver call, no
//! waiting: `hand_over`); failing that, it empties the cache of every pool and asks again,
//! unless a capture is underway (`Budget::capturing`): emptying a cache synchronises the
//! device, which would invalidate the capture, so the request goes on without it. If it still does not
//! fit, the pool queues it, first come first served (see the pool actor's `waiters`), and the
//! request waits for its reply, up to its timeout. Cancel-safe: a dropped request tells its
//! pool to forget it, and a block sent to it meanwhile goes back.
//!
//! The loop is written once (`miss_with`), over who waits (`Waiter`): a task awaits each
//! reply; a blocked thread waits for it in place, and lends itself to run the pool actor's
//! memory-source calls.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::blocks::block::{Block, Pool};
use crate::books::budget::{Budget, EmptyReport};
use crate::books::mailbox::{Answer, Ask, MissReply, MissTx, PoolMsg, Refused};
use crate::requests::long_wait;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::Runtime;

/// How a request that does not fit under the cap is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Fail at once with `OutOfMemory`.
    Never,
    /// Wait as long as the allocator's default says.
    Default,
    /// Wait at most this long.
    Upto(Duration),
}

impl Wait {
    /// Whether to wait at all, and how long at most.
    fn resolve(self, budget: &Budget) -> Option<Option<Duration>> {
        match self {
            Wait::Never => None,
            Wait::Default => Some(budget.default_timeout),
            Wait::Upto(d) => Some(Some(d)),
        }
    }
}

/// Fails a request that could never fit under the cap.
fn check_cap<R: Runtime>(pool: &Pool<R>, class: SizeClass, requested: usize) -> Result<(), Error> {
    match pool.budget.limit() {
        Some(limit) if class.size > limit => {
            pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                requested,
                block = class.size,
                limit,
                "request larger than the memory limit"
            );
            Err(Error::OutOfMemory {
                requested,
                reserved: pool.budget.reserved(),
                limit: Some(limit),
                cause: OomCause::ExceedsLimit,
            })
        }
        _ => Ok(()),
    }
}

fn send_miss<R: Runtime>(
    pool: &Pool<R>,
    class: SizeClass,
    ask: Ask,
) -> Result<flume::Receiver<Answer<Block<R>>>, Error> {
    let (tx, rx) = MissTx::pair();
    pool.mailbox
        .send(PoolMsg::Miss {
            class,
            ask,
            reply: tx,
        })
        .map_err(|_| Error::Shutdown)?;
    Ok(rx)
}

/// Tells the pool to drop a queued request whose future was dropped (cancel safety: the
/// queue forgets it at once rather than at its next look).
struct Pending<'a, R: Runtime> {
    pool: &'a Pool<R>,
    armed: bool,
}

impl<R: Runtime> Drop for Pending<'_, R> {
    fn drop(&mut self) {
        if self.armed {
            self.pool.nudge();
        }
    }
}

fn timed_out<R: Runtime>(pool: &Pool<R>, requested: usize, timeout: Duration) -> Error {
    pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        requested,
        timeout_ms = timeout.as_millis() as u64,
        "gave up waiting for pinned memory"
    );
    Error::Timeout { requested, timeout }
}

/// Asks every pool of the allocator to give back up to `upto` bytes of its cache
/// (`usize::MAX`: all of it); returns the replies to wait for.
fn ask_all_to_empty<R: Runtime>(pool: &Pool<R>, upto: usize) -> Vec<flume::Receiver<EmptyReport>> {
    pool.budget
        .pools()
        .iter()
        .filter_map(|p| p.ask_to_empty(upto))
        .collect()
}

/// The room a block of `class` lacks under the cap now: the bytes reserved past the cap
/// once it is taken (`None` without a cap, or when the cap is not what is in the way: the
/// memory source refused, and every cache must go).
fn shortfall<R: Runtime>(pool: &Pool<R>, class: SizeClass) -> Option<usize> {
    let limit = pool.budget.limit()?;
    let over = (pool.budget.reserved() + class.size).checked_sub(limit)?;
    (over > 0).then_some(over)
}

/// Who waits for a miss: a task, which awaits, or a thread, which blocks (and may lend itself
/// to run the memory source's calls). The miss loop ([`miss_with`]) is written once over it:
/// a thread's waits are done by the time their futures are first polled, so
/// [`crate::vocab::blocking::run_here`] drives the request on the thread without an executor.
trait Waiter: Sync {
    /// Whether the requesting thread runs the memory source's calls for the pool actor
    /// ([`Ask::lends`]): a task must not block its executor.
    fn lends(&self) -> bool;
    /// The pool actor's answer to a miss.
    fn answer<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
    ) -> impl Future<Output = Result<MissReply<B>, Stop>> + Send;
    /// The answer, or `None` once `at` has passed without it (the ask stays with the pool).
    fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> impl Future<Output = Result<Option<MissReply<B>>, Stop>> + Send;
    /// Whether it blocks its thread for replies (a thread) rather than awaiting them.
    fn blocks(&self) -> bool;
    /// Another actor's reply (an emptied cache's report, a lent block); `None` when it is gone.
    fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> impl Future<Output = Option<T>> + Send;
    /// Runs the free-memory callbacks: whether one of them freed something.
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send;
}

/// Why an answer did not come.
enum Stop {
    /// The pool actor is gone.
    Shutdown,
    /// The request's deadline passed.
    TimedOut,
    /// The request was refused while it waited (see `long_wait`).
    Refused(Error),
}

/// A task: it awaits every reply.
struct Task;

impl Waiter for Task {
    fn lends(&self) -> bool {
        false
    }

    async fn answer<B: Send>(&self, rx: &flume::Receiver<Answer<B>>) -> Result<MissReply<B>, Stop> {
        answer_async(rx).await.map_err(|_| Stop::Shutdown)
    }

    /// Without a tokio runtime to time it (the future polled by another executor), as
    /// `answer`.
    async fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> Result<Option<MissReply<B>>, Stop> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self.answer(rx).await.map(Some);
        }
        match tokio::time::timeout_at(at.into(), answer_async(rx)).await {
            Ok(reply) => reply.map(Some).map_err(|_| Stop::Shutdown),
            Err(_) => Ok(None),
        }
    }

    fn blocks(&self) -> bool {
        false
    }

    async fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> Option<T> {
        rx.recv_async().await.ok()
    }

    /// On a blocking thread of the tokio runtime (inline where there is none: the future is
    /// then not polled by a tokio executor).
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send {
        let budget = budget.clone();
        async move {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => handle
                    .spawn_blocking(move || budget.free_memory.run())
                    .await
                    .unwrap_or(false),
                Err(_) => budget.free_memory.run(),
            }
        }
    }
}

/// A thread outside the runtime's executors: it blocks for every reply, until `deadline`.
/// Without a deadline it lends itself to the pool actor, and spins a little before it parks
/// (see [`recv_spinning`]); a request with a deadline keeps it: the memory source's calls,
/// whose length nobody knows, run elsewhere.
struct Thread {
    deadline: Option<Instant>,
}

impl Waiter for Thread {
    fn lends(&self) -> bool {
        self.deadline.is_none()
    }

    fn answer<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
    ) -> impl Future<Output = Result<MissReply<B>, Stop>> + Send {
        std::future::ready(match self.deadline {
            Some(at) => answer_by(rx, at).map_err(|e| match e {
                flume::RecvTimeoutError::Timeout => Stop::TimedOut,
                flume::RecvTimeoutError::Disconnected => Stop::Shutdown,
            }),
            None => recv_spinning(rx).map_err(|_| Stop::Shutdown),
        })
    }

    fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> impl Future<Output = Result<Option<MissReply<B>>, Stop>> + Send {
        std::future::ready(match self.deadline {
            Some(deadline) if deadline <= at => self_deadline(answer_by(rx, deadline)),
            Some(_) => match answer_by(rx, at) {
                Err(flume::RecvTimeoutError::Timeout) => Ok(None),
                other => self_deadline(other),
            },
            None => recv_spinning_until(rx, Some(at)).map_err(|_| Stop::Shutdown),
        })
    }

    fn blocks(&self) -> bool {
        true
    }

    fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> impl Future<Output = Option<T>> + Send {
        std::future::ready(rx.recv().ok())
    }

    /// Here: a blocking miss runs on a thread that may block.
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send {
        std::future::ready(budget.free_memory.run())
    }
}

/// A thread's answer by its own deadline.
fn self_deadline<B>(
    r: Result<MissReply<B>, flume::RecvTimeoutError>,
) -> Result<Option<MissReply<B>>, Stop> {
    match r {
        Ok(reply) => Ok(Some(reply)),
        Err(flume::RecvTimeoutError::Timeout) => Err(Stop::TimedOut),
        Err(flume::RecvTimeoutError::Disconnected) => Err(Stop::Shutdown),
    }
}

/// The answer to an ask the pool may queue (room was made, and the request waits): a wait
/// that outlasts [`long_wait::AFTER`] gets its one look, a warning or a refusal (see
/// `long_wait`).
async fn answer_queued<R: Runtime, W: Waiter>(
    waiter: &W,
    rx: &flume::Receiver<Answer<Block<R>>>,
    pool: &Pool<R>,
    class: SizeClass,
    requested: usize,
) -> Result<MissReply<Block<R>>, Stop> {
    if let Some(reply) = waiter
        .answer_until(rx, Instant::now() + long_wait::AFTER)
        .await?
    {
        return Ok(reply);
    }
    long_wait::look(pool, class.size, requested, waiter.blocks())
        .await
        .map_err(Stop::Refused)?;
    waiter.answer(rx).await
}

/// Asks every pool to give back up to `upto` bytes of its cache (`usize::MAX`: all of it)
/// and waits for them all.
async fn make_room<R: Runtime, W: Waiter>(pool: &Pool<R>, upto: usize, waiter: &W) {
    for rx in ask_all_to_empty(pool, upto) {
        let _ = waiter.recv(&rx).await;
    }
}

/// The other streams' pools of the allocator, for a stream's pool of an engine that lends
/// between streams (see `EngineBuilder::lend_between_streams`; none otherwise).
fn lenders<R: Runtime>(pool: &Pool<R>) -> Vec<Arc<Pool<R>>> {
    if !pool.lends || pool.owner_stream.is_none() {
        return Vec::new();
    }
    pool.budget
        .pools()
        .into_iter()
        .filter_map(|m| m.as_any().downcast::<Pool<R>>().ok())
        .filter(|p| p.owner_stream.is_some() && !std::ptr::eq(Arc::as_ptr(p), pool))
        .collect()
}

/// Asks `lender` for a block of `class` out of memory it holds (see `PoolMsg::Lend`).
fn ask_to_lend<R: Runtime>(
    lender: &Pool<R>,
    class: SizeClass,
) -> Option<flume::Receiver<Option<Box<Block<R>>>>> {
    let (tx, rx) = flume::bounded(1);
    lender
        .mailbox
        .send(PoolMsg::Lend { class, reply: tx })
        .ok()?;
    Some(rx)
}

/// Hands a block another stream's pool lent over to the stream of `pool`, without the
/// driver and without waiting: the stream is made to wait for an event recorded now on
/// the lender's stream, after every piece of work queued there so far (which includes all
/// work that used the block: it was freed before it was lent), and the block is marked as
/// used by the stream, so that its free waits for the stream's work before the block goes
/// back to its own pool (invariant 1). A block that cannot be handed over (a stream
/// captures, or the runtime cannot order streams) goes back to its pool.
fn hand_over<R: Runtime>(pool: &Pool<R>, mut block: Box<Block<R>>) -> Option<Box<Block<R>>> {
    let rt = &pool.runtime;
    let ordered = match (pool.owner_stream.as_ref(), block.pool.owner_stream.as_ref()) {
        (Some(to), Some(from))
            if !rt.is_capturing(from).unwrap_or(true) && !rt.is_capturing(to).unwrap_or(true) =>
        {
            rt.record_event(from).ok().is_some_and(|event| {
                let waited = rt.stream_wait_event(to, &event);
                rt.release_event(event);
                waited.is_ok()
            })
        }
        _ => false,
    };
    // The borrower's own stream is of the block's runtime: recording it cannot be refused.
    match pool.owner_stream.as_ref().filter(|_| ordered) {
        Some(to) if crate::blocks::lease::record(&mut block, to).is_ok() => {
            tracing::debug!(
                from = ?block.pool.owner,
                to = ?pool.owner,
                bytes = block.size,
                "block handed over between streams"
            );
            Some(block)
        }
        _ => {
            let home = block.pool.clone();
            let _ = home.mailbox.send(PoolMsg::Home(block));
            None
        }
    }
}

/// Borrows a block of `class` from another stream's pool (see [`hand_over`]).
async fn borrow<R: Runtime, W: Waiter>(
    pool: &Pool<R>,
    class: SizeClass,
    waiter: &W,
) -> Option<Box<Block<R>>> {
    for lender in lenders(pool) {
        let Some(rx) = ask_to_lend(&lender, class) else {
            continue;
        };
        if let Some(Some(block)) = waiter.recv(&rx).await {
            if let Some(b) = hand_over(pool, block) {
                return Some(b);
            }
        }
    }
    None
}

/// Whether a request that was refused for want of room should run the free-memory callbacks
/// now: once per request, and only where some are attached.
fn callbacks_due<R: Runtime>(pool: &Pool<R>, ran: &mut bool) -> bool {
    if *ran || pool.budget.free_memory.is_empty() {
        return false;
    }
    *ran = true;
    true
}

/// What a miss may do besides asking the pool actor.
#[derive(Clone, Copy)]
struct Plan {
    /// Bytes the user asked for.
    requested: usize,
    /// Queue in the pool when there is no room even after room was made.
    queue: bool,
    /// On "need room": run the free-memory callbacks (once), borrow from another stream's
    /// pool, empty every cache, and ask again. Without: no room is the answer.
    make_room: bool,
    /// Not an out-of-memory of its own when it finds no room (one buffer of several).
    quiet: bool,
}

/// How a miss ended without a block.
enum Missed {
    /// No room, after room was made if the plan says so.
    NoRoom,
    /// The thread's deadline passed.
    TimedOut,
    /// A final error.
    Failed(Error),
}

/// The miss loop, once for tasks and threads: ask the pool; on "need room" make room as
/// `plan` says and ask again, queueing this time when the plan says so. Cancel-safe: a
/// dropped request tells its pool to forget it, and a block sent to it meanwhile goes back.
async fn miss_with<R: Runtime, W: Waiter>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    plan: Plan,
    waiter: &W,
) -> Result<Box<Block<R>>, Missed> {
    let mut ask = Ask {
        requested: plan.requested,
        wait: plan.queue,
        emptied: false,
        holds: true,
        lends: waiter.lends(),
        quiet: plan.quiet,
        sent: std::time::Instant::now(),
    };
    // A miss that returns, fails or is cancelled counts alike.
    let _timed = pool.stats.miss_wait.time();
    let mut callbacks_ran = false;
    // Room is made in two steps: first only what the cap lacks, from every pool's least
    // recently used memory (what the others cache stays, rather than be given back and
    // taken again), then, if that was not enough, every cache.
    let mut partly = false;
    loop {
        ask.sent = std::time::Instant::now();
        let rx = send_miss(pool, class, ask).map_err(Missed::Failed)?;
        let mut pending = Pending { pool, armed: true };
        let answer = if ask.emptied && plan.queue {
            answer_queued(waiter, &rx, pool, class, plan.requested).await
        } else {
            waiter.answer(&rx).await
        };
        let reply = match answer {
            Ok(reply) => reply,
            Err(stop) => {
                // Dropping `rx` hands back a block sent in the meantime; `pending` tells the
                // pool to forget the request.
                drop(rx);
                drop(pending);
                return Err(match stop {
                    Stop::Shutdown => Missed::Failed(Error::Shutdown),
                    Stop::TimedOut => Missed::TimedOut,
                    Stop::Refused(e) => Missed::Failed(e),
                });
            }
        };
        pending.armed = false;
        match reply {
            Ok(block) => return Ok(block),
            Err(Refused::Failed(e)) => return Err(Missed::Failed(e)),
            Err(Refused::NeedRoom) if plan.make_room && !ask.emptied => {
                if callbacks_due(pool, &mut callbacks_ran) && waiter.free_memory(&pool.budget).await
                {
                    // Something was freed: it may be cached now, or room made.
                    continue;
                }
                // Memory another stream's pool holds serves it without the driver.
                if let Some(block) = borrow(pool, class, waiter).await {
                    return Ok(block);
                }
                if pool.budget.capturing() {
                    // As PyTorch's allocator: no cache is emptied while a capture is
                    // underway (giving memory back synchronises the device, which would
                    // invalidate the capture). The pool is asked once more as if it had
                    // been, and the request fails (or waits, as its plan says) without it.
                    ask.emptied = true;
                    continue;
                }
                if !partly {
                    // One empty-and-retry per request, in one step or two.
                    pool.stats.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
                }
                match shortfall(pool, class).filter(|_| !partly) {
                    Some(over) => {
                        partly = true;
                        make_room(pool, over, waiter).await;
                    }
                    None => {
                        make_room(pool, usize::MAX, waiter).await;
                        ask.emptied = true;
                    }
                }
            }
            Err(Refused::NeedRoom) => return Err(Missed::NoRoom),
            Err(Refused::Coalesce) => {
                pool.send_mine_home();
                ask.holds = false;
            }
        }
    }
}

/// The error of a request for one buffer whose miss ended without a block: no room in the
/// end is an out-of-memory, a passed deadline a timeout (both counted in `num_ooms`).
fn settle<R: Runtime>(
    pool: &Pool<R>,
    requested: usize,
    timeout: Option<Duration>,
    missed: Result<Box<Block<R>>, Missed>,
) -> Result<Box<Block<R>>, Error> {
    missed.map_err(|m| match m {
        Missed::NoRoom => no_room(pool, requested),
        Missed::TimedOut => timed_out(pool, requested, timeout.unwrap_or_default()),
        Missed::Failed(e) => e,
    })
}

/// Who waits for a request: a task, or a thread outside the runtime's executors that may
/// block (see [`crate::vocab::blocking::may_block`]), whose waits are done in place. A thread drives
/// the request's future with [`crate::vocab::blocking::run_here`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Who {
    Task,
    Thread,
}

impl Who {
    /// An actor's reply; `None` when the actor is gone.
    pub(crate) async fn recv<T: Send>(self, rx: &flume::Receiver<T>) -> Option<T> {
        match self {
            Who::Task => Task.recv(rx).await,
            Who::Thread => Thread { deadline: None }.recv(rx).await,
        }
    }
}

/// A miss of a request for one buffer, waited for by `who`: ask the pool; on "need room"
/// make room and ask again, this time queueing when it still does not fit (unless `wait`
/// says not to), up to the wait's timeout (see [`settle`] for how it fails).
pub(crate) async fn miss<R: Runtime>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    requested: usize,
    wait: Wait,
    who: Who,
) -> Result<Box<Block<R>>, Error> {
    check_cap(pool, class, requested)?;
    let timeout = wait.resolve(&pool.budget);
    let plan = Plan {
        requested,
        queue: timeout.is_some(),
        make_room: true,
        quiet: false,
    };
    let timeout = timeout.flatten();
    let missed = match who {
        Who::Task => {
            let work = miss_with(pool, class, plan, &Task);
            match timeout {
                Some(d) => match tokio::time::timeout(d, work).await {
                    Ok(r) => r,
                    Err(_) => Err(Missed::TimedOut),
                },
                None => work.await,
            }
        }
        Who::Thread => {
            let thread = Thread {
                deadline: timeout.map(|d| Instant::now() + d),
            };
            miss_with(pool, class, plan, &thread).await
        }
    };
    settle(pool, requested, timeout, missed)
}

/// One try for one buffer of a request for several (see `engine::many`), from a task: ask
/// the pool; on "need room", when `empty` says so, make room as a single request does and
/// ask once more. Never queued and never counted as an out-of-memory: no room is
/// [`Tried::NoRoom`], and the request waits or fails as a whole. What the runtime itself
/// refuses once the caches were emptied (no cap in the way) is a final, counted error, as
/// for `try_alloc`. Cancel-safe as [`miss`] is.
pub(crate) async fn miss_once<R: Runtime>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    requested: usize,
    empty: bool,
) -> Result<Box<Block<R>>, Tried> {
    let plan = Plan {
        requested,
        queue: false,
        make_room: empty,
        quiet: true,
    };
    miss_with(pool, class, plan, &Task)
        .await
        .map_err(|m| match m {
            Missed::NoRoom => Tried::NoRoom,
            // A task's wait has no deadline of its own (the request's is around it).
            Missed::TimedOut => Tried::NoRoom,
            Missed::Failed(e) => Tried::Failed(e),
        })
}

/// How one try of [`miss_once`] failed.
pub(crate) enum Tried {
    /// No room now (under the cap; before the caches were emptied, also in the runtime).
    NoRoom,
    /// A final error.
    Failed(Error),
}

/// How long a blocking miss spins on its reply before it parks the thread: long enough for
/// a pool actor that has to be woken first (the requester is blocked either way; polling
/// spares it a wake-up of its own).
const REPLY_SPIN: Duration = Duration::from_micros(200);

/// Waits for a pool actor's answer, polling for it for [`REPLY_SPIN`] before parking the
/// thread: a miss that the actor serves from memory it holds is answered within
/// microseconds, and parking would add a wake-up about as long as the wait itself. Errands
/// the actor sends meanwhile run here (see [`crate::books::errand`]), and the spin starts again
/// after each: the answer follows soon after the errand's result.
fn recv_spinning<B>(rx: &flume::Receiver<Answer<B>>) -> Result<MissReply<B>, flume::RecvError> {
    // Without a deadline, the answer or the end of the channel.
    recv_spinning_until(rx, None)?.ok_or(flume::RecvError::Disconnected)
}

/// [`recv_spinning`] until `until`: `None` once it has passed without an answer.
fn recv_spinning_until<B>(
    rx: &flume::Receiver<Answer<B>>,
    until: Option<Instant>,
) -> Result<Option<MissReply<B>>, flume::RecvError> {
    let mut start = Instant::now();
    loop {
        let answer = match rx.try_recv() {
            Ok(a) => a,
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if start.elapsed() < REPLY_SPIN => {
                std::hint::spin_loop();
                continue;
            }
            Err(flume::TryRecvError::Empty) => match until {
                None => rx.recv()?,
                Some(at) => match rx.recv_deadline(at) {
                    Ok(a) => a,
                    Err(flume::RecvTimeoutError::Timeout) => return Ok(None),
                    Err(flume::RecvTimeoutError::Disconnected) => {
                        return Err(flume::RecvError::Disconnected)
                    }
                },
            },
        };
        match answer {
            Answer::Done(reply) => return Ok(Some(reply)),
            Answer::Errand(errand) => {
                errand.run();
                start = Instant::now();
            }
        }
    }
}

/// Waits for a pool actor's answer until `deadline`. Such a request does not lend its thread
/// (see [`Ask::lends`]): an errand sent all the same runs on a blocking thread once dropped.
fn answer_by<B>(
    rx: &flume::Receiver<Answer<B>>,
    deadline: Instant,
) -> Result<MissReply<B>, flume::RecvTimeoutError> {
    loop {
        if let Some(reply) = rx.recv_deadline(deadline)?.into_reply() {
            return Ok(reply);
        }
    }
}

/// Waits for a pool actor's answer from a task. A task does not lend its thread (see
/// [`Ask::lends`]); an errand sent all the same runs on a blocking thread once dropped.
async fn answer_async<B>(
    rx: &flume::Receiver<Answer<B>>,
) -> Result<MissReply<B>, flume::RecvError> {
    loop {
        if let Some(reply) = rx.recv_async().await?.into_reply() {
            return Ok(reply);
        }
    }
}

/// A pool asked for room twice (it does not once the caches were emptied): out of memory.
fn no_room<R: Runtime>(pool: &Pool<R>, requested: usize) -> Error {
    pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
    Error::OutOfMemory {
        requested,
        reserved: pool.budget.reserved(),
        limit: pool.budget.limit(),
        cause: OomCause::NoRoomNow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(v: u8) -> Answer<u8> {
        Answer::Done(Ok(Box::new(v)))
    }

    fn value(r: Result<MissReply<u8>, flume::RecvError>) -> Result<Option<u8>, flume::RecvError> {
        r.map(|reply| reply.ok().map(|b| *b))
    }

    #[test]
    fn a_reply_is_received_whether_it_comes_during_the_spin_or_after_it() {
        let (tx, rx) = flume::bounded(1);
        tx.send(done(1)).unwrap();
        assert_eq!(value(recv_spinning(&rx)), Ok(Some(1)));
        let late = std::thread::spawn(move || {
            std::thread::sleep(REPLY_SPIN * 20);
            tx.send(done(2)).unwrap();
        });
        assert_eq!(value(recv_spinning(&rx)), Ok(Some(2)));
        late.join().unwrap();
    }

    #[test]
    fn a_dropped_sender_ends_the_wait_during_the_spin_or_after_it() {
        let (tx, rx) = flume::bounded::<Answer<u8>>(1);
        drop(tx);
        assert_eq!(
            value(recv_spinning(&rx)),
            Err(flume::RecvError::Disconnected)
        );
        let (tx, rx) = flume::bounded::<Answer<u8>>(1);
        let late = std::thread::spawn(move || {
            std::thread::sleep(REPLY_SPIN * 20);
            drop(tx);
        });
        assert_eq!(
            value(recv_spinning(&rx)),
            Err(flume::RecvError::Disconnected)
        );
        late.join().unwrap();
    }

    #[test]
    fn errands_run_on_a_thread_that_waits_without_a_deadline_and_elsewhere_with_one() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let me = std::thread::current().id();
        let (ran_tx, ran_rx) = flume::unbounded();
        let errand = |ran: flume::Sender<std::thread::ThreadId>| {
            let work = Box::new(move || ran.send(std::thread::current().id()).unwrap());
            Answer::Errand(crate::books::errand::Errand::new(work, rt.handle().clone()))
        };
        // One errand waiting before the wait starts, one after the spin: both run here.
        let (tx, rx) = flume::bounded(3);
        tx.send(errand(ran_tx.clone())).unwrap();
        let late_errand = errand(ran_tx.clone());
        let late = std::thread::spawn(move || {
            std::thread::sleep(REPLY_SPIN * 20);
            tx.send(late_errand).unwrap();
            tx.send(done(3)).unwrap();
        });
        assert_eq!(value(recv_spinning(&rx)), Ok(Some(3)));
        late.join().unwrap();
        assert_eq!(ran_rx.try_iter().collect::<Vec<_>>(), vec![me, me]);
        // A wait with a deadline runs none: the errand runs elsewhere, the answer comes.
        let (tx, rx) = flume::bounded(2);
        tx.send(errand(ran_tx)).unwrap();
        tx.send(done(4)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let got = answer_by(&rx, deadline).map(|r| r.ok().map(|b| *b));
        assert_eq!(got, Ok(Some(4)));
        let elsewhere = ran_rx.recv_timeout(Duration::from_secs(10));
        assert!(matches!(elsewhere, Ok(t) if t != me), "{elsewhere:?}");
    }
}
