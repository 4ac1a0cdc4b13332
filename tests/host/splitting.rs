//! Misses served on the requesting thread where blocks are cut out of separate segments
//! (`BestFit::separate_segments` for pinned memory, the device layout without expandable
//! segments): a request that finds no ready block of its class splits a ready block of a
//! larger class, up to the pool's split limit, without the pool actor, and the actor books
//! every split so that the parts coalesce and all memory goes back. (In an expandable range,
//! the default layout, threads split ready blocks too, but never merge them: see
//! `arena_frees`.)
//!
//! To show that no actor is involved, the pool's count of the requests that asked its
//! actor (`num_misses`) must not move while a request is served. The allocators here run
//! their other actors (the router, the poller) on a current-thread runtime that is driven
//! only during set-up, and each such request runs on a thread of its own and must answer
//! within a deadline. (A pool actor runs on a thread of its own, whichever runtime drives
//! the rest.)

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use pinpool::config::DeviceConfig;
use pinpool::sim::SimRuntime;
use pinpool::tuning::BestFit;
use pinpool::{BlockStatus, Builder, DeviceAllocator, DeviceBuilder, PinnedAllocator};
use pinpool_testkit::{current_thread, multi_thread};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Runs `f` on a thread of its own and returns its result, or `None` when it has not
/// answered within a few seconds (it waits on an actor that nothing runs). Fails if a
/// request asked the pool actor meanwhile (`misses` reads the pool's count).
fn without_actors<T: Send + 'static>(
    misses: impl Fn() -> i64,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let before = misses();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    let out = rx.recv_timeout(Duration::from_secs(5)).ok();
    assert_eq!(misses(), before, "a request asked the pool actor");
    out
}

/// A device pool of separate segments whose actors run on `rt`.
fn device_segments_pool(rt: &tokio::runtime::Runtime) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .config(&DeviceConfig::default().with_expandable_segments(false))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    (pool, sim)
}

/// A `BestFit` pool of separate segments whose actors run on `rt`.
fn segments_pool_on(rt: &tokio::runtime::Runtime) -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default().separate_segments()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    (pool, sim)
}

#[test]
fn a_device_request_whose_class_is_empty_splits_a_larger_ready_block_without_the_pool_actor() {
    let rt = current_thread();
    let (pool, sim) = device_segments_pool(&rt);
    let s = sim.stream();
    let (big, other) = rt.block_on(async {
        let b = pool.alloc(MIB, &s).await.unwrap();
        // The rest of its 2 MiB segment: no other memory is free.
        let other = pool.alloc(MIB, &s).await.unwrap();
        (b.device_ptr(), other)
    });
    // The first 1 MiB block is ready (its drop above), the only ready block; nothing runs
    // the actors from here on.
    let (p, st) = (pool.clone(), s.clone());
    let parts = without_actors(
        || pool.stats(0).unwrap().num_misses,
        move || {
            let head = p.raw_alloc_with_stream(4 * KIB, &st).unwrap();
            let tail = p.raw_alloc_with_stream(MIB - 4 * KIB, &st).unwrap();
            (head, tail)
        },
    )
    .expect("both parts served without the pool actor");
    assert_eq!(
        parts,
        (big, big + 4 * KIB as u64),
        "head and tail of one block"
    );
    // A request that no ready block serves asks the pool actor, which runs on a thread of
    // its own and serves it.
    let misses = pool.stats(0).unwrap().num_misses;
    let third = pool.raw_alloc_with_stream(4 * KIB, &s).unwrap();
    assert_eq!(pool.stats(0).unwrap().num_misses, misses + 1);
    // The actor books the splits: the parts coalesce and all the memory goes back to the
    // device.
    rt.block_on(async {
        for p in [parts.0, parts.1, third] {
            pool.raw_delete(p).unwrap();
        }
        drop(other);
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.device_used(0), Some(0), "all memory went back");
        let stats = pool.stats(0).unwrap();
        assert_eq!(stats.reserved_bytes.all.current, 0);
    });
}

