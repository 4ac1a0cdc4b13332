//! Tests of [`CudaRuntime`] on real hardware. Without a CUDA driver or device each test
//! prints a line saying it skipped and passes, except the ones that check exactly that path.
//!
//! Run the timed ones one at a time so that they do not disturb each other:
//! `cargo test --release --features cuda cuda:: -- --test-threads=1 --nocapture`.
//! Lines starting with `cuda ` are measurements.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUstreamCaptureMode};
use cudarc::driver::{result, CudaContext, CudaStream};

use super::*;
use crate::config::{Config, PinStrategy};
use crate::{Origin, Region, Runtime};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// The runtime for device 0, or `None` (after saying so) where there is no GPU.
fn gpu(test: &str, config: Config) -> Option<CudaRuntime> {
    if !cuda_available() {
        println!("{test}: skipped, no CUDA driver or device");
        return None;
    }
    Some(CudaRuntime::with_config(0, config).expect("cuda_available() but device 0 did not start"))
}

fn default_gpu(test: &str) -> Option<CudaRuntime> {
    gpu(test, Config::default())
}

/// Device memory, freed on drop.
struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Self {
        context::bind(ctx).unwrap();
        // SAFETY: plain device allocation in the bound context; freed in `drop`.
        let ptr = unsafe { result::malloc_sync(len) }.unwrap();
        Self {
            ctx: Arc::clone(ctx),
            ptr,
            len,
        }
    }

    /// Enqueues `times` memsets of the whole buffer: device work that takes a while.
    fn keep_busy(&self, stream: &CudaStream, times: usize) {
        for _ in 0..times {
            // SAFETY: the buffer is live and `len` bytes long; the stream is in its context.
            unsafe { result::memset_d8_async(self.ptr, 0x5a, self.len, stream.cu_stream()) }
                .unwrap();
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        context::bind(&self.ctx).unwrap();
        // SAFETY: allocated in `new`, freed once; callers synchronise before dropping.
        unsafe { result::free_sync(self.ptr) }.unwrap();
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[test]
fn missing_driver_or_device_is_a_typed_error_not_a_panic() {
    match CudaRuntime::new(1_000_000) {
        Err(CudaInitError::NoDriver) => println!("no CUDA driver here: NoDriver, as expected"),
        Err(CudaInitError::NoSuchDevice { ordinal, count }) => {
            assert_eq!(ordinal, 1_000_000);
            println!("NoSuchDevice for ordinal {ordinal} ({count} devices), as expected");
        }
        other => panic!("expected NoDriver or NoSuchDevice, got {other:?}"),
    }
    if !cuda_available() {
        let err = CudaRuntime::new(0).unwrap_err();
        assert!(
            matches!(
                err,
                CudaInitError::NoDriver | CudaInitError::NoSuchDevice { count: 0, .. }
            ),
            "{err:?}"
        );
        println!("CudaRuntime::new(0) without a GPU: {err}");
        if let Err(err) = device_count() {
            assert_eq!(err, CudaInitError::NoDriver);
        }
    }
}

#[test]
fn both_pin_methods_allocate_use_and_free_1mib_64mib_1gib() {
    let Some(rt) = default_gpu("both_pin_methods_allocate_use_and_free") else {
        return;
    };
    let threads = rt.config().prefault_threads;
    let variants = [
        (PinStrategy::HostAlloc, true),
        (PinStrategy::Register, true),
        (PinStrategy::Register, false),
    ];
    for (strategy, huge_pages) in variants {
        let rt = CudaRuntime::with_config(
            0,
            Config::default()
                .with_pin_method(strategy)
                .with_huge_pages(huge_pages),
        )
        .unwrap();
        for size in [MIB, 64 * MIB, GIB] {
            for round in 0..2 {
                let start = Instant::now();
                let memory = rt.host_alloc(size).unwrap();
                let alloc = start.elapsed();
                assert_eq!(memory.method, Origin::from(strategy));
                assert!(memory.size >= size);
                assert_eq!(memory.ptr.as_ptr() as usize % 64, 0);
                if strategy == PinStrategy::Register && size >= rt.register_granule() {
                    assert_eq!(memory.size % rt.register_granule(), 0);
                    assert_eq!(memory.ptr.as_ptr() as usize % rt.register_granule(), 0);
                }
                // SAFETY: `memory` is a live pinned range of `memory.size` bytes owned here.
                let bytes =
                    unsafe { std::slice::from_raw_parts_mut(memory.ptr.as_ptr(), memory.size) };
                bytes[0] = 1;
                bytes[memory.size - 1] = 2;
                let start = Instant::now();
                rt.host_free(memory).unwrap();
                let free = start.elapsed();
                println!(
                    "cuda host_alloc_ms method={strategy} huge_pages={} threads={threads} size_mb={} round={round} {:.3}",
                    u8::from(huge_pages),
                    size / MIB,
                    ms(alloc)
                );
                println!(
                    "cuda host_free_ms method={strategy} huge_pages={} size_mb={} round={round} {:.3}",
                    u8::from(huge_pages),
                    size / MIB,
                    ms(free)
                );
            }
        }
    }
}

#[test]
fn register_with_one_prefault_thread_for_comparison() {
    let config = Config::default()
        .with_pin_method(PinStrategy::Register)
        .with_prefault_threads(1);
    let Some(rt) = gpu("register_with_one_prefault_thread", config) else {
        return;
    };
    let start = Instant::now();
    let memory = rt.host_alloc(GIB).unwrap();
    let alloc = start.elapsed();
    rt.host_free(memory).unwrap();
    println!(
        "cuda host_alloc_ms method=register huge_pages=1 threads=1 size_mb=1024 {:.3}",
        ms(alloc)
    );
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let Some(rt) = default_gpu("bad_requests_are_errors_not_panics") else {
        return;
    };
    assert!(rt.host_alloc(0).is_err());
    assert!(rt.host_alloc_with(0, PinStrategy::Register).is_err());
    let err = rt
        .host_alloc_with(usize::MAX - 10, PinStrategy::Register)
        .unwrap_err();
    println!("register usize::MAX: {err}");
    let err = rt
        .host_alloc_with(1 << 60, PinStrategy::HostAlloc)
        .unwrap_err();
    println!(
        "host_alloc 2^60 bytes: {err} (out_of_memory={})",
        err.out_of_memory
    );
    let err = rt
        .host_alloc_with(1 << 60, PinStrategy::Register)
        .unwrap_err();
    assert!(err.out_of_memory, "{err}");
    let mut plain = vec![0u8; 64];
    let simulated = Region {
        ptr: std::ptr::NonNull::new(plain.as_mut_ptr()).unwrap(),
        size: plain.len(),
        method: Origin::Simulated,
    };
    assert!(rt.host_free(simulated).is_err());
}

#[test]
fn events_complete_only_after_the_work_recorded_before_them() {
    let Some(rt) = default_gpu("events_complete_only_after_the_work") else {
        return;
    };
    let stream = rt.context().new_stream().unwrap();

    // Idle stream: done at once; time the record + query pair with pooled events.
    let event = rt.record_event(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(rt.query_event(&event).unwrap());
    rt.release_event(event);
    assert!(rt.idle_events() >= 1, "released events are pooled");
    let pairs = 20_000;
    let start = Instant::now();
    for _ in 0..pairs {
        let event = rt.record_event(&stream).unwrap();
        let _ = rt.query_event(&event).unwrap();
        rt.release_event(event);
    }
    let per_pair = start.elapsed().as_nanos() as f64 / pairs as f64;
    println!("cuda event_record_query_release_ns stream=idle {per_pair:.0}");
    assert!(rt.idle_events() <= 2, "events are reused, not piled up");

    // Busy stream: not ready until the work before it is done.
    let device = DeviceBuffer::new(rt.context(), GIB);
    device.keep_busy(&stream, 200);
    let start = Instant::now();
    let event = rt.record_event(&stream).unwrap();
    let first = rt.query_event(&event).unwrap();
    let mut polls = 1u64;
    while !rt.query_event(&event).unwrap() {
        polls += 1;
        std::thread::yield_now();
    }
    let waited = start.elapsed();
    println!(
        "cuda busy_stream first_query={first} polls={polls} ready_after_ms={:.1}",
        ms(waited)
    );
    assert!(
        !first,
        "an event behind 200 GiB of memsets was ready at once"
    );
    stream.synchronize().unwrap();
    assert!(rt.query_event(&event).unwrap());
    rt.release_event(event);
    drop(device);
}

#[test]
fn a_stream_is_idle_only_once_the_work_enqueued_on_it_has_run() {
    let Some(rt) = default_gpu("a_stream_is_idle_only_once_the_work_enqueued_on_it_has_run") else {
        return;
    };
    let stream = rt.context().new_stream().unwrap();
    let unused = rt.context().new_stream().unwrap();
    assert!(rt.stream_idle(&stream).unwrap(), "a new stream has no work");
    let device = DeviceBuffer::new(rt.context(), GIB);
    device.keep_busy(&stream, 200);
    assert!(
        !rt.stream_idle(&stream).unwrap(),
        "idle behind 200 GiB of memsets"
    );
    stream.synchronize().unwrap();
    assert!(rt.stream_idle(&stream).unwrap(), "idle once synchronized");
    // What a free pays: the ask, against an event's record and query (the event path).
    let n = 20_000;
    let time = |f: &dyn Fn()| {
        let start = Instant::now();
        for _ in 0..n {
            f();
        }
        start.elapsed().as_nanos() as f64 / n as f64
    };
    for round in 0..2 {
        let worked = time(&|| assert!(rt.stream_idle(&stream).unwrap()));
        let never = time(&|| assert!(rt.stream_idle(&unused).unwrap()));
        let event = time(&|| {
            let e = rt.record_event(&stream).unwrap();
            let _ = rt.query_event(&e).unwrap();
            rt.release_event(e);
        });
        println!(
            "cuda stream_idle_ns round={round} after_work={worked:.0} never_used={never:.0} \
             event_record_query_release={event:.0}"
        );
    }
    drop(device);
}

#[test]
fn asking_an_idle_stream_during_a_global_capture_leaves_the_capture_valid() {
    let Some(rt) = default_gpu("asking_an_idle_stream_during_a_global_capture") else {
        return;
    };
    let captured = rt.context().new_stream().unwrap();
    let other = rt.context().new_stream().unwrap();
    let device = DeviceBuffer::new(rt.context(), MIB);
    let done = rt.record_event(&other).unwrap();
    other.synchronize().unwrap();
    // What a free does for a block another stream used, while this thread captures (global
    // mode, the strictest): ask the other stream, record and query an event on it; then the
    // same from another thread.
    captured
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    device.keep_busy(&captured, 1);
    let here = rt.stream_idle(&other);
    let query = rt.query_event(&done);
    let recorded = rt.record_event(&other).map(|e| rt.release_event(e));
    let rt_ref = &rt;
    let other_ref = &other;
    let there = std::thread::scope(|scope| {
        scope
            .spawn(move || rt_ref.stream_idle(other_ref))
            .join()
            .unwrap()
    });
    assert!(rt.is_capturing(&captured).unwrap());
    let graph = captured.end_capture(sys::CUgraphInstantiate_flags(0));
    let valid = matches!(graph, Ok(Some(_)));
    println!(
        "cuda ask_during_global_capture here={here:?} there={there:?} event_query={query:?} \
         event_record={recorded:?} capture_valid={valid}"
    );
    assert!(valid, "the capture was invalidated");
    assert_eq!(here, Ok(true));
    assert_eq!(there, Ok(true));
    assert_eq!(query, Ok(true));
    assert_eq!(recorded, Ok(()));
    drop(graph);
    rt.release_event(done);
}

#[test]
fn events_are_recorded_in_the_stream_context_and_ids_differ_across_contexts() {
    let Some(rt) = default_gpu("events_in_the_stream_context") else {
        return;
    };
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let stream = other.new_stream().unwrap();
    let event = rt.record_event(&stream).unwrap();
    assert_eq!(event.context().cu_ctx(), other.cu_ctx());
    stream.synchronize().unwrap();
    assert!(rt.query_event(&event).unwrap());
    rt.release_event(event);

    let ids = [
        rt.stream_id(&rt.context().default_stream()),
        rt.stream_id(&rt.context().per_thread_stream()),
        rt.stream_id(&other.default_stream()),
        rt.stream_id(&other.per_thread_stream()),
        rt.stream_id(&stream),
        rt.stream_id(&rt.context().new_stream().unwrap()),
    ];
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            assert_ne!(a, b, "{ids:?}");
        }
    }
    assert_eq!(rt.stream_id(&stream), rt.stream_id(&Arc::clone(&stream)));
    drop(stream);
}

#[test]
fn events_from_many_threads_share_the_pool() {
    let Some(rt) = default_gpu("events_from_many_threads") else {
        return;
    };
    let rt = &rt;
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(move || {
                let stream = rt.context().new_stream().unwrap();
                for _ in 0..2_000 {
                    let event = rt.record_event(&stream).unwrap();
                    let _ = rt.query_event(&event).unwrap();
                    rt.release_event(event);
                }
                stream.synchronize().unwrap();
            });
        }
    });
    println!("cuda idle_events_after_8_threads {}", rt.idle_events());
    assert!(rt.idle_events() <= 16);
}

