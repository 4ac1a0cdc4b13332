//! The best-fit policy end to end, with blocks cut out of separate host allocations
//! (`BestFit::separate_segments`; the expandable range has its own tests in
//! `policy_arena.rs`): blocks carved out of shared segments keep every safety
//! invariant of whole blocks (no early reuse with streams, kept blocks of captures never
//! reused, books balance), a block is never smaller than its request, and freed neighbours
//! coalesce so that a larger request is served without fresh memory.

use std::sync::Arc;

use pinpool::sim::{SimDeviceBuffer, SimRuntime};
use pinpool::tuning::{BestFit, SizePolicy};
use pinpool::{BlockStatus, Builder, PinnedAllocator};
use pinpool_testkit::{assert_books_balance, segments_pool};

#[tokio::test]
async fn small_blocks_share_one_segment_and_coalesce_for_a_larger_request() {
    let (pool, sim) = segments_pool();
    // 32 blocks of 64 KiB fill one 2 MiB segment.
    let mut bufs = futures_join(&pool, &[64 << 10; 32]).await;
    assert_eq!(sim.total_host_allocs(), 1, "small blocks share one segment");
    bufs.sort_by_key(|b| b.as_ptr() as usize);
    let lo = bufs[8].as_ptr() as usize;
    // Four neighbours come back (into the ready queues of their class).
    drop(bufs.drain(8..12).collect::<Vec<_>>());
    // A different class: the ready blocks are drained, coalesce, and serve it in place.
    let big = pool.alloc(256 << 10).await.unwrap();
    assert!(big.capacity() >= 256 << 10);
    assert_eq!(big.as_ptr() as usize, lo);
    assert_eq!(
        sim.total_host_allocs(),
        1,
        "no fresh memory for the larger request"
    );
    drop(big);
    drop(bufs);
    assert_books_balance(&pool, &sim, 0).await;
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.live_bytes(), 0);
}

async fn futures_join(
    pool: &PinnedAllocator<SimRuntime>,
    sizes: &[usize],
) -> Vec<pinpool::PinnedBuffer<SimRuntime>> {
    let mut out = Vec::new();
    for &s in sizes {
        out.push(pool.alloc(s).await.unwrap());
    }
    out
}

#[tokio::test]
async fn a_block_is_never_smaller_than_its_request_even_after_reuse() {
    // PyTorch's bucketed thresholds once handed a 150 MB block to a 200 MB request.
    let (pool, sim) = segments_pool();
    let a = pool.alloc(3 << 20).await.unwrap();
    drop(a);
    for size in [(2 << 20) + 4096, 4 << 20, 5 << 20, (3 << 20) + 1, 1 << 20] {
        let b = pool.alloc(size).await.unwrap();
        assert!(b.capacity() >= size, "{} for {size}", b.capacity());
        assert!(
            b.capacity() <= size + size / 8,
            "{} for {size}",
            b.capacity()
        );
    }
    assert_eq!(sim.violations(), 0);
}

