//! Device memory is stream-ordered: a block belongs to the stream it was allocated on, is
//! reusable by that stream at once when no other stream used it, and waits for the work of
//! every other stream recorded on it. The simulated device checks every kernel and copy
//! for bytes written by another stream between enqueue and run (early reuse).

use std::time::Duration;

use pinpool::sim::ViolationKind;
use pinpool_testkit::sim_device_pool as device_pool;
use pinpool_testkit::{all_bytes_are, eventually};

const MIB: usize = 1 << 20;

#[tokio::test]
async fn a_block_freed_with_no_other_stream_is_reused_by_its_stream_at_once_without_an_event() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let a = pool.alloc(MIB, &s).await.unwrap();
    let ptr = a.device_ptr();
    s.fill_device(ptr, MIB, 1).unwrap(); // queued work on the block's own stream
    drop(a);
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(b.device_ptr(), ptr, "same stream, same block, at once");
    s.fill_device(b.device_ptr(), MIB, 2).unwrap();
    s.synchronize().unwrap();
    assert_eq!(sim.events_recorded(), 0, "no event on the same-stream path");
    assert_eq!(sim.violations(), 0);
    assert_eq!(pool.stats(0).unwrap().num_device_alloc, 1);
}

#[tokio::test]
async fn recording_the_blocks_own_stream_records_nothing() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let mut a = pool.alloc(4096, &s).await.unwrap();
    a.record_stream(&s).unwrap();
    assert!(a.recorded_streams().is_empty());
    let ptr = a.device_ptr();
    drop(a);
    assert_eq!(pool.alloc(4096, &s).await.unwrap().device_ptr(), ptr);
    assert_eq!(sim.events_recorded(), 0);
}

#[tokio::test]
async fn each_stream_has_its_own_blocks() {
    let (pool, sim) = device_pool();
    let (s1, s2) = (sim.stream(), sim.stream());
    let a = pool.alloc(MIB, &s1).await.unwrap();
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc(MIB, &s2).await.unwrap();
    assert_ne!(b.device_ptr(), ptr, "a block of s1 is not handed to s2");
    let snap = pool.snapshot().await.unwrap();
    let streams: std::collections::BTreeSet<_> =
        snap.segments.iter().filter_map(|s| s.stream).collect();
    assert_eq!(streams.len(), 2, "one pool per stream: {snap:?}");
    assert!(snap.segments.iter().all(|s| s.device == Some(0)));
}

#[tokio::test]
async fn a_block_another_stream_still_reads_is_held_until_that_work_is_done_and_its_bytes_stay_intact(
) {
    let (pool, sim) = device_pool();
    let (a, b) = (sim.stream(), sim.stream());
    let host = sim.host_alloc(MIB).unwrap();
    let mut x = pool.alloc(MIB, &a).await.unwrap();
    let ptr = x.device_ptr();
    a.fill_device(ptr, MIB, 0x5a).unwrap();
    a.synchronize().unwrap();
    // A kernel on B reads the block later (B is busy).
    let hold = b.hold();
    b.copy_dtoh(ptr, host.ptr.as_ptr(), MIB).unwrap();
    x.record_stream(&b).unwrap();
    drop(x);
    // A asks for the same size at once: the block is not handed out.
    let y = pool.alloc(MIB, &a).await.unwrap();
    assert_ne!(y.device_ptr(), ptr, "reuse waits for B's read");
    a.fill_device(y.device_ptr(), MIB, 0x77).unwrap();
    a.synchronize().unwrap();
    drop(hold);
    b.synchronize().unwrap();
    let read = sim.host_read(host.ptr.as_ptr(), MIB).unwrap();
    assert!(all_bytes_are(&read, 0x5a), "B read the bytes A wrote");
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    // Once B's work is done, the block comes back to A.
    drop(y);
    eventually("the block comes home", || {
        pool.stats(0).unwrap().active.all.current == 0
    })
    .await;
    let again: Vec<_> = [
        pool.alloc(MIB, &a).await.unwrap(),
        pool.alloc(MIB, &a).await.unwrap(),
    ]
    .into();
    assert!(again.iter().any(|z| z.device_ptr() == ptr));
    sim.host_free(host).unwrap();
}

#[tokio::test]
async fn without_record_stream_the_simulation_catches_the_early_reuse() {
    let (pool, sim) = device_pool();
    let (a, b) = (sim.stream(), sim.stream());
    let host = sim.host_alloc(MIB).unwrap();
    let x = pool.alloc(MIB, &a).await.unwrap();
    let ptr = x.device_ptr();
    a.fill_device(ptr, MIB, 0x5a).unwrap();
    a.synchronize().unwrap();
    let hold = b.hold();
    b.copy_dtoh(ptr, host.ptr.as_ptr(), MIB).unwrap();
    drop(x); // the user forgot record_stream(&b)
    let y = pool.alloc(MIB, &a).await.unwrap();
    assert_eq!(y.device_ptr(), ptr, "its own stream reuses it at once");
    a.fill_device(ptr, MIB, 0x77).unwrap();
    a.synchronize().unwrap();
    drop(hold);
    b.synchronize().unwrap();
    assert_eq!(sim.violations(), 1);
    assert_eq!(sim.violation_log()[0].kind, ViolationKind::EarlyReuse);
    sim.host_free(host).unwrap();
}

#[tokio::test]
async fn a_slow_stream_holds_only_its_own_block() {
    let (pool, sim) = device_pool();
    let (a, slow, fast) = (sim.stream(), sim.stream(), sim.stream());
    let mut x = pool.alloc(MIB, &a).await.unwrap();
    let mut y = pool.alloc(MIB, &a).await.unwrap();
    let (px, py) = (x.device_ptr(), y.device_ptr());
    let hold = slow.hold();
    x.record_stream(&slow).unwrap();
    y.record_stream(&fast).unwrap();
    fast.delay(Duration::from_millis(1));
    drop((x, y));
    fast.synchronize().unwrap();
    eventually("y comes back", || {
        pool.stats(0).unwrap().active.all.current == 1
    })
    .await;
    let z = pool.alloc(MIB, &a).await.unwrap();
    assert_eq!(z.device_ptr(), py);
    let w = pool.alloc(MIB, &a).await.unwrap();
    assert_ne!(w.device_ptr(), px, "x still waits for the slow stream");
    drop(hold);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_goes_back_to_the_device_only_after_the_work_queued_on_it_has_run() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let buf = pool.alloc(64 * MIB, &s).await.unwrap();
    let ptr = buf.device_ptr();
    let host = sim.host_alloc(4096).unwrap(); // pinned host memory to copy into
                                              // The bytes are written at once; the copy out runs only after 200 ms of other work.
    s.fill_device(ptr, 4096, 0x5a).unwrap();
    s.delay(Duration::from_millis(200));
    s.copy_dtoh(ptr, host.ptr.as_ptr(), 4096).unwrap();
    drop(buf); // reusable by `s` at once: stream order
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Giving the memory back to the device must wait for the copy out.
    let report = pool.empty_cache().await.unwrap();
    assert!(report.freed_bytes >= 64 * MIB, "{report:?}");
    s.synchronize().unwrap();
    // SAFETY: 4096 bytes of live host memory, written by the finished copy.
    let back = unsafe { std::slice::from_raw_parts(host.ptr.as_ptr(), 4096) }.to_vec();
    sim.host_free(host).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x5a),
        "the memory went back before the copy out ran"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}
