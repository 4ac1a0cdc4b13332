//! Inter-process handles, peer copies and two GPUs, on real GPUs (feature `cuda`).
//!
//! Each test first checks `cuda_available()` and prints `<test>: skipped: ...` and passes
//! where there is no GPU; the two-GPU tests skip the same way with fewer than two. The IPC
//! tests run the `ipc_peer` example as the other process: they look for it in
//! `$PINPOOL_IPC_PEER`, next to the test binary (where `scripts/gpu-tests.sh build` puts
//! it), and in the target directory's `examples/`. Run:
//! `cargo build --release --features cuda --example ipc_peer &&
//!  cargo test --release --features cuda --test gpu_ipc_peer -- --test-threads=1 --nocapture`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, CudaContext, CudaStream};
use pinpool::config::DeviceConfig;
use pinpool::cuda::{cuda_available, device_count, CudaRuntime};
use pinpool::{DeviceAllocator, Error, PinnedAllocator};

#[path = "common/kernels.rs"]
mod kernels;
use kernels::Kernels;

const MIB: usize = 1 << 20;

/// A device allocator on the GPU with whole `cuMemAlloc` segments (the layout IPC
/// needs), or `None` (after saying so) where there is none.
fn gpu(test: &str, devices: usize) -> Option<DeviceAllocator<CudaRuntime>> {
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return None;
    }
    let count = device_count().unwrap_or(0);
    if count < devices {
        println!("{test}: skipped: {count} GPU(s), needs {devices}");
        return None;
    }
    let config: DeviceConfig = "expandable_segments:false".parse().unwrap();
    let builder = DeviceAllocator::builder()
        .cuda()
        .expect("the GPU did not start");
    Some(builder.config(&config).build().expect("allocator"))
}

/// The `ipc_peer` example binary, or `None` (after saying so).
fn peer_binary(test: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.to_path_buf();
    let candidates = [
        std::env::var_os("PINPOOL_IPC_PEER").map(PathBuf::from),
        Some(dir.join("ipc_peer")),
        dir.parent().map(|p| p.join("examples").join("ipc_peer")),
    ];
    let found = candidates.into_iter().flatten().find(|p| p.is_file());
    if found.is_none() {
        println!(
            "{test}: skipped: no ipc_peer binary (build it: cargo build --release --features cuda --example ipc_peer)"
        );
    }
    found
}

/// A byte pattern that differs from position to position and from seed to seed (the
/// example's).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 17) as u8)
        .collect()
}

fn write(stream: &Arc<CudaStream>, ptr: u64, bytes: &[u8]) {
    stream.synchronize().unwrap();
    stream.context().bind_to_thread().unwrap();
    // SAFETY: the callers pass live device memory of at least `bytes.len()` bytes.
    unsafe { result::memcpy_htod_sync(ptr, bytes) }.unwrap();
}

