//! Tests of the runtime as the engine sees it: host memory, counters, faults, violations.

use super::*;
use crate::actors::{Origin, Region};
use std::time::Instant;

#[test]
fn host_alloc_returns_zeroed_page_aligned_simulated_memory() {
    let sim = SimRuntime::new();
    let mem = sim.host_alloc(10_000).unwrap();
    assert_eq!(mem.method, Origin::Simulated);
    assert_eq!(mem.size, 10_000);
    assert_eq!(mem.ptr.as_ptr() as usize % HOST_ALIGN, 0);
    assert!(sim
        .host_read(mem.ptr.as_ptr(), 10_000)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    sim.host_free(mem).unwrap();
}

#[test]
fn memory_counters_return_to_zero_after_every_free() {
    let sim = SimRuntime::new();
    let mems: Vec<_> = [100, 4096, 1 << 20]
        .iter()
        .map(|&s| sim.host_alloc(s).unwrap())
        .collect();
    assert_eq!(sim.live_allocations(), 3);
    assert_eq!(sim.live_bytes(), 100 + 4096 + (1 << 20));
    for m in mems {
        sim.host_free(m).unwrap();
    }
    assert_eq!(sim.live_allocations(), 0);
    assert_eq!(sim.live_bytes(), 0);
    assert_eq!(sim.total_host_allocs(), 3);
    assert_eq!(sim.total_host_frees(), 3);
    assert_eq!(sim.violations(), 0);
}

#[test]
fn double_free_is_an_error_and_changes_nothing() {
    let sim = SimRuntime::new();
    let keep = sim.host_alloc(64).unwrap();
    let mem = sim.host_alloc(64).unwrap();
    sim.host_free(mem).unwrap();
    assert!(sim.host_free(mem).is_err());
    assert_eq!(sim.live_allocations(), 1);
    assert_eq!(sim.live_bytes(), 64);
    assert_eq!(sim.total_host_frees(), 1);
    assert_eq!(sim.violation_log()[0].kind, ViolationKind::InvalidFree);
    sim.host_free(keep).unwrap();
}

#[test]
fn freeing_memory_the_runtime_does_not_own_is_an_error() {
    let sim = SimRuntime::new();
    let mut local = [0u8; 64];
    let foreign = Region {
        ptr: std::ptr::NonNull::new(local.as_mut_ptr()).unwrap(),
        size: 64,
        method: Origin::Simulated,
    };
    assert!(sim.host_free(foreign).is_err());
    let mem = sim.host_alloc(64).unwrap();
    assert!(sim.host_free(Region { size: 32, ..mem }).is_err());
    assert!(sim
        .host_free(Region {
            method: Origin::HostAlloc,
            ..mem
        })
        .is_err());
    assert!(sim
        .host_free(Region {
            ptr: std::ptr::NonNull::new(mem.ptr.as_ptr().wrapping_add(1)).unwrap(),
            ..mem
        })
        .is_err());
    assert_eq!(sim.violations(), 4);
    assert_eq!(sim.live_allocations(), 1);
    sim.host_free(mem).unwrap();
    assert_eq!(local, [0; 64]);
}

#[test]
fn memory_of_one_runtime_is_foreign_to_another() {
    let (a, b) = (SimRuntime::new(), SimRuntime::new());
    let mem = a.host_alloc(8).unwrap();
    assert!(b.host_free(mem).is_err());
    assert!(b.host_read(mem.ptr.as_ptr(), 8).is_err());
    a.host_free(mem).unwrap();
}

#[test]
fn zero_size_alloc_is_an_error() {
    let sim = SimRuntime::new();
    assert!(sim.host_alloc(0).is_err());
    assert_eq!(sim.live_allocations(), 0);
}

#[test]
fn memory_limit_refuses_with_out_of_memory_and_frees_make_room() {
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(8192));
    let a = sim.host_alloc(4096).unwrap();
    let b = sim.host_alloc(4096).unwrap();
    let err = sim.host_alloc(1).unwrap_err();
    assert!(err.out_of_memory);
    assert_eq!(sim.live_bytes(), 8192);
    sim.host_free(a).unwrap();
    let c = sim.host_alloc(4096).unwrap();
    sim.set_memory_limit(None);
    let d = sim.host_alloc(1 << 20).unwrap();
    for m in [b, c, d] {
        sim.host_free(m).unwrap();
    }
    assert_eq!(sim.live_bytes(), 0);
}

