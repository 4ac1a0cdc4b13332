//! The miss path: what a request does when the cached path found no ready block.
//!
//! It asks the pool actor (one round trip); on "need room" — fresh memory would pass the cap,
//! or the memory source is out of memory — the requesting task (never an actor, so no actor
//! ever waits on another) first runs the free-memory callbacks, if any are attached, on a
//! blocking thread, and asks again if one of them freed something (once per request); where
//! the engine lends between streams, a request of a stream's pool then borrows a block of memory another stream's pool holds,
//! handed over by ordering its stream after the other's queued work (no driver call, no
//! waiting: `hand_over`); failing that, it empties the cache of every pool and asks again. If it still does not
//! fit, the pool queues it, first come first served (see the pool actor's `waiters`), and the
//! request waits for its reply, up to its timeout. Cancel-safe: a dropped request tells its
//! pool to forget it, and a block sent to it meanwhile goes back.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::block::{Block, Pool};
use crate::budget::{Budget, EmptyReport};
use crate::error::{Error, OomCause};
use crate::mailbox::{Answer, Ask, MissReply, MissTx, PoolMsg, Refused};
use crate::policy::SizeClass;
use crate::runtime::Runtime;

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

/// Counts an empty-and-retry, and asks every pool of the allocator to empty its cache;
/// returns the replies to wait for.
fn ask_all_to_empty<R: Runtime>(pool: &Pool<R>) -> Vec<flume::Receiver<EmptyReport>> {
    pool.stats.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
    pool.budget
        .pools()
        .iter()
        .filter_map(|p| p.ask_to_empty())
        .collect()
}

/// Empties every pool's cache and waits for them all, from a task.
async fn make_room<R: Runtime>(pool: &Pool<R>) {
    for rx in ask_all_to_empty(pool) {
        let _ = rx.recv_async().await;
    }
}

