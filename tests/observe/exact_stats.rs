//! Statistics a capacity planner can size machines by: a peak is the most the requests held
//! at once (of the whole allocator, of each pool, of PyTorch's small and large pools), however
//! many threads hold the bytes and whichever of them held the most at which time; and every
//! out-of-memory failure is counted.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Barrier};

use pinpool::sim::{SimRuntime, SimStream};
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{Builder, DeviceAllocator, DeviceBuilder, DeviceStats, Error, PoolId};
use pinpool_testkit::{capped_device_pool, sim_pool};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: usize = 4;

/// The pinned pattern: in phase `p`, thread `p` holds a large block (4, 8, 16, 32 MiB: a
/// class of its own each time) and every other thread a 256 KiB one. Each thread's own peak
/// falls in a different phase, so their sum (60 MiB and more) is far above the most held at
/// once (32 MiB + 3 x 256 KiB).
fn pinned_size(thread: usize, phase: usize) -> usize {
    if thread == phase {
        (4 * MIB) << phase
    } else {
        256 * KIB
    }
}

/// The device pattern, in requested bytes that are not multiples of 512 (so that requested
/// and allocated bytes differ): large blocks in the large pool, small ones in the small pool.
fn device_size(thread: usize, phase: usize) -> usize {
    if thread == phase {
        (4 + 4 * phase) * MIB + 100
    } else {
        256 * KIB + 100 * (thread + 1)
    }
}

/// What the threads held in each phase: (block bytes, requested bytes, small?) per thread.
type Held = Vec<Vec<(usize, usize, bool)>>;

/// The most held at once over the phases: (bytes, requested, blocks) of all blocks, and bytes
/// and blocks of the small (≤ 1 MiB) and large pools.
struct Truth {
    bytes: i64,
    requested: i64,
    blocks: i64,
    small_bytes: i64,
    small_blocks: i64,
    large_bytes: i64,
    large_blocks: i64,
}

/// A held block: (bytes, requested bytes, small pool).
type HeldBlock = (usize, usize, bool);

fn truth(held: &Held) -> Truth {
    let max = |f: &dyn Fn(&HeldBlock) -> Option<usize>| {
        held.iter()
            .map(|phase| phase.iter().filter_map(f).sum::<usize>() as i64)
            .max()
            .unwrap()
    };
    Truth {
        bytes: max(&|b| Some(b.0)),
        requested: max(&|b| Some(b.1)),
        blocks: max(&|_| Some(1)),
        small_bytes: max(&|b| b.2.then_some(b.0)),
        small_blocks: max(&|b| b.2.then_some(1)),
        large_bytes: max(&|b| (!b.2).then_some(b.0)),
        large_blocks: max(&|b| (!b.2).then_some(1)),
    }
}

