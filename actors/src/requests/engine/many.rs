//! Requests for several buffers at once, from one engine or several (pinned memory and the
//! memory of each device have budgets of their own): all of them, or none.
//!
//! Owns the protocol that keeps such requests live under the caps without hold-and-wait: a
//! request never waits while it holds memory. It tries to take every buffer without waiting
//! (`Engine::try_once`: the cached path, then the pool actor, never queued); if one finds
//! no room, every buffer it took goes back before it waits. While a request waits for room
//! under a budget (`Budget::under_pressure`), a new request does not try: it queues behind.
//! Otherwise it tries first, and queues only when it finds no room. Waiting is first come
//! first served: a request takes the turn of each budget it spans (`Budget::turn`, a fair queue),
//! in one global order (`Budget::id`), so that two requests spanning the same budgets never
//! hold each other's turn; the request holding every turn it needs is the head, the only
//! queued one that makes room and waits. The head waits for blocks to come home to a pool actor under
//! its budgets (`Budget::returns`: the blocks it gave back itself are not counted, so it
//! does not wake itself), or for a cap to change, then tries again, with room made (every
//! cache emptied) when there is none. A request larger than a cap, its buffers together,
//! fails at once ([`OomCause::ExceedsLimit`]).
//!
//! The liveness rule: no request waits for ever while the bytes it needs are free, cached,
//! or held by blocks that will come back. Free or cached bytes are found by the head's
//! next try (which empties the caches); a block that comes back wakes the head. The
//! requests behind the head hold nothing, so a head can only be kept waiting by buffers
//! held elsewhere. Checked by `tests/limits/liveness.rs`.
//!
//! Cancel-safe: dropping the future at any await gives back every buffer taken so far,
//! leaves the turn queues (tokio's semaphore forgets a dropped waiter), and unregisters it
//! as a queued request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use crate::blocks::lease::Lease;
use crate::books::budget::Budget;
use crate::requests::long_wait;
use crate::requests::miss::{Tried, Wait};
use crate::vocab::blocking::may_block;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::runtime::Runtime;

use super::Engine;

/// One buffer of a request for several: `size` bytes from `engine`, for work on `stream`
/// (`None`: the engine's default pool; a stream-ordered engine takes the stream's pool).
pub struct Want<'a, R: Runtime> {
    engine: &'a Engine<R>,
    size: usize,
    stream: Option<&'a R::Stream>,
}

impl<'a, R: Runtime> Want<'a, R> {
    /// `size` bytes from `engine` for work on `stream`.
    pub fn new(engine: &'a Engine<R>, size: usize, stream: Option<&'a R::Stream>) -> Self {
        Self {
            engine,
            size,
            stream,
        }
    }
}

