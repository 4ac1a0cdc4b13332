//! A request that waits long for room under a cap: the one look it gets once it has waited
//! [`AFTER`]. No wait under a cap is silent.
//!
//! The look asks every pool under the cap what its lent blocks hold, and whose they are (each
//! block's record names the task or thread that took it: see `holder`). Then, the rule:
//!
//! - The request is refused with [`OomCause::HeldByRequester`] when it cannot fit even if
//!   every buffer that others took came back (the cap less the bytes its own task or thread
//!   took and still holds is less than it needs), and no buffer under this cap was ever
//!   dropped by another task or thread than the one that took it. Waiting would then end only
//!   if the requester itself freed memory, which it cannot do while it waits (unless another
//!   branch of the same task, `join!`, frees it). The allocator knows who took a buffer, not
//!   where it went: a buffer handed to another task may be dropped there and end the wait,
//!   which is why a program where buffers change hands (seen once one is dropped by a task
//!   that did not take it) is only warned.
//! - Otherwise a warning is logged, once: what the request waits for, the cap, what is
//!   reserved and lent (and how much of it the requester took), and the ways out.

use std::time::Duration;

use crate::blocks::block::Home;
use crate::books::messages::PoolMsg;
use crate::vocab::error::{Error, OomCause};
use crate::vocab::holder;
use crate::vocab::runtime::Runtime;

/// How long a request waits for room under a cap before it is looked at. Misses take
/// microseconds, and a driver call for a gigabyte of fresh memory a few hundred
/// milliseconds; a second is long past what room takes to come when it comes.
pub(crate) const AFTER: Duration = Duration::from_secs(1);

/// Bytes of the blocks lent under one cap: all of them, and those its requester took.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Lent {
    all: usize,
    mine: usize,
}

/// Bytes of the blocks lent under `pool`'s cap, and of those `me` took: every pool under the
/// cap is asked for its books (`PoolMsg::Describe`), one round trip each; `blocking` says
/// whether to block the thread for each reply (a thread that may block) or await it (a task).
async fn lent<R: Runtime>(pool: &Home<R>, me: u64, blocking: bool) -> Lent {
    let mut lent = Lent::default();
    for member in pool.budget.pools() {
        let Ok(p) = member.as_any().downcast::<Home<R>>() else {
            continue;
        };
        let (tx, rx) = flume::bounded(1);
        if p.mailbox.send(PoolMsg::Describe { reply: tx }).is_err() {
            continue;
        }
        let view = if blocking {
            rx.recv().ok()
        } else {
            rx.recv_async().await.ok()
        };
        let Some(view) = view else {
            continue;
        };
        for s in &view.segments {
            let blocks: Vec<_> = if s.pieces.is_empty() {
                vec![(s.memory.size, Some(s.meta))]
            } else {
                s.pieces.iter().map(|p| (p.size, p.meta)).collect()
            };
            for (size, meta) in blocks {
                match meta.map_or(holder::NOBODY, |m| m.holder()) {
                    holder::NOBODY => {}
                    h => {
                        lent.all += size;
                        if h == me {
                            lent.mine += size;
                        }
                    }
                }
            }
        }
    }
    lent
}

/// Whether a request that needs `need` bytes under `limit`, whose requester took and holds
/// `mine` of them, would wait for ever: see the module's header.
fn waits_on_its_own(limit: usize, need: usize, mine: usize, handed_over: bool) -> bool {
    !handed_over && limit.saturating_sub(mine) < need
}

/// The look at a request for `requested` bytes, which needs `need` bytes of room under the
/// cap of `pool`, and has waited [`AFTER`] (from a thread that may block, when `blocking`):
/// an error when it waits on memory only its requester can give back, else a warning (see
/// the module's header). Nothing without a cap.
pub(crate) async fn look<R: Runtime>(
    pool: &Home<R>,
    need: usize,
    requested: usize,
    blocking: bool,
) -> Result<(), Error> {
    let Some(limit) = pool.budget.limit() else {
        return Ok(());
    };
    let lent = lent(pool, holder::current(), blocking).await;
    let reserved = pool.budget.reserved();
    let waited_ms = AFTER.as_millis() as u64;
    if waits_on_its_own(limit, need, lent.mine, pool.budget.handed_over()) {
        pool.stats
            .num_ooms
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            requested,
            need,
            limit,
            held_by_requester = lent.mine,
            "refused a request that waited for memory only its own task or thread holds: \
             drop those buffers first, or take all of a request's buffers together with \
             BufferSet"
        );
        return Err(Error::OutOfMemory {
            requested,
            reserved,
            limit: Some(limit),
            cause: OomCause::HeldByRequester,
        });
    }
    tracing::warn!(
        requested,
        need,
        limit,
        reserved,
        in_use = lent.all,
        held_by_requester = lent.mine,
        waited_ms,
        "a request has waited {waited_ms} ms for room under the memory cap, held by buffers \
         in use; it fits once enough of them are dropped. A task that holds buffers while it \
         waits for more can wait for ever: take a request's buffers together with BufferSet \
         (it holds nothing while it waits), and bound waits with alloc_timeout"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_refused_only_when_the_requesters_own_buffers_keep_it_from_fitting() {
        const MIB: usize = 1 << 20;
        // The example: a 4 MiB cap, 3 MiB held by the requester, 2 MiB asked.
        assert!(waits_on_its_own(4 * MIB, 2 * MIB, 3 * MIB, false));
        // Others' buffers can make room: a wait, not an error.
        assert!(!waits_on_its_own(4 * MIB, 2 * MIB, 2 * MIB, false));
        assert!(!waits_on_its_own(4 * MIB, 2 * MIB, 0, false));
        // Buffers have changed hands here: what the requester took may be held elsewhere.
        assert!(!waits_on_its_own(4 * MIB, 2 * MIB, 3 * MIB, true));
    }
}
