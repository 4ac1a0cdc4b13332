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
//! fit, the pool queues it, first come first served (see the pool actor's `queue`), and the
//! request waits for its reply, up to its timeout. Cancel-safe: a dropped request tells its
//! pool to forget it, and a block sent to it meanwhile goes back.
//!
//! The loop is written once (`miss_with`), over who waits (`Requester`): a task awaits each
//! reply; a blocked thread waits for it in place, and runs the pool actor's memory-source
//! calls.
//!
//! This file holds the loop and the requests' entry points; `requester` is who waits and
//! how, and `room` what a miss does for room.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::blocks::block::{Block, Home};
use crate::books::budget::Budget;
use crate::books::messages::{Answer, Ask, MissReply, MissTx, PoolMsg, Refused};
use crate::requests::long_wait;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::Runtime;
use requester::{Requester, Stop, Task, Thread};
use room::{borrow, callbacks_due, make_room, shortfall};

mod room;
mod requester;

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
fn check_cap<R: Runtime>(pool: &Home<R>, class: SizeClass, requested: usize) -> Result<(), Error> {
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
    pool: &Home<R>,
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
    pool: &'a Home<R>,
    armed: bool,
}

impl<R: Runtime> Drop for Pending<'_, R> {
    fn drop(&mut self) {
        if self.armed {
            self.pool.nudge();
        }
    }
}

fn timed_out<R: Runtime>(pool: &Home<R>, requested: usize, timeout: Duration) -> Error {
    pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        requested,
        timeout_ms = timeout.as_millis() as u64,
        "gave up waiting for pinned memory"
    );
    Error::Timeout { requested, timeout }
}

/// The answer to an ask the pool may queue (room was made, and the request waits): a wait
/// that outlasts [`long_wait::AFTER`] gets its one look, a warning or a refusal (see
/// `long_wait`).
async fn answer_queued<R: Runtime, Q: Requester>(
    requester: &Q,
    rx: &flume::Receiver<Answer<Block<R>>>,
    pool: &Home<R>,
    class: SizeClass,
    requested: usize,
) -> Result<MissReply<Block<R>>, Stop> {
    if let Some(reply) = requester
        .answer_until(rx, Instant::now() + long_wait::AFTER)
        .await?
    {
        return Ok(reply);
    }
    long_wait::look(pool, class.size, requested, requester.blocks())
        .await
        .map_err(Stop::Refused)?;
    requester.answer(rx).await
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
async fn miss_with<R: Runtime, Q: Requester>(
    pool: &Arc<Home<R>>,
    class: SizeClass,
    plan: Plan,
    requester: &Q,
) -> Result<Box<Block<R>>, Missed> {
    let mut ask = Ask {
        requested: plan.requested,
        wait: plan.queue,
        emptied: false,
        holds: true,
        runs_errands: requester.runs_errands(),
        quiet: plan.quiet,
        sent: std::time::Instant::now(),
    };
    // A miss that returns, fails or is cancelled counts alike.
    let _timed = pool.stats.miss_wait.time();
    let mut room = RoomMade::default();
    loop {
        ask.sent = std::time::Instant::now();
        let rx = send_miss(pool, class, ask).map_err(Missed::Failed)?;
        let mut pending = Pending { pool, armed: true };
        let answer = if ask.emptied && plan.queue {
            answer_queued(requester, &rx, pool, class, plan.requested).await
        } else {
            requester.answer(&rx).await
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
                if let Some(block) =
                    make_room_once(pool, class, requester, &mut ask, &mut room).await
                {
                    return Ok(block);
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

/// What a request did so far to make room.
#[derive(Default)]
struct RoomMade {
    /// The free-memory callbacks ran (once per request).
    callbacks_ran: bool,
    /// What the cap lacked was asked of every pool's least recently used memory. Room is
    /// made in two steps: first only that (what the others cache stays, rather than be
    /// given back and taken again), then, if that was not enough, every cache.
    partly: bool,
}

/// One step of making room for a miss refused for want of it, before it asks again: the
/// free-memory callbacks (once a request); a block another stream's pool holds, which
/// serves the miss without the driver (returned); during a capture, nothing (the ask is
/// marked as if every cache had been emptied); else what the cap lacks (once), then every
/// cache, after which the ask is marked emptied.
async fn make_room_once<R: Runtime, Q: Requester>(
    pool: &Arc<Home<R>>,
    class: SizeClass,
    requester: &Q,
    ask: &mut Ask,
    room: &mut RoomMade,
) -> Option<Box<Block<R>>> {
    if callbacks_due(pool, &mut room.callbacks_ran) && requester.free_memory(&pool.budget).await {
        // Something was freed: it may be cached now, or room made.
        return None;
    }
    // Memory another stream's pool holds serves it without the driver.
    if let Some(block) = borrow(pool, class, requester).await {
        return Some(block);
    }
    if pool.budget.capturing() {
        // As PyTorch's allocator: no cache is emptied while a capture is underway (giving
        // memory back synchronises the device, which would invalidate the capture). The
        // pool is asked once more as if it had been, and the request fails (or waits, as
        // its plan says) without it.
        ask.emptied = true;
        return None;
    }
    if !room.partly {
        // One empty-and-retry per request, in one step or two.
        pool.stats.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
    }
    match shortfall(pool, class).filter(|_| !room.partly) {
        Some(over) => {
            room.partly = true;
            make_room(pool, over, requester).await;
        }
        None => {
            make_room(pool, usize::MAX, requester).await;
            ask.emptied = true;
        }
    }
    None
}

/// The error of a request for one buffer whose miss ended without a block: no room in the
/// end is an out-of-memory, a passed deadline a timeout (both counted in `num_ooms`).
fn settle<R: Runtime>(
    pool: &Home<R>,
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
    pool: &Arc<Home<R>>,
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
    pool: &Arc<Home<R>>,
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

/// A pool asked for room twice (it does not once the caches were emptied): out of memory.
fn no_room<R: Runtime>(pool: &Home<R>, requested: usize) -> Error {
    pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
    Error::OutOfMemory {
        requested,
        reserved: pool.budget.reserved(),
        limit: pool.budget.limit(),
        cause: OomCause::NoRoomNow,
    }
}