#[tokio::test]
async fn a_carved_block_whose_copy_is_queued_is_not_coalesced_into_reuse() {
    let (pool, sim) = segments_pool();
    let stream = sim.stream();
    let dev = SimDeviceBuffer::new(4096);
    let hold = stream.hold();
    let mut a = pool.alloc(4096).await.unwrap();
    let neighbour = pool.alloc(4096).await.unwrap();
    a.fill(0xAB);
    stream.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&stream).unwrap();
    let (start, end) = (a.as_ptr() as usize, a.as_ptr() as usize + a.capacity());
    drop(a);
    drop(neighbour);
    // Misses of other classes drain and coalesce the ready blocks; the waiting one must
    // stay out of every block handed out while its copy is queued.
    let mut held = Vec::new();
    for size in [8192, 16384, 512, 1 << 20, 100_000] {
        let mut b = pool.alloc(size).await.unwrap();
        let (s, e) = (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity());
        assert!(
            e <= start || s >= end,
            "overlaps a block whose copy is queued"
        );
        b.fill(0xCD);
        held.push(b);
    }
    hold.release();
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), vec![0xAB; 4096]);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    drop(held);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_carved_block_used_by_captured_work_is_never_reused() {
    let (pool, sim) = segments_pool();
    let cap = sim.stream();
    let replay = sim.stream();
    let dev = SimDeviceBuffer::new(4096);
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();
    let mut a = pool.alloc_on(4096, &cap).await.unwrap();
    a.fill(0x5A);
    cap.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&cap).unwrap();
    let (start, end) = (a.as_ptr() as usize, a.as_ptr() as usize + a.capacity());
    drop(a);
    let graph = cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();
    let mut later = Vec::new();
    for size in [4096, 8192, 512, 65536, 4096] {
        let mut c = pool.alloc_on(size, &cap).await.unwrap();
        let (s, e) = (c.as_ptr() as usize, c.as_ptr() as usize + c.capacity());
        assert!(
            e <= start || s >= end,
            "a kept range was cut into a new block"
        );
        c.fill(0xEE);
        later.push(c);
    }
    drop(later);
    pool.empty_cache().await.unwrap();
    for _ in 0..2 {
        dev.fill(0);
        graph.launch(&replay).unwrap();
        replay.synchronize().unwrap();
        assert_eq!(dev.to_vec(), vec![0x5A; 4096]);
    }
    assert_eq!(pool.pool_stats(id).unwrap().kept_blocks, 1);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn blocks_above_max_cached_size_go_back_to_the_runtime() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(
            BestFit::default()
                .separate_segments()
                .max_cached_size(1 << 20),
        ))
        .build()
        .unwrap();
    let big = pool.alloc(4 << 20).await.unwrap();
    let small = pool.alloc(4096).await.unwrap();
    drop(big);
    pinpool_testkit::eventually("the large segment goes back", || sim.live_bytes() < 4 << 20).await;
    drop(small);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn the_cached_path_serves_a_size_seen_before_from_the_same_block() {
    let (pool, sim) = segments_pool();
    assert_eq!(
        pinpool::tuning::engine(&pool).policy().name(),
        "bestfit_segments"
    );
    let a = pool.alloc(100_000).await.unwrap();
    let p = a.as_ptr();
    drop(a);
    for _ in 0..100 {
        let b = pool.alloc(100_000).await.unwrap();
        assert_eq!(b.as_ptr(), p);
    }
    assert_eq!(sim.total_host_allocs(), 1);
    assert_eq!(BestFit::default().class_of(100_000).unwrap().size % 512, 0);
}

#[tokio::test]
async fn a_snapshot_lists_each_segment_with_its_carved_blocks_and_free_ranges() {
    let (pool, sim) = segments_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    let a = pool.alloc(4096).await.unwrap();
    let mut b = pool.alloc(8192).await.unwrap();
    let c = pool.alloc(16384).await.unwrap();
    b.record_stream(&stream).unwrap();
    let (pa, pb, pc) = (
        a.as_ptr() as usize,
        b.as_ptr() as usize,
        c.as_ptr() as usize,
    );
    drop(b);
    drop(c);
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.config.policy, "bestfit_segments");
    assert_eq!(snap.segments.len(), 1, "small blocks share one segment");
    let seg = &snap.segments[0];
    assert_eq!(seg.total_size, 2 << 20);
    // The pieces tile the segment in address order.
    let mut at = seg.address;
    for blk in &seg.blocks {
        assert_eq!(blk.address, at);
        at += blk.size;
    }
    assert_eq!(at, seg.address + seg.total_size);
    let state = |addr| seg.blocks.iter().find(|b| b.address == addr).unwrap();
    assert_eq!(state(pa).state, BlockStatus::InUse);
    assert_eq!(state(pa).requested_size, 4096);
    assert_eq!(state(pb).state, BlockStatus::Waiting);
    assert_eq!(state(pc).state, BlockStatus::Cached);
    let free: Vec<_> = seg
        .blocks
        .iter()
        .filter(|b| b.requested_size == 0)
        .collect();
    assert_eq!(free.len(), 1);
    assert_eq!(free[0].state, BlockStatus::Cached);
    let info = pool.cache_info().await.unwrap();
    assert_eq!(info.total_cached, (2 << 20) - 4096 - 8192);
    hold.release();
    stream.synchronize().unwrap();
    drop(a);
    // Quiescent once the event poller has brought `b` home.
    pinpool_testkit::eventually("b came home", || pool.stats().waiting_blocks == 0).await;
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn fresh_segments_count_against_the_memory_limit_and_carving_does_not() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default().separate_segments()))
        .max_bytes(3 << 20)
        .build()
        .unwrap();
    // The first small request reserves a whole 2 MiB segment.
    let a = pool.try_alloc(4096).await.unwrap();
    assert_eq!(pool.reserved_bytes(), 2 << 20);
    // Carving more out of it reserves nothing.
    let b = pool.try_alloc(1 << 20).await.unwrap();
    assert_eq!(pool.reserved_bytes(), 2 << 20);
    // A second small segment does not fit under the cap; a segment of the block's own
    // size does.
    let c = pool.try_alloc(1 << 20).await.unwrap();
    assert_eq!(pool.reserved_bytes(), 3 << 20);
    // Full: what is left of the first segment is smaller than another 1 MiB.
    let err = pool.try_alloc(1 << 20).await.unwrap_err();
    assert!(matches!(err, pinpool::Error::OutOfMemory { .. }), "{err:?}");
    assert_eq!(sim.live_bytes(), 3 << 20);
    drop((a, b, c));
    // Once free, the segment serves the larger request after going back for room.
    let big = pool.try_alloc((2 << 20) + 4096).await.unwrap();
    assert!(big.capacity() >= (2 << 20) + 4096);
    assert!(pool.reserved_bytes() <= 3 << 20);
    drop(big);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_refused_segment_free_is_kept_on_the_books_and_retried() {
    use pinpool::sim::FaultPoint;
    let (pool, sim) = segments_pool();
    drop(pool.alloc(4096).await.unwrap());
    sim.faults().fail_next(FaultPoint::HostFree, 1);
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_blocks, 0);
    assert_eq!(sim.live_bytes(), 2 << 20);
    assert_eq!(pool.stats().kept_blocks, 1);
    assert_books_balance(&pool, &sim, 0).await;
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments[0].blocks[0].state, BlockStatus::Kept);
    drop(pool);
    pinpool_testkit::eventually("retried when the allocator closes", || {
        sim.live_bytes() == 0
    })
    .await;
}

