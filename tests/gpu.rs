//! The allocator on a real GPU, through the public `PinnedAllocator` API (feature `cuda`).
//!
//! Each test first checks `cuda_available()`; without a driver or device it prints
//! `<test>: skipped: no CUDA driver/GPU` and passes, except the test of exactly that path.
//! Run them one at a time (capture and timings disturb other threads):
//! `cargo test --release --features cuda --test gpu -- --test-threads=1 --nocapture`.
//! Lines starting with `gpu ` are measurements; `docs/gpu-tests.md` records them.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result, CudaContext, CudaGraph, CudaSlice, CudaStream};
use pinpool::config::{Config, PinStrategy};
use pinpool::cuda::{cuda_available, device_count, stream_id, AutoRuntime, CudaRuntime};
use pinpool::{Error, PinnedAllocator, PinnedBuffer, PoolId, Runtime};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// An allocator on device 0, or `None` (after saying so) where there is no GPU.
fn gpu(test: &str) -> Option<PinnedAllocator<CudaRuntime>> {
    gpu_with(test, Config::default())
}

fn gpu_with(test: &str, config: Config) -> Option<PinnedAllocator<CudaRuntime>> {
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return None;
    }
    let builder = PinnedAllocator::builder()
        .cuda_with_config(0, config)
        .expect("cuda_available() but device 0 did not start");
    Some(builder.build().expect("allocator"))
}

/// A byte pattern that differs from position to position and from seed to seed.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 17) as u8)
        .collect()
}

/// Keeps `stream` busy: `times` memsets of a 1 GiB device buffer (about 0.4 ms each on an
/// H100), enqueued before whatever comes next on the stream.
fn keep_busy(stream: &Arc<CudaStream>, scratch: &mut CudaSlice<u8>, times: usize) {
    for _ in 0..times {
        stream.memset_zeros(scratch).unwrap();
    }
}

/// Whether everything enqueued on `stream` so far has run, asked through the runtime.
fn stream_done(rt: &CudaRuntime, stream: &Arc<CudaStream>) -> bool {
    let event = rt.record_event(stream).unwrap();
    let done = rt.query_event(&event).unwrap();
    rt.release_event(event);
    done
}

