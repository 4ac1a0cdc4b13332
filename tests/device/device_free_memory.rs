//! Free-memory callbacks on the simulated device (seed 002's `FreeMemoryCallback` registry):
//! they run when a request finds no cached block that fits and there is no room for fresh
//! memory, before the allocator gives up; a callback that frees something lets the request
//! succeed, one that frees nothing leaves the typed out-of-memory error, and a panicking one
//! is counted and harms nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::{DeviceAllocator, DeviceBuffer, DeviceBuilder, Error};
use pinpool_testkit::{capped_device_pool, on_plain_thread};

const MIB: usize = 1 << 20;

/// An allocator on one simulated device of `capacity` bytes.
fn small_device(capacity: usize) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::builder().device_capacity(capacity).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    (pool, sim)
}

/// Attaches a callback that drops every buffer sent on the returned channel (buffers the
/// test holds, as a cache of tensors would) and says whether it dropped any; the counter
/// counts its calls.
fn attach_dropper(
    pool: &DeviceAllocator<SimRuntime>,
) -> (flume::Sender<DeviceBuffer<SimRuntime>>, Arc<AtomicUsize>) {
    let (tx, rx) = flume::unbounded::<DeviceBuffer<SimRuntime>>();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    pool.attach_free_memory_callback(move || {
        c.fetch_add(1, Ordering::SeqCst);
        rx.drain().count() > 0
    });
    (tx, calls)
}

#[tokio::test]
async fn a_callback_that_drops_held_buffers_lets_a_request_that_would_fail_succeed() {
    let (pool, sim) = small_device(64 * MIB);
    let s = sim.stream();
    let (held, calls) = attach_dropper(&pool);
    let big = pool.alloc(48 * MIB, &s).await.unwrap();

    // The callback has nothing to drop: the request fails as it would without it.
    let err = pool.alloc(32 * MIB, &s).await.unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, limit: None, .. } if requested == 32 * MIB),
        "{err:?}"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "run once, before giving up"
    );

    // Now it holds the big buffer: dropping it makes room, and the request succeeds.
    held.send(big).unwrap();
    let buf = pool.alloc(32 * MIB, &s).await.unwrap();
    assert_eq!(buf.len(), 32 * MIB);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(held.is_empty(), "the callback dropped the buffer");
    assert_eq!(pool.free_memory_callback_calls(), 2);
    assert_eq!(
        pool.stats(0).unwrap().num_ooms,
        1,
        "only the first request failed"
    );
    assert!(sim.device_used(0).unwrap() <= 64 * MIB);
}

#[tokio::test]
async fn callbacks_are_not_called_when_a_cached_block_fits_or_the_device_has_room() {
    let (pool, sim) = small_device(64 * MIB);
    let s = sim.stream();
    let (_held, calls) = attach_dropper(&pool);
    let a = pool.alloc(4 * MIB, &s).await.unwrap(); // fresh memory, room to spare
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc(4 * MIB, &s).await.unwrap(); // the cached block
    assert_eq!(b.device_ptr(), ptr);
    let c = pool.alloc(2 * MIB, &sim.stream()).await.unwrap(); // another stream's pool
    assert_eq!(c.len(), 2 * MIB);
    // Another stream's cached block cannot serve this request, but the device has room.
    drop(b);
    let d = pool.alloc(4 * MIB, &sim.stream()).await.unwrap();
    assert_ne!(d.device_ptr(), ptr);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(pool.free_memory_callback_calls(), 0);
}

#[tokio::test]
async fn a_callback_that_frees_nothing_leaves_the_typed_out_of_memory_error_and_loses_nothing() {
    let (pool, sim) = small_device(16 * MIB);
    let s = sim.stream();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    pool.attach_free_memory_callback(move || {
        c.fetch_add(1, Ordering::SeqCst);
        false
    });
    let held = pool.alloc(12 * MIB, &s).await.unwrap();
    let err = pool.try_alloc(8 * MIB, &s).await.unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, limit: None, .. } if requested == 8 * MIB),
        "{err:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let st = pool.stats(0).unwrap();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
    drop(held);
    let again = pool.alloc(8 * MIB, &s).await.unwrap();
    assert_eq!(again.len(), 8 * MIB, "the allocator still works");
}

