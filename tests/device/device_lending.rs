//! Under a cap, stream pools lend each other memory (`DeviceBuilder::lend_between_streams`):
//! a request that finds no room takes a block another stream's pool holds instead of
//! emptying every cache, with no driver call and no waiting on the host. The requesting
//! stream is ordered after the lender's queued work by an event, so work on the block on the
//! new stream never runs before the old stream's work on it; and the block goes back to its
//! own pool only after the borrower's work on it has run.

use std::sync::Arc;

use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{DeviceAllocator, DeviceBuffer, DeviceBuilder, Error, Runtime};
use pinpool_testkit::all_bytes_are;

const MIB: usize = 1 << 20;
/// The cap: room for one 12 MiB block, not for two (and an expandable range: at least 8
/// granules of 2 MiB).
const CAP: usize = 16 * MIB;
const BLOCK: usize = 12 * MIB;

/// An allocator under [`CAP`], lending between streams as `lend` says (`None`: the default).
fn lending_pool(lend: Option<bool>) -> (DeviceAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let mut builder = DeviceBuilder::new(Arc::new(sim.clone())).max_bytes(CAP);
    if let Some(on) = lend {
        builder = builder.lend_between_streams(on);
    }
    let pool = builder.build().expect("allocator builds inside a runtime");
    (pool, sim)
}

#[test]
fn a_stream_made_to_wait_for_another_streams_event_runs_its_later_work_after_that_event() {
    let sim = SimRuntime::new();
    let (a, b) = (sim.stream(), sim.stream());
    let mem = sim.host_alloc(4096).unwrap();
    let hold = a.hold();
    a.write_host(mem.ptr.as_ptr(), 4096, 1).unwrap();
    let event = sim.record_event(&a).unwrap();
    sim.stream_wait_event(&b, &event).unwrap();
    sim.release_event(event);
    b.write_host(mem.ptr.as_ptr(), 4096, 2).unwrap();
    // B's write waits for A's, which waits for the hold.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(!b.is_idle(), "B waits for A's event");
    drop(hold);
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    let read = sim.host_read(mem.ptr.as_ptr(), 4096).unwrap();
    assert!(all_bytes_are(&read, 2), "B's write came last");
    assert_eq!(sim.stream_waits(), 1);
    assert_eq!(sim.violations(), 0);
    sim.host_free(mem).unwrap();
}

/// A simulated device's allocator, three streams, and a 1 MiB block allocated on the first.
async fn three_streams_and_a_block() -> (
    SimRuntime,
    DeviceAllocator<SimRuntime>,
    [SimStream; 3],
    DeviceBuffer<SimRuntime>,
) {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .build()
        .expect("allocator builds inside a runtime");
    let streams = [sim.stream(), sim.stream(), sim.stream()];
    let x = pool.alloc(MIB, &streams[0]).await.unwrap();
    (sim, pool, streams, x)
}

/// Makes `waiter` wait for the work queued on `on` so far (an event recorded there).
fn wait_for(sim: &SimRuntime, waiter: &SimStream, on: &SimStream) {
    let event = sim.record_event(on).unwrap();
    sim.stream_wait_event(waiter, &event).unwrap();
    sim.release_event(event);
}

/// Work queued on a stream behind its wait for another stream's event is still checked for
/// early reuse: the writes that event orders before it pass, a third stream's write after
/// the wait ended does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_queued_behind_a_wait_for_another_streams_event_is_still_checked_for_early_reuse() {
    let (sim, _pool, [a, b, c], x) = three_streams_and_a_block().await;
    let addr = x.device_ptr();

    // A's write runs after B's fill is queued, but B waits for A's event: ordered.
    let hold_a = a.hold();
    a.fill_device(addr, MIB, 1).unwrap();
    wait_for(&sim, &b, &a);
    let waited = sim.record_event(&b).unwrap(); // complete once B's wait has ended
    let hold_b = b.hold();
    b.fill_device(addr, MIB, 2).unwrap();
    drop(hold_a);
    a.synchronize().unwrap();
    while !sim.query_event(&waited).unwrap() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    sim.release_event(waited);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());

    // C writes the bytes after B's wait ended and before B's fill runs: nothing orders it.
    c.fill_device(addr, MIB, 3).unwrap();
    c.synchronize().unwrap();
    drop(hold_b);
    b.synchronize().unwrap();
    let log = sim.violation_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].stream, Some(b.id()));
    assert!(
        log[0]
            .message
            .contains(&format!("written by stream {}", c.id().0)),
        "{log:?}"
    );
    drop(x);
}

