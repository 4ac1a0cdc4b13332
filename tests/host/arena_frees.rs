//! Where freed blocks of an expandable range go (`BestFit`'s default layout), and what a
//! miss may take. Threads may split a ready block for a request but never merge blocks:
//! merging is the pool actor's, which places every block it cuts best-fit in memory it
//! keeps coalesced. Pinned down here:
//! - every small block (up to 1 MiB) a thread frees stays with that thread (its slot for the
//!   class, then its queue), and its requests take them back without the pool actor;
//! - a freed large block goes home, unless the actor placed it into free mapped memory that
//!   it filled exactly: its thread then holds it until a request of its size takes it back
//!   (no actor involved), or until the thread's next miss sends it home;
//! - before the pool takes fresh memory for a small request, the requesting thread's own
//!   cached blocks come home and coalesce; a miss never takes another thread's.
//!
//! The layout these tests build on: small blocks sit in the upper zone of the range, the
//! first at its very top and the next ones side by side from the start of that granule;
//! large blocks sit side by side from the start of the range.
//!
//! Every test here runs its requests on plain threads with the blocking calls, the actors on
//! a runtime of their own, and gives its pool a shard for every thread that could be alive
//! (the test harness runs tests side by side): each thread owns its shard, its slots and the
//! block it holds.

use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::tuning::BestFit;
use pinpool::{Builder, PinnedAllocator, PinnedBuffer};
use pinpool_testkit::multi_thread;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// A `BestFit` pool (an expandable range) whose actors run on a runtime of their own.
fn arena_pool() -> (
    PinnedAllocator<SimRuntime>,
    SimRuntime,
    tokio::runtime::Runtime,
) {
    let rt = multi_thread(2);
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .handle(rt.handle().clone())
        .shards(1024)
        .build()
        .unwrap();
    (pool, sim, rt)
}

fn addr(b: &PinnedBuffer<SimRuntime>) -> usize {
    b.as_ptr() as usize
}

/// Fills one granule of the upper zone with small blocks of `sizes` (the first, at the top
/// of the range, last in the granule; the others side by side from the granule's start),
/// and returns them in that order. Nothing else is free in the granule.
fn small_granule(
    pool: &PinnedAllocator<SimRuntime>,
    sizes: &[usize],
) -> Vec<PinnedBuffer<SimRuntime>> {
    assert_eq!(sizes.iter().sum::<usize>(), 2 * MIB, "one granule");
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&n| pool.alloc_blocking(n).unwrap())
        .collect();
    let start = addr(&blocks[1]);
    let mut at = start;
    for b in &blocks[1..] {
        assert_eq!(addr(b), at, "side by side from the granule's start");
        at += b.len();
    }
    assert_eq!(addr(&blocks[0]), at, "the first block ends the granule");
    blocks
}