/// Takes every buffer of `wants` or none, waiting first come first served (as `wait` says)
/// until all of them fit under their engines' caps; the leases come back in the order of
/// `wants`.
///
/// It never waits while it holds memory: a try that finds no room for one buffer gives back
/// every buffer it took before the request waits, so requests that share caps cannot
/// deadlock, whatever they ask for and in whatever order. A request tries at once unless
/// another waits for room under one of its budgets; one that finds no room queues. Waiting
/// requests queue for the
/// turn of every budget they span (pinned memory, each device), in one global order; the
/// one at the head tries again whenever a block comes home under one of its budgets or a cap
/// changes. The liveness rule: no request waits for ever while the bytes it needs are free,
/// cached, or held by blocks that will come back (each that comes back wakes the head, and
/// its next try empties the caches). A request defers to single requests (`alloc`) already
/// queued in one of its pools.
///
/// - A request whose buffers together are larger than an engine's cap fails at once with
///   [`Error::OutOfMemory`] ([`OomCause::ExceedsLimit`], `requested` the bytes asked of
///   that engine); so does a waiting one when the cap is lowered under it.
/// - `Wait::Never`: one try, room made first; no room is [`OomCause::NoRoomNow`].
/// - `Wait::Default` waits up to the shortest default timeout of the engines, `Wait::Upto`
///   as long as it says ([`Error::Timeout`] after, `requested` the bytes of every buffer).
/// - What the runtime refuses with no cap in the way (the device out of memory after the
///   caches were emptied) fails the request, as for one buffer.
///
/// Cancel-safe: dropping the future gives back everything it took and leaves no queued request.
pub async fn alloc_many<R: Runtime>(
    wants: &[Want<'_, R>],
    wait: Wait,
) -> Result<Vec<Lease<R>>, Error> {
    if wants.is_empty() {
        return Ok(Vec::new());
    }
    let budgets = budgets_of(wants);
    never_fits(wants, &budgets)?;
    // The order of the tries: by budget, largest first (a large block cut last might not
    // find a range left whole by the small ones).
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| {
        (
            wants[i].engine.budget().id,
            std::cmp::Reverse(wants[i].size),
        )
    });
    let timeout = match wait {
        Wait::Never => None,
        Wait::Default => budgets.iter().filter_map(|b| b.default_timeout).min(),
        Wait::Upto(d) => Some(d),
    };
    // Nobody waits for room under these budgets: a try at once, without making room (the
    // cached path, as a rule); a request that finds no room queues, and makes room only at
    // the head. Requests queued for the turn that have not yet found no room do not stop
    // it: making every request queue behind a head that is merely trying builds a convoy,
    // one task wake-up per request, under load. Otherwise a request waits for room, and
    // this one queues behind it (unless it may not wait: then one try, room made first).
    let nobody_waits = budgets.iter().all(|b| !b.under_pressure());
    if nobody_waits || wait == Wait::Never {
        if let Ok(leases) = try_all(wants, &order, wait == Wait::Never).await? {
            return Ok(leases);
        }
        if wait == Wait::Never {
            return Err(no_room_now(wants, &budgets));
        }
    }
    let work = looked_at(wait_for_all(wants, &order, &budgets), wants, &budgets);
    match timeout {
        None => work.await,
        Some(d) => match tokio::time::timeout(d, work).await {
            Ok(r) => r,
            Err(_) => {
                let first = wants[0].engine.default_pool();
                first
                    .stats
                    .num_ooms
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(Error::Timeout {
                    requested: wants.iter().map(|w| w.size).sum(),
                    timeout: d,
                })
            }
        },
    }
}