#[test]
fn huge_alloc_fails_with_out_of_memory_instead_of_panicking() {
    let sim = SimRuntime::new();
    assert!(sim.host_alloc(usize::MAX).unwrap_err().out_of_memory);
    assert_eq!(sim.live_bytes(), 0);
}

#[test]
fn host_alloc_sleeps_for_the_configured_latency() {
    let sim = SimRuntime::new();
    sim.set_host_alloc_latency(Duration::from_millis(15));
    let start = Instant::now();
    let mem = sim.host_alloc(64).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(15));
    sim.host_free(mem).unwrap();
}

#[test]
fn injected_host_alloc_faults_fire_exactly_n_times() {
    let sim = SimRuntime::new();
    sim.faults().fail_next(FaultPoint::HostAlloc, 2);
    assert!(sim.host_alloc(64).unwrap_err().out_of_memory);
    assert!(sim.host_alloc(64).unwrap_err().out_of_memory);
    let mem = sim.host_alloc(64).unwrap();
    assert_eq!(sim.faults().injected(FaultPoint::HostAlloc), 2);
    assert_eq!(sim.total_host_allocs(), 1);
    sim.host_free(mem).unwrap();
}

#[test]
fn injected_host_free_fault_keeps_the_memory_live() {
    let sim = SimRuntime::new();
    let mem = sim.host_alloc(64).unwrap();
    sim.faults().fail_next(FaultPoint::HostFree, 1);
    assert!(sim.host_free(mem).is_err());
    assert_eq!(sim.live_allocations(), 1);
    sim.host_free(mem).unwrap();
    assert_eq!(sim.live_allocations(), 0);
    assert_eq!(sim.violations(), 0);
}

#[test]
fn injected_event_faults_fail_record_and_query() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    sim.faults().fail_next(FaultPoint::RecordEvent, 1);
    assert!(sim.record_event(&stream).is_err());
    assert_eq!(sim.events_recorded(), 0);
    let event = sim.record_event(&stream).unwrap();
    stream.synchronize().unwrap();
    sim.faults().fail_next(FaultPoint::QueryEvent, 1);
    assert!(sim.query_event(&event).is_err());
    assert_eq!(sim.query_event(&event), Ok(true));
    sim.release_event(event);
    assert_eq!(sim.events_recorded(), sim.events_released());
}

#[test]
fn streams_of_another_runtime_are_refused() {
    let (a, b) = (SimRuntime::new(), SimRuntime::new());
    let stream = a.stream();
    assert!(b.record_event(&stream).is_err());
    assert!(b.is_capturing(&stream).is_err());
    assert_eq!(b.events_recorded(), 0);
}

#[test]
fn freeing_memory_with_a_queued_copy_is_a_violation_but_stays_memory_safe() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    let mem = sim.host_alloc(16).unwrap();
    let dev = SimDeviceBuffer::new(16);
    let hold = stream.hold();
    stream.copy_to_device(mem.ptr.as_ptr(), 16, &dev).unwrap();
    sim.host_free(mem).unwrap();
    assert_eq!(sim.live_allocations(), 0);
    assert_eq!(sim.violations(), 1);
    assert_eq!(sim.violation_log()[0].kind, ViolationKind::FreedWhileInUse);
    drop(hold);
    stream.synchronize().unwrap();
}

