//! Helpers shared by the integration tests: allocators on fresh simulated runtimes, tokio
//! runtimes, waiting for a condition, the books-balance check (invariant 2), and a pickle
//! reader for snapshots in PyTorch's layout.
//!
//! `kernels.rs` beside this file is not part of this crate: the GPU test binaries include it
//! by path, since it needs `cudarc` (feature `cuda` of `pinpool`).

pub mod pickle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::SimRuntime;
use pinpool::tuning::{BestFit, TieredPowerOfTwo};
use pinpool::{
    Builder, DeviceAllocator, DeviceBuilder, DeviceStats, PinnedAllocator, Stat, StatArray,
};

/// An allocator on a fresh simulated runtime (call inside a tokio runtime), with the
/// `tiered` size policy (named, not left to the default): one host allocation per block, so
/// that a test can count host calls and bytes block by block. `bestfit`, which carves blocks
/// out of shared segments, has its own tests.
pub fn sim_pool() -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// An allocator under `BestFit` that cuts blocks out of separate host allocations
/// (segments), not out of an expandable range.
pub fn segments_pool() -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default().separate_segments()))
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// An allocator on a fresh simulated runtime with the `bestfit` size policy.
pub fn best_fit_pool() -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// [`best_fit_pool`] whose actors run on `rt` (callable outside any runtime).
pub fn best_fit_pool_on(rt: &tokio::runtime::Runtime) -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .handle(rt.handle().clone())
        .build()
        .expect("allocator builds");
    (pool, sim)
}

/// A device allocator on a fresh simulated runtime, with the defaults (call inside a tokio
/// runtime).
pub fn sim_device_pool() -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// A device allocator on a fresh simulated runtime, capped at `max_bytes` per device (call
/// inside a tokio runtime).
pub fn capped_device_pool(max_bytes: usize) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .max_bytes(max_bytes)
        .build()
        .expect("allocator builds inside a runtime");
    (pool, sim)
}

/// A current-thread tokio runtime (its tasks, the allocator's actors among them, run only
/// while some thread is in its `block_on`).
pub fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A multi-thread tokio runtime with `workers` worker threads.
pub fn multi_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// Waits (up to 5 s) until `cond` holds; panics with `what` otherwise.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The same, for plain threads.
pub fn eventually_blocking(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "timed out waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `f` on a plain thread, where the blocking API may block, while this task awaits it
/// (so that a current-thread runtime goes on running the actors that answer it). On the
/// runtime's own thread, blocking calls are `Error::WouldDeadlock`.
pub async fn on_plain_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.await.expect("the plain thread panicked")
}

/// Invariant 2 at a quiescent point: every pool's reserved bytes are cached, in use, waiting
/// or kept; the runtime holds exactly what the pools reserve; and the bytes in use are those
/// of the buffers the test holds (`in_use_blocks` of them).
pub async fn assert_books_balance(
    pool: &PinnedAllocator<SimRuntime>,
    sim: &SimRuntime,
    in_use_blocks: usize,
) {
    let inv = pinpool::tuning::engine(pool)
        .inventory()
        .await
        .expect("inventory");
    let mut reserved = 0;
    let mut in_use = 0;
    for p in &inv {
        assert_eq!(
            p.reserved_bytes,
            p.cached_bytes + p.in_use_bytes + p.waiting_bytes + p.kept_bytes,
            "pool {:?} does not balance: {p:?}",
            p.pool
        );
        reserved += p.reserved_bytes;
        in_use += p.in_use_blocks;
    }
    assert_eq!(
        sim.live_bytes(),
        reserved,
        "runtime holds what the pools reserve: {inv:?}"
    );
    assert_eq!(pool.stats().allocated_bytes.current as usize, reserved);
    assert_eq!(in_use, in_use_blocks, "blocks in use: {inv:?}");
}