/// [`alloc_many`] for threads outside the tokio runtime: a thin adapter that blocks the
/// calling thread on the async call. Where that would deadlock (a thread that runs a
/// current-thread runtime's tasks) it fails at once with [`Error::WouldDeadlock`] naming
/// `call` (the blocking call, and the async one to use instead); on a multi-thread
/// runtime's threads it blocks inside `block_in_place` (see [`crate::vocab::blocking`]).
pub fn alloc_many_blocking<R: Runtime>(
    wants: &[Want<'_, R>],
    wait: Wait,
    call: (&'static str, &'static str),
) -> Result<Vec<Lease<R>>, Error> {
    let Some(first) = wants.first() else {
        return Ok(Vec::new());
    };
    let blocking = may_block(call.0, call.1)?;
    let handle = first.engine.handle().clone();
    blocking.run(|| {
        // Inside `block_in_place`, or on a runtime's blocking thread, the current runtime
        // runs the future; on a plain thread the allocator's own.
        let handle = tokio::runtime::Handle::try_current().unwrap_or(handle);
        handle.block_on(alloc_many(wants, wait))
    })
}

/// The budgets `wants` spans, in the order their turns are taken.
fn budgets_of<'a, R: Runtime>(wants: &'a [Want<'_, R>]) -> Vec<&'a Arc<Budget>> {
    let mut budgets: Vec<&Arc<Budget>> = wants.iter().map(|w| w.engine.budget()).collect();
    budgets.sort_by_key(|b| b.id);
    budgets.dedup_by_key(|b| b.id);
    budgets
}

/// Fails a request whose buffers could never fit together under some cap (counted as an
/// out-of-memory of that engine, which its OOM observers hear of), or one too large for its
/// size policy.
fn never_fits<R: Runtime>(wants: &[Want<'_, R>], budgets: &[&Arc<Budget>]) -> Result<(), Error> {
    for b in budgets {
        let mut blocks = 0usize;
        let mut requested = 0usize;
        let mut first = None;
        for w in wants
            .iter()
            .filter(|w| w.engine.budget().id == b.id && w.size > 0)
        {
            let policy = w.engine.policy();
            let class = policy.class_of(w.size).ok_or(Error::SizeTooLarge {
                requested: w.size,
                max: policy.max_request(),
            })?;
            blocks = blocks.saturating_add(class.size);
            requested = requested.saturating_add(w.size);
            first.get_or_insert(w.engine);
        }
        let (Some(limit), Some(engine)) = (b.limit(), first) else {
            continue;
        };
        if blocks > limit {
            let pool = engine.default_pool();
            pool.stats
                .num_ooms
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(
                requested,
                blocks,
                limit,
                "buffers requested together larger than the memory limit"
            );
            return Err(pool.oom(Error::OutOfMemory {
                requested,
                reserved: b.reserved(),
                limit: Some(limit),
                cause: OomCause::ExceedsLimit,
            }));
        }
    }
    Ok(())
}

/// The error of a request that found no room in its one try (`Wait::Never`), counted as an
/// out-of-memory of its first engine.
fn no_room_now<R: Runtime>(wants: &[Want<'_, R>], budgets: &[&Arc<Budget>]) -> Error {
    let engine = wants[0].engine;
    let pool = engine.default_pool();
    pool.stats
        .num_ooms
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let b = engine.budget();
    debug_assert!(budgets.iter().any(|x| x.id == b.id));
    pool.oom(Error::OutOfMemory {
        requested: wants.iter().map(|w| w.size).sum(),
        reserved: b.reserved(),
        limit: b.limit(),
        cause: OomCause::NoRoomNow,
    })
}

/// Tries to take every buffer, in `order`. All of them; or, when one finds no room, none:
/// then the count of blocks given back under each budget (by the budget's id).
async fn try_all<R: Runtime>(
    wants: &[Want<'_, R>],
    order: &[usize],
    empty: bool,
) -> Result<Result<Vec<Lease<R>>, Vec<(u64, u64)>>, Error> {
    let mut got = Taken(wants.iter().map(|_| None).collect());
    for &i in order {
        let w = &wants[i];
        match w.engine.try_once(w.size, w.stream, empty).await {
            Ok(lease) => got.0[i] = Some(lease),
            Err(Tried::Failed(e)) => return Err(e),
            Err(Tried::NoRoom) => {
                let mut gave: Vec<(u64, u64)> = Vec::new();
                for (j, lease) in got.0.iter().enumerate() {
                    if lease.is_some() && wants[j].size > 0 {
                        let id = wants[j].engine.budget().id;
                        match gave.iter_mut().find(|(b, _)| *b == id) {
                            Some((_, n)) => *n += 1,
                            None => gave.push((id, 1)),
                        }
                    }
                }
                // Every buffer taken goes back before the request waits.
                drop(got);
                return Ok(Err(gave));
            }
        }
    }
    Ok(Ok(std::mem::take(&mut got.0)
        .into_iter()
        .flatten()
        .collect()))
}

/// The buffers a try has taken so far. Unless the try took them all and handed them out,
/// they go back as if never lent ([`Lease::roll_back`]: the statistics count what requesters
/// received), also when the request is dropped halfway.
struct Taken<R: Runtime>(Vec<Option<Lease<R>>>);

impl<R: Runtime> Drop for Taken<R> {
    fn drop(&mut self) {
        for lease in self.0.drain(..).flatten() {
            lease.roll_back();
        }
    }
}

/// `wait`, the wait of a request for `wants`, given its one look under each of `budgets`
/// once it has waited [`long_wait::AFTER`]: a warning, or a refusal where it waits on memory
/// only its own task holds (see `long_wait`; the request itself holds nothing while it
/// waits, so only buffers its task took before count).
async fn looked_at<R: Runtime>(
    wait: impl Future<Output = Result<Vec<Lease<R>>, Error>>,
    wants: &[Want<'_, R>],
    budgets: &[&Arc<Budget>],
) -> Result<Vec<Lease<R>>, Error> {
    let mut wait = std::pin::pin!(wait);
    // Without a tokio runtime to time it (another executor polls the request): no look.
    if tokio::runtime::Handle::try_current().is_err() {
        return wait.await;
    }
    if let Ok(done) = tokio::time::timeout(long_wait::AFTER, wait.as_mut()).await {
        return done;
    }
    for b in budgets {
        let mine = || {
            wants
                .iter()
                .filter(|w| w.engine.budget().id == b.id && w.size > 0)
        };
        let Some(first) = mine().next() else {
            continue;
        };
        let need = mine()
            .filter_map(|w| w.engine.policy().class_of(w.size))
            .map(|c| c.size)
            .sum();
        let requested = mine().map(|w| w.size).sum();
        long_wait::look(first.engine.default_pool(), need, requested, false).await?;
    }
    wait.await
}

/// Counts the request among the queued requests of each of its budgets while it lives: frees under
/// them go to the pool actors, which free what no queued request takes and count each block that
/// came home (see [`Budget::returns`]).
struct Waiting<'a>(&'a [&'a Arc<Budget>]);

impl<'a> Waiting<'a> {
    fn register(budgets: &'a [&'a Arc<Budget>]) -> Self {
        for b in budgets {
            b.queued_added();
        }
        Self(budgets)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        for b in self.0 {
            b.queued_removed();
        }
    }
}

/// Queues for the turns, then, at the head, tries and waits until every buffer fits.
async fn wait_for_all<R: Runtime>(
    wants: &[Want<'_, R>],
    order: &[usize],
    budgets: &[&Arc<Budget>],
) -> Result<Vec<Lease<R>>, Error> {
    let mut turns = Vec::with_capacity(budgets.len());
    for b in budgets {
        // The semaphore is never closed.
        turns.push(b.turn.acquire().await.map_err(|_| Error::Shutdown)?);
    }
    // Counted among the queued requests only once a try at the head found no room: a head that
    // came to the turn behind others is served by its first try, as a rule, and pressure
    // (every free sent to the pool actors) would cost the other requests their cache.
    let mut waiting = None;
    loop {
        never_fits(wants, budgets)?;
        let seen: Vec<u64> = budgets.iter().map(|b| b.returns()).collect();
        let gave = match try_all(wants, order, true).await? {
            Ok(leases) => return Ok(leases),
            Err(gave) => gave,
        };
        if waiting.is_none() {
            // From now on every block that comes home is counted; one more try first, for
            // those that went to the caches before.
            waiting = Some(Waiting::register(budgets));
            continue;
        }
        // Wake once more blocks came home (or a cap changed) than this request gave back.
        let wanted: Vec<u64> = budgets
            .iter()
            .zip(&seen)
            .map(|(b, &s)| {
                let own = gave.iter().find(|(id, _)| *id == b.id).map_or(0, |g| g.1);
                s + own + 1
            })
            .collect();
        wait_for_returns(budgets, &wanted).await;
    }
}

/// Waits until some budget counted `wanted` returns.
async fn wait_for_returns(budgets: &[&Arc<Budget>], wanted: &[u64]) {
    loop {
        let mut changed: Vec<Pin<Box<tokio::sync::futures::Notified<'_>>>> =
            budgets.iter().map(|b| Box::pin(b.changed())).collect();
        for c in &mut changed {
            c.as_mut().enable();
        }
        // Enabled first: a return counted after this look wakes the wait below.
        if budgets.iter().zip(wanted).any(|(b, &w)| b.returns() >= w) {
            return;
        }
        std::future::poll_fn(|cx| {
            let mut woke = false;
            for c in &mut changed {
                woke |= c.as_mut().poll(cx).is_ready();
            }
            if woke {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}
