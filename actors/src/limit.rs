//! The memory limit: one budget of reserved pinned bytes shared by every pool of an allocator,
//! and the path of a request that has to wait for room.
//!
//! Owns the budget (bytes reserved, the cap, how many requests wait) and the registry of the
//! allocator's pools. A pool actor reserves a block's bytes here, atomically, before it asks
//! the runtime for fresh memory, and gives them back when the memory goes back (invariant 2:
//! the budget's reserved bytes are the pools' reserved bytes).
//!
//! A request whose fresh memory would pass the cap is refused by its pool with "need room";
//! the requesting task (never an actor, so no actor ever waits on another) empties the cache
//! of every pool and asks again. If it still does not fit, the pool queues it, first come
//! first served, and while any request waits anywhere every pool's `divert` flag is set:
//! frees go to the pool actors instead of the ready queues, so that a returned block is
//! handed straight to a waiter of its class or freed to make room. Without waiters the
//! cached path reads the flag it always read and does nothing more (invariant 5).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::block::Block;
use crate::error::Error;
use crate::policy::SizeClass;
use crate::pool::{EmptyReport, PoolMsg, PoolShared, DIVERT_PRESSURE};
use crate::runtime::Runtime;

/// The cap value that means "no limit".
const NO_LIMIT: usize = usize::MAX;

/// The allocator-wide budget of reserved bytes and the registry of its pools.
pub(crate) struct Budget<R: Runtime> {
    limit: AtomicUsize,
    reserved: AtomicUsize,
    /// Requests queued in any pool.
    waiters: AtomicUsize,
    /// How long `alloc` waits for room by default (`None`: as long as it takes).
    pub(crate) default_timeout: Option<Duration>,
    /// Thread shards of the ready queues and stats (reported by snapshots).
    pub(crate) shards: usize,
    /// Name of the size policy (reported by snapshots).
    pub(crate) policy: &'static str,
    pools: ArcSwap<Vec<Weak<PoolShared<R>>>>,
}

