//! The expandable range of a stream's device pool on a memory source that unmaps only whole
//! map calls (CUDA's `cuMemUnmap`, and the simulated device): a run of granules is mapped
//! in a few units of a power of two granules rather than granule by granule; a burst of
//! requests keeps what it mapped, and memory above the reserve cap goes back only once the
//! burst is over; under a memory limit, memory no block touches moves whole into the places
//! a new block needs (`RangeCall::Move`) rather than going back to the driver and
//! being mapped again. Whatever moved still goes back whole when the cache is emptied.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::{DeviceAllocator, DeviceBuilder};

const MIB: usize = 1 << 20;

fn device_pool(cap: Option<usize>) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let mut b = DeviceBuilder::new(Arc::new(sim.clone()));
    if let Some(c) = cap {
        b = b.max_bytes(c);
    }
    (b.build().expect("allocator builds inside a runtime"), sim)
}

fn map_calls(sim: &SimRuntime) -> u64 {
    sim.device_calls(0).unwrap().0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_block_is_mapped_in_a_few_units_not_granule_by_granule() {
    let (pool, sim) = device_pool(None);
    let s = sim.stream();
    let block = pool.alloc(96 * MIB, &s).await.unwrap();
    // 48 granules of 2 MiB: units of at least an eighth of the run.
    assert!(map_calls(&sim) <= 12, "{} map calls", map_calls(&sim));
    assert_eq!(sim.device_used(0), Some(96 * MIB));
    s.fill_device(block.device_ptr(), 96 * MIB, 7).unwrap();
    s.synchronize().unwrap();
    drop(block);
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0), "every unit went back whole");
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_reserve_cap_a_burst_keeps_its_memory_and_idle_memory_goes_back_after_it() {
    let (pool, sim) = device_pool(None);
    let s = sim.stream();
    let a = pool.alloc(8 * MIB, &s).await.unwrap();
    let b = pool.alloc(8 * MIB, &s).await.unwrap();
    s.fill_device(a.device_ptr(), 8 * MIB, 1).unwrap();
    drop(a);
    let calls = driver_calls(&sim);
    // 12 MiB fit in no free range: 6 granules past `b` are mapped, and nothing goes back or
    // moves while requests come, though reserved memory passes the cap (the peak of live
    // bytes, 20 MiB).
    let c = pool.alloc(12 * MIB, &s).await.unwrap();
    assert_eq!(sim.device_remaps(0).unwrap(), 0, "nothing moved");
    assert_eq!(sim.device_calls(0).unwrap().1, 0, "nothing went back");
    assert!(
        driver_calls(&sim) - calls <= 6,
        "{} calls for one run of 6 granules",
        driver_calls(&sim) - calls
    );
    assert_eq!(sim.device_used(0), Some(28 * MIB));
    // The burst over, the idle memory above the cap goes back: `a`'s 8 MiB.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sim.device_used(0) != Some(20 * MIB) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        sim.device_used(0),
        Some(20 * MIB),
        "idle memory above the cap went back"
    );
    s.fill_device(c.device_ptr(), 12 * MIB, 2).unwrap();
    s.synchronize().unwrap();
    drop((b, c));
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_waits_for_no_queued_work_and_its_old_place_stays_mapped_until_that_work_ran() {
    // A limit of 28 MiB, fewer than the 32 a fresh 16 MiB block would need.
    let (pool, sim) = device_pool(Some(28 * MIB));
    let s = sim.stream();
    let a = pool.alloc(8 * MIB, &s).await.unwrap();
    let b = pool.alloc(8 * MIB, &s).await.unwrap();
    // Work on `a` that has not run when `a` is freed: its stream may reuse it at once.
    let hold = s.hold();
    s.fill_device(a.device_ptr(), 8 * MIB, 1).unwrap();
    drop(a);
    // `a`'s idle memory moves into the place `c` needs while the stream is still held.
    let c = tokio::time::timeout(Duration::from_secs(2), pool.alloc(16 * MIB, &s))
        .await
        .expect("the move waited for the device's queued work")
        .unwrap();
    assert!(sim.device_remaps(0).unwrap() > 0, "idle memory moved");
    assert_eq!(
        sim.device_used(0),
        Some(24 * MIB),
        "memory mapped at two places is taken once"
    );
    // A miss while that work is still queued does not end the move.
    let e = pool.alloc(4 * MIB, &s).await.unwrap();
    // The queued fill runs on `a`'s old place, still mapped.
    drop(hold);
    s.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    s.fill_device(e.device_ptr(), 4 * MIB, 2).unwrap();
    s.synchronize().unwrap();
    drop((b, c, e));
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0), "moved memory went back whole");
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_memory_limit_idle_memory_moves_instead_of_going_back_and_coming_again() {
    // A limit of 24 MiB, fewer than the 30 a fresh 14 MiB block would need.
    let (pool, sim) = device_pool(Some(24 * MIB));
    let s = sim.stream();
    let a = pool.alloc(12 * MIB, &s).await.unwrap();
    let b = pool.alloc(4 * MIB, &s).await.unwrap();
    drop(a);
    let before = map_calls(&sim);
    let frees = sim.device_calls(0).unwrap().1;
    // 7 granules past `b`: the 6 idle ones `a` left move there, 1 is mapped.
    let c = pool.alloc(14 * MIB, &s).await.unwrap();
    assert!(sim.device_remaps(0).unwrap() > 0, "idle memory moved");
    assert_eq!(sim.device_calls(0).unwrap().1, frees, "nothing went back");
    assert!(
        map_calls(&sim) - before <= 2,
        "only what did not move was mapped"
    );
    assert_eq!(pool.reserved_bytes(0).unwrap(), 18 * MIB);
    s.fill_device(c.device_ptr(), 14 * MIB, 3).unwrap();
    s.synchronize().unwrap();
    drop((b, c));
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_loop_of_mixed_large_blocks_makes_few_map_calls_and_reserves_no_more_than_pytorch(
) {
    let (pool, sim) = device_pool(None);
    let s = sim.stream();
    let peak = mixed_large_loop(&pool, &s).await;
    s.synchronize().unwrap();
    let reserved = pool.stats(0).unwrap().reserved_bytes.all.peak as usize;
    // Granule by granule, each new place of a block was as many map calls as it had
    // granules (hundreds here).
    assert!(map_calls(&sim) <= 80, "{} map calls", map_calls(&sim));
    // PyTorch's allocator with expandable segments, emulated on the same requests.
    let torch = pinpool_tools::torch_layout::emulate(&mixed_large_trace()).peak_reserved;
    assert!(
        reserved as u64 <= torch,
        "reserved {reserved} for a peak of {peak}; PyTorch's layout {torch}"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// A pool configured as `thread_cache_mb`, and its runtime. A shard for every thread that
/// could be alive (the test harness runs tests side by side), so that each thread owns its
/// shard and keeps the blocks it frees in its own slots.
fn thread_cached_pool(mb: usize) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let config = pinpool::config::DeviceConfig::default().with_thread_cache(mb * MIB);
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .config(&config)
        .shards(1024)
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// Takes `sizes` in order on `s`, frees them all, and does it again: the misses (requests
/// the pool actor answered) of the second round.
async fn misses_of_a_repeated_round(
    pool: &DeviceAllocator<SimRuntime>,
    s: &pinpool::sim::SimStream,
    sizes: &[usize],
) -> i64 {
    for round in 0..2 {
        let before = pool.stats(0).unwrap().num_misses;
        let blocks: Vec<_> = {
            let mut v = Vec::new();
            for &n in sizes {
                v.push(pool.alloc(n, s).await.unwrap());
            }
            v
        };
        // Freed together, on one thread.
        drop(blocks);
        if round == 1 {
            return pool.stats(0).unwrap().num_misses - before;
        }
    }
    unreachable!()
}

/// With a thread cache, a thread keeps the large blocks it frees (up to the cache's size):
/// a repeated round of requests is served from the thread's slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_thread_cache_a_repeated_round_of_large_requests_is_served_without_the_pool_actor() {
    // Five sizes of five size classes.
    let sizes = [8 * MIB, 3 * MIB + 4096, 20 * MIB, 6 * MIB, 5 * MIB];
    let (cached, sim) = thread_cached_pool(32);
    let s = sim.stream();
    assert_eq!(misses_of_a_repeated_round(&cached, &s, &sizes).await, 0);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    // Without it, every block above 1 MiB went back to the actor, which answers each again.
    let (plain, sim) = thread_cached_pool(0);
    let s = sim.stream();
    assert_eq!(
        misses_of_a_repeated_round(&plain, &s, &sizes).await,
        sizes.len() as i64
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// With a thread cache, a thread keeps every block it frees up to the cache's size, as it
/// keeps small ones: the first of a size class in its slot, the next ones in its queue. A
/// larger block goes home to the pool actor, which answers the request for it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_thread_cache_a_thread_keeps_every_block_it_frees_up_to_the_caches_size_two_of_a_class_too(
) {
    let sizes = [8 * MIB, 8 * MIB, 3 * MIB, 40 * MIB];
    let (pool, sim) = thread_cached_pool(32);
    let s = sim.stream();
    assert_eq!(
        misses_of_a_repeated_round(&pool, &s, &sizes).await,
        1,
        "only the block above the cache's size asked the pool actor"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_thread_cache_a_large_request_is_placed_by_the_pool_actor_not_by_merging_cached_neighbours(
) {
    let (pool, sim) = thread_cached_pool(32);
    let s = sim.stream();
    // Two neighbours, freed onto this thread's cached path.
    let a = pool.alloc(4 * MIB, &s).await.unwrap();
    let b = pool.alloc(4 * MIB, &s).await.unwrap();
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    drop((a, b));
    // Each comes back from the cache as it was, without the pool actor.
    let misses = pool.stats(0).unwrap().num_misses;
    let again = pool.alloc(4 * MIB, &s).await.unwrap();
    assert!([pa, pb].contains(&again.device_ptr()));
    assert_eq!(pool.stats(0).unwrap().num_misses, misses);
    drop(again);
    // A request larger than either goes to the actor, which places it best-fit.
    let large = pool.alloc(8 * MIB, &s).await.unwrap();
    assert_eq!(pool.stats(0).unwrap().num_misses, misses + 1);
    drop(large);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_time_requests_spend_on_misses_grows_with_a_miss_and_not_with_a_cached_hit() {
    let (pool, sim) = thread_cached_pool(32);
    let s = sim.stream();
    let a = pool.alloc(4 * MIB, &s).await.unwrap();
    drop(a);
    let before = pool.stats(0).unwrap();
    assert!(before.num_misses >= 1);
    assert!(before.miss_wait_ns > 0, "{before:?}");
    // Served by the thread's cache: neither count moves.
    let again = pool.alloc(4 * MIB, &s).await.unwrap();
    let hit = pool.stats(0).unwrap();
    assert_eq!(
        (hit.num_misses, hit.miss_wait_ns),
        (before.num_misses, before.miss_wait_ns)
    );
    // A size the cache does not hold asks the pool actor: both grow.
    let large = pool.alloc(8 * MIB, &s).await.unwrap();
    let missed = pool.stats(0).unwrap();
    assert_eq!(missed.num_misses, before.num_misses + 1);
    assert!(missed.miss_wait_ns > before.miss_wait_ns);
    // The actor's share of the time is part of it.
    assert!(missed.miss_serve_ns > before.miss_serve_ns);
    assert!(missed.miss_serve_ns <= missed.miss_wait_ns);
    drop((again, large));
    // Accumulated counts start over on request.
    pool.reset_accumulated_stats(0).unwrap();
    let reset = pool.stats(0).unwrap();
    assert_eq!((reset.miss_wait_ns, reset.miss_serve_ns), (0, 0));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// The sizes of the loop of mixed large blocks, in order: three held at a time, each freed
/// when the fourth comes.
fn mixed_large_sizes() -> impl Iterator<Item = usize> {
    const SIZES: [usize; 7] = [24, 40, 6, 18, 64, 10, 33];
    (0..140).map(|step| SIZES[(step * 5) % SIZES.len()] * MIB)
}

/// The loop of mixed large blocks as a trace (without the frees at the end).
fn mixed_large_trace() -> pinpool_tools::trace::Trace {
    use pinpool_tools::trace::{Trace, TraceEvent};
    let mut events = Vec::new();
    for (id, size) in mixed_large_sizes().enumerate() {
        events.push(TraceEvent::Alloc {
            id,
            bytes: size as u64,
            stream: 0,
        });
        if id >= 3 {
            events.push(TraceEvent::Free { id: id - 3 });
        }
    }
    Trace::from_events(events).unwrap()
}

/// Runs the loop of mixed large blocks once on `s` (all freed at the end) and returns the
/// peak of live requested bytes.
async fn mixed_large_loop(
    pool: &DeviceAllocator<SimRuntime>,
    s: &pinpool::sim::SimStream,
) -> usize {
    let mut held = std::collections::VecDeque::new();
    let (mut live, mut peak) = (0usize, 0usize);
    for (step, size) in mixed_large_sizes().enumerate() {
        let b = pool.alloc(size, s).await.unwrap();
        s.fill_device(b.device_ptr(), 4096, step as u8).unwrap();
        live += size;
        peak = peak.max(live);
        held.push_back(b);
        if held.len() > 3 {
            let old = held.pop_front().unwrap();
            live -= old.len();
            drop(old);
        }
    }
    peak
}

/// The driver calls the simulated device has seen: maps, unmaps and moves.
fn driver_calls(sim: &SimRuntime) -> u64 {
    let (maps, unmaps) = sim.device_calls(0).unwrap();
    maps + unmaps + sim.device_remaps(0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_or_without_a_reserve_cap_a_repeated_loop_makes_no_driver_calls_once_it_has_run() {
    for conf in ["reserve_cap:none", ""] {
        let sim = SimRuntime::new();
        let config: pinpool::config::DeviceConfig = conf.parse().unwrap();
        let pool = DeviceBuilder::new(Arc::new(sim.clone()))
            .config(&config)
            .build()
            .unwrap();
        let s = sim.stream();
        mixed_large_loop(&pool, &s).await;
        let (calls, used) = (driver_calls(&sim), sim.device_used(0));
        mixed_large_loop(&pool, &s).await;
        s.synchronize().unwrap();
        let again = driver_calls(&sim) - calls;
        // The cap is kept between bursts, not inside one: the same loop again runs on the
        // memory its first run mapped.
        assert_eq!(again, 0, "{conf}: driver calls in the second run");
        assert_eq!(sim.device_used(0), used, "{conf}: memory stayed mapped");
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.device_used(0), Some(0), "{conf}: all memory went back");
        assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    }
}