/// [`make_room`] for plain threads.
fn make_room_blocking<R: Runtime>(pool: &Pool<R>) {
    for rx in ask_all_to_empty(pool) {
        let _ = rx.recv();
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
        Some(to) if crate::lease::record(&mut block, to).is_ok() => {
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

/// Borrows a block of `class` from another stream's pool (see [`hand_over`]), from a task.
async fn borrow<R: Runtime>(pool: &Pool<R>, class: SizeClass) -> Option<Box<Block<R>>> {
    for lender in lenders(pool) {
        let Some(rx) = ask_to_lend(&lender, class) else {
            continue;
        };
        if let Ok(Some(block)) = rx.recv_async().await {
            if let Some(b) = hand_over(pool, block) {
                return Some(b);
            }
        }
    }
    None
}

/// [`borrow`] for plain threads.
fn borrow_blocking<R: Runtime>(pool: &Pool<R>, class: SizeClass) -> Option<Box<Block<R>>> {
    for lender in lenders(pool) {
        let Some(rx) = ask_to_lend(&lender, class) else {
            continue;
        };
        if let Ok(Some(block)) = rx.recv() {
            if let Some(b) = hand_over(pool, block) {
                return Some(b);
            }
        }
    }
    None
}

/// Runs the free-memory callbacks, from a task: on a blocking thread of the tokio runtime
/// (inline where there is none: the future is then not polled by a tokio executor). Whether
/// one of them freed something.
async fn free_memory<R: Runtime>(pool: &Pool<R>) -> bool {
    let budget = pool.budget.clone();
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle
            .spawn_blocking(move || budget.free_memory.run())
            .await
            .unwrap_or(false),
        Err(_) => budget.free_memory.run(),
    }
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

/// A miss, from a task: ask the pool; on "need room" empty every cache and ask again, this
/// time queueing when it still does not fit (unless `wait` says not to).
pub(crate) async fn miss_async<R: Runtime>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    requested: usize,
    wait: Wait,
) -> Result<Box<Block<R>>, Error> {
    check_cap(pool, class, requested)?;
    let timeout = wait.resolve(&pool.budget);
    let may_wait = timeout.is_some();
    let work = async {
        let mut ask = Ask {
            requested,
            wait: may_wait,
            emptied: false,
            shard: pool.ready.my_shard(),
            // A task must not block its executor: the pool runs its calls elsewhere.
            lends: false,
            quiet: false,
        };
        let mut callbacks_ran = false;
        loop {
            let rx = send_miss(pool, class, ask)?;
            let mut pending = Pending { pool, armed: true };
            let reply = answer_async(&rx).await;
            pending.armed = false;
            match reply.map_err(|_| Error::Shutdown)? {
                Ok(block) => return Ok(block),
                Err(Refused::Failed(e)) => return Err(e),
                Err(Refused::NeedRoom) if !ask.emptied => {
                    if callbacks_due(pool, &mut callbacks_ran) && free_memory(pool).await {
                        // Something was freed: it may be cached now, or room made.
                        continue;
                    }
                    // Memory another stream's pool holds serves it without the driver.
                    if let Some(block) = borrow(pool, class).await {
                        return Ok(block);
                    }
                    make_room(pool).await;
                    ask.emptied = true;
                }
                Err(Refused::NeedRoom) => return Err(no_room(pool, requested)),
            }
        }
    };
    match timeout.flatten() {
        Some(d) => match tokio::time::timeout(d, work).await {
            Ok(r) => r,
            Err(_) => Err(timed_out(pool, requested, d)),
        },
        None => work.await,
    }
}

/// [`miss_async`] for plain threads.
pub(crate) fn miss_blocking<R: Runtime>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    requested: usize,
    wait: Wait,
) -> Result<Box<Block<R>>, Error> {
    check_cap(pool, class, requested)?;
    let timeout = wait.resolve(&pool.budget);
    let deadline = timeout.flatten().map(|d| Instant::now() + d);
    let mut ask = Ask {
        requested,
        wait: timeout.is_some(),
        emptied: false,
        shard: pool.ready.my_shard(),
        // A request with a deadline keeps it: the memory source's calls, whose length
        // nobody knows, run elsewhere.
        lends: deadline.is_none(),
        quiet: false,
    };
    let mut callbacks_ran = false;
    loop {
        let rx = send_miss(pool, class, ask)?;
        let mut pending = Pending { pool, armed: true };
        let reply = match deadline {
            Some(at) => match answer_by(&rx, at) {
                Ok(r) => r,
                Err(flume::RecvTimeoutError::Timeout) => {
                    // Dropping `rx` hands back a block sent in the meantime; `pending` tells
                    // the pool to forget the request.
                    drop(rx);
                    drop(pending);
                    let d = timeout.flatten().unwrap_or_default();
                    return Err(timed_out(pool, requested, d));
                }
                Err(flume::RecvTimeoutError::Disconnected) => return Err(Error::Shutdown),
            },
            None => recv_spinning(&rx).map_err(|_| Error::Shutdown)?,
        };
        pending.armed = false;
        match reply {
            Ok(block) => return Ok(block),
            Err(Refused::Failed(e)) => return Err(e),
            Err(Refused::NeedRoom) if !ask.emptied => {
                // A blocking miss runs on a thread that may block: the callbacks run here.
                if callbacks_due(pool, &mut callbacks_ran) && pool.budget.free_memory.run() {
                    continue;
                }
                if let Some(block) = borrow_blocking(pool, class) {
                    return Ok(block);
                }
                make_room_blocking(pool);
                ask.emptied = true;
            }
            Err(Refused::NeedRoom) => return Err(no_room(pool, requested)),
        }
    }
}

/// One try for one buffer of a request for several (see `engine::many`), from a task: ask
/// the pool; on "need room", when `empty` says so, run the free-memory callbacks (once) and
/// empty every cache, and ask once more. Never queued and never counted as an out-of-memory:
/// no room is [`Tried::NoRoom`], and the request waits or fails as a whole. What the
/// runtime itself refuses once the caches were emptied (no cap in the way) is a final,
/// counted error, as for `try_alloc`. Cancel-safe as [`miss_async`] is.
pub(crate) async fn miss_once<R: Runtime>(
    pool: &Arc<Pool<R>>,
    class: SizeClass,
    requested: usize,
    empty: bool,
) -> Result<Box<Block<R>>, Tried> {
    let mut ask = Ask {
        requested,
        wait: false,
        emptied: false,
        shard: pool.ready.my_shard(),
        lends: false,
        quiet: true,
    };
    let mut callbacks_ran = false;
    loop {
        let rx = send_miss(pool, class, ask).map_err(Tried::Failed)?;
        let mut pending = Pending { pool, armed: true };
        let reply = answer_async(&rx).await;
        pending.armed = false;
        match reply.map_err(|_| Tried::Failed(Error::Shutdown))? {
            Ok(block) => return Ok(block),
            Err(Refused::Failed(e)) => return Err(Tried::Failed(e)),
            Err(Refused::NeedRoom) if empty && !ask.emptied => {
                if callbacks_due(pool, &mut callbacks_ran) && free_memory(pool).await {
                    continue;
                }
                make_room(pool).await;
                ask.emptied = true;
            }
            Err(Refused::NeedRoom) => return Err(Tried::NoRoom),
        }
    }
}

/// How one try of [`miss_once`] failed.
pub(crate) enum Tried {
    /// No room now (under the cap; before the caches were emptied, also in the runtime).
    NoRoom,
    /// A final error.
    Failed(Error),
}

/// How long a blocking miss spins on its reply before it parks the thread.
const REPLY_SPIN: Duration = Duration::from_micros(30);

/// Waits for a pool actor's answer, polling for it for [`REPLY_SPIN`] before parking the
/// thread: a miss that the actor serves from memory it holds is answered within
/// microseconds, and parking would add a wake-up about as long as the wait itself. Errands
/// the actor sends meanwhile run here (see [`crate::errand`]), and the spin starts again
/// after each: the answer follows soon after the errand's result.
fn recv_spinning<B>(rx: &flume::Receiver<Answer<B>>) -> Result<MissReply<B>, flume::RecvError> {
    let mut start = Instant::now();
    loop {
        let answer = match rx.try_recv() {
            Ok(a) => a,
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if start.elapsed() < REPLY_SPIN => {
                std::hint::spin_loop();
                continue;
            }
            Err(flume::TryRecvError::Empty) => rx.recv()?,
        };
        match answer {
            Answer::Done(reply) => return Ok(reply),
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
            Answer::Errand(crate::errand::Errand::new(work, rt.handle().clone()))
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
