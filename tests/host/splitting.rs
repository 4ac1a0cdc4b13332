//! Misses served on the requesting thread: under a carving layout (`bestfit` for pinned
//! memory, the device layout), a request that finds no ready block of its class splits a
//! ready block of a larger class, and after a miss the pool actor hands the requesting thread
//! the free ranges of its mapped memory as ready blocks. Neither needs the pool actor, and
//! the actor books every split so that the parts coalesce and all memory goes back.
//!
//! To show that no actor is involved, the allocators here run their actors on a
//! current-thread runtime that is driven only during set-up: once nothing drives it, a request
//! that needed an actor would never be answered (each such request runs on a thread of its
//! own and must answer within a deadline), and the pool's count of the requests that asked
//! its actor (`num_misses`) must not move.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::{BlockStatus, DeviceAllocator, DeviceBuilder};
use pinpool_testkit::{best_fit_pool_on, current_thread, multi_thread};

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

fn device_pool(rt: &tokio::runtime::Runtime) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    (pool, sim)
}

#[test]
fn a_device_request_whose_class_is_empty_splits_a_larger_ready_block_without_the_pool_actor() {
    let rt = current_thread();
    let (pool, sim) = device_pool(&rt);
    let s = sim.stream();
    let (big, other) = rt.block_on(async {
        let b = pool.alloc(MIB, &s).await.unwrap();
        // The rest of the granule, so that no other free memory is handed over.
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
    // A request that no ready block serves waits for the actor.
    let (tx, third) = mpsc::channel();
    let (p, st) = (pool.clone(), s.clone());
    std::thread::spawn(move || {
        let _ = tx.send(p.raw_alloc_with_stream(4 * KIB, &st));
    });
    assert!(third.recv_timeout(Duration::from_millis(300)).is_err());
    // Once the actor runs again, it serves it and books the splits: the parts coalesce and
    // all the memory goes back to the device.
    rt.block_on(async {
        let third = loop {
            match third.try_recv() {
                Ok(r) => break r.unwrap(),
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
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
fn after_a_miss_the_thread_gets_the_free_mapped_ranges_and_its_next_requests_need_no_actor() {
    let rt = current_thread();
    let (pool, sim) = device_pool(&rt);
    let s = sim.stream();
    let (a, b) = rt.block_on(async {
        // 1.5 MiB then 100 KiB: one 2 MiB granule, 412 KiB of it left free after the second
        // miss, which the actor hands this thread as a ready block.
        let a = pool.alloc(3 * MIB / 2, &s).await.unwrap();
        let b = pool.alloc(100 * KIB, &s).await.unwrap();
        tokio::task::yield_now().await;
        (a, b)
    });
    let (p, st) = (pool.clone(), s.clone());
    let c = without_actors(
        || pool.stats(0).unwrap().num_misses,
        move || p.raw_alloc_with_stream(200 * KIB, &st).unwrap(),
    )
    .expect("served from the ranges handed over at the miss");
    assert_eq!(c, b.device_ptr() + 100 * KIB as u64);
    rt.block_on(async {
        drop((a, b));
        pool.raw_delete(c).unwrap();
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.device_used(0), Some(0), "all memory went back");
        let stats = pool.stats(0).unwrap();
        assert_eq!(stats.reserved_bytes.all.current, 0);
        assert_eq!(stats.active_bytes.all.current, 0);
    });
}

#[test]
fn a_pinned_request_under_bestfit_splits_a_larger_ready_block_without_the_pool_actor() {
    let rt = current_thread();
    let (pool, sim) = best_fit_pool_on(&rt);
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
    // Cut out of the freed 512 KiB block, or out of the free memory after it that the actor
    // handed over at the miss; the same block again from the thread's slot.
    assert_eq!(head.0, head.1);
    assert!(
        (big..big + 2 * MIB).contains(&head.0),
        "{:#x} {big:#x}",
        head.0
    );
    rt.block_on(async {
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
    });
}

#[test]
fn a_pinned_request_under_bestfit_merges_the_threads_freed_neighbours_without_the_pool_actor() {
    let rt = current_thread();
    let (pool, sim) = best_fit_pool_on(&rt);
    // Four 512 KiB blocks side by side fill the first 2 MiB granule: no free mapped memory
    // is left for the actor to hand over.
    let blocks = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(pool.alloc(512 * KIB).await.unwrap());
        }
        v
    });
    let addrs: Vec<usize> = blocks.iter().map(|b| b.as_ptr() as usize).collect();
    for w in addrs.windows(2) {
        assert_eq!(w[1], w[0] + 512 * KIB, "side by side: {addrs:x?}");
    }
    let mut blocks = blocks.into_iter();
    let (a, b, c, d) = (
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
    );
    let p = pool.clone();
    let (merged, again) = without_actors(
        || pool.stats().num_misses,
        move || {
            // Freed on this thread: two ready 512 KiB blocks in its shard, neither large enough
            // for 1 MiB on its own.
            drop((b, c));
            let merged = p.alloc_blocking(MIB).unwrap();
            let at = merged.as_ptr() as usize;
            // The merged block is an ordinary ready block once freed: the same size again is
            // the cached path.
            drop(merged);
            let again = p.alloc_blocking(MIB).unwrap();
            (at, again)
        },
    )
    .expect("served from the merged neighbours without the pool actor");
    assert_eq!(merged, addrs[1], "the two freed blocks, merged in place");
    assert_eq!(again.as_ptr() as usize, addrs[1]);
    // The actor booked the merge: every piece coalesces and all memory goes back.
    rt.block_on(async {
        drop((a, d, again));
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
        assert_eq!(pool.stats().allocated_bytes.current, 0);
    });
}

#[test]
fn merged_neighbours_keep_the_books_of_the_pieces_still_lent() {
    let rt = current_thread();
    let (pool, sim) = best_fit_pool_on(&rt);
    // Six 256 KiB blocks and one 512 KiB block fill one 2 MiB granule.
    let mut held = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..6 {
            v.push(pool.alloc(256 * KIB).await.unwrap());
        }
        v.push(pool.alloc(512 * KIB).await.unwrap());
        v
    });
    let last = held.pop().unwrap();
    let p = pool.clone();
    let kept = without_actors(
        || pool.stats().num_misses,
        move || {
            // Free the 2nd to 5th: the thread merges them (1 MiB) for a 768 KiB request, and the
            // rest of the merged block goes back to its ready queues.
            let mut it = held.into_iter();
            let first = it.next().unwrap();
            let sixth = it.next_back().unwrap();
            drop(it);
            let r = p.alloc_blocking(768 * KIB).unwrap();
            (first, sixth, r)
        },
    )
    .expect("served without the pool actor");
    let (first, sixth, r) = kept;
    let base = first.as_ptr() as usize;
    assert_eq!(r.as_ptr() as usize, base + 256 * KIB);
    assert_eq!(sixth.as_ptr() as usize, base + 5 * 256 * KIB);
    assert_eq!(last.as_ptr() as usize, base + 3 * MIB / 2);
    rt.block_on(async {
        // The snapshot, made from the actor's books, shows the pieces as they are: the
        // merged block cut for the request, its rest cached, the others lent.
        let snap = pool.snapshot().await.unwrap();
        let pieces: Vec<(usize, usize, BlockStatus)> = snap
            .blocks()
            .map(|(_, b)| (b.address, b.size, b.state))
            .filter(|&(a, _, _)| (base..base + 2 * MIB).contains(&a))
            .collect();
        assert_eq!(
            pieces,
            vec![
                (base, 256 * KIB, BlockStatus::InUse),
                (base + 256 * KIB, 768 * KIB, BlockStatus::InUse),
                (base + MIB, 256 * KIB, BlockStatus::Cached),
                (base + 5 * 256 * KIB, 256 * KIB, BlockStatus::InUse),
                (base + 3 * MIB / 2, 512 * KIB, BlockStatus::InUse),
            ],
            "{pieces:x?}"
        );
        drop((first, sixth, r, last));
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
    });
}

#[test]
fn a_thread_never_cuts_a_small_request_out_of_a_large_cached_block() {
    let rt = current_thread();
    let (pool, _sim) = best_fit_pool_on(&rt);
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
    let (pool, sim) = best_fit_pool_on(&rt);
    // Four 512 KiB blocks fill the first 2 MiB granule; the second is freed into the ready
    // queues of this thread, the only ready block of the pool.
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

#[test]
fn a_freed_large_piece_of_the_expandable_range_stays_on_the_cached_path() {
    let rt = current_thread();
    let (pool, sim) = best_fit_pool_on(&rt);
    // A 3 MiB block between two others: larger than the 1 MiB of small blocks, within the
    // 4 MiB that threads merge themselves. Freed, it goes to the ready queues, not back
    // into the range through the pool actor.
    let (first, big, last) = rt.block_on(async {
        let first = pool.alloc(MIB).await.unwrap();
        let big = pool.alloc(3 * MIB).await.unwrap();
        let last = pool.alloc(MIB).await.unwrap();
        (first, big, last)
    });
    let at = big.as_ptr() as usize;
    drop(big);
    let p = pool.clone();
    let again = without_actors(
        || pool.stats().num_misses,
        move || p.alloc_blocking(3 * MIB).unwrap(),
    )
    .expect("served from the ready queues without the pool actor");
    assert_eq!(again.as_ptr() as usize, at);
    rt.block_on(async {
        drop((first, again, last));
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.live_bytes(), 0, "all memory went back");
    });
}

/// Four 512 KiB blocks held (one 2 MiB granule, nothing else free), on a `bestfit` pool
/// whose actors run on `rt`: the ready blocks of the tests below are only those they free.
/// A shard for every thread that could be alive (the test harness runs tests side by side),
/// so that each thread owns its shard and fills its own slots.
fn four_half_mebibytes(
    rt: &tokio::runtime::Runtime,
) -> (
    pinpool::PinnedAllocator<SimRuntime>,
    Vec<pinpool::PinnedBuffer<SimRuntime>>,
) {
    let pool = pinpool::Builder::new(Arc::new(SimRuntime::new()))
        .policy(Arc::new(pinpool::tuning::BestFit::default()))
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
