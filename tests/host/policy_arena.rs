//! `BestFit` on a runtime with expandable host memory: blocks are cut out of one reserved
//! range whose granules are mapped as blocks need them, small blocks (up to 1 MiB) in the
//! upper zone of the range and large ones below. Pinned down here: the range grows by the
//! granules a block needs and no more, free neighbours coalesce across granules, a granule
//! that no block touches goes back while its neighbours still lend, under a memory limit
//! such granules are room for a request larger than any free range, over the reserve cap
//! (which pinned memory keeps while requests come) idle granules move where a request needs
//! them (and a refused move changes nothing), snapshots list the mapped runs, and
//! everything (the range included) goes back at shutdown, however the allocator is dropped.
//! A runtime without the capability, or a limit of fewer than eight granules, gets separate
//! segments instead.

use std::sync::Arc;

use pinpool::sim::{FaultPoint, SimRuntime};
use pinpool::tuning::BestFit;
use pinpool::{BlockStatus, Builder, Error, PinnedAllocator, PinnedBuffer};
use pinpool_testkit::{assert_books_balance, best_fit_pool, eventually};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The simulated runtime's granule.
const GRANULE: usize = 2 * MIB;

#[tokio::test]
async fn the_range_grows_by_the_granules_a_block_needs_and_blocks_of_a_zone_sit_side_by_side() {
    let (pool, sim) = best_fit_pool();
    let a = pool.alloc(4 * KIB).await.unwrap();
    assert_eq!(sim.live_bytes(), GRANULE, "one granule mapped");
    // Large blocks sit in the lower zone of the range, from its start.
    let b = pool.alloc(3 * MIB).await.unwrap();
    assert_eq!(sim.live_bytes(), 3 * GRANULE, "the two granules it needs");
    let c = pool.alloc(3 * MIB / 2).await.unwrap();
    assert_eq!(
        c.as_ptr() as usize,
        b.as_ptr() as usize + 3 * MIB,
        "right after the large block before it, across the granule boundary"
    );
    assert_eq!(
        sim.live_bytes(),
        4 * GRANULE,
        "only the one more granule it needs"
    );
    // Small blocks sit in the upper zone, side by side within a granule, above every large
    // block: the free memory around large blocks coalesces without them in the way.
    let d = pool.alloc(8 * KIB).await.unwrap();
    let e = pool.alloc(8 * KIB).await.unwrap();
    assert_eq!(e.as_ptr() as usize, d.as_ptr() as usize + 8 * KIB);
    assert_eq!(
        sim.live_bytes(),
        4 * GRANULE,
        "in the small blocks' granule"
    );
    for small in [&a, &d, &e] {
        assert!(small.as_ptr() as usize > c.as_ptr() as usize + 64 * MIB);
    }
    assert_eq!(pinpool::tuning::engine(&pool).policy().name(), "bestfit");
    drop((a, b, c, d, e));
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn freed_neighbours_coalesce_across_granules_and_serve_a_larger_request_in_place() {
    let (pool, sim) = best_fit_pool();
    let a = pool.alloc(3 * MIB).await.unwrap();
    let b = pool.alloc(3 * MIB).await.unwrap();
    let tail = pool.alloc(4 * KIB).await.unwrap();
    let at = a.as_ptr() as usize;
    assert_eq!(b.as_ptr() as usize, at + 3 * MIB);
    let maps = sim.total_host_allocs();
    drop((a, b));
    let both = pool.alloc(6 * MIB).await.unwrap();
    assert_eq!(
        both.as_ptr() as usize,
        at,
        "the two freed blocks, as one range"
    );
    assert_eq!(sim.total_host_allocs(), maps, "no fresh memory");
    drop((both, tail));
    assert_books_balance(&pool, &sim, 0).await;
}

/// Three large blocks side by side from the start of the range: 1.5 MiB in granule 0, 3 MiB
/// across granules 0, 1 and 2, and 1.5 MiB, the rest of granule 2.
async fn three_large_blocks(
    pool: &PinnedAllocator<SimRuntime>,
    sim: &SimRuntime,
) -> [PinnedBuffer<SimRuntime>; 3] {
    let x = pool.alloc(3 * MIB / 2).await.unwrap();
    let y = pool.alloc(3 * MIB).await.unwrap();
    let z = pool.alloc(3 * MIB / 2).await.unwrap();
    assert_eq!(sim.live_bytes(), 3 * GRANULE);
    assert_eq!(y.as_ptr() as usize, x.as_ptr() as usize + 3 * MIB / 2);
    assert_eq!(z.as_ptr() as usize, y.as_ptr() as usize + 3 * MIB);
    [x, y, z]
}

#[tokio::test]
async fn a_granule_no_block_touches_goes_back_while_its_neighbours_still_lend() {
    let (pool, sim) = best_fit_pool();
    let [x, y, z] = three_large_blocks(&pool, &sim).await;
    drop(y);
    eventually("the large block is home", || {
        pool.stats().active_bytes.current as usize == 3 * MIB
    })
    .await;
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_bytes, GRANULE, "granule 1 went back");
    assert_eq!(sim.live_bytes(), 2 * GRANULE);
    // The blocks on either side are untouched and still usable.
    sim.host_write(x.as_ptr() as *mut u8, &[7; 16]).unwrap();
    sim.host_write(z.as_ptr() as *mut u8, &[9; 16]).unwrap();
    assert_eq!(sim.host_read(x.as_ptr(), 16).unwrap(), [7; 16]);
    assert_books_balance(&pool, &sim, 2).await;
    drop((x, z));
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.reserved_after, 0);
    assert_eq!(sim.live_bytes(), 0);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn under_a_memory_limit_idle_granules_are_room_for_a_request_larger_than_any_free_range() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .max_bytes(8 * GRANULE)
        .build()
        .unwrap();
    // Eight 2 MiB blocks, side by side from the start of the range, one to a granule.
    let mut blocks = Vec::new();
    for _ in 0..8 {
        blocks.push(Some(pool.try_alloc(GRANULE).await.unwrap()));
    }
    let base = blocks[0].as_ref().unwrap().as_ptr() as usize;
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.as_ref().unwrap().as_ptr() as usize, base + i * GRANULE);
    }
    assert_eq!(sim.live_bytes(), 8 * GRANULE, "the limit is reached");
    // Keep the blocks in granules 0, 2, 5 and 7: the largest free range is 4 MiB, and
    // granules 1, 3, 4 and 6 are touched by no block.
    for (i, b) in blocks.iter_mut().enumerate() {
        if ![0, 2, 5, 7].contains(&i) {
            drop(b.take());
        }
    }
    let big = pool
        .try_alloc(6 * MIB)
        .await
        .expect("idle granules make room");
    assert!(sim.live_bytes() <= 8 * GRANULE);
    sim.host_write(big.as_ptr() as *mut u8, &vec![1; 6 * MIB])
        .unwrap();
    // Nothing more fits: 8 MiB held, 6 MiB in use, and 2 MiB granules.
    assert!(matches!(
        pool.try_alloc(6 * MIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    drop((big, blocks));
    assert_books_balance(&pool, &sim, 0).await;
}

/// Eight 2 MiB blocks (large ones: side by side from the start of the range, one to a
/// granule), of which those in granules 0, 2, 5 and 7 are kept, each filled at its start
/// with its own byte. The others go home to the pool actor as they are freed (a thread
/// keeps only small blocks), so granules 1, 3, 4 and 6 are touched by no block. Peak live
/// is 16 MiB, so `BestFit`'s cap allows at most 18.4 MiB reserved.
async fn four_blocks_around_idle_granules(
    pool: &PinnedAllocator<SimRuntime>,
    sim: &SimRuntime,
) -> Vec<(PinnedBuffer<SimRuntime>, u8)> {
    let mut blocks = Vec::new();
    for _ in 0..8 {
        blocks.push(pool.alloc(GRANULE).await.unwrap());
    }
    let base = blocks[0].as_ptr() as usize;
    let mut kept = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        assert_eq!(b.as_ptr() as usize, base + i * GRANULE, "one to a granule");
        if [0, 2, 5, 7].contains(&i) {
            sim.host_write(b.as_ptr() as *mut u8, &[i as u8; 64])
                .unwrap();
            kept.push((b, i as u8));
        }
    }
    kept
}

/// The large block served after [`four_blocks_around_idle_granules`] is writable, the kept
/// blocks still hold their bytes, the books balance, and everything comes back.
async fn the_large_block_works_beside_the_kept_ones(
    pool: &PinnedAllocator<SimRuntime>,
    sim: &SimRuntime,
    big: PinnedBuffer<SimRuntime>,
    kept: Vec<(PinnedBuffer<SimRuntime>, u8)>,
) {
    sim.host_write(big.as_ptr() as *mut u8, &vec![1; big.len()])
        .unwrap();
    for (b, tag) in &kept {
        assert_eq!(sim.host_read(b.as_ptr(), 64).unwrap(), [*tag; 64]);
    }
    assert_books_balance(pool, sim, 5).await;
    drop((big, kept));
    assert_books_balance(pool, sim, 0).await;
}

#[tokio::test]
async fn over_the_reserve_cap_idle_granules_move_where_a_request_needs_them_instead_of_pinning_anew(
) {
    let (pool, sim) = best_fit_pool();
    let kept = four_blocks_around_idle_granules(&pool, &sim).await;
    let (maps, before) = (sim.total_host_allocs(), pool.stats());
    assert_eq!(before.allocated_bytes.current, 8 * GRANULE as i64);
    // No mapped free range holds 6 MiB (the largest, granules 3 and 4, holds 4): three
    // granules past the last block are needed, which would take 22 MiB. Idle granules move there (at least two, to stay under the cap); any
    // other is mapped fresh.
    let big = pool.alloc(6 * MIB).await.unwrap();
    let moved = sim.total_host_remaps();
    assert!(moved >= 2, "{moved} granules moved");
    assert_eq!(
        sim.total_host_allocs() - maps + moved,
        3,
        "each moved or fresh"
    );
    let after = pool.stats();
    assert_eq!(after.num_host_remaps as u64, moved);
    let fresh_calls = (after.num_host_alloc - before.num_host_alloc) as u64;
    assert_eq!(
        fresh_calls,
        u64::from(moved < 3),
        "one map call for the rest"
    );
    assert!(
        after.allocated_bytes.current <= 9 * GRANULE as i64,
        "under the cap"
    );
    the_large_block_works_beside_the_kept_ones(&pool, &sim, big, kept).await;
}

#[tokio::test]
async fn a_move_the_runtime_refuses_changes_nothing_and_fresh_memory_serves_instead() {
    let (pool, sim) = best_fit_pool();
    let kept = four_blocks_around_idle_granules(&pool, &sim).await;
    let maps = sim.total_host_allocs();
    // The three moves this request makes (see the test above) fail: the sim's remap checks
    // the fault point of mapping.
    sim.faults().fail_next(FaultPoint::HostAlloc, 3);
    let big = pool.alloc(6 * MIB).await.unwrap();
    assert_eq!(sim.faults().injected(FaultPoint::HostAlloc), 3);
    assert_eq!(sim.total_host_remaps(), 0);
    assert_eq!(pool.stats().num_host_remaps, 0);
    assert_eq!(
        sim.total_host_allocs(),
        maps + 3,
        "the block's granules, mapped fresh"
    );
    the_large_block_works_beside_the_kept_ones(&pool, &sim, big, kept).await;
}

/// Random requests of 4 KiB to 6 MiB and frees in random order under a tight reserve cap
/// (reserved at most the peak of live bytes), so that granules move often: every live
/// buffer keeps its bytes, the books balance, nothing is used early, and everything goes
/// back at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_under_a_tight_cap_move_granules_and_every_buffer_keeps_its_bytes() {
    let mut moved = 0;
    for seed in [1u64, 7, 42, 1234] {
        let sim = SimRuntime::new();
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(Arc::new(BestFit::default().reserve_cap(1.0)))
            .build()
            .unwrap();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut live: Vec<(PinnedBuffer<SimRuntime>, u8)> = Vec::new();
        for step in 0..1500u32 {
            if live.len() < 32 && (live.is_empty() || next() % 100 < 55) {
                let size = (4 * KIB) << (next() % 11) as usize;
                let size = (size + (next() as usize % size)).min(6 * MIB);
                let mut buf = pool.alloc(size).await.unwrap();
                let tag = step as u8;
                buf[..64].fill(tag);
                let len = buf.len();
                buf[len - 64..].fill(tag);
                live.push((buf, tag));
            } else {
                let (buf, tag) = live.swap_remove(next() as usize % live.len());
                let len = buf.len();
                assert!(buf[..64].iter().chain(&buf[len - 64..]).all(|&b| b == tag));
            }
        }
        for (buf, tag) in &live {
            let len = buf.len();
            assert!(buf[..64].iter().chain(&buf[len - 64..]).all(|b| b == tag));
        }
        drop(live);
        assert_books_balance(&pool, &sim, 0).await;
        assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
        assert_eq!(pool.stats().num_host_remaps as u64, sim.total_host_remaps());
        moved += sim.total_host_remaps();
        drop(pool);
        eventually("all memory given back", || sim.live_bytes() == 0).await;
        assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    }
    assert!(
        moved > 0,
        "no granule moved: the test no longer tests moves"
    );
}

