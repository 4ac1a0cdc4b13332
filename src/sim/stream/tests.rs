//! Tests of `SimStream`: enqueue order, holds and delays, copies and the violations they
//! catch, and capture.

use super::super::ViolationKind;
use super::*;
use crate::actors::{MemorySource, Region, Runtime};
use std::time::Instant;

fn setup(size: usize) -> (SimRuntime, SimStream, Region) {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    let mem = sim.host_alloc(size).unwrap();
    (sim, stream, mem)
}

#[test]
fn operations_run_in_enqueue_order() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let (first, second) = (SimDeviceBuffer::new(4), SimDeviceBuffer::new(4));
    stream.write_host(p, 4, 1).unwrap();
    stream.copy_to_device(p, 4, &first).unwrap();
    stream.write_host(p, 4, 2).unwrap();
    stream.copy_to_device(p, 4, &second).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(first.to_vec(), [1; 4]);
    assert_eq!(second.to_vec(), [2; 4]);
    assert_eq!(sim.host_read(p, 4).unwrap(), [2; 4]);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    sim.host_free(mem).unwrap();
}

#[test]
fn a_stream_is_idle_only_once_everything_queued_on_it_has_run() {
    let (_sim, stream, _mem) = setup(4);
    assert!(stream.is_idle(), "nothing queued");
    let hold = stream.hold();
    assert!(!stream.is_idle(), "held");
    stream.delay(std::time::Duration::from_millis(1));
    drop(hold);
    stream.synchronize().unwrap();
    assert!(stream.is_idle(), "everything ran");
    stream.delay(std::time::Duration::from_millis(200));
    assert!(!stream.is_idle(), "a kernel still running");
    stream.synchronize().unwrap();
    assert!(stream.is_idle());
}

#[test]
fn hold_keeps_later_operations_queued_until_released() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let hold = stream.hold();
    stream.write_host(p, 4, 9).unwrap();
    assert!(!stream
        .synchronize_timeout(Duration::from_millis(30))
        .unwrap());
    assert_eq!(sim.host_read(p, 4).unwrap(), [0; 4]);
    hold.release();
    stream.synchronize().unwrap();
    assert_eq!(sim.host_read(p, 4).unwrap(), [9; 4]);
    sim.host_free(mem).unwrap();
}

#[test]
fn dropping_the_hold_guard_releases_the_stream() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    let hold = stream.hold();
    drop(hold);
    assert!(stream.synchronize_timeout(Duration::from_secs(1)).unwrap());
}

#[test]
fn delay_keeps_the_stream_busy_for_its_duration() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    let start = Instant::now();
    stream.delay(Duration::from_millis(20));
    stream.synchronize().unwrap();
    assert!(start.elapsed() >= Duration::from_millis(20));
}

#[test]
fn hung_stream_never_completes() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    stream.hang();
    let event = sim.record_event(&stream).unwrap();
    assert!(!stream
        .synchronize_timeout(Duration::from_millis(30))
        .unwrap());
    assert_eq!(sim.query_event(&event), Ok(false));
    sim.release_event(event);
}

#[test]
fn copy_reads_host_bytes_when_it_runs_not_when_enqueued() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let dev = SimDeviceBuffer::new(4);
    let hold = stream.hold();
    stream.write_host(p, 4, 5).unwrap();
    stream.copy_to_device(p, 4, &dev).unwrap();
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), [5; 4]);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    sim.host_free(mem).unwrap();
}

#[test]
fn copy_whose_source_was_overwritten_before_it_ran_is_a_violation() {
    let (sim, stream, mem) = setup(8);
    let p = mem.ptr.as_ptr();
    let dev = SimDeviceBuffer::new(8);
    let hold = stream.hold();
    stream.copy_to_device(p, 8, &dev).unwrap();
    sim.host_write(p, &[3; 8]).unwrap();
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(sim.violations(), 1);
    let log = sim.violation_log();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].kind, ViolationKind::EarlyReuse);
    assert_eq!(log[0].stream, Some(stream.id()));
    assert_eq!(
        dev.to_vec(),
        [3; 8],
        "the copy saw the overwritten bytes, like DMA"
    );
    sim.host_free(mem).unwrap();
}

#[test]
fn copy_whose_source_was_left_alone_is_not_a_violation() {
    let (sim, stream, mem) = setup(8);
    let p = mem.ptr.as_ptr();
    sim.host_write(p, &[4; 8]).unwrap();
    let dev = SimDeviceBuffer::new(8);
    let hold = stream.hold();
    stream.copy_to_device(p, 8, &dev).unwrap();
    drop(hold);
    stream.synchronize().unwrap();
    sim.host_write(p, &[5; 8]).unwrap(); // after the copy ran: legitimate reuse
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), [4; 8]);
    assert_eq!(sim.violations(), 0);
    sim.host_free(mem).unwrap();
}

#[test]
fn host_write_to_a_queued_device_to_host_destination_is_a_violation() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let dev = SimDeviceBuffer::new(4);
    dev.fill(8);
    let hold = stream.hold();
    stream.copy_to_host(&dev, p, 4).unwrap();
    sim.host_write(p, &[1; 4]).unwrap();
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(sim.host_read(p, 4).unwrap(), [8; 4]);
    assert_eq!(sim.violations(), 1);
    sim.host_free(mem).unwrap();
}

/// One device allocation (a mapping) with two 64 KiB blocks side by side.
fn two_blocks() -> (SimRuntime, Region, u64, u64) {
    let sim = SimRuntime::new();
    let region = sim.device_memory(0).unwrap().alloc(128 << 10).unwrap();
    let first = region.addr() as u64;
    (sim, region, first, first + (64 << 10))
}