#[tokio::test]
async fn under_a_cap_a_callback_that_frees_makes_room_without_waiting() {
    let (pool, sim) = capped_device_pool(8 * MIB);
    let s = sim.stream();
    let (held, calls) = attach_dropper(&pool);
    held.send(pool.alloc(8 * MIB, &s).await.unwrap()).unwrap();
    // `try_alloc` never waits for room: without the callback it would fail at once.
    let buf = pool.try_alloc(4 * MIB, &sim.stream()).await.unwrap();
    assert_eq!(buf.len(), 4 * MIB);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(pool.reserved_bytes(0).unwrap() <= 8 * MIB);
}

#[tokio::test]
async fn a_panicking_callback_is_counted_and_the_others_still_free_memory() {
    let (pool, sim) = small_device(32 * MIB);
    let s = sim.stream();
    pool.attach_free_memory_callback(|| panic!("a callback that fails"));
    let (held, calls) = attach_dropper(&pool);
    held.send(pool.alloc(24 * MIB, &s).await.unwrap()).unwrap();
    let buf = pool.alloc(16 * MIB, &s).await.unwrap();
    assert_eq!(buf.len(), 16 * MIB);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the callback after it ran");
    assert_eq!(pool.free_memory_callback_panics(), 1);
    assert_eq!(pool.free_memory_callback_calls(), 2);
    // The allocator goes on serving requests.
    drop(buf);
    let again = pool.alloc(16 * MIB, &s).await.unwrap();
    assert_eq!(again.len(), 16 * MIB);
}

#[tokio::test]
async fn blocking_requests_run_the_callbacks_on_their_own_thread() {
    let (pool, sim) = small_device(32 * MIB);
    let s = sim.stream();
    let (tx, rx) = flume::unbounded::<DeviceBuffer<SimRuntime>>();
    let (ran_on_tx, ran_on) = flume::unbounded();
    pool.attach_free_memory_callback(move || {
        let _ = ran_on_tx.send(std::thread::current().id());
        rx.drain().count() > 0
    });
    tx.send(pool.alloc(24 * MIB, &s).await.unwrap()).unwrap();
    let (p, s2) = (pool.clone(), s.clone());
    let (buf, thread) = on_plain_thread(move || {
        let buf = p.alloc_blocking(16 * MIB, &s2).map(|b| b.len());
        (buf, std::thread::current().id())
    })
    .await;
    assert_eq!(buf.unwrap(), 16 * MIB);
    assert_eq!(ran_on.try_recv().unwrap(), thread);
}

#[tokio::test]
async fn a_callback_runs_for_the_device_that_is_out_of_memory() {
    let sim = SimRuntime::builder()
        .devices(2)
        .device_capacity(16 * MIB)
        .build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let (held, calls) = attach_dropper(&pool);
    let s1 = sim.stream_on(1).unwrap();
    let d0 = pool.alloc(12 * MIB, &sim.stream()).await.unwrap();
    held.send(pool.alloc(12 * MIB, &s1).await.unwrap()).unwrap();
    let buf = pool.alloc(8 * MIB, &s1).await.unwrap();
    assert_eq!(buf.device(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        pinpool::tuning::device_engine(&pool, 1)
            .unwrap()
            .free_memory_callback_calls(),
        1
    );
    assert_eq!(
        pinpool::tuning::device_engine(&pool, 0)
            .unwrap()
            .free_memory_callback_calls(),
        0
    );
    assert_eq!(d0.len(), 12 * MIB, "device 0 is untouched");
}
