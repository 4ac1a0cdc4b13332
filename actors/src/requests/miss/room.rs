//! Making room for a miss refused for want of it: the free-memory callbacks (once a
//! request), a block borrowed from another stream's pool and handed over without the
//! driver, and the caches of every pool emptied, first by what the cap lacks.

use std::sync::Arc;

use super::requester::Requester;
use crate::blocks::block::{Block, Home};
use crate::books::budget::EmptyReport;
use crate::books::messages::PoolMsg;
use crate::vocab::policy::SizeClass;
use crate::vocab::runtime::Runtime;

/// Asks every pool of the allocator to give back up to `upto` bytes of its cache
/// (`usize::MAX`: all of it); returns the replies to wait for.
fn ask_all_to_empty<R: Runtime>(pool: &Home<R>, upto: usize) -> Vec<flume::Receiver<EmptyReport>> {
    pool.budget
        .pools()
        .iter()
        .filter_map(|p| p.ask_to_empty(upto))
        .collect()
}

/// The room a block of `class` lacks under the cap now: the bytes reserved past the cap
/// once it is taken (`None` without a cap, or when the cap is not what is in the way: the
/// memory source refused, and every cache must go).
pub(super) fn shortfall<R: Runtime>(pool: &Home<R>, class: SizeClass) -> Option<usize> {
    let limit = pool.budget.limit()?;
    let over = (pool.budget.reserved() + class.size).checked_sub(limit)?;
    (over > 0).then_some(over)
}

/// Asks every pool to give back up to `upto` bytes of its cache (`usize::MAX`: all of it)
/// and waits for them all.
pub(super) async fn make_room<R: Runtime, Q: Requester>(
    pool: &Home<R>,
    upto: usize,
    requester: &Q,
) {
    for rx in ask_all_to_empty(pool, upto) {
        let _ = requester.recv(&rx).await;
    }
}

/// The other streams' pools of the allocator, for a stream's pool of an engine that lends
/// between streams (see `EngineBuilder::lend_between_streams`; none otherwise).
fn lenders<R: Runtime>(pool: &Home<R>) -> Vec<Arc<Home<R>>> {
    if !pool.lends || pool.owner_stream.is_none() {
        return Vec::new();
    }
    pool.budget
        .pools()
        .into_iter()
        .filter_map(|m| m.as_any().downcast::<Home<R>>().ok())
        .filter(|p| p.owner_stream.is_some() && !std::ptr::eq(Arc::as_ptr(p), pool))
        .collect()
}

/// Asks `lender` for a block of `class` out of memory it holds (see `PoolMsg::Lend`).
fn ask_to_lend<R: Runtime>(
    lender: &Home<R>,
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
fn hand_over<R: Runtime>(pool: &Home<R>, mut block: Box<Block<R>>) -> Option<Box<Block<R>>> {
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
pub(super) async fn borrow<R: Runtime, Q: Requester>(
    pool: &Home<R>,
    class: SizeClass,
    requester: &Q,
) -> Option<Box<Block<R>>> {
    for lender in lenders(pool) {
        let Some(rx) = ask_to_lend(&lender, class) else {
            continue;
        };
        if let Some(Some(block)) = requester.recv(&rx).await {
            if let Some(b) = hand_over(pool, block) {
                return Some(b);
            }
        }
    }
    None
}

/// Whether a request that was refused for want of room should run the free-memory callbacks
/// now: once per request, and only where some are attached.
pub(super) fn callbacks_due<R: Runtime>(pool: &Home<R>, ran: &mut bool) -> bool {
    if *ran || pool.budget.free_memory.is_empty() {
        return false;
    }
    *ran = true;
    true
}