/// Runs the phases on `THREADS` plain threads: in each, every thread takes its block with
/// `alloc(thread, phase)`, all hold theirs together, then all give them back. Returns what
/// each thread held in each phase.
fn run_phases<B: Send>(
    phases: usize,
    alloc: impl Fn(usize, usize) -> (B, usize, usize) + Sync,
) -> Held {
    let barrier = Barrier::new(THREADS);
    let held: Vec<Vec<(usize, usize, bool)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (barrier, alloc) = (&barrier, &alloc);
                s.spawn(move || {
                    (0..phases)
                        .map(|p| {
                            let (buf, bytes, requested) = alloc(t, p);
                            barrier.wait(); // every block of the phase is held
                            barrier.wait();
                            drop(buf);
                            barrier.wait(); // every block of the phase is back
                            (bytes, requested, bytes <= MIB)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // By phase, not by thread.
    (0..phases)
        .map(|p| held.iter().map(|t| t[p]).collect())
        .collect()
}

fn assert_device_peaks(s: &DeviceStats, t: &Truth, what: &str) {
    for (name, stat, want) in [
        ("allocated_bytes.all", &s.allocated_bytes.all, t.bytes),
        (
            "allocated_bytes.small_pool",
            &s.allocated_bytes.small_pool,
            t.small_bytes,
        ),
        (
            "allocated_bytes.large_pool",
            &s.allocated_bytes.large_pool,
            t.large_bytes,
        ),
        ("active_bytes.all", &s.active_bytes.all, t.bytes),
        (
            "active_bytes.small_pool",
            &s.active_bytes.small_pool,
            t.small_bytes,
        ),
        (
            "active_bytes.large_pool",
            &s.active_bytes.large_pool,
            t.large_bytes,
        ),
        ("requested_bytes.all", &s.requested_bytes.all, t.requested),
        ("allocation.all", &s.allocation.all, t.blocks),
        (
            "allocation.small_pool",
            &s.allocation.small_pool,
            t.small_blocks,
        ),
        (
            "allocation.large_pool",
            &s.allocation.large_pool,
            t.large_blocks,
        ),
        ("active.all", &s.active.all, t.blocks),
        ("active.small_pool", &s.active.small_pool, t.small_blocks),
        ("active.large_pool", &s.active.large_pool, t.large_blocks),
    ] {
        assert_eq!(stat.peak, want, "{what}: {name}.peak");
        assert_eq!(stat.current, 0, "{what}: {name}.current");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_peaks_are_the_most_held_at_once_across_threads_not_a_sum_of_each_threads_peak() {
    let (pool, _sim) = sim_pool();
    let held = tokio::task::block_in_place(|| {
        run_phases(THREADS, |t, p| {
            let b = pool.alloc_blocking(pinned_size(t, p)).unwrap();
            let cap = b.capacity();
            (b, cap, pinned_size(t, p))
        })
    });
    let t = truth(&held);
    assert_eq!(t.bytes, (32 * MIB + 3 * 256 * KIB) as i64);
    let s = pool.stats();
    assert_eq!(s.active_bytes.peak, t.bytes, "{s:?}");
    assert_eq!(s.active_requests.peak, THREADS as i64);
    assert_eq!(s.active_bytes.current, 0);
    // The default pool's own report is the same.
    let d = pool.pool_stats(PoolId::DEFAULT).unwrap();
    assert_eq!(d.active_bytes.peak, t.bytes);

    // After a reset, the peak is the most held at once since.
    pool.reset_peak_stats();
    assert_eq!(pool.stats().active_bytes.peak, 0);
    let again = tokio::task::block_in_place(|| {
        run_phases(1, |t, _| {
            let b = pool.alloc_blocking(pinned_size(t, 1)).unwrap();
            let cap = b.capacity();
            (b, cap, 0)
        })
    });
    assert_eq!(pool.stats().active_bytes.peak, truth(&again).bytes);
    assert_eq!(truth(&again).bytes, (8 * MIB + 3 * 256 * KIB) as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_peaks_are_the_most_held_at_once_over_streams_and_threads_for_all_small_and_large() {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    // Each thread its own stream, so each its own stream pool.
    let streams: Vec<SimStream> = (0..THREADS).map(|_| sim.stream()).collect();
    let held = tokio::task::block_in_place(|| {
        run_phases(THREADS, |t, p| {
            let b = pool.alloc_blocking(device_size(t, p), &streams[t]).unwrap();
            let cap = b.capacity();
            (b, cap, device_size(t, p))
        })
    });
    let t = truth(&held);
    assert_eq!(t.small_blocks, 3);
    assert_device_peaks(&pool.stats(0).unwrap(), &t, "device");
    // The engine's host view counts the same active blocks.
    let host = pinpool::tuning::device_engine(&pool, 0).unwrap().stats();
    assert_eq!(host.active_bytes.peak, t.bytes);
    assert_eq!(host.active_requests.peak, t.blocks);

    pool.reset_peak_stats(0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.peak, 0);
    assert_eq!(s.allocation.small_pool.peak, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_pools_peaks_are_the_most_its_requests_held_at_once() {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let streams: Vec<SimStream> = (0..THREADS).map(|_| sim.stream()).collect();
    // Something in the default pool first, so that the device's book and the capture
    // pool's differ.
    let s0 = sim.stream();
    drop(pool.alloc(64 * MIB, &s0).await.unwrap());
    let id = pinpool::PoolId::fresh();
    let ids: Vec<u64> = streams.iter().map(|s| s.id().0).collect();
    pool.begin_allocate_to_pool(0, id, move |s| ids.contains(&s.id().0))
        .await
        .unwrap();
    let held = tokio::task::block_in_place(|| {
        run_phases(THREADS, |t, p| {
            let b = pool.alloc_blocking(device_size(t, p), &streams[t]).unwrap();
            assert_eq!(b.pool(), Some(id));
            let cap = b.capacity();
            (b, cap, device_size(t, p))
        })
    });
    pool.end_allocate_to_pool(0, id).await.unwrap();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let t = truth(&held);
    pinpool_testkit::eventually("the capture pool's blocks are reusable", || {
        pool.pool_stats(0, id).unwrap().active.all.current == 0
    })
    .await;
    assert_device_peaks(&pool.pool_stats(0, id).unwrap(), &t, "capture pool");
    // The device's peak is the larger of the two (they never held at once).
    let d = pool.stats(0).unwrap();
    assert_eq!(
        d.allocated_bytes.all.peak,
        (64 * MIB as i64).max(t.bytes),
        "{:?}",
        d.allocated_bytes
    );
    pool.release_pool(0, id).await.unwrap();
}

/// Random sizes, held by several threads at random: the peak lies between the most held at
/// once as counted just after each allocation and just before each free (a lower bound) and
/// as counted just before each allocation and just after each free (an upper bound).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_random_concurrent_use_peaks_lie_between_what_the_threads_saw_held() {
    const SIZES: [usize; 4] = [4 * KIB, 64 * KIB, MIB, 4 * MIB];
    let (pinned, sim) = sim_pool();
    let device = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    #[derive(Default)]
    struct Bracket {
        lower: AtomicI64,
        lower_max: AtomicI64,
        upper: AtomicI64,
        upper_max: AtomicI64,
    }
    impl Bracket {
        fn before_alloc(&self, n: usize) {
            let now = self.upper.fetch_add(n as i64, Ordering::SeqCst) + n as i64;
            self.upper_max.fetch_max(now, Ordering::SeqCst);
        }
        fn after_alloc(&self, n: usize) {
            let now = self.lower.fetch_add(n as i64, Ordering::SeqCst) + n as i64;
            self.lower_max.fetch_max(now, Ordering::SeqCst);
        }
        fn before_free(&self, n: usize) {
            self.lower.fetch_sub(n as i64, Ordering::SeqCst);
        }
        fn after_free(&self, n: usize) {
            self.upper.fetch_sub(n as i64, Ordering::SeqCst);
        }
        fn check(&self, peak: i64, what: &str) {
            let (lo, hi) = (
                self.lower_max.load(Ordering::SeqCst),
                self.upper_max.load(Ordering::SeqCst),
            );
            assert!(lo <= peak && peak <= hi, "{what}: {lo} <= {peak} <= {hi}");
        }
    }
    let (host_b, dev_b) = (Bracket::default(), Bracket::default());
    tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (pinned, device, host_b, dev_b) = (&pinned, &device, &host_b, &dev_b);
                let stream = sim.stream();
                s.spawn(move || {
                    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut host = Vec::new();
                    let mut dev = Vec::new();
                    for _ in 0..2000 {
                        let r = next();
                        let size = SIZES[(r % 4) as usize];
                        if r & 16 == 0 && host.len() < 3 {
                            host_b.before_alloc(size);
                            let b = pinned.alloc_blocking(size).unwrap();
                            assert_eq!(b.capacity(), size);
                            host_b.after_alloc(size);
                            host.push(b);
                        } else if r & 16 == 0 && !host.is_empty() {
                            let b = host.swap_remove((r >> 8) as usize % host.len());
                            let n = b.capacity();
                            host_b.before_free(n);
                            drop(b);
                            host_b.after_free(n);
                        } else if dev.len() < 3 {
                            // Device blocks are the request rounded to 512 bytes or more:
                            // the bracket counts requested bytes.
                            let size = size - 100;
                            dev_b.before_alloc(size);
                            let b = device.alloc_blocking(size, &stream).unwrap();
                            dev_b.after_alloc(size);
                            dev.push(b);
                        } else {
                            let b = dev.swap_remove((r >> 8) as usize % dev.len());
                            let n = b.len();
                            dev_b.before_free(n);
                            drop(b);
                            dev_b.after_free(n);
                        }
                    }
                    for b in host {
                        let n = b.capacity();
                        host_b.before_free(n);
                        drop(b);
                        host_b.after_free(n);
                    }
                    for b in dev {
                        let n = b.len();
                        dev_b.before_free(n);
                        drop(b);
                        dev_b.after_free(n);
                    }
                });
            }
        })
    });
    let h = pinned.stats();
    assert_eq!(h.active_bytes.current, 0);
    host_b.check(h.active_bytes.peak, "pinned active_bytes");
    let d = device.stats(0).unwrap();
    assert_eq!(d.requested_bytes.all.current, 0);
    dev_b.check(d.requested_bytes.all.peak, "device requested_bytes");
}

#[tokio::test]
async fn every_out_of_memory_error_is_counted_in_num_ooms_for_pinned_and_device_memory() {
    // Pinned: larger than the cap (refused at once), then out of room under it.
    let (pool, _sim) = sim_pool();
    pool.set_max_bytes(Some(4 * MIB)).unwrap();
    let err = pool.alloc(8 * MIB).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    assert_eq!(pool.stats().num_ooms, 1);
    let held = pool.alloc(4 * MIB).await.unwrap();
    assert!(matches!(
        pool.try_alloc(MIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(pool.stats().num_ooms, 2);
    drop(held);
    // Pinned: the runtime itself out of memory.
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(8 * MIB));
    let pool = Builder::new(Arc::new(sim))
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .build()
        .unwrap();
    assert!(matches!(
        pool.alloc(16 * MIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(pool.stats().num_ooms, 1);

    // Device: larger than the device (refused at once, before any pool is asked).
    let sim = SimRuntime::builder().device_capacity(64 * MIB).build();
    let device: DeviceAllocator<SimRuntime> =
        DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let err = device.alloc(65 * MIB, &s).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    assert_eq!(
        device.stats(0).unwrap().num_ooms,
        1,
        "larger than the device"
    );
    let (p, s2) = (device.clone(), s.clone());
    let raw =
        pinpool_testkit::on_plain_thread(move || p.raw_alloc_with_stream(65 * MIB, &s2)).await;
    assert!(matches!(raw, Err(Error::OutOfMemory { .. })));
    assert_eq!(device.stats(0).unwrap().num_ooms, 2);
    // Device: larger than the cap, then out of room under it.
    let (capped, sim) = capped_device_pool(4 * MIB);
    let s = sim.stream();
    assert!(matches!(
        capped.alloc(8 * MIB, &s).await,
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(capped.stats(0).unwrap().num_ooms, 1);
    let held = capped.alloc(4 * MIB, &s).await.unwrap();
    assert!(matches!(
        capped.try_alloc(MIB, &s).await,
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(capped.stats(0).unwrap().num_ooms, 2);
    drop(held);
}