fn read(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Vec<u8> {
    stream.synchronize().unwrap();
    stream.context().bind_to_thread().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: the callers pass live device memory of at least `len` bytes.
    unsafe { result::memcpy_dtoh_sync(&mut out, ptr) }.unwrap();
    out
}

/// Keeps `stream` busy for `ms` milliseconds of GPU time (the kernels are loaded into the
/// stream's context on each call: tests are short).
fn spin(stream: &Arc<CudaStream>, ms: u64) {
    Kernels::load(stream).spin(stream, ms);
}

/// Runs `ipc_peer open` on `handle`, expecting `expect` and writing `write`.
fn run_peer(binary: &PathBuf, handle: &pinpool::IpcHandle, expect: u8, write: u8) {
    let out = Command::new(binary)
        .args([
            "open",
            &handle.to_hex(),
            &expect.to_string(),
            &write.to_string(),
        ])
        .output()
        .expect("ipc_peer runs");
    println!(
        "ipc_peer: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "ipc_peer failed: {:?}", out.status);
}

/// Exports a block of device `device` and has another process read and write it.
async fn round_trip(test: &str, device: usize) {
    let Some(pool) = gpu(test, device + 1) else {
        return;
    };
    let Some(binary) = peer_binary(test) else {
        return;
    };
    let ctx = CudaContext::new(device).unwrap();
    let stream = ctx.new_stream().unwrap();
    // Two small blocks: the second lies inside the first one's segment, past offset 0.
    let first = pool.alloc(64 * 1024, &stream).await.unwrap();
    let buf = pool.alloc(64 * 1024, &stream).await.unwrap();
    assert_eq!(buf.device(), device);
    write(&stream, buf.device_ptr(), &pattern(buf.len(), 1));
    let handle = pool.ipc_handle(&buf).unwrap();
    let first_handle = pool.ipc_handle(&first).unwrap();
    println!(
        "{test}: offsets {} and {}; same segment handle: {}",
        first_handle.offset(),
        handle.offset(),
        first_handle.segment_handle() == handle.segment_handle()
    );
    assert_eq!((handle.len(), handle.device()), (64 * 1024, device));
    run_peer(&binary, &handle, 1, 2);
    assert_eq!(
        read(&stream, buf.device_ptr(), buf.len()),
        pattern(buf.len(), 2),
        "the other process's writes"
    );
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_exported_to_another_process_is_read_and_written_there() {
    round_trip(
        "a_block_exported_to_another_process_is_read_and_written_there",
        0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_of_the_second_gpu_is_exported_and_opened_on_that_gpu() {
    round_trip(
        "a_block_of_the_second_gpu_is_exported_and_opened_on_that_gpu",
        1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_whose_process_has_exited_is_a_typed_error() {
    let test = "a_handle_whose_process_has_exited_is_a_typed_error";
    let Some(pool) = gpu(test, 1) else { return };
    let Some(binary) = peer_binary(test) else {
        return;
    };
    let out = Command::new(&binary)
        .args(["export", "5"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hex = String::from_utf8_lossy(&out.stdout);
    let handle: pinpool::IpcHandle = hex.trim().parse().unwrap();
    let err = pool.open_ipc(&handle).unwrap_err();
    println!("{test}: {err}");
    assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err:?}");
    assert_eq!(pool.ipc_open_segments(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_this_processs_own_handle_or_garbage_is_a_typed_error() {
    let test = "opening_this_processs_own_handle_or_garbage_is_a_typed_error";
    let Some(pool) = gpu(test, 1) else { return };
    let stream = pool.runtime().context().new_stream().unwrap();
    let buf = pool.alloc(MIB, &stream).await.unwrap();
    let handle = pool.ipc_handle(&buf).unwrap();
    let err = pool.open_ipc(&handle).unwrap_err();
    println!("{test}: {err}");
    assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err:?}");
    assert!(matches!(
        pinpool::IpcHandle::from_bytes(b"\x00\x01garbage"),
        Err(Error::InvalidIpcHandle { .. })
    ));
}

/// A device allocator of the default layout (an expandable range per stream), or `None`
/// (after saying so) where there is no GPU or the device cannot map memory.
fn expandable(test: &str) -> Option<DeviceAllocator<CudaRuntime>> {
    if !cuda_available() {
        println!("{test}: skipped: no CUDA driver/GPU");
        return None;
    }
    let config: DeviceConfig = "expandable_segments:true".parse().unwrap();
    let pool = DeviceAllocator::builder()
        .cuda()
        .unwrap()
        .config(&config)
        .build()
        .unwrap();
    let engine = pinpool::tuning::device_engine(&pool, 0).unwrap();
    let granule = engine.memory().granularity();
    if granule.is_none() {
        println!("{test}: skipped: the device cannot map memory (no expandable segments)");
        return None;
    }
    Some(pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_of_an_expandable_segment_is_refused_with_the_setting_to_change() {
    let test = "a_block_of_an_expandable_segment_is_refused_with_the_setting_to_change";
    let Some(pool) = expandable(test) else { return };
    let stream = pool.runtime().context().new_stream().unwrap();
    let buf = pool.alloc(MIB, &stream).await.unwrap();
    match pool.ipc_handle(&buf) {
        Ok(handle) => {
            // The export this test covers is the fallback of drivers without it.
            assert!(!handle.mapped_handles().is_empty());
            println!(
                "{test}: skipped: the driver exports expandable memory as file descriptors \
                 (a_block_of_the_default_layout_is_read_and_written_by_another_process)"
            );
        }
        Err(Error::NotSupported { reason, .. }) => {
            assert!(reason.contains("expandable_segments:false"), "{reason}")
        }
        Err(other) => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_of_the_default_layout_is_read_and_written_by_another_process() {
    let test = "a_block_of_the_default_layout_is_read_and_written_by_another_process";
    let Some(pool) = expandable(test) else { return };
    let Some(binary) = peer_binary(test) else {
        return;
    };
    let stream = pool.runtime().context().new_stream().unwrap();
    // Two blocks of one range: the second starts past the range's first byte.
    let first = pool.alloc(64 * 1024, &stream).await.unwrap();
    let buf = pool.alloc(3 * MIB, &stream).await.unwrap();
    write(&stream, buf.device_ptr(), &pattern(buf.len(), 3));
    let handle = match pool.ipc_handle(&buf) {
        Ok(h) => h,
        Err(Error::NotSupported { reason, .. }) => {
            println!("{test}: skipped: the driver cannot export file descriptors: {reason}");
            return;
        }
        Err(other) => panic!("{other:?}"),
    };
    println!("{test}: {handle:?}");
    assert_eq!(handle.segment_handle(), None);
    assert!(!handle.mapped_handles().is_empty());
    assert_eq!((handle.len(), handle.device()), (3 * MIB as u64, 0));
    assert_eq!(
        pool.ipc_handle(&buf).unwrap(),
        handle,
        "a second export of a buffer gives the same handle (the same descriptors)"
    );
    // Through the hex form, in another process.
    run_peer(&binary, &handle, 3, 4);
    assert_eq!(
        read(&stream, buf.device_ptr(), buf.len()),
        pattern(buf.len(), 4),
        "the other process's writes"
    );
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_layout_handle_whose_process_has_exited_is_a_typed_error() {
    let test = "a_default_layout_handle_whose_process_has_exited_is_a_typed_error";
    let Some(pool) = expandable(test) else { return };
    let Some(binary) = peer_binary(test) else {
        return;
    };
    let out = Command::new(&binary)
        .args(["export", "6", "expandable"])
        .output()
        .unwrap();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("expandable_segments:false"), "{stderr}");
        println!("{test}: skipped: the driver cannot export file descriptors: {stderr}");
        return;
    }
    let hex = String::from_utf8_lossy(&out.stdout);
    let handle: pinpool::IpcHandle = hex.trim().parse().unwrap();
    assert_eq!(handle.segment_handle(), None);
    let err = pool.open_ipc(&handle).unwrap_err();
    println!("{test}: {err}");
    assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err:?}");
    assert_eq!(pool.ipc_open_segments(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_copy_between_two_gpus_moves_bytes_and_keeps_both_blocks_from_early_reuse() {
    let test = "a_peer_copy_between_two_gpus_moves_bytes_and_keeps_both_blocks_from_early_reuse";
    let Some(pool) = gpu(test, 2) else { return };
    peer_copy(test, pool).await;
}

/// The same copies between blocks of expandable ranges (the default layout), whose mapped
/// memory a peer reaches only if the mapping grants it access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_copy_between_expandable_ranges_of_two_gpus_moves_bytes() {
    let test = "a_peer_copy_between_expandable_ranges_of_two_gpus_moves_bytes";
    let Some(_) = gpu(test, 2) else { return };
    let pool = DeviceAllocator::builder()
        .cuda()
        .expect("the GPU did not start")
        .config(&"expandable_segments:true".parse().unwrap())
        .build()
        .expect("allocator");
    peer_copy(test, pool).await;
}

async fn peer_copy(test: &str, pool: DeviceAllocator<CudaRuntime>) {
    let s0 = CudaContext::new(0).unwrap().new_stream().unwrap();
    let s1 = CudaContext::new(1).unwrap().new_stream().unwrap();
    let p2p = match pool.enable_peer_access(0, 1) {
        Ok(()) => true,
        Err(Error::PeerAccessUnsupported { .. }) => {
            println!("{test}: no peer path between GPU 0 and 1: staged copies only");
            false
        }
        Err(e) => panic!("{e:?}"),
    };
    assert!(matches!(
        pool.enable_peer_access(0, 2 + device_count().unwrap()),
        Err(Error::NoSuchDevice { .. })
    ));
    let mut src = pool.alloc(MIB, &s0).await.unwrap();
    write(&s0, src.device_ptr(), &pattern(MIB, 3));
    let mut dst = pool.alloc(MIB, &s1).await.unwrap();
    let dst_ptr = dst.device_ptr();
    // The copy waits behind a kernel on device 0's stream; the destination, freed at
    // once, must not go back to device 1's stream before the copy has run.
    spin(&s0, 300);
    pool.memcpy_async(&mut dst, &mut src, MIB, &s0, p2p)
        .unwrap();
    drop(dst);
    let again = pool.alloc(MIB, &s1).await.unwrap();
    assert_ne!(
        again.device_ptr(),
        dst_ptr,
        "handed out under a queued copy"
    );
    s0.synchronize().unwrap();
    // A copy of the source into a block we keep, to read the bytes.
    let mut kept = pool.alloc(MIB, &s1).await.unwrap();
    pool.memcpy_async(&mut kept, &mut src, MIB, &s1, false)
        .unwrap();
    assert_eq!(read(&s1, kept.device_ptr(), MIB), pattern(MIB, 3));
    // Once the copy ran, the destination block is reusable again (its event completed; it
    // may come back at another address once its free range has merged with a neighbour):
    // with every other block of device 1 freed, nothing there is active, and emptying the
    // cache gives all of device 1's memory back.
    drop((again, kept));
    let start = std::time::Instant::now();
    while pool.stats(1).unwrap().active.all.current > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the destination never came back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pool.empty_cache().await.unwrap();
    assert_eq!(pool.stats(1).unwrap().reserved_bytes.all.current, 0);
}

/// PyTorch's `test_caching_pinned_memory_multi_gpu`: pinned memory copied from on GPU 1 is
/// handed out again only once that copy has run (its event is recorded in GPU 1's context).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_memory_copied_on_the_second_gpu_is_reused_only_after_the_copy() {
    let test = "pinned_memory_copied_on_the_second_gpu_is_reused_only_after_the_copy";
    if gpu(test, 2).is_none() {
        return;
    }
    let pinned = PinnedAllocator::builder().cuda(0).unwrap().build().unwrap();
    let s1 = CudaContext::new(1).unwrap().new_stream().unwrap();
    let mut device = s1.alloc_zeros::<u8>(MIB).unwrap();
    let mut buf = pinned.alloc(MIB).await.unwrap();
    buf.fill(9);
    let ptr = buf.as_ptr();
    spin(&s1, 300);
    buf.copy_to_device(&s1, &mut device).unwrap();
    drop(buf);
    let next = pinned.alloc(MIB).await.unwrap();
    assert_ne!(next.as_ptr(), ptr, "reused while GPU 1's copy was queued");
    s1.synchronize().unwrap();
    assert!(s1.clone_dtoh(&device).unwrap().iter().all(|&b| b == 9));
    let mut held = vec![next];
    let mut back = false;
    for _ in 0..200 {
        let b = pinned.alloc(MIB).await.unwrap();
        back = b.as_ptr() == ptr;
        held.push(b);
        if back {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(back, "the pinned block never came back after the copy");
}
