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
use pinpool::{Builder, DeviceAllocator, DeviceBuilder, PinnedAllocator};

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