#[test]
fn another_streams_write_to_another_block_of_the_mapping_is_not_early_reuse() {
    // Two owners of one block on stream `a`, both fills queued (stream order makes
    // that legal); meanwhile stream `b` writes the other block of the same mapping.
    let (sim, region, first, second) = two_blocks();
    let (a, b) = (sim.stream(), sim.stream());
    let hold = a.hold();
    a.fill_device(first, 64 << 10, 1).unwrap(); // the first owner's fill
    a.fill_device(first, 64 << 10, 2).unwrap(); // the next owner's, queued behind it
    b.fill_device(second, 64 << 10, 3).unwrap();
    b.synchronize().unwrap();
    drop(hold);
    a.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    sim.device_memory(0).unwrap().free(region).unwrap();
}

#[test]
fn another_streams_write_to_the_block_while_its_work_is_queued_is_early_reuse() {
    let (sim, region, first, second) = two_blocks();
    let (a, b) = (sim.stream(), sim.stream());
    let hold = a.hold();
    a.fill_device(first, 64 << 10, 1).unwrap();
    a.fill_device(second, 64 << 10, 1).unwrap();
    // `b` writes the last 512 bytes of the first block only: caught, and only there.
    b.fill_device(second - 512, 512, 3).unwrap();
    b.synchronize().unwrap();
    drop(hold);
    a.synchronize().unwrap();
    let log = sim.violation_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].kind, ViolationKind::EarlyReuse);
    assert_eq!(log[0].stream, Some(a.id()));
    assert!(
        log[0]
            .message
            .contains(&format!("written by stream {}", b.id().0)),
        "{}",
        log[0].message
    );
    sim.device_memory(0).unwrap().free(region).unwrap();
}

#[test]
fn device_writes_on_another_stream_are_not_mistaken_for_host_reuse() {
    let (sim, a, mem) = setup(4);
    let b = sim.stream();
    let p = mem.ptr.as_ptr();
    let dev = SimDeviceBuffer::new(4);
    let hold = a.hold();
    a.copy_to_device(p, 4, &dev).unwrap();
    b.write_host(p, 4, 6).unwrap();
    b.synchronize().unwrap();
    drop(hold);
    a.synchronize().unwrap();
    assert_eq!(dev.to_vec(), [6; 4]);
    assert_eq!(sim.violations(), 0);
    sim.host_free(mem).unwrap();
}

#[test]
fn copies_outside_runtime_memory_or_device_bounds_are_refused() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let local = [0u8; 4];
    assert!(matches!(
        stream.copy_to_device(local.as_ptr(), 4, &SimDeviceBuffer::new(4)),
        Err(SimError::ForeignHostMemory { .. })
    ));
    assert!(matches!(
        stream.copy_to_device(p, 5, &SimDeviceBuffer::new(8)),
        Err(SimError::ForeignHostMemory { .. })
    ));
    assert!(matches!(
        stream.copy_to_device(p, 4, &SimDeviceBuffer::new(2)),
        Err(SimError::DeviceOutOfBounds { .. })
    ));
    assert!(matches!(
        stream.copy_to_host(&SimDeviceBuffer::new(2), p, 4),
        Err(SimError::DeviceOutOfBounds { .. })
    ));
    assert!(matches!(
        stream.write_host(p.wrapping_add(2), 4, 0),
        Err(SimError::ForeignHostMemory { .. })
    ));
    sim.host_free(mem).unwrap();
}

#[test]
fn unchecked_copy_from_foreign_memory_detects_early_reuse_too() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    let local: Vec<std::sync::atomic::AtomicU8> = (0..4)
        .map(|_| std::sync::atomic::AtomicU8::new(1))
        .collect();
    let dev = SimDeviceBuffer::new(4);
    let hold = stream.hold();
    // SAFETY: `local` outlives the copy: the stream is synchronized before it is dropped.
    unsafe {
        stream
            .copy_to_device_unchecked(local.as_ptr().cast(), 4, &dev)
            .unwrap()
    };
    local[0].store(2, Ordering::Relaxed);
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), [2, 1, 1, 1]);
    assert_eq!(sim.violations(), 1);
}

#[test]
fn synchronize_during_capture_is_refused() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    stream.begin_capture().unwrap();
    assert!(matches!(
        stream.synchronize(),
        Err(SimError::IllegalDuringCapture { .. })
    ));
    stream.end_capture().unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn stream_ids_are_unique_and_shared_by_clones() {
    let sim = SimRuntime::new();
    let (a, b) = (sim.stream(), SimStream::new(&sim));
    assert_ne!(a.id(), b.id());
    assert_eq!(a.clone().id(), a.id());
    assert_eq!(sim.stream_id(&a), a.id());
}

#[test]
fn queued_work_still_runs_after_every_handle_is_dropped() {
    let (sim, stream, mem) = setup(4);
    let p = mem.ptr.as_ptr();
    let other = sim.stream();
    let event = {
        let hold = stream.hold();
        stream.write_host(p, 4, 7).unwrap();
        let event = sim.record_event(&stream).unwrap();
        drop(stream);
        drop(hold);
        event
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    while !sim.query_event(&event).unwrap() && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(sim.query_event(&event), Ok(true));
    assert_eq!(sim.host_read(p, 4).unwrap(), [7; 4]);
    sim.release_event(event);
    other.synchronize().unwrap();
    sim.host_free(mem).unwrap();
}
