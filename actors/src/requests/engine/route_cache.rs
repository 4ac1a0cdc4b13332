//! A thread's last stream routes: which pool a stream's requests went to, remembered per
//! thread so that the cached path of a request naming a stream does not load the routing
//! table (an `ArcSwap` load and its guard's drop are two read-modify-writes of shared lines;
//! the check here is one plain load of the router's epoch).
//!
//! A route is remembered only when no capture was underway (the stream's own pool serves
//! it, or the default pool where streams have none), under the engine's id, the stream and
//! the router's epoch read before the table was. It is used while the epoch is unchanged: any
//! new table (a capture begun, a stream pool added) makes the thread look the stream up
//! again. The default pool lives as long as the engine, stream pools are never taken out of
//! a table while their engine has a handle (only the router's close does, and the last
//! handle's drop sends it), and engine ids are never reused, so a remembered pool is alive
//! whenever a handle of its engine finds it.

use std::cell::Cell;
use std::sync::Arc;

use crate::blocks::block::Pool;
use crate::vocab::runtime::{Runtime, StreamId};

/// Routes remembered per thread (direct-mapped by stream; a power of two).
const WAYS: usize = 4;

#[derive(Clone, Copy)]
struct Route {
    engine: u64,
    stream: u64,
    epoch: u64,
    pool: *const (),
}

const NONE: Route = Route {
    engine: 0,
    stream: 0,
    epoch: 0,
    pool: std::ptr::null(),
};

thread_local! {
    static ROUTES: [Cell<Route>; WAYS] = const { [const { Cell::new(NONE) }; WAYS] };
}

/// The way of `stream`: the top bits of a multiplicative hash (a stream's id may be a
/// driver handle, whose low bits are the same for every stream).
#[inline]
fn way(stream: StreamId) -> usize {
    (stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - WAYS.trailing_zeros())) as usize
}

/// A remembered stream pool, alive while the handle it was looked up through is.
pub(super) struct Known<'a, R: Runtime>(&'a Pool<R>);

impl<'a, R: Runtime> Known<'a, R> {
    pub(super) fn pool(&self) -> &'a Pool<R> {
        self.0
    }

    /// A strong reference to the pool (for a miss, which hands it to the pool actor's
    /// request).
    pub(super) fn shared(&self) -> Arc<Pool<R>> {
        let p: *const Pool<R> = self.0;
        // SAFETY: `remember` stored `Arc::as_ptr` of a live `Arc<Pool<R>>`, and the table in
        // force still holds that `Arc` (see `lookup`): adding a strong count and taking one
        // reference for it is balanced by the returned `Arc`'s drop.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    }
}

/// The pool this thread last routed `stream` of engine `engine` to, if the router has
/// published nothing since (`epoch`, read now).
///
/// # Safety
///
/// The caller holds a handle of engine `engine`, whose runtime is `R`, for `'a`.
#[inline]
pub(super) unsafe fn lookup<'a, R: Runtime>(
    engine: u64,
    stream: StreamId,
    epoch: u64,
) -> Option<Known<'a, R>> {
    let r = ROUTES.try_with(|routes| routes[way(stream)].get()).ok()?;
    if r.engine != engine || r.stream != stream.0 || r.epoch != epoch || r.pool.is_null() {
        return None;
    }
    // SAFETY: `remember` stored a pointer to a stream pool of engine `engine` (type
    // `Pool<R>`: an engine has one runtime type) taken from a table published at `epoch`.
    // Stream pools stay in every later table while the engine has a handle (see the module
    // header), and the caller holds one for `'a`: the table in force holds the pool.
    Some(Known(unsafe { &*(r.pool as *const Pool<R>) }))
}

/// Remembers that `stream` of engine `engine` routes to `pool`, read from a table loaded
/// after the router's epoch was `epoch`, with no capture underway.
#[inline]
pub(super) fn remember<R: Runtime>(engine: u64, stream: StreamId, epoch: u64, pool: &Arc<Pool<R>>) {
    let route = Route {
        engine,
        stream: stream.0,
        epoch,
        pool: Arc::as_ptr(pool) as *const (),
    };
    let _ = ROUTES.try_with(|routes| routes[way(stream)].set(route));
}

#[cfg(all(test, not(pinpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn streams_whose_ids_are_aligned_handles_spread_over_every_way() {
        let mut used = [0usize; WAYS];
        for i in 1..=64u64 {
            used[way(StreamId(0x7f00_0000_0000 + i * 512))] += 1;
        }
        assert!(used.iter().all(|&n| n > 0), "ways used: {used:?}");
    }
}