#[test]
fn capture_is_seen_and_host_memory_can_be_pinned_during_it() {
    let Some(rt) = default_gpu("capture_is_seen") else {
        return;
    };
    let stream = rt.context().new_stream().unwrap();
    let device = DeviceBuffer::new(rt.context(), MIB);
    assert!(!rt.is_capturing(&stream).unwrap());

    // This thread's own capture (thread-local mode) forbids host allocation on this thread
    // unless the runtime relaxes the mode.
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    assert!(rt.is_capturing(&stream).unwrap());
    device.keep_busy(&stream, 1);
    for strategy in [PinStrategy::HostAlloc, PinStrategy::Register] {
        let memory = rt.host_alloc_with(MIB, strategy).unwrap();
        rt.host_free(memory).unwrap();
    }
    let event = rt.record_event(&stream).unwrap(); // recorded during capture: never queried
    assert!(rt.is_capturing(&stream).unwrap());
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap();
    assert!(graph.is_some(), "the capture was not invalidated");
    drop(graph);
    rt.release_event(event);
    assert!(!rt.is_capturing(&stream).unwrap());

    // Global mode on this thread: another thread (like the pool's blocking thread) pins
    // memory meanwhile.
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    device.keep_busy(&stream, 1);
    let rt_ref = &rt;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                for strategy in [PinStrategy::HostAlloc, PinStrategy::Register] {
                    let memory = rt_ref.host_alloc_with(MIB, strategy).unwrap();
                    rt_ref.host_free(memory).unwrap();
                }
            })
            .join()
            .unwrap();
    });
    assert!(rt.is_capturing(&stream).unwrap());
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap();
    assert!(graph.is_some(), "the capture was not invalidated");
    drop(graph);
    assert!(!rt.is_capturing(&stream).unwrap());
    stream.synchronize().unwrap();
    drop(device);
    println!("cuda capture: is_capturing true during, false after; pinning in capture ok");
}