/// Waits until no block of any pool is in use or waits on events (the caller has
/// synchronised its streams). A freed block can be on its way to its pool actor (a large
/// piece of a segment, say, once the poller saw its events complete): counted as in use
/// until the actor takes it home, so a block still waiting now may be in use a moment later.
pub async fn eventually_nothing_in_use(pool: &PinnedAllocator<SimRuntime>) {
    let start = Instant::now();
    loop {
        let inv = pinpool::tuning::engine(pool)
            .inventory()
            .await
            .expect("inventory");
        if inv
            .iter()
            .all(|p| p.in_use_blocks == 0 && p.waiting_blocks == 0)
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "blocks still in use: {inv:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Whether every byte of `bytes` is `value` (compared a chunk at a time, so that checking
/// megabytes stays fast in debug builds).
pub fn all_bytes_are(bytes: &[u8], value: u8) -> bool {
    let chunk = [value; 4096];
    bytes.chunks(chunk.len()).all(|c| c == &chunk[..c.len()])
}

/// One of PyTorch's pools (or both) of a statistic.
type Part = fn(&StatArray) -> Stat;

/// Every rule the device statistics keep, checked on one report taken at a quiescent point:
/// in the small pool, the large pool and both, allocated bytes are at most active bytes, which
/// are at most reserved bytes (their peaks too); inactive bytes are the rest; segments are
/// never negative, and none are counted without reserved bytes; and the parts add up to the
/// whole (see [`assert_parts_add_up`]).
pub fn assert_device_stats_add_up(s: &DeviceStats) {
    let arrays = [
        ("allocation", &s.allocation),
        ("segment", &s.segment),
        ("active", &s.active),
        ("allocated_bytes", &s.allocated_bytes),
        ("reserved_bytes", &s.reserved_bytes),
        ("active_bytes", &s.active_bytes),
        ("inactive_split_bytes", &s.inactive_split_bytes),
        ("requested_bytes", &s.requested_bytes),
    ];
    for (name, a) in arrays {
        // Inactive bytes are a value now: no accumulated counts are kept for them.
        assert_parts_add_up(name, a, name != "inactive_split_bytes");
    }
    let parts: [(&str, Part); 3] = [
        ("small_pool", |a: &StatArray| a.small_pool),
        ("large_pool", |a: &StatArray| a.large_pool),
        ("all", |a: &StatArray| a.all),
    ];
    for (name, part) in parts {
        let (allocated, active, reserved) = (
            part(&s.allocated_bytes).current,
            part(&s.active_bytes).current,
            part(&s.reserved_bytes).current,
        );
        assert!(
            allocated <= active && active <= reserved,
            "{name}: allocated {allocated}, active {active}, reserved {reserved}"
        );
        assert_eq!(
            part(&s.inactive_split_bytes).current,
            reserved - active,
            "{name}: inactive bytes are the reserved bytes no active block uses"
        );
        assert!(
            part(&s.allocated_bytes).peak <= part(&s.reserved_bytes).peak,
            "{name}: allocated peak above reserved peak: {s:?}"
        );
        let segments = part(&s.segment).current;
        assert!(segments >= 0, "{name}: {segments} segments");
        if reserved == 0 {
            assert_eq!(
                segments, 0,
                "{name}: segments without reserved bytes: {s:?}"
            );
        }
    }
}

/// The small and large parts of `a` add up to its whole: current values and (where kept,
/// `accumulated`) accumulated counts, each part's current value being what it gained less
/// what it lost; no part is negative or above its peak.
pub fn assert_parts_add_up(name: &str, a: &StatArray, accumulated: bool) {
    let (s, l, all) = (a.small_pool, a.large_pool, a.all);
    assert_eq!(s.current + l.current, all.current, "{name}: {a:?}");
    for (part, st) in [("small", s), ("large", l), ("all", all)] {
        assert!(
            st.current >= 0 && st.current <= st.peak,
            "{name}.{part}: {st:?}"
        );
    }
    for (part, st) in [("small", s), ("large", l)] {
        assert!(
            st.peak <= all.peak,
            "{name}.{part} peak above the whole's: {a:?}"
        );
    }
    if !accumulated {
        return;
    }
    assert_eq!(s.allocated + l.allocated, all.allocated, "{name}: {a:?}");
    assert_eq!(s.freed + l.freed, all.freed, "{name}: {a:?}");
    for (part, st) in [("small", s), ("large", l), ("all", all)] {
        assert!(st.allocated >= 0 && st.freed >= 0, "{name}.{part}: {st:?}");
        assert_eq!(st.allocated - st.freed, st.current, "{name}.{part}: {st:?}");
    }
}