#[test]
fn a_pinned_request_under_bestfit_splits_a_larger_ready_block_without_the_pool_actor() {
    let rt = current_thread();
    let (pool, sim) = segments_pool_on(&rt);
    let big = rt.block_on(async {
        let b = pool.alloc(512 * KIB).await.unwrap();
        b.as_ptr() as usize
    });
    let p = pool.clone();
    let head = without_actors(
        || pool.stats().num_misses,
        move || {
            let b = p.alloc_blocking(8 * KIB).unwrap();
            let at = b.as_ptr() as usize;
            // Freed into this thread's ready slot: the same size again is the cached path.
            drop(b);
            let again = p.alloc_blocking(8 * KIB).unwrap().as_ptr() as usize;
            (at, again)
        },
    )
    .expect("served without the pool actor");
    // The head of the freed 512 KiB block; the same block again from the thread's slot.
    assert_eq!(head, (big, big));
    rt.block_on(async {
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
    });
}

#[test]
fn a_thread_never_cuts_a_small_request_out_of_a_large_cached_block() {
    // Separate segments, and the expandable range (where a block this large gets a segment
    // of its own too).
    for policy in [BestFit::default().separate_segments(), BestFit::default()] {
        let rt = current_thread();
        let pool = Builder::new(Arc::new(SimRuntime::new()))
            .policy(Arc::new(policy))
            .handle(rt.handle().clone())
            .build()
            .unwrap();
        a_small_request_leaves_a_large_cached_block_whole(&rt, &pool);
    }
}

fn a_small_request_leaves_a_large_cached_block_whole(
    rt: &tokio::runtime::Runtime,
    pool: &PinnedAllocator<SimRuntime>,
) {
    rt.block_on(async {
        // 600 MiB: a segment of its own, which it fills, so freed it stays cached on this
        // thread.
        let big = pool.alloc(600 * MIB).await.unwrap();
        let range = big.as_ptr() as usize..big.as_ptr() as usize + 600 * MIB;
        drop(big);
        let small = pool.alloc(4 * KIB).await.unwrap();
        assert!(
            !range.contains(&(small.as_ptr() as usize)),
            "a 4 KiB request was cut out of the cached 600 MiB block"
        );
        // The large block is still whole: the same size again gets it back.
        let again = pool.alloc(600 * MIB).await.unwrap();
        assert_eq!(again.as_ptr() as usize, range.start);
    });
}

#[test]
fn a_split_whose_rest_would_be_a_sliver_lends_the_whole_block_and_keeps_it_for_the_class() {
    let rt = current_thread();
    let (pool, sim) = segments_pool_on(&rt);
    // Four 512 KiB blocks fill a 2 MiB segment; the second is freed into the ready queues of
    // this thread, the only ready block of the pool.
    let mut held = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(pool.alloc(512 * KIB).await.unwrap());
        }
        v
    });
    let freed = held.remove(1);
    let at = freed.as_ptr() as usize;
    drop(freed);
    let p = pool.clone();
    let served = without_actors(
        || pool.stats().num_misses,
        move || {
            // 480 KiB leaves 32 KiB of the 512 KiB block: less than an eighth, so the request
            // takes the whole block rather than cut a sliver off it.
            let b = p.alloc_blocking(480 * KIB).unwrap();
            let first = (b.as_ptr() as usize, b.len(), b.capacity());
            drop(b);
            // Freed, the block is filed under the request's class: the same size again is the
            // cached path.
            let b = p.alloc_blocking(480 * KIB).unwrap();
            let again = (b.as_ptr() as usize, b.capacity());
            (first, again, b)
        },
    )
    .expect("served without the pool actor");
    assert_eq!(served.0, (at, 480 * KIB, 512 * KIB));
    assert_eq!(served.1, (at, 512 * KIB));
    rt.block_on(async {
        let snap = pool.snapshot().await.unwrap();
        let pieces: Vec<(usize, usize, BlockStatus)> = snap
            .blocks()
            .map(|(_, b)| (b.address, b.size, b.state))
            .filter(|&(a, _, _)| (at..at + 512 * KIB).contains(&a))
            .collect();
        assert_eq!(
            pieces,
            vec![(at, 512 * KIB, BlockStatus::InUse)],
            "{pieces:x?}"
        );
        drop((held, served.2));
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
    });
}