#[test]
fn random_delays_keep_stream_order() {
    let sim = SimRuntime::new();
    sim.set_random_delays(3, Duration::from_micros(200));
    let stream = sim.stream();
    let mem = sim.host_alloc(1).unwrap();
    let p = mem.ptr.as_ptr();
    let devs: Vec<_> = (0..20u8)
        .map(|i| {
            stream.write_host(p, 1, i).unwrap();
            let d = SimDeviceBuffer::new(1);
            stream.copy_to_device(p, 1, &d).unwrap();
            d
        })
        .collect();
    stream.synchronize().unwrap();
    for (i, d) in devs.iter().enumerate() {
        assert_eq!(d.to_vec(), [i as u8]);
    }
    assert_eq!(sim.violations(), 0);
    sim.host_free(mem).unwrap();
}

#[test]
fn clones_share_counters_and_the_runtime_works_behind_arc() {
    let sim = Arc::new(SimRuntime::new());
    let clone = (*sim).clone();
    let mem = clone.host_alloc(64).unwrap();
    assert_eq!(sim.live_allocations(), 1);
    let worker = {
        let sim = Arc::clone(&sim);
        std::thread::spawn(move || sim.host_free(mem))
    };
    worker.join().unwrap().unwrap();
    assert_eq!(clone.live_allocations(), 0);
    assert_eq!(sim.name(), "sim");
}