/// A stream made to wait for two events, the later one complete already: work queued after
/// both is ordered after the earlier, still pending one too, and the writes it orders first
/// are not early reuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_queued_behind_two_waits_is_ordered_after_both_events() {
    let (sim, _pool, [a, b, c], x) = three_streams_and_a_block().await;
    let addr = x.device_ptr();

    let hold_a = a.hold();
    a.fill_device(addr, MIB, 1).unwrap();
    wait_for(&sim, &b, &a); // still pending
    c.synchronize().unwrap();
    wait_for(&sim, &b, &c); // complete already
                            // Queued behind both waits: A's write, still to come, is ordered before it.
    b.fill_device(addr, MIB, 2).unwrap();
    drop(hold_a);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    drop(x);
}

#[test]
fn waiting_for_an_event_recorded_during_capture_is_refused() {
    let sim = SimRuntime::new();
    let (a, b) = (sim.stream(), sim.stream());
    a.begin_capture().unwrap();
    let event = sim.record_event(&a).unwrap();
    assert!(sim.stream_wait_event(&b, &event).is_err());
    sim.release_event(event);
    a.end_capture().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_lent_between_streams_runs_the_borrowers_work_after_the_lenders() {
    let (pool, sim) = lending_pool(Some(true));
    let (a, b) = (sim.stream(), sim.stream());
    let host = sim.host_alloc(BLOCK).unwrap();

    // A writes its block, but its stream is held: the write is still queued when A frees it.
    let x = pool.alloc(BLOCK, &a).await.unwrap();
    let addr = x.device_ptr();
    let hold = a.hold();
    a.fill_device(addr, BLOCK, 1).unwrap();
    drop(x);
    let maps = sim.device_calls(0).unwrap().0;

    // B finds no room under the cap: it borrows A's block, without the driver.
    let y = pool.try_alloc(BLOCK, &b).await.unwrap();
    assert_eq!(y.device_ptr(), addr, "A's block, lent to B");
    assert_eq!(sim.device_calls(0).unwrap().0, maps, "no map call");
    b.fill_device(y.device_ptr(), BLOCK, 2).unwrap();
    b.copy_dtoh(y.device_ptr(), host.ptr.as_ptr(), BLOCK)
        .unwrap();

    drop(hold);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let read = sim.host_read(host.ptr.as_ptr(), BLOCK).unwrap();
    assert!(all_bytes_are(&read, 2), "B read its own bytes");
    // A's queued write ran before B's: what is left in the block is B's.
    b.copy_dtoh(y.device_ptr(), host.ptr.as_ptr(), BLOCK)
        .unwrap();
    b.synchronize().unwrap();
    let read = sim.host_read(host.ptr.as_ptr(), BLOCK).unwrap();
    assert!(all_bytes_are(&read, 2), "A's write did not land after B's");
    assert_eq!(sim.stream_waits(), 1, "B waited for A's event");
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    drop(y);
    sim.host_free(host).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_block_goes_back_to_its_own_pool_only_after_the_borrowers_work_has_run() {
    let (pool, sim) = lending_pool(Some(true));
    let (a, b) = (sim.stream(), sim.stream());
    let x = pool.alloc(BLOCK, &a).await.unwrap();
    let addr = x.device_ptr();
    drop(x);
    let y = pool.try_alloc(BLOCK, &b).await.unwrap();
    assert_eq!(y.device_ptr(), addr);

    // B's work on the block is still queued when B frees it.
    let hold = b.hold();
    b.fill_device(addr, BLOCK, 3).unwrap();
    drop(y);
    let err = pool.try_alloc(BLOCK, &a).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");

    drop(hold);
    b.synchronize().unwrap();
    let z = loop {
        match pool.try_alloc(BLOCK, &a).await {
            Ok(z) => break z,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
        }
    };
    assert_eq!(z.device_ptr(), addr, "back in A's pool, for A");
    a.fill_device(z.device_ptr(), BLOCK, 4).unwrap();
    a.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_lending_a_request_over_the_cap_takes_memory_from_the_driver_again() {
    let (pool, sim) = lending_pool(Some(false));
    let (a, b) = (sim.stream(), sim.stream());
    let x = pool.alloc(BLOCK, &a).await.unwrap();
    let addr = x.device_ptr();
    drop(x);
    let maps = sim.device_calls(0).unwrap().0;
    let y = pool.try_alloc(BLOCK, &b).await.unwrap();
    assert_ne!(y.device_ptr(), addr, "B's own memory");
    assert!(sim.device_calls(0).unwrap().0 > maps, "mapped again");
    assert_eq!(sim.stream_waits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_pools_lend_each_other_memory_by_default() {
    let (pool, sim) = lending_pool(None);
    let (a, b) = (sim.stream(), sim.stream());
    let x = pool.alloc(BLOCK, &a).await.unwrap();
    let addr = x.device_ptr();
    drop(x);
    let maps = sim.device_calls(0).unwrap().0;
    let y = pool.try_alloc(BLOCK, &b).await.unwrap();
    assert_eq!(y.device_ptr(), addr, "A's block, lent to B");
    assert_eq!(sim.device_calls(0).unwrap().0, maps, "no map call");
    assert_eq!(sim.stream_waits(), 1, "B waits for A's event");
}