const MIB: usize = 1 << 20;

#[tokio::test]
async fn a_small_request_leaves_a_much_larger_free_segment_whole_while_fresh_memory_fits_under_the_cap(
) {
    let (pool, sim) = segments_pool();
    let big = pool.alloc(64 * MIB).await.unwrap();
    let big_at = big.as_ptr() as usize;
    drop(big);
    // 64 MiB is more than 3 times 4 MiB, and 64 + 4 MiB stays under 1.2 x 64 MiB: fresh.
    let small = pool.alloc(4 * MIB).await.unwrap();
    let at = small.as_ptr() as usize;
    assert!(
        at + small.capacity() <= big_at || at >= big_at + 64 * MIB,
        "not cut out of the large segment"
    );
    assert_eq!(sim.total_host_allocs(), 2);
    // So the large segment still serves the large size, whole.
    let again = pool.alloc(64 * MIB).await.unwrap();
    assert_eq!(again.as_ptr() as usize, big_at);
    assert_eq!(sim.total_host_allocs(), 2);
    drop((small, again));
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_large_free_segment_is_split_when_fresh_memory_would_cross_the_cap() {
    let (pool, sim) = segments_pool();
    let big = pool.alloc(64 * MIB).await.unwrap();
    let big_at = big.as_ptr() as usize;
    drop(big);
    // 64 + 14 MiB would be above 1.2 x 64 MiB: the free segment is cut instead.
    let piece = pool.alloc(14 * MIB).await.unwrap();
    assert_eq!(piece.as_ptr() as usize, big_at);
    assert_eq!(sim.total_host_allocs(), 1);
    drop(piece);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_freed_large_piece_coalesces_with_its_segment_at_once() {
    let (pool, sim) = segments_pool();
    drop(pool.alloc(64 * MIB).await.unwrap());
    let piece = pool.alloc(14 * MIB).await.unwrap();
    drop(piece);
    // Not parked in a ready queue as a 14 MiB block: the segment is one free range again.
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments.len(), 1);
    let blocks = &snap.segments[0].blocks;
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    assert_eq!(blocks[0].requested_size, 0);
    assert_eq!(blocks[0].size, 64 * MIB);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_large_piece_asked_for_again_at_once_stays_on_the_cached_path_until_a_drain() {
    let (pool, sim) = segments_pool();
    drop(pool.alloc(64 * MIB).await.unwrap());
    let first = pool.alloc(14 * MIB).await.unwrap();
    let at = first.as_ptr() as usize;
    drop(first);
    // Asked for again while its range is still free: the same range, and from now on the
    // block stays cached when freed (a thread looping over one size stays off the actor).
    for _ in 0..3 {
        let again = pool.alloc(14 * MIB).await.unwrap();
        assert_eq!(again.as_ptr() as usize, at);
        drop(again);
        let snap = pool.snapshot().await.unwrap();
        let blocks = &snap.segments[0].blocks;
        assert_eq!(blocks.len(), 2, "{blocks:?}");
        assert_eq!((blocks[0].address, blocks[0].size), (at, 14 * MIB));
        assert_eq!(blocks[0].state, BlockStatus::Cached);
        assert_eq!(blocks[1].size, 50 * MIB);
    }
    // Another size drains it: the segment coalesces and serves 40 MiB from its start.
    let other = pool.alloc(40 * MIB).await.unwrap();
    assert_eq!(other.as_ptr() as usize, at);
    assert_eq!(sim.total_host_allocs(), 1);
    drop(other);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_large_piece_that_comes_back_between_lent_neighbours_stays_cached_from_its_second_round()
{
    let (pool, sim) = segments_pool();
    drop(pool.alloc(64 * MIB).await.unwrap());
    let a = pool.alloc(20 * MIB).await.unwrap();
    let b = pool.alloc(14 * MIB).await.unwrap();
    let c = pool.alloc(30 * MIB).await.unwrap();
    let at = b.as_ptr() as usize;
    assert_eq!(at, a.as_ptr() as usize + 20 * MIB);
    let piece_at = |snap: &pinpool::MemorySnapshot| {
        snap.blocks()
            .find(|(_, blk)| blk.address == at)
            .map(|(_, blk)| (blk.size, blk.state, blk.requested_size))
            .unwrap()
    };
    drop(b);
    // First time back: a free range again (no request size), between lent neighbours.
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(piece_at(&snap), (14 * MIB, BlockStatus::Cached, 0));
    // Taken again from the same range and freed: now a cached block of its class.
    for _ in 0..3 {
        let again = pool.alloc(14 * MIB).await.unwrap();
        assert_eq!(again.as_ptr() as usize, at);
        drop(again);
        let snap = pool.snapshot().await.unwrap();
        assert_eq!(piece_at(&snap), (14 * MIB, BlockStatus::Cached, 14 * MIB));
    }
    assert_eq!(sim.total_host_allocs(), 1);
    drop((a, c));
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_class_does_not_get_its_last_range_back_once_another_block_took_part_of_it() {
    let (pool, sim) = segments_pool();
    drop(pool.alloc(64 * MIB).await.unwrap());
    let first = pool.alloc(14 * MIB).await.unwrap();
    let at = first.as_ptr() as usize;
    drop(first);
    // 20 MiB is cut from the start of the coalesced segment, over the old 14 MiB range.
    let over = pool.alloc(20 * MIB).await.unwrap();
    assert_eq!(over.as_ptr() as usize, at);
    let again = pool.alloc(14 * MIB).await.unwrap();
    let p = again.as_ptr() as usize;
    assert!(
        p >= at + 20 * MIB || p + 14 * MIB <= at,
        "overlaps the 20 MiB block"
    );
    assert_eq!(sim.total_host_allocs(), 1);
    drop((over, again));
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn wholly_free_segments_go_back_before_fresh_memory_would_cross_the_cap() {
    for keep in [false, true] {
        let sim = SimRuntime::new();
        let policy = if keep {
            BestFit::default().separate_segments().keep_free_segments()
        } else {
            BestFit::default().separate_segments()
        };
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(Arc::new(policy))
            .build()
            .unwrap();
        drop(pool.alloc(30 * MIB).await.unwrap());
        // Nothing free holds 100 MiB, and 30 + 100 MiB is above 1.2 x 100 MiB.
        let big = pool.alloc(100 * MIB).await.unwrap();
        let peak = pool.stats().allocated_bytes.peak as usize;
        if keep {
            assert_eq!(peak, 130 * MIB);
            assert_eq!(sim.live_bytes(), 130 * MIB);
        } else {
            assert_eq!(peak, 100 * MIB, "the 30 MiB segment went back first");
            assert_eq!(sim.live_bytes(), 100 * MIB);
        }
        drop(big);
        assert_books_balance(&pool, &sim, 0).await;
    }
}