impl<R: Runtime> Budget<R> {
    pub(crate) fn new(
        limit: Option<usize>,
        default_timeout: Option<Duration>,
        shards: usize,
        policy: &'static str,
    ) -> Self {
        Self {
            limit: AtomicUsize::new(limit.unwrap_or(NO_LIMIT)),
            reserved: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            default_timeout,
            shards,
            policy,
            pools: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// The cap on reserved bytes, if any.
    pub(crate) fn limit(&self) -> Option<usize> {
        match self.limit.load(Ordering::Relaxed) {
            NO_LIMIT => None,
            l => Some(l),
        }
    }

    /// Changes the cap; waiters are looked at again (a higher cap may let them in).
    pub(crate) fn set_limit(&self, limit: Option<usize>) {
        self.limit
            .store(limit.unwrap_or(NO_LIMIT), Ordering::SeqCst);
        self.nudge();
    }

    /// Bytes reserved by all pools together.
    pub(crate) fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` if the cap allows it.
    pub(crate) fn try_reserve(&self, bytes: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                r.checked_add(bytes).filter(|&t| t <= limit)
            })
            .is_ok()
    }

    /// Reserves `bytes` whatever the cap (the runtime rounded an allocation up).
    pub(crate) fn force_reserve(&self, bytes: usize) {
        self.reserved.fetch_add(bytes, Ordering::SeqCst);
    }

    /// Gives back `bytes`; wakes the pools whose requests wait.
    pub(crate) fn release(&self, bytes: usize) {
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
        if self.under_pressure() {
            self.nudge();
        }
    }

    /// Whether some request waits for room in some pool.
    pub(crate) fn under_pressure(&self) -> bool {
        self.waiters.load(Ordering::SeqCst) > 0
    }

    /// A pool queued a request.
    pub(crate) fn waiter_added(&self) {
        if self.waiters.fetch_add(1, Ordering::SeqCst) == 0 {
            self.sync_flags();
        }
    }

    /// A pool served, failed or dropped a queued request.
    pub(crate) fn waiter_removed(&self) {
        if self.waiters.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.sync_flags();
        }
    }

    /// Adds a pool to the registry (dropping pools that are gone).
    pub(crate) fn register(&self, pool: &Arc<PoolShared<R>>) {
        let weak = Arc::downgrade(pool);
        self.pools.rcu(|pools| {
            let mut v: Vec<_> = pools
                .iter()
                .filter(|p| p.strong_count() > 0)
                .cloned()
                .collect();
            v.push(weak.clone());
            v
        });
        self.sync_flags();
    }

    /// Every pool alive, in the order they were made (the default pool first).
    pub(crate) fn pools(&self) -> Vec<Arc<PoolShared<R>>> {
        self.pools.load().iter().filter_map(Weak::upgrade).collect()
    }

    /// Makes every pool's pressure bit say whether requests wait. Whoever changes the count
    /// of waiters from or to zero calls this; each call checks after writing that the count
    /// still agrees with what it wrote, so the last writer always writes the truth.
    fn sync_flags(&self) {
        loop {
            let on = self.under_pressure();
            for p in self.pools() {
                if on {
                    p.divert.fetch_or(DIVERT_PRESSURE, Ordering::SeqCst);
                } else {
                    p.divert.fetch_and(!DIVERT_PRESSURE, Ordering::SeqCst);
                }
            }
            if self.under_pressure() == on {
                break;
            }
        }
    }

    /// Asks every pool with queued requests to look at them again.
    pub(crate) fn nudge(&self) {
        for p in self.pools() {
            p.nudge();
        }
    }
}

/// How a request that does not fit under the cap is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Fail at once with `OutOfMemory`.
    Never,
    /// Wait as long as the allocator's default says.
    Default,
    /// Wait at most this long.
    Upto(Duration),
}

impl Wait {
    /// Whether to wait at all, and how long at most.
    fn resolve<R: Runtime>(self, budget: &Budget<R>) -> Option<Option<Duration>> {
        match self {
            Wait::Never => None,
            Wait::Default => Some(budget.default_timeout),
            Wait::Upto(d) => Some(Some(d)),
        }
    }
}

/// What a request tells its pool beside the class.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask {
    /// Bytes the user asked for (for errors).
    pub(crate) requested: usize,
    /// Whether the request may be queued when it does not fit.
    pub(crate) wait: bool,
    /// Whether every pool's cache has been emptied for this request already.
    pub(crate) emptied: bool,
}

/// Why a pool did not hand out a block.
pub(crate) enum Refused {
    /// No room (under the cap, or from the runtime): empty every cache and ask again.
    NeedRoom,
    /// A final answer.
    Failed(Error),
}

/// A pool's answer to a miss.
pub(crate) type MissReply<R> = Result<Box<Block<R>>, Refused>;

/// Fails a request that could never fit under the cap.
fn check_cap<R: Runtime>(
    pool: &PoolShared<R>,
    class: SizeClass,
    requested: usize,
) -> Result<(), Error> {
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
            })
        }
        _ => Ok(()),
    }
}

fn send_miss<R: Runtime>(
    pool: &PoolShared<R>,
    class: SizeClass,
    ask: Ask,
) -> Result<flume::Receiver<MissReply<R>>, Error> {
    let (tx, rx) = flume::bounded(1);
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
    pool: &'a PoolShared<R>,
    armed: bool,
}

impl<R: Runtime> Drop for Pending<'_, R> {
    fn drop(&mut self) {
        if self.armed {
            self.pool.nudge();
        }
    }
}

fn timed_out<R: Runtime>(pool: &PoolShared<R>, requested: usize, timeout: Duration) -> Error {
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
fn ask_all_to_empty<R: Runtime>(pool: &PoolShared<R>) -> Vec<flume::Receiver<EmptyReport>> {
    pool.stats.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
    pool.budget
        .pools()
        .iter()
        .filter_map(|p| {
            let (tx, rx) = flume::bounded(1);
            let msg = PoolMsg::EmptyCache {
                include_kept: false,
                reply: tx,
            };
            p.mailbox.send(msg).is_ok().then_some(rx)
        })
        .collect()
}

/// Empties every pool's cache and waits for them all, from a task.
async fn make_room<R: Runtime>(pool: &PoolShared<R>) {
    for rx in ask_all_to_empty(pool) {
        let _ = rx.recv_async().await;
    }
}

/// [`make_room`] for plain threads.
fn make_room_blocking<R: Runtime>(pool: &PoolShared<R>) {
    for rx in ask_all_to_empty(pool) {
        let _ = rx.recv();
    }
}

/// A miss, from a task: ask the pool; on "need room" empty every cache and ask again, this
/// time queueing when it still does not fit (unless `wait` says not to).
pub(crate) async fn miss_async<R: Runtime>(
    pool: &Arc<PoolShared<R>>,
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
        };
        loop {
            let rx = send_miss(pool, class, ask)?;
            let mut pending = Pending { pool, armed: true };
            let reply = rx.recv_async().await;
            pending.armed = false;
            match reply.map_err(|_| Error::Shutdown)? {
                Ok(block) => return Ok(block),
                Err(Refused::Failed(e)) => return Err(e),
                Err(Refused::NeedRoom) if !ask.emptied => {
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
    pool: &Arc<PoolShared<R>>,
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
    };
    loop {
        let rx = send_miss(pool, class, ask)?;
        let mut pending = Pending { pool, armed: true };
        let reply = match deadline {
            Some(at) => match rx.recv_deadline(at) {
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
                make_room_blocking(pool);
                ask.emptied = true;
            }
            Err(Refused::NeedRoom) => return Err(no_room(pool, requested)),
        }
    }
}

/// How long a blocking miss spins on its reply before it parks the thread.
const REPLY_SPIN: Duration = Duration::from_micros(30);

/// Waits for a pool actor's reply, polling it for [`REPLY_SPIN`] before parking the thread:
/// a miss that the actor serves from memory it holds is answered within microseconds, and
/// parking would add a wake-up about as long as the wait itself.
fn recv_spinning<T>(rx: &flume::Receiver<T>) -> Result<T, flume::RecvError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if start.elapsed() < REPLY_SPIN => {
                std::hint::spin_loop()
            }
            Err(flume::TryRecvError::Empty) => return rx.recv(),
        }
    }
}

/// A pool asked for room twice (it does not once the caches were emptied): out of memory.
fn no_room<R: Runtime>(pool: &PoolShared<R>, requested: usize) -> Error {
    pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
    Error::OutOfMemory {
        requested,
        reserved: pool.budget.reserved(),
        limit: pool.budget.limit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_received_whether_it_comes_during_the_spin_or_after_it() {
        let (tx, rx) = flume::bounded(1);
        tx.send(1).unwrap();
        assert_eq!(recv_spinning(&rx), Ok(1));
        let late = std::thread::spawn(move || {
            std::thread::sleep(REPLY_SPIN * 20);
            tx.send(2).unwrap();
        });
        assert_eq!(recv_spinning(&rx), Ok(2));
        late.join().unwrap();
    }

    #[test]
    fn a_dropped_sender_ends_the_wait_during_the_spin_or_after_it() {
        let (tx, rx) = flume::bounded::<u8>(1);
        drop(tx);
        assert_eq!(recv_spinning(&rx), Err(flume::RecvError::Disconnected));
        let (tx, rx) = flume::bounded::<u8>(1);
        let late = std::thread::spawn(move || {
            std::thread::sleep(REPLY_SPIN * 20);
            drop(tx);
        });
        assert_eq!(recv_spinning(&rx), Err(flume::RecvError::Disconnected));
        late.join().unwrap();
    }
}