/// Copies `src` to the device `reps` times and returns GB/s (10^9 bytes per second).
fn htod_gbps(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    device: &DeviceBuffer,
    src: *const u8,
    len: usize,
    reps: usize,
) -> f64 {
    context::bind(ctx).unwrap();
    let copy = || {
        // SAFETY: `src` points to `len` live host bytes and the device buffer holds at least
        // `len` bytes; the stream is synchronised before either goes away.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(device.ptr, src as *const c_void, len, stream.cu_stream())
        }
        .result()
        .unwrap();
    };
    copy();
    stream.synchronize().unwrap();
    let start = Instant::now();
    for _ in 0..reps {
        copy();
    }
    stream.synchronize().unwrap();
    (len * reps) as f64 / start.elapsed().as_secs_f64() / 1e9
}

#[test]
fn host_to_device_copy_bandwidth_from_each_kind_of_memory() {
    let Some(rt) = default_gpu("host_to_device_copy_bandwidth") else {
        return;
    };
    let len = 256 * MIB;
    let reps = 8;
    let stream = rt.context().new_stream().unwrap();
    let device = DeviceBuffer::new(rt.context(), len);
    let huge = CudaRuntime::with_config(0, Config::default().with_huge_pages(true)).unwrap();
    let small = CudaRuntime::with_config(0, Config::default().with_huge_pages(false)).unwrap();
    let sources: [(&str, &CudaRuntime, PinStrategy); 3] = [
        ("host_alloc_portable", &rt, PinStrategy::HostAlloc),
        ("register_huge_pages", &huge, PinStrategy::Register),
        ("register_4k_pages", &small, PinStrategy::Register),
    ];
    for (name, runtime, strategy) in sources {
        let memory = runtime.host_alloc_with(len, strategy).unwrap();
        let gbps = htod_gbps(
            rt.context(),
            &stream,
            &device,
            memory.ptr.as_ptr(),
            len,
            reps,
        );
        println!("cuda htod_GBps source={name} size_mb=256 {gbps:.1} GB/s");
        runtime.host_free(memory).unwrap();
    }
    // A plain cuMemHostAlloc buffer (flags 0), as cudaHostAlloc makes by default.
    context::bind(rt.context()).unwrap();
    // SAFETY: plain pinned allocation, freed below after the copies have finished.
    let plain = unsafe { result::malloc_host(len, 0) }.unwrap();
    let gbps = htod_gbps(
        rt.context(),
        &stream,
        &device,
        plain as *const u8,
        len,
        reps,
    );
    println!("cuda htod_GBps source=plain_cuMemHostAlloc size_mb=256 {gbps:.1} GB/s");
    // SAFETY: allocated above by `malloc_host`; the copies were synchronised.
    unsafe { result::free_host(plain) }.unwrap();
    let pageable = vec![1u8; len];
    let gbps = htod_gbps(rt.context(), &stream, &device, pageable.as_ptr(), len, 2);
    println!("cuda htod_GBps source=pageable_vec size_mb=256 {gbps:.1} GB/s");
    drop(device);
}