/// Four 512 KiB blocks held (one 2 MiB segment, nothing else free), on a pool of separate
/// segments whose actors run on `rt`: the ready blocks of the tests below are only those
/// they free.
/// A shard for every thread that could be alive (the test harness runs tests side by side),
/// so that each thread owns its shard and fills its own slots.
fn four_half_mebibytes(
    rt: &tokio::runtime::Runtime,
) -> (
    pinpool::PinnedAllocator<SimRuntime>,
    Vec<pinpool::PinnedBuffer<SimRuntime>>,
) {
    let pool = pinpool::Builder::new(Arc::new(SimRuntime::new()))
        .policy(Arc::new(BestFit::default().separate_segments()))
        .handle(rt.handle().clone())
        .shards(1024)
        .build()
        .unwrap();
    let held = (0..4)
        .map(|_| pool.alloc_blocking(512 * KIB).unwrap())
        .collect();
    (pool, held)
}

#[test]
fn a_request_whose_class_is_empty_takes_a_block_of_the_class_below_that_holds_it_first() {
    // Classes 480, 496 and 512 KiB (sixteen to a doubling). A 512 KiB block lent whole for
    // 480 KiB is filed under 480 KiB when freed; another 512 KiB block is filed under 512.
    let rt = multi_thread(2);
    let (pool, mut held) = four_half_mebibytes(&rt);
    let below = held.pop().unwrap();
    let (a, b) = (below.as_ptr() as usize, held[0].as_ptr() as usize);
    drop(below);
    let sliver = pool.alloc_blocking(480 * KIB).unwrap();
    assert_eq!(
        (sliver.as_ptr() as usize, sliver.capacity()),
        (a, 512 * KIB)
    );
    drop(sliver);
    drop(held.remove(0));
    // 496 KiB: its class is empty; the block below holds it and is taken before the next
    // class's, which is taken once nothing below is left.
    let first = pool.alloc_blocking(496 * KIB).unwrap();
    let second = pool.alloc_blocking(496 * KIB).unwrap();
    assert_eq!(
        (first.as_ptr() as usize, second.as_ptr() as usize),
        (a, b),
        "the class below first, then the class above"
    );
    assert_eq!(pool.stats().num_host_alloc, 1, "no fresh memory");
}

#[test]
fn a_request_whose_class_is_empty_takes_its_own_next_class_block_before_another_threads() {
    let rt = multi_thread(2);
    let (pool, mut held) = four_half_mebibytes(&rt);
    // Another thread frees a block of exactly the class of 496 KiB into its shard.
    let p = pool.clone();
    let theirs = std::thread::spawn(move || {
        let b = p.alloc_blocking(496 * KIB).unwrap();
        b.as_ptr() as usize
    })
    .join()
    .unwrap();
    // This thread frees a 512 KiB block (the next class up) into its own.
    let mine = held[0].as_ptr() as usize;
    drop(held.remove(0));
    let b = pool.alloc_blocking(496 * KIB).unwrap();
    assert_eq!(b.as_ptr() as usize, mine, "its own block, lent whole");
    assert_eq!(b.capacity(), 512 * KIB);
    // The other thread's block still serves the next such request.
    let c = pool.alloc_blocking(496 * KIB).unwrap();
    assert_eq!(c.as_ptr() as usize, theirs);
}
