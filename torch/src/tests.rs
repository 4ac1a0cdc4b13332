//! The C ABI's behaviour on the simulated runtime: what PyTorch's pluggable-allocator calls
//! get for each input, good and bad, called from threads outside any tokio runtime.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use crate::abi;
use crate::plugin::{pool_id, torch_pool_id};
use crate::plugin::{Plugin, StreamMap, LEGACY_STREAM, PER_THREAD_STREAM};
use crate::snapshot::{walk, BlockRecord, TraceRecord};
use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{BlockStatus, DeviceAllocator, Error, PoolId};

/// Stream handles 0..HANDLES of each device, as simulated streams.
const HANDLES: usize = 8;

struct SimStreams {
    by_device: Vec<Vec<SimStream>>,
    handles: HashMap<u64, usize>,
}

impl SimStreams {
    fn new(sim: &SimRuntime) -> Self {
        let mut by_device = Vec::new();
        let mut handles = HashMap::new();
        for d in 0..sim.device_count() {
            let streams: Vec<SimStream> = (0..HANDLES)
                .map(|_| sim.stream_on(d).expect("a stream"))
                .collect();
            for (h, s) in streams.iter().enumerate() {
                handles.insert(s.id().0, h);
            }
            by_device.push(streams);
        }
        Self { by_device, handles }
    }
}

impl StreamMap<SimRuntime> for SimStreams {
    fn stream(&self, device: usize, handle: usize) -> Result<SimStream, Error> {
        self.by_device[device]
            .get(handle)
            .cloned()
            .ok_or(Error::NotSupported {
                operation: "stream",
                reason: format!("no simulated stream with handle {handle}"),
            })
    }

    fn handle(&self, stream: &SimStream) -> usize {
        self.handles[&stream.id().0]
    }
}

struct Setup {
    plugin: Plugin<SimRuntime>,
    streams: Arc<SimStreams>,
    _rt: tokio::runtime::Runtime,
}

impl Setup {
    fn stream(&self, device: usize, handle: usize) -> &SimStream {
        &self.streams.by_device[device][handle]
    }
}

fn setup_with(sim: SimRuntime) -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let streams = Arc::new(SimStreams::new(&sim));
    // More shards than threads alive at once (the test harness runs tests side by side,
    // each with its runtime's threads): each test thread owns its shard, so that a block it
    // frees waits in its own slot for its next request rather than going home to the pool
    // actor, as it would from a thread beyond the shard count.
    let alloc = DeviceAllocator::builder()
        .runtime(Arc::new(sim))
        .handle(rt.handle().clone())
        .shards(64)
        .build()
        .unwrap();
    Setup {
        plugin: Plugin::new(alloc, streams.clone()),
        streams,
        _rt: rt,
    }
}

fn setup() -> Setup {
    setup_with(SimRuntime::builder().devices(2).build())
}

const MIB: usize = 1 << 20;

#[test]
fn a_block_freed_on_its_stream_is_handed_out_again_on_that_stream() {
    let s = setup();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    assert_ne!(p, 0);
    s.plugin.free(p, 0, 3).unwrap();
    assert_eq!(s.plugin.alloc(MIB, 0, 3).unwrap(), p);
}

#[test]
fn size_zero_gives_null_and_freeing_null_does_nothing() {
    let s = setup();
    assert_eq!(s.plugin.alloc(0, 0, 3), Ok(0));
    assert_eq!(s.plugin.free(0, 0, 3), Ok(()));
    let through_c = abi::guarded("alloc", 1, || s.plugin.alloc(0, 0, 3));
    assert_eq!(through_c, 0);
    let before = abi::failures();
    abi::guarded("free", (), || s.plugin.free(0, 0, 3));
    assert_eq!(abi::failures(), before, "freeing null is not an error");
    assert_eq!(
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocation
            .all
            .current,
        0
    );
}

#[test]
fn freeing_an_unknown_or_already_freed_pointer_is_a_typed_error_that_changes_nothing() {
    let s = setup();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    let unknown = p + 512;
    assert_eq!(
        s.plugin.free(unknown, 0, 3),
        Err(Error::UnknownPointer {
            ptr: unknown as u64
        })
    );
    assert_eq!(
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocation
            .all
            .current,
        1
    );
    s.plugin.free(p, 0, 3).unwrap();
    assert_eq!(
        s.plugin.free(p, 0, 3),
        Err(Error::UnknownPointer { ptr: p as u64 })
    );
    // Through the C boundary: nothing returned, the reason kept for the thread.
    abi::guarded("free", (), || s.plugin.free(p, 0, 3));
    assert!(
        abi::last_error().contains("not a live raw allocation"),
        "{}",
        abi::last_error()
    );
    assert_eq!(
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocation
            .all
            .current,
        0
    );
}