#[test]
fn expandable_host_memory_maps_granules_copies_across_them_and_unmaps_one_in_the_middle() {
    let Some(rt) = default_gpu("expandable_host_memory") else {
        return;
    };
    let Some(g) = rt.host_granularity() else {
        println!("expandable_host_memory: skipped, the driver has no host granules");
        return;
    };
    let range = rt.host_reserve(64 * g).unwrap();
    assert_eq!(range.method, Origin::Mapped);
    // Bad shapes are refused before the driver sees them.
    assert!(rt.host_map(&range, 1, g).is_err());
    assert!(rt.host_map(&range, 63 * g, 2 * g).is_err());
    let t0 = Instant::now();
    rt.host_map(&range, 0, 32 * g).unwrap();
    println!(
        "cuda vmm_map granules=32 granule_kb={} {:.1} us per granule",
        g >> 10,
        t0.elapsed().as_secs_f64() * 1e6 / 32.0
    );
    let len = 32 * g;
    let base = range.ptr.as_ptr();
    // SAFETY: the 32 granules at the start of the range are mapped read-write for the host.
    let host = unsafe { std::slice::from_raw_parts_mut(base, len) };
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let stream = rt.context().new_stream().unwrap();
    let device = DeviceBuffer::new(rt.context(), len);
    let gbps = htod_gbps(rt.context(), &stream, &device, base, len, 8);
    println!(
        "cuda htod_GBps source=expandable_host size_mb={} {gbps:.1} GB/s",
        len >> 20
    );
    // Back from the device into granules 1..3 after zeroing them: the bytes round-trip.
    host[g..3 * g].fill(0);
    context::bind(rt.context()).unwrap();
    // SAFETY: the device buffer holds `len` bytes; granules 1 and 2 are mapped.
    unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            base.add(g) as *mut c_void,
            device.ptr + g as u64,
            2 * g,
            stream.cu_stream(),
        )
    }
    .result()
    .unwrap();
    stream.synchronize().unwrap();
    assert!(host[g..3 * g]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == ((g + i) % 251) as u8));
    // A granule in the middle goes back on its own; copies on either side still work.
    rt.host_unmap(&range, 10 * g, g).unwrap();
    htod_gbps(rt.context(), &stream, &device, base, 10 * g, 1);
    // SAFETY: pointer arithmetic inside the reserved range; granules 11..32 are mapped.
    let after = unsafe { base.add(11 * g) };
    htod_gbps(rt.context(), &stream, &device, after, 21 * g, 1);
    rt.host_map(&range, 10 * g, g).unwrap();
    let t0 = Instant::now();
    rt.host_unmap(&range, 0, 32 * g).unwrap();
    println!(
        "cuda vmm_unmap granules=32 {:.1} us per granule",
        t0.elapsed().as_secs_f64() * 1e6 / 32.0
    );
    rt.host_unreserve(range).unwrap();
    drop(device);
}

