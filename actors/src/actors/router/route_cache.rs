//! A thread's last stream routes: which pool a stream's requests went to, remembered per
//! thread so that the cached path of a request naming a stream does not load the routing
//! table (an `ArcSwap` load and its guard's drop are two read-modify-writes of shared lines;
//! the check here is one plain load of the router's epoch).
//!
//! A route is remembered only when no capture was underway (the stream's own pool serves
//! it, or the default pool where streams have none), under the engine's id, the stream and
//! the router's epoch read before the table was. It is used while the epoch is unchanged: any
//! new table (a capture begun, a stream pool added or retired) makes the thread look the
//! stream up again. The thread holds a strong reference to each pool it remembers, taken
//! when the route is (not when it is used): a stream's pool retired (taken out of the tables
//! and let go by the router) while a thread is between reading the epoch and using the
//! route stays alive until the thread remembers another pool in its place. Engine ids are
//! never reused, so a route is used only through a handle of the engine it was made for.

use std::any::Any;
use std::cell::Cell;
use std::sync::Arc;

use crate::blocks::block::Home;
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

/// A pool held by a thread for the route that names it.
type Held = Option<Arc<dyn Any + Send + Sync>>;

/// A thread's routes, and the pools they name. One thread-local, so that the routes cannot
/// be read once the pools are dropped with the thread's locals.
struct Ways {
    routes: [Cell<Route>; WAYS],
    held: [Cell<Held>; WAYS],
}

thread_local! {
    static ROUTES: Ways = const {
        Ways {
            routes: [const { Cell::new(NONE) }; WAYS],
            held: [const { Cell::new(None) }; WAYS],
        }
    };
}

/// The way of `stream`: the top bits of a multiplicative hash (a stream's id may be a
/// driver handle, whose low bits are the same for every stream).
#[inline]
fn way(stream: StreamId) -> usize {
    (stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - WAYS.trailing_zeros())) as usize
}

/// A remembered stream pool, alive while the handle it was looked up through is.
pub(crate) struct Known<'a, R: Runtime>(&'a Home<R>);

impl<'a, R: Runtime> Known<'a, R> {
    pub(crate) fn pool(&self) -> &'a Home<R> {
        self.0
    }

    /// A strong reference to the pool (for a miss, which hands it to the pool actor's
    /// request).
    pub(crate) fn shared(&self) -> Arc<Home<R>> {
        let p: *const Home<R> = self.0;
        // SAFETY: `remember` stored `Arc::as_ptr` of an `Arc<Home<R>>` whose strong
        // reference this thread still holds (see `lookup`): adding a strong count and taking
        // one reference for it is balanced by the returned `Arc`'s drop.
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
pub(crate) unsafe fn lookup<'a, R: Runtime>(
    engine: u64,
    stream: StreamId,
    epoch: u64,
) -> Option<Known<'a, R>> {
    let r = ROUTES.try_with(|w| w.routes[way(stream)].get()).ok()?;
    if r.engine != engine || r.stream != stream.0 || r.epoch != epoch || r.pool.is_null() {
        return None;
    }
    // SAFETY: `remember` stored a pointer to a pool of engine `engine` (type `Home<R>`: an
    // engine has one runtime type) and a strong reference to it in the same way, which this
    // thread replaces only in `remember`; the caller uses the reference before it remembers
    // anything (for `'a`, within one request), so the pool is alive.
    Some(Known(unsafe { &*(r.pool as *const Home<R>) }))
}

/// Remembers that `stream` of engine `engine` routes to `pool`, read from a table loaded
/// after the router's epoch was `epoch`, with no capture underway; holds the pool for the
/// route (a new reference only when the way named another pool).
#[inline]
pub(crate) fn remember<R: Runtime>(engine: u64, stream: StreamId, epoch: u64, pool: &Arc<Home<R>>) {
    let route = Route {
        engine,
        stream: stream.0,
        epoch,
        pool: Arc::as_ptr(pool) as *const (),
    };
    let way = way(stream);
    let _ = ROUTES.try_with(|w| {
        let before = w.routes[way].get();
        let old = (before.pool != route.pool).then(|| {
            let held: Arc<dyn Any + Send + Sync> = pool.clone();
            w.held[way].replace(Some(held))
        });
        w.routes[way].set(route);
        // The pool the way named before goes after the route moved off it.
        drop(old);
    });
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
