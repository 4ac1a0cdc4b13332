//! The device allocator on a real GPU, through the public `DeviceAllocator` API (feature
//! `cuda`).
//!
//! Each test first checks `cuda_available()`; without a driver or device it prints
//! `<test>: skipped: no CUDA driver/GPU` and passes, except the test of exactly that path.
//! Run them one at a time (they fill the device, and timings disturb other threads):
//! `cargo test --release --features cuda --test gpu_device -- --test-threads=1 --nocapture`.
//! Lines starting with `gpu ` are measurements; `docs/gpu-tests.md` records them.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result, sys, CudaGraph, CudaSlice, CudaStream};
use pinpool::cuda::{cuda_available, stream_id, CudaRuntime};
use pinpool::{DeviceAllocator, DeviceBuffer, Error, HistoryContext, OomReport, PoolId, Runtime};

use pinpool_testkit::pickle as pickle_reader;

#[path = "common/kernels.rs"]
mod kernels;
use kernels::Kernels;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// A device allocator on the GPU, or `None` (after saying so) where there is none.
fn gpu(test: &str) -> Option<DeviceAllocator<CudaRuntime>> {
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return None;
    }
    let builder = DeviceAllocator::builder()
        .cuda()
        .expect("cuda_available() but the GPU did not start");
    Some(builder.build().expect("allocator"))
}

/// A byte pattern that differs from position to position and from seed to seed.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 17) as u8)
        .collect()
}

/// Two new streams of the runtime's device.
fn two_streams(rt: &CudaRuntime) -> (Arc<CudaStream>, Arc<CudaStream>) {
    let ctx = rt.context();
    (ctx.new_stream().unwrap(), ctx.new_stream().unwrap())
}