#[test]
fn device_granules_mapped_as_units_in_one_call_are_all_usable_and_each_goes_back_alone() {
    use crate::actors::{MemorySource, RangeCall};
    let map = |offset, len, unit| RangeCall::Map { offset, len, unit };
    let unmap = |at, len| RangeCall::Unmap { at, len };
    let Some(rt) = default_gpu("device_map_units") else {
        return;
    };
    let mem = CudaDeviceMemory::new(rt.context().clone(), rt.mapped_access());
    let Some(g) = mem.granularity() else {
        println!("device_map_units: skipped, the device has no granules");
        return;
    };
    let range = mem.reserve(16 * g).unwrap();
    // Bad shapes are refused before the driver sees them.
    assert!(mem.range_call(&range, map(0, 3 * g, 2 * g)).is_err());
    assert!(mem.range_call(&range, map(1, 2 * g, g)).is_err());
    let t0 = Instant::now();
    mem.range_call(&range, map(0, 8 * g, g)).unwrap();
    let one_call = t0.elapsed();
    // The device writes the whole span in one memset, across every unit, and it reads back.
    let base = range.ptr.as_ptr() as usize as sys::CUdeviceptr;
    let mut back = vec![0u8; 8 * g];
    context::bind(rt.context()).unwrap();
    // SAFETY: the 8 granules at `base` are mapped and readable and writable by the device;
    // `back` holds as many bytes.
    unsafe {
        sys::cuMemsetD8_v2(base, 0x5a, 8 * g).result().unwrap();
        sys::cuCtxSynchronize().result().unwrap();
        sys::cuMemcpyDtoH_v2(back.as_mut_ptr() as *mut c_void, base, 8 * g)
            .result()
            .unwrap();
    }
    assert!(back.iter().all(|&b| b == 0x5a));
    // A unit in the middle goes back on its own; the units after it are still usable.
    mem.range_call(&range, unmap(3 * g, g)).unwrap();
    // SAFETY: granules 4..8 are still mapped.
    unsafe {
        sys::cuMemsetD8_v2(base + 4 * g as u64, 0x11, 4 * g)
            .result()
            .unwrap();
        sys::cuCtxSynchronize().result().unwrap();
    }
    for i in (0..8).filter(|&i| i != 3) {
        mem.range_call(&range, unmap(i * g, g)).unwrap();
    }
    // The same units mapped one call each, for comparison.
    let t0 = Instant::now();
    for i in 0..8 {
        mem.range_call(&range, map(i * g, g, g)).unwrap();
    }
    let per_unit = t0.elapsed();
    for i in 0..8 {
        mem.range_call(&range, unmap(i * g, g)).unwrap();
    }
    println!(
        "cuda device_map_units granules=8 granule_kb={} one_call_us {:.0} per_unit_calls_us {:.0}",
        g >> 10,
        one_call.as_secs_f64() * 1e6,
        per_unit.as_secs_f64() * 1e6
    );
    mem.unreserve(range).unwrap();
}
