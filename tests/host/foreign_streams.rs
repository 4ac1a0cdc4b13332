//! A stream of another runtime is refused where it is recorded, with a typed error, on
//! pinned and device buffers alike: no event of this runtime could ever say when that
//! stream's work is done, so accepting it would keep the block out of reuse for ever.
//! Built the obvious way (each allocator with its own simulated runtime), the streams of one
//! are foreign to the other.

use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{Builder, DeviceAllocator, DeviceBuilder, Error, PinnedAllocator};

fn pinned() -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .build()
        .unwrap();
    (pool, sim)
}

fn device() -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    (pool, sim)
}

fn is_foreign_stream(r: Result<(), Error>) -> bool {
    matches!(r, Err(Error::ForeignStream { runtime: "sim", .. }))
}

#[tokio::test]
async fn a_pinned_buffer_refuses_a_stream_of_another_runtime_and_comes_back_at_its_free() {
    let (pool, _sim) = pinned();
    let (_dev_pool, other_sim) = device();
    let foreign = other_sim.stream();
    let mut buf = pool.alloc(1 << 20).await.unwrap();
    let ptr = buf.as_ptr();
    assert!(is_foreign_stream(buf.record_stream(&foreign)));
    assert!(buf.recorded_streams().is_empty(), "nothing recorded");
    drop(buf);
    let st = pool.stats();
    assert_eq!((st.kept_blocks, st.waiting_blocks), (0, 0));
    let again = pool.alloc(1 << 20).await.unwrap();
    assert_eq!(
        again.as_ptr(),
        ptr,
        "reused at once, as a buffer no stream used"
    );
    assert_eq!(pool.stats().num_host_alloc, 1);
}

#[tokio::test]
async fn the_pinned_allocators_record_stream_refuses_a_stream_of_another_runtime() {
    let (pool, _sim) = pinned();
    let foreign = SimRuntime::new().stream();
    let mut buf = pool.alloc(4096).await.unwrap();
    assert!(is_foreign_stream(pool.record_stream(&mut buf, &foreign)));
    assert!(buf.recorded_streams().is_empty());
}

#[tokio::test]
async fn a_device_buffer_refuses_a_stream_of_another_runtime_and_comes_back_at_its_free() {
    let (pool, sim) = device();
    let (_pinned_pool, other_sim) = pinned();
    let stream = sim.stream();
    let foreign = other_sim.stream();
    let mut buf = pool.alloc(1 << 20, &stream).await.unwrap();
    let ptr = buf.device_ptr();
    assert!(is_foreign_stream(buf.record_stream(&foreign)));
    assert!(is_foreign_stream(pool.record_stream(&mut buf, &foreign)));
    assert!(buf.recorded_streams().is_empty(), "nothing recorded");
    drop(buf);
    let inv = pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .inventory()
        .await
        .unwrap();
    assert!(
        inv.iter()
            .all(|p| p.kept_bytes == 0 && p.waiting_bytes == 0),
        "{inv:?}"
    );
    let again = pool.alloc(1 << 20, &stream).await.unwrap();
    assert_eq!(again.device_ptr(), ptr, "reused at once by its stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_allocation_refuses_a_stream_of_another_runtime() {
    let (pool, sim) = device();
    let stream = sim.stream();
    let foreign = SimRuntime::new().stream();
    let ptr = pool.raw_alloc_with_stream(4096, &stream).unwrap();
    assert!(is_foreign_stream(pool.raw_record_stream(ptr, &foreign)));
    // The allocation is still there, and the runtime's own streams are accepted.
    assert_eq!(pool.raw_record_stream(ptr, &sim.stream()), Ok(()));
    pool.raw_delete(ptr).unwrap();
}

#[tokio::test]
async fn device_memory_is_not_allocated_on_a_stream_of_another_runtime() {
    let (pool, _sim) = device();
    let foreign = SimRuntime::new().stream();
    let err = pool.alloc(4096, &foreign).await.unwrap_err();
    assert!(matches!(err, Error::ForeignStream { .. }), "{err:?}");
}

/// Both runtimes are simulated, so naming the runtime's kind does not tell them apart: the
/// message says the stream is of another runtime instance, and how to share one.
#[tokio::test]
async fn a_foreign_streams_error_says_how_to_share_one_runtime() {
    let (pinned, _sim) = pinned();
    let (device, other) = device();
    let mut buf = pinned.alloc(4096).await.unwrap();
    let err = buf.record_stream(&other.new_stream().unwrap()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("another sim runtime"), "{text}");
    assert!(text.contains("runtime().new_stream()"), "{text}");
    assert!(text.contains(".runtime(a.runtime().clone())"), "{text}");
    // Following the advice: the device allocator on the pinned one's runtime.
    let shared = DeviceBuilder::new(pinned.runtime().clone())
        .build()
        .unwrap();
    let stream = shared.runtime().new_stream().unwrap();
    assert_eq!(buf.record_stream(&stream), Ok(()));
    drop(device);
}

#[tokio::test]
async fn many_requests_recording_a_foreign_stream_take_no_more_memory_than_without() {
    // The downstream program of the report: 640 requests, each recording the device
    // allocator's stream on a pinned buffer. Refused, the blocks come back as if unused.
    let (pool, _sim) = pinned();
    let (_dev_pool, other_sim) = device();
    let foreign = other_sim.stream();
    for _ in 0..640 {
        let mut buf = pool.alloc(1 << 20).await.unwrap();
        assert!(buf.record_stream(&foreign).is_err());
    }
    assert_eq!(
        pool.stats().num_host_alloc,
        1,
        "one block, reused each time"
    );
    assert_eq!(pool.stats().kept_blocks, 0);
}