/// Allocates `size` until the block at `ptr` comes back, holding the others so that each try
/// can find it; panics after `timeout`. Returns the tries it took.
async fn alloc_until(
    pool: &PinnedAllocator<CudaRuntime>,
    size: usize,
    ptr: *const u8,
    timeout: Duration,
) -> usize {
    let start = Instant::now();
    let mut held: Vec<PinnedBuffer<CudaRuntime>> = Vec::new();
    loop {
        let buf = pool.alloc(size).await.unwrap();
        if buf.as_ptr() == ptr {
            return held.len() + 1;
        }
        held.push(buf);
        assert!(
            start.elapsed() < timeout,
            "the block did not come back within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_freed_with_its_copy_queued_is_not_reused_until_the_copy_has_run() {
    let test = "a_buffer_freed_with_its_copy_queued_is_not_reused";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let stream = rt.context().new_stream().unwrap();
    let mut scratch = stream.alloc_zeros::<u8>(GIB).unwrap();
    let mut dev = stream.alloc_zeros::<u8>(4 * MIB).unwrap();
    stream.synchronize().unwrap();

    let expected = pattern(4 * MIB, 1);
    let mut buf = pool.alloc(4 * MIB).await.unwrap();
    let ptr = buf.as_ptr();
    buf.copy_from_slice(&expected);
    keep_busy(&stream, &mut scratch, 400);
    buf.copy_to_device(&stream, &mut dev).unwrap();
    let freed = Instant::now();
    drop(buf);

    // While the copy is still queued, the same size gets other memory, which we scribble on.
    let mut other = pool.alloc(4 * MIB).await.unwrap();
    let busy_then = !stream_done(&rt, &stream);
    assert!(busy_then, "the stream finished 160 GiB of memsets at once");
    assert_ne!(other.as_ptr(), ptr, "handed out while its copy was queued");
    other.fill(0xEE);
    assert_eq!(pool.stats().waiting_blocks, 1);

    stream.synchronize().unwrap();
    let queued = freed.elapsed();
    let tries = alloc_until(&pool, 4 * MIB, ptr, Duration::from_secs(2)).await;
    let back = stream.clone_dtoh(&dev).unwrap();
    assert!(back == expected, "the copied bytes arrived damaged");
    println!(
        "gpu held_while_copy_queued ms={:.1} reused_after_tries={tries} data=intact",
        queued.as_secs_f64() * 1e3
    );
    drop(other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_block_is_reused_once_its_copy_has_completed() {
    let Some(pool) = gpu("the_same_block_is_reused_once_its_copy_has_completed") else {
        return;
    };
    let stream = pool.runtime().context().new_stream().unwrap();
    let mut dev = stream.alloc_zeros::<u8>(MIB).unwrap();
    let mut ptrs = Vec::new();
    for round in 0..50u8 {
        let mut buf = pool.alloc(MIB).await.unwrap();
        ptrs.push(buf.as_ptr());
        let expected = pattern(MIB, round);
        buf.copy_from_slice(&expected);
        buf.copy_to_device(&stream, &mut dev).unwrap();
        drop(buf);
        stream.synchronize().unwrap();
        assert!(
            stream.clone_dtoh(&dev).unwrap() == expected,
            "round {round}"
        );
        // Let the event poller see the completed event.
        let start = Instant::now();
        while pool.stats().waiting_blocks > 0 {
            assert!(start.elapsed() < Duration::from_secs(2));
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    // The memory of the first round serves every round: the freed block itself, or under
    // the default policy also the rest of the granule it was cut from, which the pool
    // handed the requesting thread.
    let distinct: std::collections::HashSet<_> = ptrs.iter().collect();
    assert!(
        distinct.len() <= 2,
        "{} blocks served 50 rounds",
        distinct.len()
    );
    assert_eq!(
        pool.stats().num_host_alloc,
        1,
        "no fresh memory after the first round"
    );
    println!(
        "gpu reuse_after_copy rounds=50 host_allocs=1 blocks={}",
        distinct.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_is_recorded_on_the_stream_that_used_the_block() {
    let Some(pool) = gpu("the_event_is_recorded_on_the_stream_that_used_the_block") else {
        return;
    };
    let rt = pool.runtime().clone();
    let a = rt.context().new_stream().unwrap();
    let b = rt.context().new_stream().unwrap();
    let mut scratch = b.alloc_zeros::<u8>(GIB).unwrap();
    let mut dev = b.alloc_zeros::<u8>(MIB).unwrap();
    b.synchronize().unwrap();

    let mut buf = pool.alloc(MIB).await.unwrap();
    let ptr = buf.as_ptr();
    buf.fill(9);
    buf.record_stream(&a).unwrap(); // used by A too, which stays idle
    keep_busy(&b, &mut scratch, 400);
    buf.copy_to_device(&b, &mut dev).unwrap();
    assert_eq!(buf.recorded_streams(), vec![stream_id(&a), stream_id(&b)]);
    drop(buf);

    assert!(stream_done(&rt, &a), "stream A is idle");
    let other = pool.alloc(MIB).await.unwrap();
    assert!(
        !stream_done(&rt, &b),
        "stream B finished its memsets at once"
    );
    assert_ne!(other.as_ptr(), ptr, "reused while stream B was busy");
    b.synchronize().unwrap();
    let tries = alloc_until(&pool, MIB, ptr, Duration::from_secs(2)).await;
    println!("gpu held_while_other_stream_busy streams=2 reused_after_tries={tries}");
    drop(other);

    // A second device, where there is one: its stream's event lives in its own context.
    let devices = device_count().unwrap();
    if devices < 2 {
        println!("gpu second_device: skipped: {devices} device(s)");
        return;
    }
    let ctx1 = CudaContext::new(1).unwrap();
    let s1 = ctx1.new_stream().unwrap();
    let mut scratch1 = s1.alloc_zeros::<u8>(GIB).unwrap();
    let mut dev1 = s1.alloc_zeros::<u8>(MIB).unwrap();
    let mut buf = pool.alloc(MIB).await.unwrap();
    let ptr = buf.as_ptr();
    let expected = pattern(MIB, 3);
    buf.copy_from_slice(&expected);
    keep_busy(&s1, &mut scratch1, 400);
    buf.copy_to_device(&s1, &mut dev1).unwrap();
    drop(buf);
    let other = pool.alloc(MIB).await.unwrap();
    assert!(!stream_done(&rt, &s1));
    assert_ne!(other.as_ptr(), ptr, "reused while device 1 was busy");
    s1.synchronize().unwrap();
    alloc_until(&pool, MIB, ptr, Duration::from_secs(2)).await;
    assert!(s1.clone_dtoh(&dev1).unwrap() == expected);
    println!("gpu held_while_second_device_busy devices={devices}");
}

/// Begins a thread-local capture on `stream` with allocations for it routed to `id`.
async fn begin(pool: &PinnedAllocator<CudaRuntime>, stream: &Arc<CudaStream>, id: PoolId) {
    let wanted = stream_id(stream);
    pool.begin_allocate_to_pool(id, move |s| stream_id(s) == wanted)
        .await
        .unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
}

async fn end(
    pool: &PinnedAllocator<CudaRuntime>,
    stream: &Arc<CudaStream>,
    id: PoolId,
) -> CudaGraph {
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture was invalidated");
    pool.end_allocate_to_pool(id).await.unwrap();
    graph
}

/// Blocks kept for graph replays, over every pool (a round trip to the pools, so that every
/// block freed before the call is counted).
async fn kept_blocks(pool: &PinnedAllocator<CudaRuntime>) -> usize {
    pinpool::tuning::engine(pool)
        .inventory()
        .await
        .unwrap()
        .iter()
        .map(|i| i.kept_blocks)
        .sum()
}

/// Replays `graph` after clearing `dev`, and returns what it wrote there.
fn replay(graph: &CudaGraph, stream: &Arc<CudaStream>, dev: &mut CudaSlice<u8>) -> Vec<u8> {
    stream.memset_zeros(dev).unwrap();
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    stream.clone_dtoh(dev).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_pools_keep_blocks_that_real_cuda_graphs_read() {
    let Some(pool) = gpu("capture_pools_keep_blocks_that_real_cuda_graphs_read") else {
        return;
    };
    let ctx = pool.runtime().context().clone();
    // SAFETY: this test orders its device work itself (one stream, explicit
    // synchronisation); without cudarc's event tracking nothing waits during capture on an
    // event recorded outside it.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let mut dev1 = stream.alloc_zeros::<u8>(MIB).unwrap();
    let mut dev2 = stream.alloc_zeros::<u8>(MIB).unwrap();
    stream.synchronize().unwrap();
    let id = pinpool::PoolId::fresh();

    // Graph 1.
    begin(&pool, &stream, id).await;
    let mut a = pool.alloc_on(MIB, &stream).await.unwrap();
    let b = pool.alloc_on(MIB, &stream).await.unwrap();
    assert_eq!(a.pool(), Some(id));
    assert!(a.allocated_during_capture() && b.allocated_during_capture());
    assert_ne!(
        a.as_ptr(),
        b.as_ptr(),
        "two live allocations during capture differ"
    );
    let unused = b.as_ptr();
    drop(b);
    let c = pool.alloc_on(MIB, &stream).await.unwrap();
    assert_eq!(
        c.as_ptr(),
        unused,
        "a block freed during capture without use is reused"
    );
    drop(c);
    let expected1 = pattern(MIB, 1);
    a.copy_from_slice(&expected1);
    a.copy_to_device(&stream, &mut dev1).unwrap(); // captured, not run
    let kept1 = a.as_ptr();
    drop(a);
    let d = pool.alloc_on(MIB, &stream).await.unwrap();
    assert_ne!(
        d.as_ptr(),
        kept1,
        "a block used by captured work was reused"
    );
    drop(d);
    let graph1 = end(&pool, &stream, id).await;
    assert_eq!(kept_blocks(&pool).await, 1);

    // Graph 2, sharing the pool: it gets the unused block, never graph 1's.
    begin(&pool, &stream, id).await;
    let mut e = pool.alloc_on(MIB, &stream).await.unwrap();
    assert_ne!(e.as_ptr(), kept1, "graph 2 got a block graph 1 reads");
    let expected2 = pattern(MIB, 2);
    e.copy_from_slice(&expected2);
    e.copy_to_device(&stream, &mut dev2).unwrap();
    let kept2 = e.as_ptr();
    drop(e);
    let graph2 = end(&pool, &stream, id).await;
    assert_ne!(kept1, kept2);
    assert_eq!(kept_blocks(&pool).await, 2);

    // Replays read the captured bytes, however much else is allocated and written meanwhile.
    for round in 0..3 {
        let mut churn = Vec::new();
        for _ in 0..8 {
            let mut x = pool.alloc(MIB).await.unwrap();
            assert!(x.as_ptr() != kept1 && x.as_ptr() != kept2);
            x.fill(0xEE);
            churn.push(x);
        }
        assert!(
            replay(&graph1, &stream, &mut dev1) == expected1,
            "graph 1, replay {round}"
        );
        assert!(
            replay(&graph2, &stream, &mut dev2) == expected2,
            "graph 2, replay {round}"
        );
    }
    println!("gpu capture_pools graphs=2 replays=3 kept_blocks=2 bytes=right");

    // Once both graphs are gone and both uses released, empty_cache frees the kept blocks.
    drop(graph1);
    drop(graph2);
    pool.release_pool(id).await.unwrap();
    pool.release_pool(id).await.unwrap();
    let report = pool.empty_cache().await.unwrap();
    assert!(report.freed_bytes >= 2 * MIB, "{report:?}");
    assert_eq!(kept_blocks(&pool).await, 0);
}

/// The best bandwidth (10^9 bytes/s) of `reps` host-to-device copies of `src`, each timed on its own after
/// two unmeasured ones: what the memory can do, not what a hiccup of the machine left of it
/// (a fresh registration's first copies have run slower on some hosts).
fn htod_gbps(stream: &Arc<CudaStream>, src: &[u8], dev: &mut CudaSlice<u8>, reps: usize) -> f64 {
    for _ in 0..2 {
        stream.memcpy_htod(src, dev).unwrap();
    }
    stream.synchronize().unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let start = Instant::now();
        stream.memcpy_htod(src, dev).unwrap();
        stream.synchronize().unwrap();
        best = best.min(start.elapsed().as_secs_f64());
    }
    src.len() as f64 / best / 1e9
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_pin_methods_copy_to_the_device_at_full_speed() {
    let Some(reference) = gpu("both_pin_methods_copy_to_the_device_at_full_speed") else {
        return;
    };
    let len = 256 * MIB;
    let reps = 16;
    let rt = reference.runtime().clone();
    let stream = rt.context().new_stream().unwrap();
    let mut dev = stream.alloc_zeros::<u8>(len).unwrap();

    // A plain cuMemHostAlloc buffer (flags 0), as cudaHostAlloc makes by default.
    rt.context().bind_to_thread().unwrap();
    // SAFETY: a plain pinned allocation of `len` bytes, freed below once the copies are done.
    let plain = unsafe { result::malloc_host(len, 0) }.unwrap();
    // SAFETY: `plain` points to `len` bytes of pinned memory owned here until `free_host`.
    let plain_bytes = unsafe { std::slice::from_raw_parts_mut(plain as *mut u8, len) };
    plain_bytes.fill(1);
    let baseline = htod_gbps(&stream, plain_bytes, &mut dev, reps);
    println!("gpu htod_GBps source=plain_cuMemHostAlloc size_mb=256 {baseline:.1}");
    // SAFETY: allocated above; every copy from it was synchronised.
    unsafe { result::free_host(plain) }.unwrap();

    for method in [PinStrategy::HostAlloc, PinStrategy::Register] {
        let pool = gpu_with("pin", Config::default().with_pin_method(method)).unwrap();
        let mut buf = pool.alloc(len).await.unwrap();
        buf.fill(2);
        buf.record_stream(&stream).unwrap();
        let gbps = htod_gbps(&stream, &buf, &mut dev, reps);
        println!("gpu htod_GBps source=pinpool_{method} size_mb=256 {gbps:.1}");
        assert!(
            gbps >= 0.8 * baseline,
            "{method}: {gbps:.1} GB/s against {baseline:.1} GB/s from plain pinned memory"
        );
        drop(buf);
        stream.synchronize().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cudarc_copies_are_asynchronous_only_when_the_stream_is_recorded() {
    let test = "cudarc_copies_are_asynchronous_only_when_the_stream_is_recorded";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let stream = rt.context().new_stream().unwrap();
    let mut scratch = stream.alloc_zeros::<u8>(GIB).unwrap();
    let mut dev = stream.alloc_zeros::<u8>(MIB).unwrap();
    let mut buf = pool.alloc(MIB).await.unwrap();
    buf.fill(5);

    // Not recorded: cudarc waits for the copy before returning.
    keep_busy(&stream, &mut scratch, 200);
    stream.memcpy_htod(&buf, &mut dev).unwrap();
    assert!(
        stream_done(&rt, &stream),
        "an unrecorded copy returned before it ran"
    );
    assert!(buf.recorded_streams().is_empty());

    // Recorded: the call returns at once, and the free waits for the copy instead.
    buf.record_stream(&stream).unwrap();
    keep_busy(&stream, &mut scratch, 200);
    stream.memcpy_htod(&buf, &mut dev).unwrap();
    assert!(
        !stream_done(&rt, &stream),
        "a recorded copy waited for the stream"
    );
    drop(buf);
    assert_eq!(pool.stats().waiting_blocks, 1);
    stream.memcpy_dtoh(&dev, &mut vec![0u8; MIB]).unwrap();
    stream.synchronize().unwrap();
    println!("gpu cudarc_host_slice unrecorded=synchronous recorded=asynchronous");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_into_a_shorter_destination_is_a_typed_error_and_enqueues_nothing() {
    let test = "a_copy_into_a_shorter_destination_is_a_typed_error";
    let Some(pool) = gpu(test) else { return };
    let stream = pool.runtime().context().new_stream().unwrap();
    let mut small = stream.alloc_zeros::<u8>(1000).unwrap();
    let mut buf = pool.alloc(4096).await.unwrap();
    let err = buf.copy_to_device(&stream, &mut small).unwrap_err();
    assert_eq!(
        err,
        Error::LengthMismatch {
            src_len: 4096,
            dst_len: 1000
        }
    );
    assert!(
        buf.recorded_streams().is_empty(),
        "nothing was enqueued or recorded"
    );
    let big = stream.alloc_zeros::<u8>(8192).unwrap();
    let err = buf.copy_from_device(&stream, &big).unwrap_err();
    assert_eq!(
        err,
        Error::LengthMismatch {
            src_len: 8192,
            dst_len: 4096
        }
    );
    // A destination longer than the source is fine: the copy fills its start.
    let mut long = stream.alloc_zeros::<u8>(8192).unwrap();
    buf.fill(4);
    buf.copy_to_device(&stream, &mut long).unwrap();
    let back = stream.clone_dtoh(&long).unwrap();
    assert!(back[..4096].iter().all(|&x| x == 4) && back[4096..].iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_granules_moved_over_the_reserve_cap_are_pinned_memory_that_copies_both_ways() {
    let test = "idle_granules_moved_over_the_reserve_cap";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let Some(g) = rt.host_granularity() else {
        println!("{test}: skipped: no expandable host memory on this driver");
        return;
    };
    if pinpool::tuning::engine(&pool).policy().name() != "bestfit" {
        println!("{test}: skipped: the default policy does not carve an expandable range");
        return;
    }
    // Eight blocks of one granule each (large ones: they go home to the pool actor as they
    // are freed, where a thread keeps the small blocks it frees). Keep those in granules 0,
    // 2, 5 and 7, each with its own bytes; the other four granules are touched by no block.
    let mut blocks = Vec::new();
    for _ in 0..8 {
        blocks.push(Some(pool.alloc(g).await.unwrap()));
    }
    for (i, b) in blocks.iter_mut().enumerate() {
        if [0, 2, 5, 7].contains(&i) {
            b.as_mut().unwrap().copy_from_slice(&pattern(g, i as u8));
        } else {
            drop(b.take());
        }
    }
    let before = pool.stats();
    // Three granules past the last: over the cap (1.15 times the 8 granules of peak live),
    // so idle granules move there.
    let mut big = pool.alloc(3 * g).await.unwrap();
    let after = pool.stats();
    let moved = after.num_host_remaps - before.num_host_remaps;
    assert!(moved >= 2, "{moved} granules moved");
    assert!(after.num_host_alloc - before.num_host_alloc <= 1);
    assert!(after.allocated_bytes.current <= before.allocated_bytes.current + g as i64);

    let stream = rt.context().new_stream().unwrap();
    let mut dev = stream.alloc_zeros::<u8>(3 * g).unwrap();
    let expected = pattern(3 * g, 99);
    big.copy_from_slice(&expected);
    big.record_stream(&stream).unwrap();
    stream.memcpy_htod(&big, &mut dev).unwrap();
    // The copy reads the buffer while the stream runs it (the buffer's stream is recorded,
    // so the call does not wait): it must be done before the buffer is written again.
    stream.synchronize().unwrap();
    big.fill(0);
    stream.memcpy_dtoh(&dev, &mut big[..]).unwrap();
    stream.synchronize().unwrap();
    assert!(
        big[..] == expected[..],
        "the moved memory lost bytes on the way"
    );
    for (i, b) in blocks.iter().enumerate() {
        if let Some(b) = b {
            assert!(b[..] == pattern(g, i as u8)[..], "block {i} changed");
        }
    }
    println!("gpu moved_granules={moved} copies=intact");
    drop((big, blocks));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gpu_the_builder_gives_a_typed_error_and_best_available_falls_back_to_sim() {
    // Runs everywhere: no device has this ordinal.
    match PinnedAllocator::builder().cuda(1_000_000) {
        Err(Error::DeviceUnavailable { message }) => println!("no CUDA driver: {message}"),
        Err(Error::NoSuchDevice { ordinal, count }) => {
            assert_eq!(ordinal, 1_000_000);
            println!("NoSuchDevice {{ ordinal: {ordinal}, count: {count} }}");
        }
        Err(other) => panic!("unexpected error {other:?}"),
        Ok(_) => panic!("device 1000000 exists?"),
    }
    let auto = PinnedAllocator::builder()
        .best_available(0)
        .unwrap()
        .build()
        .unwrap();
    let runtime: &AutoRuntime = auto.runtime();
    println!("best available: {}", runtime.describe());
    assert_eq!(runtime.is_cuda(), cuda_available());
    let stream = runtime.new_stream().unwrap();
    let mut buf = auto.alloc(4096).await.unwrap();
    buf.fill(1);
    buf.record_stream(&stream).unwrap();
    let ptr = buf.as_ptr();
    drop(buf);
    let start = Instant::now();
    loop {
        let again = auto.alloc(4096).await.unwrap();
        if again.as_ptr() == ptr {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the idle stream's block never came back"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if !cuda_available() {
        let err = PinnedAllocator::builder()
            .cuda(0)
            .err()
            .expect("no GPU here");
        assert!(
            matches!(
                err,
                Error::DeviceUnavailable { .. } | Error::NoSuchDevice { count: 0, .. }
            ),
            "{err:?}"
        );
        assert!(runtime.as_sim().is_some());
        println!("builder().cuda(0) without a GPU: {err}");
    }
}