/// Whether everything enqueued on `stream` so far has run, asked through the runtime.
fn stream_done(rt: &CudaRuntime, stream: &Arc<CudaStream>) -> bool {
    let event = rt.record_event(stream).unwrap();
    let done = rt.query_event(&event).unwrap();
    rt.release_event(event);
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_another_streams_kernel_still_reads_is_not_handed_out_until_that_work_completes() {
    let test = "a_block_another_streams_kernel_still_reads_is_not_handed_out";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (a, b) = two_streams(&rt);
    let kernels = Kernels::load(&a);
    let size = 4 * MIB;
    let expected = pattern(size, 3);
    let out: CudaSlice<u8> = b.alloc_zeros(size).unwrap();
    b.synchronize().unwrap();

    let mut buf = pool.alloc(size, &a).await.unwrap();
    let ptr = buf.device_ptr();
    a.memcpy_htod(&expected, &mut buf).unwrap();
    a.synchronize().unwrap();
    // Stream B: 300 ms of other work, then a kernel that reads the buffer.
    buf.record_stream(&b).unwrap();
    kernels.spin(&b, 300);
    let (out_ptr, _) = cudarc::driver::DevicePtr::device_ptr(&out, &b);
    kernels.copy(&b, out_ptr, ptr, size as u64);
    let freed = Instant::now();
    drop(buf);

    // While B's kernel waits, stream A gets other memory for the same size, and overwrites it.
    let mut others: Vec<DeviceBuffer<CudaRuntime>> = Vec::new();
    for _ in 0..4 {
        let mut other = pool.alloc(size, &a).await.unwrap();
        assert_ne!(
            other.device_ptr(),
            ptr,
            "handed out while B's kernel had not read it"
        );
        a.memset_zeros(&mut other).unwrap();
        others.push(other);
    }
    assert!(!stream_done(&rt, &b), "B finished 300 ms of work at once");
    assert_eq!(
        pinpool::tuning::device_engine(&pool, 0)
            .unwrap()
            .stats()
            .waiting_blocks,
        1
    );
    a.synchronize().unwrap();
    drop(others);

    // Once B is done, the block comes back (the poller saw the event) with the bytes intact.
    b.synchronize().unwrap();
    let held_ms = freed.elapsed().as_secs_f64() * 1e3;
    let back = b.clone_dtoh(&out).unwrap();
    assert!(back == expected, "the kernel read damaged bytes");
    let start = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let again = pool.alloc(size, &a).await.unwrap();
        if again.device_ptr() == ptr {
            break;
        }
        std::mem::forget(again); // keep it out of the way (the test's process ends soon)
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the block never came back after B's work completed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!(
        "gpu device_held_while_kernel_reads ms={held_ms:.1} reused_after_tries={tries} data=intact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_on_its_own_busy_stream_is_reused_by_that_stream_at_once_without_an_event() {
    let test = "a_block_freed_on_its_own_busy_stream_is_reused_at_once";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let a = rt.context().new_stream().unwrap();
    let kernels = Kernels::load(&a);
    let mut buf = pool.alloc(MIB, &a).await.unwrap();
    let ptr = buf.device_ptr();
    kernels.spin(&a, 200);
    a.memset_zeros(&mut buf).unwrap(); // queued behind the spin
    drop(buf);
    let t = Instant::now();
    let again = pool.alloc(MIB, &a).await.unwrap();
    let ns = t.elapsed().as_nanos();
    assert_eq!(
        again.device_ptr(),
        ptr,
        "its own stream did not get the block back"
    );
    assert!(!stream_done(&rt, &a), "the stream's work had already run");
    let stats = pinpool::tuning::device_engine(&pool, 0).unwrap().stats();
    assert_eq!(stats.waiting_blocks, 0, "a block waited on an event");
    a.synchronize().unwrap();
    println!("gpu device_same_stream_reuse ns={ns} events=0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_out_of_memory_frees_the_cache_retries_and_then_reports_a_typed_error() {
    let test = "driver_out_of_memory_frees_the_cache_retries";
    let Some(pool) = gpu(test) else { return };
    let reports: Arc<Mutex<Vec<OomReport>>> = Arc::default();
    let seen = reports.clone();
    pool.attach_oom_observer(move |r| seen.lock().unwrap().push(*r));
    let rt = pool.runtime().clone();
    let (a, b) = two_streams(&rt);

    // 8 GiB cached in stream A's pool.
    drop(pool.alloc(8 * GIB, &a).await.unwrap());
    // Everything else but 4 GiB taken outside the allocator.
    let (free, _) = pool.memory_info(0).unwrap();
    let hog: CudaSlice<u8> = b.alloc_zeros::<u8>(free - 4 * GIB).unwrap();

    // 10 GiB on stream B: does not fit beside the cache, fits once it is freed.
    let big = pool
        .alloc(10 * GIB, &b)
        .await
        .expect("the retry after freeing the cache");
    let stats = pool.stats(0).unwrap();
    assert!(stats.num_alloc_retries >= 1, "{stats:?}");
    assert!(stats.num_device_free >= 1, "the cached block was not freed");

    // 10 GiB more does not fit at all: a typed error, and the observers hear of it.
    let err = pool.alloc(10 * GIB, &b).await.unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, .. } if requested == 10 * GIB),
        "{err:?}"
    );
    // Observers run off the allocating thread: wait for the report.
    let start = Instant::now();
    let report = loop {
        if let Some(r) = reports.lock().unwrap().last().copied() {
            break r;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "no OOM report");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(report.requested, 10 * GIB);
    assert!(report.allocated >= 10 * GIB, "{report:?}");
    let driver_free = report.driver_free.expect("the driver's free bytes");
    assert!(driver_free < 10 * GIB, "{report:?}");
    assert_eq!(pool.stats(0).unwrap().num_ooms, 1);
    println!(
        "gpu device_oom requested_gib=10 driver_free_mib={} retries={} error=\"{err}\"",
        driver_free >> 20,
        stats.num_alloc_retries
    );
    drop(big);
    drop(hog);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cudarc_copies_and_a_kernel_launch_work_on_device_buffers() {
    let test = "cudarc_copies_and_a_kernel_launch_work_on_device_buffers";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (a, other) = two_streams(&rt);
    let kernels = Kernels::load(&a);
    let size = 3 * MIB + 5;
    let expected = pattern(size, 9);
    let mut src = pool.alloc(size, &a).await.unwrap();
    let dst = pool.alloc(size, &a).await.unwrap();
    let mut copied = pool.alloc(size, &a).await.unwrap();

    a.memcpy_htod(&expected, &mut src).unwrap(); // HostSlice -> DevicePtrMut
    kernels.copy(&a, dst.device_ptr(), src.device_ptr(), size as u64); // a kernel launch
    a.memcpy_dtod(&dst, &mut copied).unwrap(); // DevicePtr -> DevicePtrMut
    let mut back = vec![0u8; size];
    a.memcpy_dtoh(&copied, &mut back).unwrap(); // DevicePtr -> host
    a.synchronize().unwrap();
    assert!(back == expected, "the bytes did not make the round trip");

    // On a stream that does not own the buffer and is not recorded, cudarc waits for the
    // copy before returning (so a drop right after is safe); recorded, it does not.
    let mut theirs: CudaSlice<u8> = other.alloc_zeros(size).unwrap();
    other.synchronize().unwrap();
    kernels.spin(&other, 100);
    other.memcpy_dtod(&copied, &mut theirs).unwrap();
    assert!(
        stream_done(&rt, &other),
        "an unrecorded stream's copy returned before it ran"
    );
    copied.record_stream(&other).unwrap();
    kernels.spin(&other, 100);
    other.memcpy_dtod(&copied, &mut theirs).unwrap();
    assert!(!stream_done(&rt, &other), "a recorded stream's copy waited");
    drop(copied);
    assert_eq!(
        pinpool::tuning::device_engine(&pool, 0)
            .unwrap()
            .stats()
            .waiting_blocks,
        1
    );
    assert!(other.clone_dtoh(&theirs).unwrap() == expected);
    println!(
        "gpu device_cudarc copies=htod,dtod,dtoh kernel=copy_bytes foreign_stream=synchronous"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_errors_are_typed_on_the_gpu_and_without_one() {
    match DeviceAllocator::builder().cuda() {
        Err(Error::DeviceUnavailable { message }) => {
            assert!(!cuda_available());
            println!("no CUDA driver: {message}");
        }
        Err(other) => panic!("unexpected error {other:?}"),
        Ok(builder) => {
            let pool = builder.build().unwrap();
            let stream = pool.runtime().context().new_stream().unwrap();
            let (_, total) = pool.memory_info(0).unwrap();
            let err = pool.alloc(total + 1, &stream).await.unwrap_err();
            assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
            let count = pool.device_count();
            assert!(matches!(
                pool.stats(count),
                Err(Error::NoSuchDevice { ordinal, .. }) if ordinal == count
            ));
            assert!(matches!(
                pool.raw_delete(0xdead_0000),
                Err(Error::UnknownPointer { ptr: 0xdead_0000 })
            ));
            let empty = pool.alloc(0, &stream).await.unwrap();
            assert!(empty.is_empty());
            assert_eq!(empty.device_ptr(), 0, "an empty buffer holds no memory");
            println!("gpu device_errors too_big=OutOfMemory unknown_pointer=UnknownPointer");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_stream_never_inherits_the_blocks_of_a_dropped_stream_whose_work_still_runs() {
    let test = "a_new_stream_never_inherits_the_blocks_of_a_dropped_stream";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let a = rt.context().new_stream().unwrap();
    let kernels = Kernels::load(&a);
    let mut buf = pool.alloc(MIB, &a).await.unwrap();
    let ptr = buf.device_ptr();
    kernels.spin(&a, 300);
    a.memset_zeros(&mut buf).unwrap(); // still queued when the stream is dropped
    drop(buf);
    let a_id = pinpool::cuda::stream_id(&a);
    drop(a);
    // The driver may give a new stream the handle of a destroyed one; the allocator keeps
    // the streams it serves alive, so the new stream's id (and pool) are its own.
    let b = rt.context().new_stream().unwrap();
    assert_ne!(
        pinpool::cuda::stream_id(&b),
        a_id,
        "a stream the allocator serves was destroyed"
    );
    let other = pool.alloc(MIB, &b).await.unwrap();
    assert_ne!(
        other.device_ptr(),
        ptr,
        "a new stream got a block the old stream's work still writes"
    );
    b.synchronize().unwrap();
    println!("gpu device_dropped_stream new_stream_id=distinct block=distinct");
}

/// Threads of this process's device pool actors (named `pinpool-<device>, <pool>...`).
fn pool_threads() -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("pinpool-0, "))
        .count()
}

/// A stream's pool that holds nothing and served no request since the `empty_cache` before
/// is retired by `empty_cache` (its thread ends, its address range goes back) and the stream
/// is served again by a new pool, bytes intact, counts kept. Prints what a request after a
/// retirement costs (a new pool: its thread, its range, the map) against one after an
/// `empty_cache` that kept the pool (used since the call before), which maps anew too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_pool_retired_by_empty_cache_serves_its_stream_again_with_a_new_pool() {
    let test = "a_streams_pool_retired_by_empty_cache";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let s = rt.context().new_stream().unwrap();
    let size = 8 * MIB;
    let (mut retired_us, mut kept_us) = (Vec::new(), Vec::new());
    for round in 0..8u8 {
        let t0 = Instant::now();
        let buf = pool.alloc(size, &s).await.unwrap();
        let took = t0.elapsed().as_secs_f64() * 1e6;
        memset(&s, buf.device_ptr(), round + 1, size);
        let back = read_back(&s, buf.device_ptr(), size);
        assert!(back.iter().all(|&b| b == round + 1), "round {round}: bytes");
        drop(buf);
        // The request of round r follows the empty_cache calls of round r - 1.
        match round % 2 {
            _ if round == 0 => {}
            1 => retired_us.push(took),
            _ => kept_us.push(took),
        }
        let before = pool_threads();
        pool.empty_cache().await.unwrap();
        assert_eq!(
            pool.reserved_bytes(0).unwrap(),
            0,
            "round {round}: all given back"
        );
        assert_eq!(
            pool_threads(),
            before,
            "round {round}: used since the call before"
        );
        if round % 2 == 0 {
            // A second call with the stream unused retires its pool.
            pool.empty_cache().await.unwrap();
            let t0 = Instant::now();
            while pool_threads() != before - 1 {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "the pool's thread ended"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    let stats = pool.stats(0).unwrap();
    assert_eq!(stats.allocation.all.allocated, 8, "every request counted");
    s.synchronize().unwrap();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // A new stream's first request, with and without expandable memory (which reserves an
    // address range as large as the device for the stream's pool).
    let first_us = |pool: &DeviceAllocator<CudaRuntime>| {
        let mut took: Vec<f64> = (0..5u8)
            .map(|i| {
                let s = rt.context().new_stream().unwrap();
                let t0 = Instant::now();
                let buf = pool.alloc_blocking(size, &s).unwrap();
                let took = t0.elapsed().as_secs_f64() * 1e6;
                memset(&s, buf.device_ptr(), i, size);
                assert!(read_back(&s, buf.device_ptr(), size)
                    .iter()
                    .all(|&b| b == i));
                took
            })
            .collect();
        median(&mut took)
    };
    let expandable = first_us(&pool);
    let config = pinpool::config::DeviceConfig::default().with_expandable_segments(false);
    let segments = DeviceAllocator::builder()
        .cuda()
        .unwrap()
        .config(&config)
        .build();
    let segments = first_us(&segments.expect("allocator"));
    println!(
        "gpu device_stream_retired rounds=8 alloc_after_retire_us={:.0} \
         alloc_after_empty_us={:.0} new_stream_first_us={expandable:.0} \
         new_stream_first_no_expandable_us={segments:.0}",
        median(&mut retired_us),
        median(&mut kept_us)
    );
}

/// Sets `n` bytes at device address `ptr` to `byte`, on `stream` (captured while it captures).
fn memset(stream: &Arc<CudaStream>, ptr: u64, byte: u8, n: usize) {
    stream.context().bind_to_thread().unwrap();
    // SAFETY: the caller passes `n` bytes of live device memory at `ptr`; the stream is alive.
    unsafe { result::memset_d8_async(ptr, byte, n, stream.cu_stream()) }.unwrap();
}

/// The `n` bytes at device address `ptr`, read on `stream` once its earlier work has run.
fn read_back(stream: &Arc<CudaStream>, ptr: u64, n: usize) -> Vec<u8> {
    let mut host = vec![0u8; n];
    stream.context().bind_to_thread().unwrap();
    // SAFETY: `n` bytes of live device memory at `ptr`; `host` outlives the copy, which
    // the synchronisation below waits for.
    unsafe { result::memcpy_dtoh_async(&mut host, ptr, stream.cu_stream()) }.unwrap();
    stream.synchronize().unwrap();
    host
}

/// After `c` (12 MiB of 3s) took the idle memory that moved past `b` (8 MiB of 2s): both
/// read back what was written, and once both are freed and the cache emptied nothing stays
/// reserved.
async fn moved_memory_holds_its_data_and_goes_back_whole(
    pool: &DeviceAllocator<CudaRuntime>,
    s: &Arc<CudaStream>,
    b: DeviceBuffer<CudaRuntime>,
    c: DeviceBuffer<CudaRuntime>,
) {
    assert!(read_back(s, c.device_ptr(), 12 * MIB)
        .iter()
        .all(|&x| x == 3));
    assert!(read_back(s, b.device_ptr(), 8 * MIB)
        .iter()
        .all(|&x| x == 2));
    drop((b, c));
    pool.empty_cache().await.unwrap();
    assert_eq!(
        pool.reserved_bytes(0).unwrap(),
        0,
        "moved memory went back whole"
    );
}

/// Routes `stream`'s requests on device 0 to `id`, and begins a thread-local capture on it
/// (ended on the same thread: a `#[tokio::test]` body runs on the test's thread).
async fn begin_capture(pool: &DeviceAllocator<CudaRuntime>, stream: &Arc<CudaStream>, id: PoolId) {
    let wanted = stream_id(stream);
    pool.begin_allocate_to_pool(0, id, move |s| stream_id(s) == wanted)
        .await
        .unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
}

async fn end_capture(
    pool: &DeviceAllocator<CudaRuntime>,
    stream: &Arc<CudaStream>,
    id: PoolId,
) -> CudaGraph {
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the capture was invalidated");
    pool.end_allocate_to_pool(0, id).await.unwrap();
    graph
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_cuda_graphs_sharing_a_device_pool_replay_the_right_bytes() {
    let test = "two_cuda_graphs_sharing_a_device_pool_replay_the_right_bytes";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (s, other) = two_streams(&rt);
    let kernels = Kernels::load(&s);
    let id = pinpool::PoolId::fresh();

    // Graph 1 writes A.
    begin_capture(&pool, &s, id).await;
    let a = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(a.pool(), Some(id));
    assert!(a.allocated_during_capture());
    memset(&s, a.device_ptr(), 0x5a, MIB);
    let g1 = end_capture(&pool, &s, id).await;

    // Graph 2, sharing the pool, copies A into B with a kernel; a scratch buffer it writes
    // and frees during capture is never handed out again.
    begin_capture(&pool, &s, id).await;
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(b.pool(), Some(id));
    assert_ne!(b.device_ptr(), a.device_ptr());
    let scratch = pool.alloc(MIB, &s).await.unwrap();
    let scratch_ptr = scratch.device_ptr();
    memset(&s, scratch_ptr, 0x33, MIB);
    drop(scratch);
    let after = pool.alloc(MIB, &s).await.unwrap();
    assert_ne!(
        after.device_ptr(),
        scratch_ptr,
        "a block captured work writes was handed out again"
    );
    drop(after);
    kernels.copy(&s, b.device_ptr(), a.device_ptr(), MIB as u64);
    let g2 = end_capture(&pool, &s, id).await;
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    drop((a, b)); // the graphs go on using them: kept while the pool lives
    let kept: usize = pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .inventory()
        .await
        .unwrap()
        .iter()
        .map(|i| i.kept_blocks)
        .sum();
    assert_eq!(kept, 4, "A, B, the scratch block and the one after it");
    let reserved = pool.pool_stats(0, id).unwrap().reserved_bytes.all.current;
    assert!(reserved >= 4 * MIB as i64);

    let clear = |p: u64, len: usize| {
        [pa, pb, scratch_ptr]
            .iter()
            .all(|&k| k + MIB as u64 <= p || p + len as u64 <= k)
    };
    for round in 0..3 {
        // Allocations outside the pool, on both streams, never get the pool's blocks, even
        // after the caches were emptied.
        pool.empty_cache().await.unwrap();
        let mut churn = Vec::new();
        for t in [&s, &other] {
            for size in [MIB, 2 * MIB, 64 * MIB] {
                let x = pool.alloc(size, t).await.unwrap();
                assert!(clear(x.device_ptr(), size), "round {round}: {x:?}");
                memset(t, x.device_ptr(), 0xee, size);
                churn.push((x, t));
            }
        }
        other.synchronize().unwrap();
        memset(&s, pb, 0, MIB);
        g1.launch().unwrap();
        g2.launch().unwrap();
        assert!(
            read_back(&s, pb, MIB).iter().all(|&v| v == 0x5a),
            "replay {round}: B does not hold A's bytes"
        );
        assert!(read_back(&s, pa, MIB).iter().all(|&v| v == 0x5a));
        for (x, t) in &churn {
            assert!(
                read_back(t, x.device_ptr(), x.len())
                    .iter()
                    .all(|&v| v == 0xee),
                "replay {round} wrote outside its pool"
            );
        }
    }

    // Both graphs gone and both uses released: empty_cache gives the pool back.
    drop((g1, g2));
    s.synchronize().unwrap();
    pool.release_pool(0, id).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert_eq!(pool.pools(0).unwrap(), vec![id], "one use is left");
    pool.release_pool(0, id).await.unwrap();
    let report = pool.empty_cache().await.unwrap();
    assert!(report.freed_bytes >= 4 * MIB, "{report:?}");
    assert!(pool.pools(0).unwrap().is_empty());
    assert_eq!(pool.pool_stats(0, id).unwrap_err(), Error::UnknownPool(id));
    println!(
        "gpu device_capture_pools graphs=2 replays=3 kept_blocks={kept} pool_reserved_mib={} bytes=right",
        reserved >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_memory_callback_lets_a_request_the_gpu_has_no_room_for_succeed() {
    let test = "a_free_memory_callback_lets_a_request_the_gpu_has_no_room_for_succeed";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (a, b) = two_streams(&rt);
    let (held_tx, held_rx) = flume::unbounded::<DeviceBuffer<CudaRuntime>>();
    let (calls_tx, calls) = flume::unbounded::<()>();
    pool.attach_free_memory_callback(move || {
        let _ = calls_tx.send(());
        held_rx.drain().count() > 0
    });

    // Everything but 4 GiB taken outside the allocator, 3 GiB of that by a held buffer.
    let (free, _) = pool.memory_info(0).unwrap();
    let hog: CudaSlice<u8> = b.alloc_zeros::<u8>(free - 4 * GIB).unwrap();
    let held = pool.alloc(3 * GIB, &a).await.unwrap();

    // Nothing to drop yet: a typed out-of-memory error, after one call.
    let err = pool.alloc(3 * GIB, &b).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    assert_eq!(calls.drain().count(), 1);

    // The callback drops the held buffer: the same request succeeds.
    held_tx.send(held).unwrap();
    let big = pool
        .alloc(3 * GIB, &b)
        .await
        .expect("room made by the callback");
    assert_eq!(big.len(), 3 * GIB);
    assert_eq!(calls.drain().count(), 1);
    assert!(held_tx.is_empty());
    assert_eq!(pool.free_memory_callback_panics(), 0);
    println!(
        "gpu device_free_memory_callback calls={} first=OutOfMemory second=served",
        pool.free_memory_callback_calls()
    );
    drop(big);
    drop(hog);
}

/// Loads a dumped snapshot in Python and checks it: argv[1] the file, argv[2] the address of
/// the block in use (3 MiB requested), argv[3] the address of the block pending free. With
/// torch importable, `torch.cuda._memory_viz` renders it too.
const PY_SNAPSHOT_CHECK: &str = r#"
import pickle, sys
with open(sys.argv[1], 'rb') as f:
    s = pickle.load(f)
in_use, pending = int(sys.argv[2]), int(sys.argv[3])
states = {}
for seg in s['segments']:
    addr = seg['address']
    for b in seg['blocks']:
        assert b['address'] == addr
        addr += b['size']
        states[b['address']] = (b['state'], b['requested_size'], seg['device'])
    assert addr == seg['address'] + seg['total_size']
assert states[in_use] == ('active_allocated', 3 << 20, 0), states[in_use]
assert states[pending][0] == 'active_pending_free', states[pending]
acts = [e['action'] for e in s['device_traces'][0]]
assert 'alloc' in acts and 'free_requested' in acts and acts[-1] == 'snapshot', acts
try:
    from torch.cuda import _memory_viz as mv
except Exception as e:
    print('ok python; torch not importable:', e)
    sys.exit(0)
assert 'segments: ' in mv.segsum(s)
assert 'Device 0' in mv.trace(s)
assert 'Allocator State History' in mv.segment_plot(s)
assert 'Active Memory Timeline' in mv.trace_plot(s)
print('ok python and torch')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dumped_device_snapshot_loads_as_pytorchs_pickle_with_block_states_and_the_trace() {
    let test = "a_dumped_device_snapshot_loads_as_pytorchs_pickle";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (a, b) = two_streams(&rt);
    let kernels = Kernels::load(&a);
    pool.record_history(true, 10_000, HistoryContext::Alloc)
        .unwrap();
    let keep = pool.alloc(3 * MIB, &a).await.unwrap();
    drop(pool.alloc(5000, &a).await.unwrap()); // cached
                                               // A block another stream's queued work still uses: pending free until B is done.
    let mut pending = pool.alloc(2 * MIB, &a).await.unwrap();
    let pending_ptr = pending.device_ptr();
    kernels.spin(&b, 2000);
    pending.record_stream(&b).unwrap();
    drop(pending);

    let file = std::env::temp_dir().join(format!("pinpool-gpu-{}.pickle", std::process::id()));
    std::fs::write(&file, pool.pickle_snapshot().await.unwrap()).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let snap = pickle_reader::read(&bytes).expect("a pickle the visualizer reads");
    let state_at = |ptr: u64| {
        for seg in snap.get("segments").items() {
            let mut at = seg.get("address").int();
            for blk in seg.get("blocks").items() {
                assert_eq!(blk.get("address").int(), at, "blocks tile the segment");
                if at == ptr as i128 {
                    return (
                        blk.get("state").str().to_owned(),
                        blk.get("requested_size").int(),
                        seg.get("stream").int(),
                    );
                }
                at += blk.get("size").int();
            }
        }
        panic!("no block at {ptr:#x}");
    };
    let a_stream = pinpool::cuda::stream_id(&a).0 as i64 as i128;
    assert_eq!(
        state_at(keep.device_ptr()),
        ("active_allocated".to_owned(), 3 * MIB as i128, a_stream)
    );
    assert_eq!(state_at(pending_ptr).0, "active_pending_free");
    let trace = &snap.get("device_traces").items()[0];
    let alloc = trace
        .items()
        .iter()
        .find(|e| {
            e.get("action").str() == "alloc" && e.get("addr").int() == keep.device_ptr() as i128
        })
        .expect("the allocation is in device 0's trace");
    assert_eq!(alloc.get("size").int(), 3 * MIB as i128);
    assert_eq!(alloc.get("stream").int(), a_stream);

    match std::process::Command::new("python3")
        .arg("-c")
        .arg(PY_SNAPSHOT_CHECK)
        .arg(&file)
        .arg(keep.device_ptr().to_string())
        .arg(pending_ptr.to_string())
        .output()
    {
        Ok(out) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "python: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            println!(
                "gpu device_snapshot_pickle bytes={} {}",
                bytes.len(),
                stdout.trim()
            );
        }
        Err(e) => println!("{test}: python part skipped: python3 not found ({e})"),
    }
    b.synchronize().unwrap();
    std::fs::remove_file(&file).unwrap();
    drop(keep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_pool_restored_to_a_checkpoint_gets_its_blocks_back_at_their_addresses() {
    let Some(pool) = gpu("checkpoint round trip") else {
        return;
    };
    let rt = pool.runtime().clone();
    let (s, _) = two_streams(&rt);
    let sid = pinpool::cuda::stream_id(&s);
    let id = pinpool::PoolId::fresh();
    let route = || {
        let pool = &pool;
        async move {
            pool.begin_allocate_to_pool(0, id, move |t| pinpool::cuda::stream_id(t) == sid)
                .await
                .unwrap();
        }
    };
    route().await;
    let a = pool.raw_alloc_with_stream(4 * MIB, &s).unwrap();
    let b = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    pool.raw_delete(a).unwrap();
    route().await;
    let later = pool.raw_alloc_with_stream(6 * MIB, &s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    s.synchronize().unwrap();

    let delta = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap();
    assert_eq!(delta.ptrs_freed, vec![later]);
    assert_eq!(delta.dataptrs_allocd, vec![a], "back at its old address");
    assert!(pool
        .check_pool_live_allocations(0, id, &[a, b])
        .await
        .unwrap());
    // The restored block is real device memory: a copy through it round-trips.
    let data = pattern(4 * MIB, 3);
    let mut back = vec![0u8; 4 * MIB];
    // SAFETY: `a` is a live allocation of 4 MiB on this device, and both copies are 4 MiB.
    unsafe {
        result::memcpy_htod_sync(a as sys::CUdeviceptr, &data).unwrap();
        result::memcpy_dtoh_sync(&mut back, a as sys::CUdeviceptr).unwrap();
    }
    assert_eq!(back, data);
    let held = pool.alloc(MIB, &s).await.unwrap(); // not the pool's: a default-pool buffer
    assert_eq!(held.pool(), Some(PoolId::DEFAULT));
    pool.raw_delete(a).unwrap();
    pool.raw_delete(b).unwrap();
    drop(held);
    s.synchronize().unwrap();
    pool.release_pool(0, id).await.unwrap();
}

/// A blocking request that needs fresh memory has the driver called on its own thread: the
/// thread's current context must be what it was, whether none or another.
#[test]
fn a_blocking_request_that_maps_fresh_memory_leaves_the_threads_current_context_as_it_was() {
    let test = "a_blocking_request_that_maps_fresh_memory_leaves_the_threads_current_context";
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pool = DeviceAllocator::builder()
        .cuda()
        .expect("cuda_available() but the GPU did not start")
        .handle(rt.handle().clone())
        .build()
        .expect("allocator");
    let stream = pool.runtime().context().new_stream().unwrap();
    for size in [4 * MIB, 300 * MIB] {
        // No context current on this thread.
        // SAFETY: making no context current is always sound.
        unsafe { result::ctx::set_current(std::ptr::null_mut()) }.unwrap();
        let fresh = pool.stats(0).unwrap().num_device_alloc;
        let ptr = pool.raw_alloc_with_stream(size, &stream).unwrap();
        assert!(
            pool.stats(0).unwrap().num_device_alloc > fresh,
            "{size} bytes: no fresh memory was mapped"
        );
        assert_eq!(
            result::ctx::get_current().unwrap(),
            None,
            "{size} bytes: the request left a context bound on the thread"
        );
        // The memory is there: bytes set on the stream read back.
        memset(&stream, ptr, 0x5a, size);
        assert!(read_back(&stream, ptr, size).iter().all(|&b| b == 0x5a));
        pool.raw_delete(ptr).unwrap();
        pool.empty_cache_blocking().unwrap();
    }
    println!("{test}: passed");
}

/// `Kernels` shared by the tasks of one test.
struct SharedKernels(Kernels);

// SAFETY: the kernels are driver handles of a loaded module, which the driver lets any
// thread launch once it binds the module's context (`Kernels` binds it at each launch).
unsafe impl Send for SharedKernels {}
// SAFETY: as above; launching takes `&self` and changes nothing in the handles.
unsafe impl Sync for SharedKernels {}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn buffers_shared_across_streams_by_many_tasks_are_never_overwritten_early() {
    // The pattern of the simulated test `device_cross_stream`, on the GPU: 16 tasks, 4
    // streams, 300 rounds; a round takes a block of 512 B to 6 MiB on its stream `s` and
    // fills it there; a third of the rounds then synchronize `s`, and on another stream `o`
    // spin 2 ms, fill the block again and copy its first and last 4 KiB into a check slot,
    // recording `o`. Were the block handed out before `o`'s work ran, the next owner's fill
    // on `s` would reach the check slot first.
    let test = "buffers_shared_across_streams_by_many_tasks_are_never_overwritten_early";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let ctx = rt.context();
    let streams: Vec<Arc<CudaStream>> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    let kernels = Arc::new(SharedKernels(Kernels::load(&streams[0])));
    const TASKS: usize = 16;
    const ROUNDS: usize = 300;
    const SLOT: usize = 8192;
    let check_stream = ctx.new_stream().unwrap();
    let check = pool
        .alloc(TASKS * ROUNDS * SLOT, &check_stream)
        .await
        .unwrap();
    let check_ptr = check.device_ptr();
    memset(&check_stream, check_ptr, 0, TASKS * ROUNDS * SLOT);
    check_stream.synchronize().unwrap();
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (pool, streams, kernels) = (pool.clone(), streams.clone(), kernels.clone());
        tasks.push(tokio::spawn(async move {
            let mut x = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let own = &streams[t % streams.len()];
            let mut expected = Vec::new();
            for round in 0..ROUNDS {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let size = 512 + (x as usize >> 8) % (6 * MIB - 512 + 1);
                let mut b = pool.alloc(size, own).await.unwrap();
                memset(own, b.device_ptr(), x as u8, size);
                if (x >> 40) % 3 == 0 {
                    own.synchronize().unwrap();
                    let other = &streams[(x >> 48) as usize % streams.len()];
                    let byte = ((x >> 32) as u8) | 1; // never the slot's initial 0
                    kernels.0.spin(other, 2);
                    memset(other, b.device_ptr(), byte, size);
                    let slot = check_ptr + ((t * ROUNDS + round) * SLOT) as u64;
                    let n = size.min(SLOT / 2) as u64;
                    kernels.0.copy(other, slot, b.device_ptr(), n);
                    let tail = b.device_ptr() + size as u64 - n;
                    kernels.0.copy(other, slot + n, tail, n);
                    b.record_stream(other).unwrap();
                    expected.push((t * ROUNDS + round, byte, 2 * n as usize));
                }
                drop(b);
            }
            expected
        }));
    }
    let mut expected = Vec::new();
    for t in tasks {
        expected.extend(t.await.unwrap());
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    let seen = read_back(&check_stream, check_ptr, TASKS * ROUNDS * SLOT);
    let overwritten = expected
        .iter()
        .filter(|(slot, byte, n)| {
            let at = slot * SLOT;
            seen[at..at + n].iter().any(|b| b != byte)
        })
        .count();
    println!(
        "gpu device_cross_stream checked={} overwritten_early={overwritten}",
        expected.len()
    );
    assert_eq!(
        overwritten, 0,
        "blocks handed out before another stream's work ran"
    );
    drop(check);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_device_memory_moved_to_a_new_place_holds_what_is_written_there() {
    let test = "idle_device_memory_moved_to_a_new_place_holds_what_is_written_there";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (s, _) = two_streams(&rt);
    let a = pool.alloc(8 * MIB, &s).await.unwrap();
    let b = pool.alloc(8 * MIB, &s).await.unwrap();
    memset(&s, a.device_ptr(), 1, 8 * MIB);
    memset(&s, b.device_ptr(), 2, 8 * MIB);
    drop(a);
    // Over the reserve cap: the granules `a` left move past `b` (`cuMemMap` of their handles
    // at the new place), and what is missing is mapped fresh.
    let c = pool.alloc(12 * MIB, &s).await.unwrap();
    memset(&s, c.device_ptr(), 3, 12 * MIB);
    moved_memory_holds_its_data_and_goes_back_whole(&pool, &s, b, c).await;
    println!("gpu device_moved_memory data=intact reserved_after_empty=0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_under_a_running_kernel_waits_for_nothing_and_the_old_place_outlives_its_work() {
    let test =
        "a_move_under_a_running_kernel_waits_for_nothing_and_the_old_place_outlives_its_work";
    let Some(pool) = gpu(test) else { return };
    let rt = pool.runtime().clone();
    let (s, _) = two_streams(&rt);
    let kernels = Kernels::load(&s);
    let a = pool.alloc(8 * MIB, &s).await.unwrap();
    let b = pool.alloc(8 * MIB, &s).await.unwrap();
    memset(&s, b.device_ptr(), 2, 8 * MIB);
    // `a` is written after 300 ms of other work, and freed at once (its stream may reuse it).
    kernels.spin(&s, 300);
    memset(&s, a.device_ptr(), 1, 8 * MIB);
    drop(a);
    // Over the reserve cap, `a`'s idle memory moves past `b`: without waiting for the
    // stream, its old place still mapped for the queued write.
    let t0 = Instant::now();
    let c = pool.alloc(12 * MIB, &s).await.unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(150),
        "the move waited {took:?}"
    );
    memset(&s, c.device_ptr(), 3, 12 * MIB);
    // A fault of the queued write would surface here.
    s.synchronize().unwrap();
    moved_memory_holds_its_data_and_goes_back_whole(&pool, &s, b, c).await;
    println!(
        "gpu device_move_under_kernel alloc_us={} remaps={}",
        took.as_micros(),
        pool.stats(0).unwrap().num_device_remaps
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_lent_between_streams_is_used_by_the_borrower_only_after_the_lenders_kernel() {
    let test = "a_block_lent_between_streams_is_used_by_the_borrower_only_after_the_lenders_kernel";
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return;
    }
    let pool = DeviceAllocator::builder()
        .cuda()
        .expect("cuda_available() but the GPU did not start")
        .max_bytes(16 * MIB)
        .lend_between_streams(true)
        .build()
        .expect("allocator");
    let rt = pool.runtime().clone();
    let (a, b) = two_streams(&rt);
    let kernels = Kernels::load(&a);
    let size = 12 * MIB;
    let x = pool.alloc(size, &a).await.unwrap();
    let ptr = x.device_ptr();
    // A: 300 ms of work, then a write of the block; freed on its own stream meanwhile.
    kernels.spin(&a, 300);
    memset(&a, ptr, 1, size);
    drop(x);
    // B finds no room under the cap and borrows A's block, without waiting for A.
    let t0 = Instant::now();
    let y = pool.try_alloc(size, &b).await.unwrap();
    let took_ms = t0.elapsed().as_secs_f64() * 1e3;
    assert_eq!(y.device_ptr(), ptr, "A's block, lent to B");
    assert!(
        !stream_done(&rt, &a),
        "the borrow did not wait for A's work"
    );
    memset(&b, ptr, 2, size);
    let back = read_back(&b, ptr, size);
    assert!(back.iter().all(|&v| v == 2), "A's write landed after B's");
    a.synchronize().unwrap();
    println!("gpu device_lent_between_streams borrow_ms={took_ms:.3} data=ordered");
}