#[test]
fn a_device_that_does_not_exist_gives_null_and_says_so() {
    let s = setup();
    for device in [2, -1, i32::MAX] {
        assert!(matches!(
            s.plugin.alloc(MIB, device, 3),
            Err(Error::NoSuchDevice { count: 2, .. })
        ));
        let p = abi::guarded("alloc", 0, || s.plugin.alloc(MIB, device, 3));
        assert_eq!(p, 0);
        assert!(
            abi::last_error().contains("no CUDA device"),
            "{}",
            abi::last_error()
        );
    }
    assert!(matches!(
        s.plugin.memory_stats_json(5),
        Err(Error::NoSuchDevice { .. })
    ));
}

#[test]
fn out_of_memory_gives_null_with_the_reason() {
    let s = setup_with(SimRuntime::builder().device_capacity(64 * MIB).build());
    let p = abi::guarded("alloc", 0, || s.plugin.alloc(1 << 30, 0, 3));
    assert_eq!(p, 0);
    assert!(
        abi::last_error().contains("out of memory"),
        "{}",
        abi::last_error()
    );
    // The device still serves what fits.
    assert_ne!(s.plugin.alloc(MIB, 0, 3).unwrap(), 0);
}

#[test]
fn allocations_land_on_the_device_asked_for() {
    let s = setup();
    let a = s.plugin.alloc(MIB, 0, 3).unwrap();
    let b = s.plugin.alloc(MIB, 1, 3).unwrap();
    assert_ne!(a, b);
    assert_eq!(
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocation
            .all
            .current,
        1
    );
    assert_eq!(
        s.plugin
            .allocator()
            .stats(1)
            .unwrap()
            .allocation
            .all
            .current,
        1
    );
    s.plugin.free(b, 1, 3).unwrap();
    assert_eq!(
        s.plugin
            .allocator()
            .stats(1)
            .unwrap()
            .allocation
            .all
            .current,
        0
    );
}

#[test]
fn the_legacy_default_stream_has_one_pool_under_both_its_names() {
    let s = setup();
    // `cudaStreamLegacy` (1) is the same stream as the null handle: both buffers come from
    // the one pool of that stream.
    let a = s.plugin.alloc(MIB, 0, LEGACY_STREAM).unwrap();
    let b = s.plugin.alloc(MIB, 0, 1).unwrap();
    let snap = s._rt.block_on(s.plugin.allocator().snapshot()).unwrap();
    let streams: std::collections::BTreeSet<_> = snap
        .segments
        .iter()
        .filter(|seg| seg.blocks.iter().any(|b| b.state == BlockStatus::InUse))
        .map(|seg| seg.stream)
        .collect();
    assert_eq!(streams.len(), 1, "{streams:?}");
    assert_eq!(
        streams.first(),
        Some(&Some(s.stream(0, LEGACY_STREAM).id().0))
    );
    s.plugin.free(a, 0, LEGACY_STREAM).unwrap();
    s.plugin.free(b, 0, 1).unwrap();
}

#[test]
fn a_block_freed_from_the_per_thread_stream_waits_for_the_legacy_stream() {
    let s = setup();
    // Another thread's work on its own per-thread stream, still running: the legacy
    // stream's work waits for it, so an event there is not complete yet.
    let busy = s.stream(0, LEGACY_STREAM).hold();
    let p = s.plugin.alloc(MIB, 0, PER_THREAD_STREAM).unwrap();
    s.plugin.free(p, 0, PER_THREAD_STREAM).unwrap();
    let q = s.plugin.alloc(MIB, 0, PER_THREAD_STREAM).unwrap();
    assert_ne!(
        q, p,
        "reused while the work queued before the free may still run"
    );
    drop(busy);
    // A created stream's block, by contrast, is its stream's again at once.
    let r = s.plugin.alloc(MIB, 0, 3).unwrap();
    s.plugin.free(r, 0, 3).unwrap();
    assert_eq!(s.plugin.alloc(MIB, 0, 3).unwrap(), r);
}