#[test]
fn every_small_block_a_thread_frees_stays_with_it_a_second_of_a_class_too_until_the_pool_would_grow(
) {
    let (pool, sim, _rt) = arena_pool();
    // p (512 KiB) at the top; b, c (256 KiB) and d, e (512 KiB) side by side below it.
    let mut g = small_granule(
        &pool,
        &[512 * KIB, 256 * KIB, 256 * KIB, 512 * KIB, 512 * KIB],
    );
    let (e, d, c, b, p) = (
        g.pop().unwrap(),
        g.pop().unwrap(),
        g.pop().unwrap(),
        g.pop().unwrap(),
        g.pop().unwrap(),
    );
    let (at_b, at_c, at_d, at_p) = (addr(&b), addr(&c), addr(&d), addr(&p));
    let allocs = sim.total_host_allocs();
    // The first of each class fills this thread's slot, the second its queue: none goes home.
    drop((p, b, c, d));
    let misses = pool.stats().num_misses;
    let again = [
        pool.alloc_blocking(256 * KIB).unwrap(),
        pool.alloc_blocking(256 * KIB).unwrap(),
        pool.alloc_blocking(512 * KIB).unwrap(),
        pool.alloc_blocking(512 * KIB).unwrap(),
    ]
    .map(|b| (addr(&b), b));
    assert_eq!(
        pool.stats().num_misses,
        misses,
        "all four served without the pool actor"
    );
    let mut at: Vec<usize> = again.iter().map(|(a, _)| *a).collect();
    at.sort_unstable();
    let mut want = vec![at_b, at_c, at_d, at_p];
    want.sort_unstable();
    assert_eq!(at, want, "this thread's own blocks");
    // Freed again, they stay with this thread until a request only fresh memory would
    // serve: 768 KiB. Then they all come home, and b, c and d, side by side, coalesce.
    drop(again);
    let both = pool.alloc_blocking(768 * KIB).unwrap();
    assert_eq!(addr(&both), at_b, "the thread's own blocks, coalesced");
    assert_eq!(sim.total_host_allocs(), allocs, "no fresh memory");
    // The queued blocks came home too: the next 512 KiB asks the pool actor, which places
    // it at the top of the range, where p was.
    let misses = pool.stats().num_misses;
    let top = pool.alloc_blocking(512 * KIB).unwrap();
    assert!(
        pool.stats().num_misses > misses,
        "nothing left with the thread"
    );
    assert_eq!(addr(&top), at_p);
    assert_eq!(sim.total_host_allocs(), allocs, "no fresh memory");
    drop((both, top, e));
}

/// Three large blocks side by side from the start of the range: 2, 3 and 3 MiB, filling
/// four granules. Freed, the middle one goes home: it was placed into fresh memory.
fn large_blocks_with_a_free_middle(
    pool: &PinnedAllocator<SimRuntime>,
) -> (PinnedBuffer<SimRuntime>, usize, PinnedBuffer<SimRuntime>) {
    let a = pool.alloc_blocking(2 * MIB).unwrap();
    let mid = pool.alloc_blocking(3 * MIB).unwrap();
    let c = pool.alloc_blocking(3 * MIB).unwrap();
    assert_eq!(addr(&mid), addr(&a) + 2 * MIB, "side by side");
    assert_eq!(addr(&c), addr(&mid) + 3 * MIB, "side by side");
    let at = addr(&mid);
    drop(mid);
    (a, at, c)
}

#[test]
fn a_large_block_placed_into_memory_it_filled_exactly_is_held_by_its_thread_and_taken_back_without_the_pool_actor(
) {
    let (pool, sim, _rt) = arena_pool();
    let (a, at, c) = large_blocks_with_a_free_middle(&pool);
    let allocs = sim.total_host_allocs();
    // The freed 3 MiB are the only free mapped memory, and a request of 3 MiB fills them.
    let misses = pool.stats().num_misses;
    let exact = pool.alloc_blocking(3 * MIB).unwrap();
    assert_eq!(addr(&exact), at);
    assert_eq!(
        pool.stats().num_misses,
        misses + 1,
        "placed by the pool actor"
    );
    // Freed, this thread holds it: the same size again takes it back without the actor, as
    // often as the thread frees it.
    drop(exact);
    for _ in 0..3 {
        let again = pool.alloc_blocking(3 * MIB).unwrap();
        assert_eq!(addr(&again), at);
        drop(again);
    }
    assert_eq!(
        pool.stats().num_misses,
        misses + 1,
        "no request asked the actor"
    );
    // Another thread does not see it: its request of the size asks the actor, which has no
    // free memory there, so the block lands elsewhere.
    let p = pool.clone();
    let theirs = std::thread::spawn(move || addr(&p.alloc_blocking(3 * MIB).unwrap()))
        .join()
        .unwrap();
    assert_ne!(theirs, at, "the held block stays with its thread");
    assert_eq!(pool.stats().num_misses, misses + 2);
    assert!(
        sim.total_host_allocs() > allocs,
        "fresh memory for the other thread"
    );
    drop((a, c));
}