#[test]
fn hung_stream_is_let_go_when_the_runtime_is_dropped() {
    let sim = SimRuntime::new();
    let stream = sim.stream();
    stream.hang();
    drop(sim);
    assert!(stream.synchronize_timeout(Duration::from_secs(1)).unwrap());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "reserves 16-32 MiB, which miri materialises and tracks byte by byte: too slow"
)]
fn expandable_memory_is_live_only_where_mapped_and_misuse_is_refused() {
    let sim = SimRuntime::new();
    let g = sim.host_granularity().unwrap();
    let range = sim.host_reserve(16 * g).unwrap();
    assert_eq!(range.method, Origin::Mapped);
    assert_eq!((sim.live_allocations(), sim.live_bytes()), (1, 0));
    let base = range.ptr.as_ptr();
    assert!(sim.host_write(base, &[1; 8]).is_err(), "nothing mapped yet");
    sim.host_map(&range, g, 2 * g).unwrap();
    assert_eq!(sim.live_bytes(), 2 * g);
    // SAFETY: pointer arithmetic inside the reserved range.
    let (one, three) = unsafe { (base.add(g), base.add(3 * g)) };
    // A write across the two mapped granules is inside live memory; one past them is not.
    // SAFETY: pointer arithmetic inside the reserved range.
    let (across, past) = unsafe { (one.add(g - 4), three.sub(4)) };
    sim.host_write(across, &[2; 8]).unwrap();
    assert!(sim.host_write(past, &[2; 8]).is_err());
    // A copy from mapped memory works; from an unmapped granule it is refused.
    let stream = sim.stream();
    let dev = SimDeviceBuffer::new(g);
    stream.copy_to_device(one, 64, &dev).unwrap();
    assert!(stream.copy_to_device(three, 64, &dev).is_err());
    stream.synchronize().unwrap();
    // Mapping a mapped granule, or unmapping a partial or unmapped one, is refused.
    assert!(sim.host_map(&range, 2 * g, g).is_err());
    assert!(sim.host_unmap(&range, 0, g).is_err());
    assert!(sim.host_unmap(&range, g, g / 2).is_err());
    assert_eq!(sim.live_bytes(), 2 * g, "refusals change nothing");
    // Giving back a range that still maps granules is refused.
    assert!(sim.host_unreserve(range).is_err());
    sim.host_unmap(&range, 2 * g, g).unwrap();
    assert!(sim.host_read(one, 8).is_ok(), "its neighbour stays");
    sim.host_unmap(&range, g, g).unwrap();
    sim.host_unreserve(range).unwrap();
    assert_eq!((sim.live_allocations(), sim.live_bytes()), (0, 0));
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "reserves 16-32 MiB, which miri materialises and tracks byte by byte: too slow"
)]
fn mapping_counts_against_the_memory_limit_and_can_be_turned_off() {
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(4 << 20));
    let g = sim.host_granularity().unwrap();
    let range = sim.host_reserve(8 * g).unwrap();
    sim.host_map(&range, 0, 2 * g).unwrap();
    let err = sim.host_map(&range, 2 * g, g).unwrap_err();
    assert!(err.out_of_memory, "{err}");
    sim.host_unmap(&range, 0, 2 * g).unwrap();
    sim.host_unreserve(range).unwrap();
    let off = SimRuntime::builder().without_expandable_memory().build();
    assert_eq!(off.host_granularity(), None);
    assert!(off.host_reserve(8 << 20).is_err());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "reserves 16 MiB, which miri materialises and tracks byte by byte: too slow"
)]
fn a_remapped_granule_moves_its_memory_without_allocating_and_misuse_changes_nothing() {
    use crate::actors::{MemorySource, RangeCall};
    let sim = SimRuntime::new();
    let g = sim.host_granularity().unwrap();
    let mv = |from, to| RangeCall::Move { from, to, len: g };
    assert!(sim.remaps());
    let range = sim.host_reserve(8 * g).unwrap();
    sim.host_map(&range, 0, 2 * g).unwrap();
    let (allocs, frees) = (sim.total_host_allocs(), sim.total_host_frees());
    let base = range.ptr.as_ptr();
    // SAFETY: pointer arithmetic inside the reserved range.
    let (zero, one, five) = unsafe { (base, base.add(g), base.add(5 * g)) };
    sim.host_write(zero, &[3; 8]).unwrap();
    sim.range_call(&range, mv(0, 5 * g)).unwrap();
    assert!(
        sim.host_write(zero, &[1; 8]).is_err(),
        "the old place is unmapped"
    );
    sim.host_write(five, &[4; 8]).unwrap();
    assert_eq!(sim.host_read(five, 8).unwrap(), [4; 8]);
    assert_eq!(
        sim.host_read(one, 8).unwrap(),
        [0; 8],
        "its neighbour stays"
    );
    assert_eq!(sim.live_bytes(), 2 * g, "no memory taken or given back");
    assert_eq!(
        (sim.total_host_allocs(), sim.total_host_frees()),
        (allocs, frees)
    );
    assert_eq!(sim.total_host_remaps(), 1);
    // Onto a mapped granule, from an unmapped one, or off the granules: refused, and
    // nothing changes.
    assert!(sim.range_call(&range, mv(g, 5 * g)).is_err());
    assert!(sim.range_call(&range, mv(0, 3 * g)).is_err());
    assert!(sim.range_call(&range, mv(g, 3 * g + 4096)).is_err());
    assert!(
        sim.range_call(&range, mv(g, 8 * g)).is_err(),
        "past the range"
    );
    assert!(sim.host_read(one, 8).is_ok() && sim.host_read(five, 8).is_ok());
    assert!(sim.host_write(base.wrapping_add(3 * g), &[1; 8]).is_err());
    assert_eq!(sim.live_bytes(), 2 * g);
    assert_eq!(sim.total_host_remaps(), 1);
    sim.host_unmap(&range, g, g).unwrap();
    sim.host_unmap(&range, 5 * g, g).unwrap();
    sim.host_unreserve(range).unwrap();
    assert_eq!((sim.live_allocations(), sim.live_bytes()), (0, 0));
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
}

#[test]
fn a_device_memory_source_allocates_up_to_the_capacity() {
    use crate::actors::{MemoryKind, MemorySource};

    let sim = SimRuntime::builder().device_capacity(64 << 20).build();
    let device = sim.device_memory(0).unwrap();
    assert_eq!(device.kind(), MemoryKind::Device(0));
    let block = device.alloc(1 << 20).unwrap();
    assert_eq!(sim.device_used(0), Some(1 << 20));
    // The driver says no past the device's capacity.
    assert!(device.alloc(64 << 20).unwrap_err().out_of_memory);
    device.free(block).unwrap();
    assert_eq!(sim.device_used(0), Some(0));
}