#[test]
fn record_stream_keeps_a_block_until_that_streams_work_is_done() {
    let s = setup();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    let busy = s.stream(0, 4).hold();
    s.plugin.record_stream(p, 0, 4).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    assert_ne!(s.plugin.alloc(MIB, 0, 3).unwrap(), p);
    drop(busy);
    // Recording on a pointer never lent is a typed error.
    assert!(matches!(
        s.plugin.record_stream(p + 512, 0, 4),
        Err(Error::UnknownPointer { .. })
    ));
}

#[test]
fn memory_stats_come_as_json_with_pytorchs_keys() {
    let s = setup();
    let p = s.plugin.alloc(3 * MIB, 0, 3).unwrap();
    let stats: serde_json::Value =
        serde_json::from_str(&s.plugin.memory_stats_json(0).unwrap()).unwrap();
    assert_eq!(stats["allocated_bytes.all.current"], 3 * MIB);
    assert_eq!(stats["allocation.all.current"], 1);
    assert!(stats["reserved_bytes.all.current"].as_u64().unwrap() >= 3 * MIB as u64);
    assert_eq!(stats["num_ooms"], 0);
    // pinpool's own: the first request asked the pool actor, and its time was counted.
    assert!(stats["num_misses"].as_u64().unwrap() >= 1);
    assert!(stats["miss_wait_ns"].as_u64().unwrap() > 0);
    s.plugin.free(p, 0, 3).unwrap();
    s.plugin.reset_peak_stats(0).unwrap();
    let stats: serde_json::Value =
        serde_json::from_str(&s.plugin.memory_stats_json(0).unwrap()).unwrap();
    assert_eq!(stats["allocated_bytes.all.peak"], 0);
}

#[test]
fn statistics_named_by_pytorchs_keys_come_in_the_order_asked_and_unknown_keys_are_zero() {
    let s = setup();
    let p = s.plugin.alloc(3 * MIB, 0, 3).unwrap();
    let keys = [
        "allocation.all.current",
        "no.such.key",
        "allocated_bytes.large_pool.current",
        "reserved_bytes.all.current",
    ];
    let v = s.plugin.stats_values(0, &keys).unwrap();
    assert_eq!(v[0], 1);
    assert_eq!(v[1], 0);
    assert_eq!(v[2], 3 * MIB as i64);
    assert!(v[3] >= 3 * MIB as i64);
    assert!(matches!(
        s.plugin.stats_values(7, &keys),
        Err(Error::NoSuchDevice { .. })
    ));
    s.plugin.free(p, 0, 3).unwrap();
}

#[test]
fn the_largest_block_is_what_the_device_has_free_and_the_pools_hold_unused_within_the_cap() {
    let s = setup_with(SimRuntime::builder().device_capacity(256 * MIB).build());
    let held = s.plugin.alloc(32 * MIB, 0, 3).unwrap();
    let cached = s.plugin.alloc(16 * MIB, 0, 3).unwrap();
    s.plugin.free(cached, 0, 3).unwrap();
    let reserved = s.plugin.reserved_bytes(0).unwrap();
    let largest = s.plugin.largest_block(0).unwrap();
    assert_eq!(largest, 256 * MIB - reserved + (reserved - 32 * MIB));
    s.plugin.set_memory_fraction(0.25, 0).unwrap();
    assert_eq!(s.plugin.largest_block(0).unwrap(), 64 * MIB - 32 * MIB);
    s.plugin.free(held, 0, 3).unwrap();
}

