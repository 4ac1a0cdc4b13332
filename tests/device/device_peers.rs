//! Two simulated devices under one device allocator: peer access, copies between devices
//! that keep both blocks from early reuse, per-device pools and statistics, pinned memory
//! copied on one device and reused on another, and inter-process handles (which the
//! simulation refuses with a typed error).

use std::sync::Arc;
use std::time::Duration;

use pinpool::config::DeviceConfig;
use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{Builder, DeviceAllocator, DeviceBuffer, DeviceBuilder, Error, IpcHandle};

const MIB: usize = 1 << 20;

fn two_devices(sim: SimRuntime) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    (pool, sim)
}

/// The bytes of `len` bytes of device memory at `ptr`, read on `stream` (of its device).
fn read_device(sim: &SimRuntime, stream: &SimStream, ptr: u64, len: usize) -> Vec<u8> {
    let host = sim.host_alloc(len).unwrap();
    stream.copy_dtoh(ptr, host.ptr.as_ptr(), len).unwrap();
    stream.synchronize().unwrap();
    let bytes = sim.host_read(host.ptr.as_ptr(), len).unwrap();
    sim.host_free(host).unwrap();
    bytes
}

/// Allocates on `stream` until the block at `ptr` comes back (keeping the others), or
/// gives up after about a second; whether it came back.
async fn comes_back(
    pool: &DeviceAllocator<SimRuntime>,
    stream: &SimStream,
    size: usize,
    ptr: u64,
) -> bool {
    let mut held: Vec<DeviceBuffer> = Vec::new();
    for _ in 0..200 {
        let b = pool.alloc(size, stream).await.unwrap();
        if b.device_ptr() == ptr {
            return true;
        }
        held.push(b);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

#[tokio::test]
async fn a_peer_copy_moves_bytes_from_device_0_to_device_1_either_way() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    pool.enable_peer_access(1, 0).unwrap();
    assert!(pool.peer_access_enabled(1, 0));
    assert!(!pool.peer_access_enabled(0, 1), "one way only");
    for (p2p, on) in [(false, &s0), (true, &s1), (false, &s1)] {
        let mut src = pool.alloc(MIB, &s0).await.unwrap();
        let mut dst = pool.alloc(MIB, &s1).await.unwrap();
        assert_eq!((src.device(), dst.device()), (0, 1));
        s0.fill_device(src.device_ptr(), MIB, 0x5a).unwrap();
        s0.synchronize().unwrap();
        pool.memcpy_async(&mut dst, &mut src, MIB / 2, on, p2p)
            .unwrap();
        on.synchronize().unwrap();
        let got = read_device(&sim, &s1, dst.device_ptr(), MIB);
        assert!(got[..MIB / 2].iter().all(|&b| b == 0x5a), "p2p {p2p}");
        assert!(got[MIB / 2..].iter().all(|&b| b != 0x5a), "only n bytes");
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// PyTorch enables peer access when a program first copies between two GPUs, long after
/// memory was mapped: the mapped memory of both devices' expandable ranges, old and new (and
/// moved after the grant), must be reachable by the peer's direct copy.
#[tokio::test]
async fn memory_mapped_before_peer_access_is_enabled_is_reached_by_the_peers_copies() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let mut old_src = pool.alloc(3 * MIB, &s0).await.unwrap();
    let mut old_dst = pool.alloc(3 * MIB, &s1).await.unwrap();
    s0.fill_device(old_src.device_ptr(), 3 * MIB, 0x3c).unwrap();
    s0.synchronize().unwrap();
    pool.enable_peer_access(1, 0).unwrap();
    pool.enable_peer_access(0, 1).unwrap();
    let mut new_src = pool.alloc(40 * MIB, &s0).await.unwrap();
    s0.fill_device(new_src.device_ptr(), 40 * MIB, 0x3d)
        .unwrap();
    s0.synchronize().unwrap();
    let mut new_dst = pool.alloc(40 * MIB, &s1).await.unwrap();
    // On device 1's stream (reaching device 0's memory) and on device 0's (reaching 1's).
    pool.memcpy_async(&mut old_dst, &mut old_src, 3 * MIB, &s1, true)
        .unwrap();
    pool.memcpy_async(&mut new_dst, &mut new_src, 40 * MIB, &s0, true)
        .unwrap();
    s0.synchronize().unwrap();
    pool.memcpy_async(&mut new_dst, &mut old_src, MIB, &s1, true)
        .unwrap();
    s1.synchronize().unwrap();
    let old = read_device(&sim, &s1, old_dst.device_ptr(), 3 * MIB);
    assert!(old.iter().all(|&b| b == 0x3c));
    let new = read_device(&sim, &s1, new_dst.device_ptr(), 40 * MIB);
    assert!(new[..MIB].iter().all(|&b| b == 0x3c));
    assert!(new[MIB..].iter().all(|&b| b == 0x3d));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn a_destination_freed_right_after_a_peer_copy_is_not_reused_before_the_copy_runs() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let mut src = pool.alloc(MIB, &s0).await.unwrap();
    s0.fill_device(src.device_ptr(), MIB, 7).unwrap();
    let mut dst = pool.alloc(MIB, &s1).await.unwrap();
    let dst_ptr = dst.device_ptr();
    let hold = s0.hold();
    pool.memcpy_async(&mut dst, &mut src, MIB, &s0, false)
        .unwrap();
    assert_eq!(dst.recorded_streams(), vec![s0.id()]);
    assert!(src.recorded_streams().is_empty(), "s0 owns src");
    drop(dst); // the copy into it is still queued on s0
    let again = pool.alloc(MIB, &s1).await.unwrap();
    assert_ne!(
        again.device_ptr(),
        dst_ptr,
        "handed out under a queued copy"
    );
    s1.fill_device(again.device_ptr(), MIB, 9).unwrap();
    drop(hold);
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert!(
        comes_back(&pool, &s1, MIB, dst_ptr).await,
        "reusable once the copy ran"
    );
}

#[tokio::test]
async fn a_source_freed_right_after_a_peer_copy_is_not_reused_before_the_copy_runs() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let mut src = pool.alloc(MIB, &s0).await.unwrap();
    let src_ptr = src.device_ptr();
    s0.fill_device(src_ptr, MIB, 3).unwrap();
    s0.synchronize().unwrap();
    let mut dst = pool.alloc(MIB, &s1).await.unwrap();
    let hold = s1.hold();
    pool.memcpy_async(&mut dst, &mut src, MIB, &s1, false)
        .unwrap();
    drop(src); // s1 still has to read it
    let again = pool.alloc(MIB, &s0).await.unwrap();
    assert_ne!(
        again.device_ptr(),
        src_ptr,
        "handed out under a queued copy"
    );
    s0.fill_device(again.device_ptr(), MIB, 4).unwrap();
    s0.synchronize().unwrap();
    drop(hold);
    s1.synchronize().unwrap();
    assert!(read_device(&sim, &s1, dst.device_ptr(), MIB)
        .iter()
        .all(|&b| b == 3));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// The control of the two tests above: the same copy enqueued behind the allocator's back
/// (no stream recorded) lets the block go to its stream at once, and the simulation
/// catches the early reuse.
#[tokio::test]
async fn a_peer_copy_made_behind_the_allocators_back_is_caught_as_early_reuse() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let src = pool.alloc(MIB, &s0).await.unwrap();
    s0.fill_device(src.device_ptr(), MIB, 7).unwrap();
    let dst = pool.alloc(MIB, &s1).await.unwrap();
    let dst_ptr = dst.device_ptr();
    let hold = s0.hold();
    s0.copy_dtod(src.device_ptr(), dst_ptr, MIB).unwrap();
    drop(dst);
    let again = pool.alloc(MIB, &s1).await.unwrap();
    assert_eq!(again.device_ptr(), dst_ptr, "nothing told the pool to wait");
    s1.fill_device(dst_ptr, MIB, 9).unwrap();
    s1.synchronize().unwrap();
    drop(hold);
    s0.synchronize().unwrap();
    assert!(sim.violations() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_stream_delays_never_let_a_freed_source_be_refilled_before_its_copy_ran() {
    let sim = SimRuntime::builder().devices(2).build();
    sim.set_random_delays(17, Duration::from_millis(1));
    let (pool, sim) = two_devices(sim);
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    pool.enable_peer_access(1, 0).unwrap();
    const SIZE: usize = 256 * 1024;
    let mut copies = Vec::new();
    for round in 1..=40u8 {
        // The source, filled on its own stream; the copy runs on device 1's stream, and
        // the source is freed at once: the next round asks its stream for the same size
        // and fills what it gets.
        let mut src = pool.alloc(SIZE, &s0).await.unwrap();
        s0.fill_device(src.device_ptr(), SIZE, round).unwrap();
        s0.synchronize().unwrap();
        let mut dst = pool.alloc(SIZE, &s1).await.unwrap();
        pool.memcpy_async(&mut dst, &mut src, SIZE, &s1, round % 2 == 0)
            .unwrap();
        drop(src);
        copies.push((dst, round));
    }
    s1.synchronize().unwrap();
    for (dst, round) in &copies {
        let got = read_device(&sim, &s1, dst.device_ptr(), SIZE);
        assert!(
            got.iter().all(|b| b == round),
            "round {round} copied another round's bytes"
        );
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn bad_peers_and_bad_copies_are_typed_errors_and_change_nothing() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(3).build());
    assert!(matches!(
        pool.enable_peer_access(0, 3),
        Err(Error::NoSuchDevice {
            ordinal: 3,
            count: 3
        })
    ));
    assert!(matches!(
        pool.enable_peer_access(9, 0),
        Err(Error::NoSuchDevice { ordinal: 9, .. })
    ));
    pool.enable_peer_access(2, 2).unwrap(); // itself: nothing to do
    let (s0, s1, s2) = (
        sim.stream_on(0).unwrap(),
        sim.stream_on(1).unwrap(),
        sim.stream_on(2).unwrap(),
    );
    let mut a = pool.alloc(MIB, &s0).await.unwrap();
    let mut b = pool.alloc(MIB / 2, &s1).await.unwrap();
    let err = pool.memcpy_async(&mut b, &mut a, MIB, &s0, false);
    assert!(matches!(err, Err(Error::CopyOutOfRange { .. })), "{err:?}");
    let err = pool.memcpy_async(&mut b, &mut a, 16, &s2, false);
    assert!(
        matches!(
            err,
            Err(Error::StreamOnOtherDevice {
                stream_device: 2,
                dst_device: 1,
                src_device: 0
            })
        ),
        "{err:?}"
    );
    let err = pool.memcpy_async(&mut b, &mut a, 16, &s0, true);
    assert!(
        matches!(err, Err(Error::PeerAccessNotEnabled { device: 0, peer: 1 })),
        "{err:?}"
    );
    assert!(a.recorded_streams().is_empty() && b.recorded_streams().is_empty());
    // A buffer of another allocator on the same runtime.
    let other = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let mut foreign = other.alloc(MIB, &s1).await.unwrap();
    let err = pool.memcpy_async(&mut foreign, &mut a, 16, &s0, false);
    assert!(matches!(err, Err(Error::ForeignBuffer)), "{err:?}");
    assert!(a.recorded_streams().is_empty() && foreign.recorded_streams().is_empty());
    assert_eq!(sim.violations(), 0);
}

#[tokio::test]
async fn devices_without_a_peer_path_refuse_peer_access_but_still_copy_staged() {
    let sim = SimRuntime::builder()
        .devices(2)
        .without_peer_access()
        .build();
    let (pool, sim) = two_devices(sim);
    assert!(matches!(
        pool.enable_peer_access(0, 1),
        Err(Error::PeerAccessUnsupported { device: 0, peer: 1 })
    ));
    assert!(!pool.peer_access_enabled(0, 1));
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let mut src = pool.alloc(4096, &s0).await.unwrap();
    s0.fill_device(src.device_ptr(), 4096, 1).unwrap();
    s0.synchronize().unwrap();
    let mut dst = pool.alloc(4096, &s1).await.unwrap();
    assert!(matches!(
        pool.memcpy_async(&mut dst, &mut src, 4096, &s0, true),
        Err(Error::PeerAccessNotEnabled { .. })
    ));
    pool.memcpy_async(&mut dst, &mut src, 4096, &s0, false)
        .unwrap();
    s0.synchronize().unwrap();
    assert!(read_device(&sim, &s1, dst.device_ptr(), 4096)
        .iter()
        .all(|&b| b == 1));
}

/// With `torchrun` every rank sees every GPU and uses one: a device is started (on a GPU,
/// its context retained) only when used, and settings made for every device before then
/// reach it when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_devices_used_are_started_and_every_device_setting_reaches_them() {
    let sim = SimRuntime::builder()
        .devices(4)
        .device_capacity(64 * MIB)
        .build();
    let (pool, sim) = two_devices(sim);
    let ooms = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = ooms.clone();
    pool.attach_oom_observer(move |_| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    pool.record_history(true, 100, pinpool::HistoryContext::None)
        .unwrap();
    pool.record_annotation("before any device");
    // Questions about devices not used yet start none of them.
    assert_eq!(pool.stats(3).unwrap().allocated_bytes.all.current, 0);
    assert_eq!(pool.reserved_bytes(1).unwrap(), 0);
    assert!(pool.history(0).await.unwrap().entries.is_empty());
    assert!(pool.history(0).await.unwrap().enabled);
    pool.reset_peak_stats(3).unwrap();
    pool.empty_cache().await.unwrap();
    assert!((0..4).all(|d| sim.device_opened(d) == Some(false)));
    assert!(matches!(
        pool.stats(4),
        Err(Error::NoSuchDevice { ordinal: 4, .. })
    ));

    let s2 = sim.stream_on(2).unwrap();
    let held = pool.try_alloc(40 * MIB, &s2).await.unwrap();
    let opened: Vec<bool> = (0..4).map(|d| sim.device_opened(d).unwrap()).collect();
    assert_eq!(opened, [false, false, true, false]);
    let history = pool.history(2).await.unwrap();
    assert!(
        history.enabled && !history.entries.is_empty(),
        "set before it started"
    );
    let err = pool.try_alloc(40 * MIB, &s2).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    // Observers are called off the requester's thread.
    let start = std::time::Instant::now();
    while ooms.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "observer not called"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let snap = pool.snapshot().await.unwrap();
    assert!(snap.segments.iter().all(|s| s.device == Some(2)));
    drop(held);
    assert_eq!(sim.violations(), 0);
}

/// Threads that start one device at once while observers are attached to every device:
/// each observer ends attached to the device's engine exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observers_attached_while_a_device_starts_are_attached_exactly_once() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const OBSERVERS: usize = 20;
    for _ in 0..10 {
        let sim = SimRuntime::builder()
            .devices(2)
            .device_capacity(64 * MIB)
            .build();
        let (pool, sim) = two_devices(sim);
        let calls = Arc::new(AtomicUsize::new(0));
        let starters: Vec<_> = (0..4)
            .map(|_| {
                let (pool, stream) = (pool.clone(), sim.stream_on(1).unwrap());
                tokio::spawn(async move { drop(pool.alloc(MIB, &stream).await.unwrap()) })
            })
            .collect();
        for _ in 0..OBSERVERS {
            let calls = calls.clone();
            pool.attach_oom_observer(move |_| {
                calls.fetch_add(1, SeqCst);
            });
            tokio::task::yield_now().await;
        }
        for s in starters {
            s.await.unwrap();
        }
        let s1 = sim.stream_on(1).unwrap();
        let held = pool.try_alloc(40 * MIB, &s1).await.unwrap();
        assert!(pool.try_alloc(40 * MIB, &s1).await.is_err());
        let start = std::time::Instant::now();
        while calls.load(SeqCst) < OBSERVERS && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(calls.load(SeqCst), OBSERVERS, "each observer once");
        drop(held);
    }
}

#[tokio::test]
async fn one_allocator_keeps_each_devices_pools_and_statistics_apart() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let a = pool.alloc(3 * MIB, &s0).await.unwrap();
    let b = pool.alloc(5 * MIB, &s1).await.unwrap();
    let c = pool.alloc(5 * MIB, &s1).await.unwrap();
    assert_eq!((a.device(), b.device(), c.device()), (0, 1, 1));
    let (st0, st1) = (pool.stats(0).unwrap(), pool.stats(1).unwrap());
    assert_eq!(st0.allocated_bytes.all.current, 3 * MIB as i64);
    assert_eq!(st1.allocated_bytes.all.current, 10 * MIB as i64);
    assert_eq!(
        (st0.allocation.all.current, st1.allocation.all.current),
        (1, 2)
    );
    assert!(sim.device_used(0).unwrap() >= 3 * MIB && sim.device_used(0).unwrap() < 10 * MIB);
    assert!(sim.device_used(1).unwrap() >= 10 * MIB);
    // Freeing on device 1 leaves device 0's books alone; a size device 1 freed is not
    // served to device 0 from device 1's cache.
    drop((b, c));
    assert_eq!(pool.stats(1).unwrap().allocated_bytes.all.current, 0);
    assert_eq!(
        pool.stats(0).unwrap().allocated_bytes.all.current,
        3 * MIB as i64
    );
    let d = pool.alloc(5 * MIB, &s0).await.unwrap();
    assert_eq!(d.device(), 0);
    assert_eq!(
        pool.stats(0).unwrap().allocated_bytes.all.current,
        8 * MIB as i64
    );
    pool.reset_peak_stats(1).unwrap();
    assert_eq!(pool.stats(1).unwrap().allocated_bytes.all.peak, 0);
    assert_eq!(
        pool.stats(0).unwrap().allocated_bytes.all.peak,
        8 * MIB as i64
    );
    drop((a, d));
    let cached_1 = pool.reserved_bytes(1).unwrap();
    assert!(cached_1 >= 10 * MIB);
    pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .empty_cache()
        .await
        .unwrap();
    assert_eq!(pool.reserved_bytes(0).unwrap(), 0);
    assert_eq!(
        pool.reserved_bytes(1).unwrap(),
        cached_1,
        "device 1 untouched"
    );
    pool.empty_cache().await.unwrap();
    assert_eq!((sim.device_used(0), sim.device_used(1)), (Some(0), Some(0)));
}

/// PyTorch's `test_caching_pinned_memory_multi_gpu`: pinned memory copied from on device
/// 1's stream and freed is reused (and copied from on device 0) only after that copy ran.
#[tokio::test]
async fn pinned_memory_copied_on_device_1_is_reused_on_device_0_only_after_the_copy_ran() {
    let sim = SimRuntime::builder().devices(2).build();
    let pinned = Builder::new(Arc::new(sim.clone())).build().unwrap();
    let (devices, _) = two_devices(sim.clone());
    let (s0, s1) = (sim.stream_on(0).unwrap(), sim.stream_on(1).unwrap());
    let d1 = devices.alloc(MIB, &s1).await.unwrap();
    let d0 = devices.alloc(MIB, &s0).await.unwrap();

    let mut host = pinned.alloc(MIB).await.unwrap();
    host.fill(1);
    let host_ptr = host.as_ptr();
    let hold = s1.hold();
    s1.copy_htod(host_ptr, d1.device_ptr(), MIB).unwrap();
    host.record_stream(&s1).unwrap();
    drop(host);
    let mut next = pinned.alloc(MIB).await.unwrap();
    assert_ne!(
        next.as_ptr(),
        host_ptr,
        "reused while device 1's copy was queued"
    );
    next.fill(2);
    drop(hold);
    s1.synchronize().unwrap();
    assert!(read_device(&sim, &s1, d1.device_ptr(), MIB)
        .iter()
        .all(|&b| b == 1));

    // Once the copy ran, the block comes back, and device 0 copies from it.
    let mut held = vec![next];
    let reused = loop {
        let b = pinned.alloc(MIB).await.unwrap();
        if b.as_ptr() == host_ptr {
            break b;
        }
        assert!(held.len() < 200, "the block never came back");
        held.push(b);
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let mut reused = reused;
    reused.fill(3);
    s0.copy_htod(reused.as_ptr(), d0.device_ptr(), MIB).unwrap();
    reused.record_stream(&s0).unwrap();
    drop(reused);
    s0.synchronize().unwrap();
    assert!(read_device(&sim, &s0, d0.device_ptr(), MIB)
        .iter()
        .all(|&b| b == 3));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn ipc_on_the_simulated_runtime_is_a_typed_not_supported_error() {
    let (pool, sim) = two_devices(SimRuntime::builder().devices(2).build());
    let s1 = sim.stream_on(1).unwrap();
    // Separate segments: the layout IPC needs, refused by the runtime itself.
    let config: DeviceConfig = "expandable_segments:false".parse().unwrap();
    let segments = DeviceBuilder::new(Arc::new(sim.clone()))
        .config(&config)
        .build()
        .unwrap();
    let buf = segments.alloc(MIB, &s1).await.unwrap();
    match segments.ipc_handle(&buf) {
        Err(Error::NotSupported { operation, reason }) => {
            assert_eq!(operation, "ipc_handle");
            assert!(reason.contains("sim"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let handle = IpcHandle::new([1; 64], 0, MIB as u64, 1);
    assert!(matches!(
        pool.open_ipc(&handle),
        Err(Error::NotSupported {
            operation: "open_ipc",
            ..
        })
    ));
    assert!(matches!(
        pool.open_ipc(&IpcHandle::from_bytes(&handle.to_bytes()).unwrap()),
        Err(Error::NotSupported { .. })
    ));
    assert_eq!(pool.ipc_open_segments(), 0);
}

#[tokio::test]
async fn a_block_of_an_expandable_segment_cannot_be_exported_and_the_error_names_the_setting() {
    let (pool, sim) = two_devices(SimRuntime::new());
    assert!(pool.config().expandable_segments);
    let s = sim.stream();
    let buf = pool.alloc(MIB, &s).await.unwrap();
    match pool.ipc_handle(&buf) {
        Err(Error::NotSupported { reason, .. }) => {
            assert!(reason.contains("expandable_segments:false"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let empty = pool.alloc(0, &s).await.unwrap();
    assert!(matches!(
        pool.ipc_handle(&empty),
        Err(Error::NotSupported { .. })
    ));
}

#[tokio::test]
async fn bad_ipc_handles_are_typed_errors() {
    let (pool, _sim) = two_devices(SimRuntime::builder().devices(2).build());
    assert!(matches!(
        IpcHandle::from_bytes(b"garbage"),
        Err(Error::InvalidIpcHandle { .. })
    ));
    let mut bytes = IpcHandle::new([1; 64], 0, 512, 0).to_bytes();
    bytes[3] = b'X';
    assert!(matches!(
        IpcHandle::from_bytes(&bytes),
        Err(Error::InvalidIpcHandle { .. })
    ));
    // A device this process does not have.
    let far = IpcHandle::new([1; 64], 0, 512, 5);
    assert!(matches!(
        pool.open_ipc(&far),
        Err(Error::NoSuchDevice {
            ordinal: 5,
            count: 2
        })
    ));
    assert_eq!(pool.ipc_open_segments(), 0);
}