#[tokio::test]
async fn a_snapshot_lists_each_mapped_run_as_a_segment_tiled_by_its_pieces() {
    let (pool, sim) = best_fit_pool();
    let [x, y, z] = three_large_blocks(&pool, &sim).await;
    drop(y);
    eventually("the large block is home", || {
        pool.stats().active_bytes.current as usize == 3 * MIB
    })
    .await;
    pool.empty_cache().await.unwrap();
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments.len(), 2, "granules 0 and 2, apart");
    for seg in &snap.segments {
        assert_eq!(seg.total_size, GRANULE);
        let mut at = seg.address;
        for blk in &seg.blocks {
            assert_eq!(blk.address, at);
            at += blk.size;
        }
        assert_eq!(at, seg.address + seg.total_size);
        let lent: Vec<_> = seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockStatus::InUse)
            .collect();
        assert_eq!(lent.len(), 1);
        assert_eq!(lent[0].requested_size, 3 * MIB / 2);
    }
    let total: usize = snap.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(total, sim.live_bytes());
    drop((x, z));
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn dropping_the_allocator_gives_back_every_granule_and_the_range_even_after_a_late_buffer() {
    let (pool, sim) = best_fit_pool();
    let cached = pool.alloc(64 * KIB).await.unwrap();
    let late = pool.alloc(5 * MIB).await.unwrap();
    drop(cached);
    assert_eq!(sim.live_allocations(), 1, "the reserved range");
    drop(pool);
    assert!(
        sim.live_bytes() >= 5 * MIB,
        "the late buffer's granules stay"
    );
    sim.host_write(late.as_ptr() as *mut u8, &[3; 64]).unwrap();
    drop(late);
    eventually("everything given back", || {
        sim.live_bytes() == 0 && sim.live_allocations() == 0
    })
    .await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[test]
fn dropping_the_tokio_runtime_with_a_live_buffer_gives_everything_back_when_it_drops() {
    let sim = SimRuntime::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (pool, live) = rt.block_on(async {
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(Arc::new(BestFit::default()))
            .build()
            .unwrap();
        let live = pool.alloc(3 * MIB).await.unwrap();
        drop(pool.alloc(8 * KIB).await.unwrap());
        (pool, live)
    });
    drop(rt);
    drop(pool);
    drop(live);
    pinpool_testkit::eventually_blocking("everything given back", || {
        sim.live_bytes() == 0 && sim.live_allocations() == 0
    });
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn a_runtime_without_expandable_memory_gets_separate_segments() {
    let sim = SimRuntime::builder().without_expandable_memory().build();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .build()
        .unwrap();
    // A segment of the block's own size, where the range would map three granules.
    let b = pool.alloc(5 * MIB).await.unwrap();
    assert_eq!(sim.live_bytes(), 5 * MIB);
    drop(b);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn near_the_pinned_memory_limit_a_block_smaller_than_a_granule_gets_a_segment_of_its_own() {
    // 1 MiB of pinned memory in all: no 2 MiB granule can be mapped.
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(1 << 20));
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .build()
        .unwrap();
    let a = pool.alloc(256 << 10).await.unwrap();
    assert_eq!(
        sim.live_bytes(),
        256 << 10,
        "a segment of the block's own size"
    );
    let b = pool.alloc(512 << 10).await.unwrap();
    assert_eq!(sim.live_bytes(), 768 << 10);
    // What does not fit the pinned memory left is a typed error, with nothing lost.
    let err = pool.alloc(512 << 10).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    drop((a, b));
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.live_bytes(), 0);
}