#[test]
fn a_held_large_block_goes_home_at_its_threads_next_miss_where_that_miss_can_use_it() {
    let (pool, sim, _rt) = arena_pool();
    let (a, at, c) = large_blocks_with_a_free_middle(&pool);
    // Placed into the 3 MiB it fills, then held by this thread: the same size again takes
    // it back without the actor.
    drop(pool.alloc_blocking(3 * MIB).unwrap());
    let allocs = sim.total_host_allocs();
    let misses = pool.stats().num_misses;
    let held = pool.alloc_blocking(3 * MIB).unwrap();
    assert_eq!((addr(&held), pool.stats().num_misses), (at, misses), "held");
    drop(held);
    // Another size misses: the held block goes home before the request reaches the actor,
    // whose best fit is then the place it left.
    let other = pool.alloc_blocking(2 * MIB + 512 * KIB).unwrap();
    assert_eq!(addr(&other), at);
    assert_eq!(pool.stats().num_misses, misses + 1);
    assert_eq!(sim.total_host_allocs(), allocs, "no fresh memory");
    drop((a, c, other));
}

type Buffer = PinnedBuffer<SimRuntime>;

/// One granule of small blocks: p (512 KiB) at the top; b (256 KiB), d (512 KiB) and
/// f (768 KiB) side by side below it.
fn four_side_by_side(pool: &PinnedAllocator<SimRuntime>) -> (Buffer, Buffer, Buffer, Buffer) {
    let mut g = small_granule(pool, &[512 * KIB, 256 * KIB, 512 * KIB, 768 * KIB]);
    let mut next = || g.remove(0);
    (next(), next(), next(), next())
}

#[test]
fn before_the_pool_grows_for_a_small_request_the_requesting_threads_cached_blocks_come_home() {
    let (pool, sim, _rt) = arena_pool();
    let (p, b, d, f) = four_side_by_side(&pool);
    let at_b = addr(&b);
    // Each fills this thread's slot of its class: no free mapped memory is left with the
    // pool actor.
    drop((b, d));
    let allocs = sim.total_host_allocs();
    // 768 KiB fits no free mapped memory: rather than grow, the pool has this thread send
    // its cached blocks home, where `b` and `d` coalesce into room for it.
    let both = pool.alloc_blocking(768 * KIB).unwrap();
    assert_eq!(addr(&both), at_b, "the thread's own blocks, coalesced");
    assert_eq!(sim.total_host_allocs(), allocs, "no fresh memory");
    // They left this thread's slots: its next 256 KiB request asks the actor.
    let misses = pool.stats().num_misses;
    let next = pool.alloc_blocking(256 * KIB).unwrap();
    assert!(pool.stats().num_misses > misses, "the slot was emptied");
    drop((both, next, f, p));
}

#[test]
fn a_miss_never_takes_another_threads_cached_blocks() {
    let (pool, sim, _rt) = arena_pool();
    // The same granule as above: this thread's `b` and `d`, side by side, fill its slots.
    let (p, b, d, f) = four_side_by_side(&pool);
    let (at_b, at_d) = (addr(&b), addr(&d));
    drop((b, d));
    let allocs = sim.total_host_allocs();
    // Another thread's 768 KiB: its own shard holds nothing, so the pool takes fresh memory
    // rather than this thread's blocks.
    let q = pool.clone();
    let theirs = std::thread::spawn(move || {
        let b = q.alloc_blocking(768 * KIB).unwrap();
        let at = addr(&b);
        drop(b);
        at
    })
    .join()
    .unwrap();
    assert!(
        !(at_b..at_b + 768 * KIB).contains(&theirs),
        "cut out of another thread's cached blocks"
    );
    assert_eq!(sim.total_host_allocs(), allocs + 1, "fresh memory");
    // This thread's blocks are where it left them: served without the actor.
    let misses = pool.stats().num_misses;
    let mine = (
        pool.alloc_blocking(256 * KIB).unwrap(),
        pool.alloc_blocking(512 * KIB).unwrap(),
    );
    assert_eq!((addr(&mine.0), addr(&mine.1)), (at_b, at_d));
    assert_eq!(pool.stats().num_misses, misses);
    drop((mine, f, p));
}