#[test]
fn the_c_copy_of_a_string_reports_its_length_and_never_overruns() {
    let mut buf = [0x55u8; 8];
    // SAFETY: `buf` has 8 bytes.
    let n = unsafe { abi::copy_out("{\"a\": 1}", buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(n, 8);
    assert_eq!(buf, [0x55; 8], "an answer that does not fit is not written");
    let mut buf = [0x55u8; 9];
    // SAFETY: `buf` has 9 bytes.
    let n = unsafe { abi::copy_out("{\"a\": 1}", buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(n, 8);
    assert_eq!(&buf, b"{\"a\": 1}\0");
}

#[test]
fn empty_cache_gives_cached_blocks_back() {
    let s = setup();
    let p = s.plugin.alloc(64 * MIB, 0, 3).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    assert!(s.plugin.reserved_bytes(0).unwrap() >= 64 * MIB);
    s.plugin.empty_cache().unwrap();
    assert_eq!(s.plugin.reserved_bytes(0).unwrap(), 0);
}

#[test]
fn memory_fraction_caps_the_device_and_bad_fractions_are_refused() {
    let s = setup_with(SimRuntime::builder().device_capacity(256 * MIB).build());
    s.plugin.set_memory_fraction(0.25, 0).unwrap();
    let held = s.plugin.alloc(32 * MIB, 0, 3).unwrap();
    // Over the cap: fails at once (it would otherwise wait for `held` to come back).
    assert!(matches!(
        s.plugin.alloc(48 * MIB, 0, 3),
        Err(Error::OutOfMemory { .. })
    ));
    s.plugin.free(held, 0, 3).unwrap();
    assert_ne!(s.plugin.alloc(48 * MIB, 0, 3).unwrap(), 0);
    assert!(matches!(
        s.plugin.set_memory_fraction(1.5, 0),
        Err(Error::InvalidLimit { .. })
    ));
    assert!(matches!(
        s.plugin.set_memory_fraction(0.5, 9),
        Err(Error::NoSuchDevice { .. })
    ));
}

#[test]
fn requests_of_the_streams_a_filter_accepts_go_to_the_graph_pool() {
    let s = setup();
    let pool = (0, 7);
    s.plugin
        .begin_allocate_to_pool(0, pool, |handle| handle == 5)
        .unwrap();
    let in_pool = s.plugin.alloc(MIB, 0, 5).unwrap();
    let outside = s.plugin.alloc(MIB, 0, 3).unwrap();
    s.plugin.end_allocate_to_pool(0, pool).unwrap();
    let stats = s.plugin.allocator().pool_stats(0, pool_id(pool)).unwrap();
    assert_eq!(stats.allocation.all.current, 1);
    s.plugin.free(in_pool, 0, 5).unwrap();
    s.plugin.free(outside, 0, 3).unwrap();
    s.plugin.release_pool(0, pool).unwrap();
    assert!(matches!(
        s.plugin.release_pool(0, pool),
        Err(Error::UnknownPool(_) | Error::PoolAlreadyReleased(_))
    ));
}

#[test]
fn pool_ids_of_graphs_and_of_user_pools_never_collide() {
    assert_eq!(pool_id((0, 0)), PoolId::DEFAULT);
    let mut seen = std::collections::HashSet::new();
    for n in 1..1000u64 {
        assert!(seen.insert(pool_id((n, 0))));
        assert!(seen.insert(pool_id((0, n))));
    }
    for _ in 0..1000 {
        assert!(!seen.contains(&PoolId::fresh()));
    }
}

#[test]
fn a_panic_inside_a_call_becomes_an_error_not_an_abort() {
    let got = abi::guarded("alloc", 7usize, || -> Result<usize, Error> {
        panic!("boom")
    });
    assert_eq!(got, 7);
    assert!(
        abi::last_error().contains("panicked: boom"),
        "{}",
        abi::last_error()
    );
}

#[test]
fn the_last_error_belongs_to_the_thread_that_failed() {
    abi::set_last_error("here", "this thread's");
    let other = std::thread::spawn(abi::last_error).join().unwrap();
    assert_eq!(other, "");
    assert!(abi::last_error().contains("this thread's"));
}

#[test]
fn threads_on_their_own_streams_never_share_a_live_block() {
    let s = Arc::new(setup());
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (s, barrier) = (s.clone(), barrier.clone());
            std::thread::spawn(move || {
                let handle = 3 + t % 4; // two threads per stream
                let mut held = Vec::new();
                for round in 0..50 {
                    let size = 512 * (1 + (t * 31 + round * 7) % 300);
                    held.push((s.plugin.alloc(size, 0, handle).unwrap(), size));
                    if round % 3 == 2 {
                        let (p, _) = held.remove(0);
                        s.plugin.free(p, 0, handle).unwrap();
                    }
                }
                barrier.wait();
                (handle, held)
            })
        })
        .collect();
    let live: Vec<(usize, Vec<(usize, usize)>)> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut ranges: Vec<(usize, usize)> = live.iter().flat_map(|(_, v)| v.clone()).collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "{:#x?} overlaps {:#x?}",
            w[0],
            w[1]
        );
    }
    let count: usize = live.iter().map(|(_, v)| v.len()).sum();
    let stats = s.plugin.allocator().stats(0).unwrap();
    assert_eq!(stats.allocation.all.current as usize, count);
    // Racing frees of one pointer: exactly one succeeds.
    let (handle, first) = (live[0].0, live[0].1[0].0);
    let ok: usize = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || s.plugin.free(first, 0, handle).is_ok() as usize)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .sum();
    assert_eq!(ok, 1);
    for (handle, held) in &live {
        for &(p, _) in held {
            if p != first {
                s.plugin.free(p, 0, *handle).unwrap();
            }
        }
    }
    assert_eq!(
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocation
            .all
            .current,
        0
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_cuda_the_exported_symbols_fail_softly() {
    use crate::exports::*;
    let p = pinpool_alloc(MIB, 0, std::ptr::null_mut());
    assert!(p.is_null());
    let mut buf = [0u8; 256];
    // SAFETY: `buf` has 256 bytes.
    let n = unsafe { pinpool_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    let text = std::str::from_utf8(&buf[..n]).unwrap();
    assert!(text.contains("without its `cuda` feature"), "{text}");
    assert_eq!(
        pinpool_last_error_is_oom(),
        0,
        "a missing device is no out-of-memory"
    );
    // SAFETY: a null buffer only asks for the length.
    let written = unsafe { pinpool_memory_stats(0, std::ptr::null_mut(), 0) };
    assert_eq!(written, -1);
    assert_eq!(pinpool_init(), -1);
    pinpool_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
    pinpool_empty_cache();
}

/// PyTorch's `enablePeerAccess`, made before its first copy between two GPUs, long after
/// the first allocations: a direct copy on the peer then reaches the memory mapped before.
#[test]
fn pytorchs_peer_access_call_opens_the_memory_mapped_before_it() {
    let s = setup();
    let alloc = s.plugin.allocator();
    let (s0, s1) = (s.stream(0, 3), s.stream(1, 3));
    let mut src = alloc.alloc_blocking(3 * MIB, s0).unwrap();
    let mut dst = alloc.alloc_blocking(3 * MIB, s1).unwrap();
    s0.fill_device(src.device_ptr(), 3 * MIB, 7).unwrap();
    s0.synchronize().unwrap();
    assert!(matches!(
        alloc.memcpy_async(&mut dst, &mut src, 3 * MIB, s1, true),
        Err(Error::PeerAccessNotEnabled { device: 1, peer: 0 })
    ));
    assert!(matches!(
        s.plugin.enable_peer_access(1, 5),
        Err(Error::NoSuchDevice { ordinal: 5, .. })
    ));
    s.plugin.enable_peer_access(1, 0).unwrap();
    alloc
        .memcpy_async(&mut dst, &mut src, 3 * MIB, s1, true)
        .unwrap();
    s1.synchronize().unwrap();
    let sim = alloc.runtime();
    let host = sim.host_alloc(3 * MIB).unwrap();
    s1.copy_dtoh(dst.device_ptr(), host.ptr.as_ptr(), 3 * MIB)
        .unwrap();
    s1.synchronize().unwrap();
    let back = sim.host_read(host.ptr.as_ptr(), 3 * MIB).unwrap();
    sim.host_free(host).unwrap();
    assert!(back.iter().all(|&b| b == 7));
}

#[test]
fn reset_peak_stats_brings_the_allocated_peak_down_to_what_is_allocated_now() {
    let s = setup();
    let big = s.plugin.alloc(64 * MIB, 0, LEGACY_STREAM).unwrap();
    s.plugin.free(big, 0, LEGACY_STREAM).unwrap();
    let peak = |s: &Setup| {
        s.plugin
            .allocator()
            .stats(0)
            .unwrap()
            .allocated_bytes
            .all
            .peak
    };
    assert!(peak(&s) >= (64 * MIB) as i64);
    s.plugin.reset_peak_stats(0).unwrap();
    assert!(peak(&s) < (64 * MIB) as i64, "{}", peak(&s));
}

/// A child forked from a process whose allocator runs has none of its threads: a call that
/// needs a pool actor would wait for ever. Every call there fails at once instead (an
/// allocation gives null, a free leaks the parent's block), and the parent goes on as before.
#[cfg(unix)]
#[test]
fn a_forked_child_is_refused_the_parents_allocator_at_once_instead_of_hanging() {
    let s = setup();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    // SAFETY: the child only runs the calls below (no lock another thread may hold is
    // taken on their refused path) and leaves with `_exit`, running no destructor.
    match unsafe { libc::fork() } {
        0 => {
            // A hang is ended by the alarm's signal, which the parent sees.
            // SAFETY: `alarm` only schedules a signal.
            unsafe { libc::alarm(20) };
            let big = abi::guarded("alloc", 0, || s.plugin.alloc(256 * MIB, 0, 3));
            let small = abi::guarded("alloc", 0, || s.plugin.alloc(MIB, 0, 3));
            abi::guarded("free", (), || s.plugin.free(p, 0, 3));
            let refused = abi::last_error().contains("forked");
            let code = if big == 0 && small == 0 && refused {
                0
            } else {
                1
            };
            // SAFETY: ends the child at once, as a forked child of a threaded process must.
            unsafe { libc::_exit(code) }
        }
        -1 => panic!("fork failed"),
        child => {
            let mut status = 0;
            // SAFETY: `status` is a writable int; `child` is this process's child.
            assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "the child hung or was not refused: wait status {status:#x}"
            );
        }
    }
    // The parent's allocator is untouched.
    s.plugin.free(p, 0, 3).unwrap();
    assert_eq!(s.plugin.alloc(MIB, 0, 3).unwrap(), p);
}

/// Out of memory while PyTorch captures a graph (a graph pool's begin without its end): no
/// cache is emptied, since giving memory back synchronises the device and would invalidate
/// the capture. The allocation gives null with an out-of-memory error (the shim raises it),
/// the capture stays valid, and once it ends the same request fits.
#[test]
fn out_of_memory_during_a_capture_gives_null_and_leaves_the_capture_valid() {
    let s = setup_with(SimRuntime::builder().device_capacity(64 * MIB).build());
    let cached = s.plugin.alloc(48 * MIB, 0, 4).unwrap();
    s.plugin.free(cached, 0, 4).unwrap();
    let pool = (0, 9);
    s.plugin
        .begin_allocate_to_pool(0, pool, |handle| handle == 5)
        .unwrap();
    let capturing = s.stream(0, 5).clone();
    capturing.begin_capture().unwrap();
    let p = abi::guarded("alloc", 0, || s.plugin.alloc(32 * MIB, 0, 5));
    assert_eq!(p, 0);
    assert!(
        abi::last_error().contains("out of memory"),
        "{}",
        abi::last_error()
    );
    capturing.end_capture().expect("the capture stays valid");
    s.plugin.end_allocate_to_pool(0, pool).unwrap();
    let sim = s.plugin.allocator().runtime();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert_ne!(s.plugin.alloc(32 * MIB, 0, 5).unwrap(), 0);
}

/// `PINPOOL_DEVICE_CONF` overrides the keys it names and no others (setting one key used to
/// drop the rest of the plug-in's settings), over the device allocator's own defaults, and
/// PyTorch's `PYTORCH_CUDA_ALLOC_CONF` strings are read in PyTorch's grammar.
#[test]
fn the_device_setting_overrides_only_the_keys_it_names() {
    use crate::plugin::settings;
    let library = pinpool::config::DeviceConfig::default();
    let defaults = settings(None).unwrap();
    assert_eq!(
        defaults, library,
        "the plug-in's defaults are the library's"
    );
    let capped = settings(Some("reserve_cap:1.25")).unwrap();
    let one = settings(Some("expandable_segments:False")).unwrap();
    assert!(!one.expandable_segments);
    assert_eq!(one.thread_cache, library.thread_cache);
    assert_eq!(one.reserve_cap, library.reserve_cap);
    assert_eq!(capped.reserve_cap, Some(1.25));
    assert_eq!(capped.expandable_segments, library.expandable_segments);
    let cap = settings(Some("reserve_cap:none,thread_cache_mb:32")).unwrap();
    assert_eq!((cap.thread_cache, cap.reserve_cap), (32 << 20, None));
    let torch = settings(Some(
        "roundup_power2_divisions:[256:1,>:4],max_split_size_mb:128",
    ));
    assert!(torch.unwrap().roundup_power2_divisions_by_size.is_some());
    let err = settings(Some("thread_cache:32")).unwrap_err().to_string();
    assert!(err.contains("thread_cache_mb"), "{err}");
}

/// `Tensor.record_stream` on an empty tensor hands PyTorch's hook a null pointer: nothing to
/// do, and no failure (PyTorch's allocator ignores it too).
#[test]
fn record_stream_of_null_does_nothing_and_is_no_failure() {
    abi::set_last_error("earlier", "kept");
    crate::exports::pinpool_record_stream(std::ptr::null_mut(), std::ptr::null_mut());
    assert!(abi::last_error().contains("kept"), "{}", abi::last_error());
}

#[test]
fn only_a_call_that_failed_for_want_of_memory_is_an_out_of_memory_until_the_next_call() {
    let failed = abi::guarded("alloc", 0usize, || {
        abi::note_out_of_memory();
        Err::<usize, _>("out of memory")
    });
    assert_eq!(failed, 0);
    assert!(abi::last_was_out_of_memory());
    assert_eq!(abi::guarded("alloc", 0usize, || Ok::<_, String>(7)), 7);
    assert!(!abi::last_was_out_of_memory(), "the next call clears it");
    abi::guarded("alloc", 0usize, || Err::<usize, _>("no such device"));
    assert!(!abi::last_was_out_of_memory());
}

/// A segment as `pinpool_snapshot` hands it out: address, bytes, PyTorch pool, blocks.
type Segment = (u64, u64, [u64; 2], Vec<BlockRecord>);

/// What `pinpool_snapshot` hands PyTorch's allocator front: the segments with their blocks,
/// and the trace entries.
fn torch_snapshot(s: &Setup, pool: (u64, u64)) -> (Vec<Segment>, Vec<TraceRecord>) {
    let (snap, histories) = s._rt.block_on(s.plugin.torch_snapshot(true)).unwrap();
    let (mut segments, mut traces) = (Vec::new(), Vec::new());
    walk(
        &snap,
        &histories,
        pool,
        |seg| {
            // SAFETY: `walk` hands out `n_blocks` blocks, valid during the call.
            let blocks = unsafe { std::slice::from_raw_parts(seg.blocks, seg.n_blocks) };
            assert_eq!(
                seg.allocated_size,
                blocks
                    .iter()
                    .filter(|b| b.allocated == 1)
                    .map(|b| b.size)
                    .sum::<u64>()
            );
            assert_eq!(
                seg.active_size,
                blocks
                    .iter()
                    .filter(|b| b.active == 1)
                    .map(|b| b.size)
                    .sum::<u64>()
            );
            segments.push((seg.address, seg.total_size, seg.pool, blocks.to_vec()));
        },
        |t| traces.push(*t),
    );
    (segments, traces)
}

#[test]
fn pytorchs_snapshot_lists_every_segment_tiled_by_its_blocks_as_the_statistics_count_them() {
    let s = setup();
    let a = s.plugin.alloc(3 * MIB, 0, 3).unwrap();
    let b = s.plugin.alloc(4096, 0, 3).unwrap();
    let c = s.plugin.alloc(MIB, 1, 2).unwrap();
    s.plugin.free(b, 0, 3).unwrap();
    let (segments, _) = torch_snapshot(&s, (0, 0));
    let reserved: usize = (0..2).map(|d| s.plugin.reserved_bytes(d).unwrap()).sum();
    assert_eq!(segments.iter().map(|g| g.1).sum::<u64>(), reserved as u64);
    let allocated: i64 = (0..2)
        .map(|d| {
            s.plugin
                .stats_values(d, &["allocated_bytes.all.current"])
                .unwrap()[0]
        })
        .sum();
    let in_blocks: u64 = segments
        .iter()
        .flat_map(|g| &g.3)
        .filter(|b| b.allocated == 1)
        .map(|b| b.size)
        .sum();
    assert_eq!(in_blocks, allocated as u64);
    for (address, total, pool, blocks) in &segments {
        assert_eq!(*pool, [0, 0]);
        assert_eq!(
            blocks.iter().map(|b| b.size).sum::<u64>(),
            *total,
            "{address:#x}"
        );
    }
    // Each live allocation is one allocated block, at its address, of at least its size.
    let mut live = Vec::new();
    for (address, _, _, blocks) in &segments {
        let mut at = *address;
        for blk in blocks {
            if blk.allocated == 1 {
                live.push((at as usize, blk.size as usize, blk.requested_size as usize));
            }
            at += blk.size;
        }
    }
    live.sort();
    let mut want = vec![(a, 3 * MIB), (c, MIB)];
    want.sort();
    assert_eq!(live.len(), 2, "{live:?}");
    for ((at, size, requested), (p, bytes)) in live.iter().zip(&want) {
        assert_eq!((*at, *requested), (*p, *bytes));
        assert!(size >= bytes);
    }
    s.plugin.free(a, 0, 3).unwrap();
    s.plugin.free(c, 1, 2).unwrap();
}

#[test]
fn a_snapshot_of_a_graph_pool_lists_only_its_segments_under_pytorchs_pool_id() {
    let s = setup();
    let pool = (0, 9);
    s.plugin
        .begin_allocate_to_pool(0, pool, |handle| handle == 5)
        .unwrap();
    let inside = s.plugin.alloc(MIB, 0, 5).unwrap();
    s.plugin.end_allocate_to_pool(0, pool).unwrap();
    let outside = s.plugin.alloc(MIB, 0, 3).unwrap();
    let contains =
        |segs: &[Segment], p: usize| segs.iter().any(|g| (g.0..g.0 + g.1).contains(&(p as u64)));
    let (mine, _) = torch_snapshot(&s, pool);
    assert!(!mine.is_empty());
    assert!(mine.iter().all(|g| g.2 == [0, 9]));
    assert!(contains(&mine, inside) && !contains(&mine, outside));
    let (all, _) = torch_snapshot(&s, (0, 0));
    assert!(contains(&all, inside) && contains(&all, outside));
    s.plugin.free(inside, 0, 5).unwrap();
    s.plugin.free(outside, 0, 3).unwrap();
}

#[test]
fn pytorchs_pool_ids_come_back_from_the_pools_made_of_them() {
    for id in [(0, 0), (7, 0), (0, 7), (1 << 40, 0), (0, (1 << 61) - 1)] {
        assert_eq!(torch_pool_id(pool_id(id).0), id);
    }
}

#[test]
fn the_trace_gives_pytorchs_actions_in_order_with_requested_sizes_and_ages() {
    let s = setup();
    s.plugin
        .allocator()
        .record_history(true, 1000, pinpool::HistoryContext::None)
        .unwrap();
    let p = s.plugin.alloc(MIB + 100, 0, 3).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    let (_, traces) = torch_snapshot(&s, (0, 0));
    // The block's own entries (its segment's mapping may start at the same address).
    let of_p: Vec<&TraceRecord> = traces
        .iter()
        .filter(|t| t.addr == p as u64 && t.action <= 2)
        .collect();
    let actions: Vec<i32> = of_p.iter().map(|t| t.action).collect();
    // alloc, then free requested (free completed follows once the stream's work is done).
    assert_eq!(&actions[..2], &[0, 1], "{actions:?}");
    assert!(
        traces.iter().any(|t| t.action == 5 || t.action == 3),
        "a segment entry"
    );
    assert!(of_p
        .iter()
        .all(|t| t.size == (MIB + 100) as u64 && t.device == 0));
    assert!(traces.iter().all(|t| (0..=8).contains(&t.action)));
    // Older entries are older: the ages fall along the trace.
    assert!(of_p[0].age_us >= of_p[1].age_us && of_p[1].age_us >= 5_000);
}

/// PyTorch's `clear_history` forgets the entries recorded so far, and its `skip_actions`
/// leaves those actions out of the trace until the next call.
#[test]
fn clear_history_and_skip_actions_shape_the_trace_as_pytorchs_do() {
    let s = setup();
    let on = |clear: bool, skip: &[pinpool::TraceAction]| {
        let context = pinpool::HistoryContext::None;
        let alloc = s.plugin.allocator();
        alloc.record_history_with(true, 1000, context, clear, skip)
    };
    let actions = |s: &Setup| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        let (_, traces) = torch_snapshot(s, (0, 0));
        traces.iter().map(|t| t.action).collect::<Vec<i32>>()
    };
    on(false, &[]).unwrap();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    assert!(actions(&s).contains(&1), "free_requested recorded");

    let skip: Vec<pinpool::TraceAction> = ["free_requested", "segment_map"]
        .iter()
        .map(|name| name.parse().unwrap())
        .collect();
    on(true, &skip).unwrap();
    let kept = actions(&s);
    assert!(kept.is_empty(), "cleared: {kept:?}");
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    let skipped = actions(&s);
    assert!(skipped.contains(&0), "alloc recorded: {skipped:?}");
    assert!(
        !skipped.contains(&1),
        "free_requested left out: {skipped:?}"
    );

    on(false, &[]).unwrap();
    let p = s.plugin.alloc(MIB, 0, 3).unwrap();
    s.plugin.free(p, 0, 3).unwrap();
    let all = actions(&s);
    assert!(
        all.contains(&1),
        "the next call records every action again: {all:?}"
    );
}
