//! `BufferSet`: a request's pinned and device buffers taken together, all or none; waiting
//! first come first served under both caps, holding nothing while it waits; cancel-safe;
//! a request that can never fit refused at once; a blocking twin that follows the blocking
//! rule.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::{
    BufferSet, Builder, DeviceAllocator, DeviceBuilder, Error, OomCause, PinnedAllocator,
};
use pinpool_testkit::{eventually, eventually_nothing_in_use};

const MIB: usize = 1 << 20;

/// A pinned allocator capped at `pinned` and a device allocator capped at `device`, on one
/// simulated runtime.
fn capped(pinned: usize, device: usize) -> (PinnedAllocator, DeviceAllocator, SimRuntime) {
    let sim = SimRuntime::new();
    let host = Builder::new(Arc::new(sim.clone()))
        .max_bytes(pinned)
        .build()
        .unwrap();
    let dev = DeviceBuilder::new(Arc::new(sim.clone()))
        .max_bytes(device)
        .build()
        .unwrap();
    (host, dev, sim)
}

/// Bytes in use (lent) by the device allocator's device 0.
fn device_in_use(dev: &DeviceAllocator) -> i64 {
    dev.stats(0).unwrap().active_bytes.all.current
}

#[tokio::test]
async fn a_set_gives_every_buffer_its_size_and_the_device_ones_their_stream() {
    let (host, dev, sim) = capped(8 * MIB, 16 * MIB);
    let (s1, s2) = (sim.stream(), sim.stream());
    let taken = BufferSet::new()
        .pinned(&host, MIB)
        .device(&dev, 3 * MIB, &s1)
        .pinned(&host, 4096)
        .device(&dev, 5000, &s2)
        .pinned(&host, 0)
        .alloc()
        .await
        .unwrap();
    let pinned: Vec<usize> = taken.pinned.iter().map(|b| b.len()).collect();
    let device: Vec<usize> = taken.device.iter().map(|b| b.len()).collect();
    assert_eq!(pinned, [MIB, 4096, 0]);
    assert_eq!(device, [3 * MIB, 5000]);
    assert_eq!(taken.device[0].stream().id(), s1.id());
    assert_eq!(taken.device[1].stream().id(), s2.id());
    drop(taken);
    eventually_nothing_in_use(&host).await;
    eventually("device buffers back", || device_in_use(&dev) == 0).await;
}

#[tokio::test]
async fn buffers_that_fit_the_cap_alone_but_not_together_are_refused_at_once_as_never_fitting() {
    let (host, dev, sim) = capped(4 * MIB, 8 * MIB);
    let s = sim.stream();
    // Each fits under its cap; together the pinned ones do not.
    let err = BufferSet::new()
        .pinned(&host, 3 * MIB)
        .pinned(&host, 3 * MIB)
        .device(&dev, MIB, &s)
        .alloc()
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            Error::OutOfMemory { requested, limit: Some(l), cause: OomCause::ExceedsLimit, .. }
                if requested == 6 * MIB && l == 4 * MIB
        ),
        "{err:?}"
    );
    // The same on the device side, and for `try_alloc`.
    let err = BufferSet::new()
        .pinned(&host, MIB)
        .device(&dev, 5 * MIB, &s)
        .device(&dev, 5 * MIB, &s)
        .try_alloc()
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(err, Error::OutOfMemory { limit: Some(l), cause: OomCause::ExceedsLimit, .. } if l == 8 * MIB),
        "{err:?}"
    );
    assert!(err.never_fits());
    assert_eq!(host.reserved_bytes(), 0, "nothing was taken");
    assert_eq!(dev.reserved_bytes(0).unwrap(), 0, "nothing was taken");
    assert_eq!(
        (host.stats().num_ooms, dev.stats(0).unwrap().num_ooms),
        (1, 1)
    );
}

#[tokio::test]
async fn a_buffer_larger_than_its_device_makes_the_set_fail_as_never_fitting() {
    let sim = SimRuntime::builder().device_capacity(64 * MIB).build();
    let host = Builder::new(Arc::new(sim.clone())).build().unwrap();
    let dev = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let err = BufferSet::new()
        .pinned(&host, MIB)
        .device(&dev, 65 * MIB, &s)
        .alloc()
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            Error::OutOfMemory {
                cause: OomCause::ExceedsDevice,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        host.stats().active_requests.allocated,
        0,
        "nothing was taken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_set_holds_nothing_and_is_served_once_the_held_buffers_come_back() {
    let (host, dev, sim) = capped(4 * MIB, 8 * MIB);
    let s = sim.stream();
    // The pinned side has room; the device side has not.
    let held = dev.alloc(6 * MIB, &s).await.unwrap();
    let waiter = {
        let (host, dev, s) = (host.clone(), dev.clone(), s.clone());
        tokio::spawn(async move {
            let t = BufferSet::new()
                .pinned(&host, 2 * MIB)
                .device(&dev, 4 * MIB, &s)
                .alloc()
                .await?;
            Ok::<_, Error>((t.pinned[0].len(), t.device[0].len()))
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "no device room yet: it waits");
    // While it waits it holds no pinned memory: all of the pinned cap can be taken now.
    let all = host
        .try_alloc(4 * MIB)
        .await
        .expect("the waiting set holds no pinned memory");
    drop(all);
    assert_eq!(
        device_in_use(&dev),
        6 * MIB as i64,
        "only the held buffer is lent"
    );
    drop(held);
    let got = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("served once the buffer came back")
        .unwrap()
        .unwrap();
    assert_eq!(got, (2 * MIB, 4 * MIB));
    assert!(dev.reserved_bytes(0).unwrap() <= 8 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_spanning_both_allocators_in_opposite_orders_never_deadlock() {
    // Under hold-and-wait (take the first buffer, wait for the second) these requests
    // deadlock at once: each can hold most of one cap while waiting for the other.
    let (host, dev, sim) = capped(8 * MIB, 8 * MIB);
    let streams = [sim.stream(), sim.stream()];
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (host, dev, s) = (host.clone(), dev.clone(), streams[t % 2].clone());
            tokio::spawn(async move {
                for i in 0..40 {
                    let set = if (t + i) % 2 == 0 {
                        BufferSet::new()
                            .pinned(&host, 5 * MIB)
                            .device(&dev, 5 * MIB, &s)
                    } else {
                        BufferSet::new()
                            .device(&dev, 5 * MIB, &s)
                            .pinned(&host, 5 * MIB)
                    };
                    let taken = set.alloc().await?;
                    tokio::task::yield_now().await;
                    drop(taken);
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("no deadlock")
            .unwrap()
            .unwrap();
    }
    assert!(host.stats().allocated_bytes.peak <= 8 * MIB as i64);
    assert!(dev.stats(0).unwrap().reserved_bytes.all.peak <= 8 * MIB as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_arrives_later_waits_behind_an_earlier_one_even_when_it_would_fit() {
    let (host, dev, sim) = capped(8 * MIB, 8 * MIB);
    let s = sim.stream();
    let a = host.alloc(4 * MIB).await.unwrap();
    let b = host.alloc(4 * MIB).await.unwrap();
    let (tx, rx) = flume::unbounded();
    let first = {
        let (host, tx) = (host.clone(), tx.clone());
        tokio::spawn(async move {
            let t = BufferSet::<SimRuntime>::new()
                .pinned(&host, 6 * MIB)
                .alloc()
                .await;
            tx.send("first").unwrap();
            t.map(drop)
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = {
        let (host, dev, s) = (host.clone(), dev.clone(), s.clone());
        tokio::spawn(async move {
            let t = BufferSet::new()
                .pinned(&host, 2 * MIB)
                .device(&dev, MIB, &s)
                .alloc()
                .await;
            tx.send("second").unwrap();
            t.map(drop)
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Room for the second, not the first: the second still waits its turn.
    drop(a);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(rx.is_empty(), "{:?}", rx.try_recv());
    drop(b);
    for t in [first, second] {
        tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("both served")
            .unwrap()
            .unwrap();
    }
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), ["first", "second"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_dropped_while_it_waits_gives_back_everything_and_leaves_no_waiter() {
    let (host, dev, sim) = capped(4 * MIB, 8 * MIB);
    let s = sim.stream();
    let held = dev.alloc(6 * MIB, &s).await.unwrap();
    // Waits (its pinned buffer fits, its device buffer does not), then is dropped.
    let set = BufferSet::new()
        .pinned(&host, 3 * MIB)
        .device(&dev, 4 * MIB, &s)
        .alloc();
    assert!(tokio::time::timeout(Duration::from_millis(50), set)
        .await
        .is_err());
    // And one that gives up by itself.
    let err = BufferSet::new()
        .pinned(&host, 3 * MIB)
        .device(&dev, 4 * MIB, &s)
        .timeout(Duration::from_millis(20))
        .alloc()
        .await
        .err()
        .expect("times out");
    assert!(
        matches!(err, Error::Timeout { requested, .. } if requested == 7 * MIB),
        "{err:?}"
    );
    eventually_nothing_in_use(&host).await;
    assert_eq!(device_in_use(&dev), 6 * MIB as i64);
    drop(held);
    eventually("device buffer back", || device_in_use(&dev) == 0).await;
    // No waiter was left behind: a set that fits now is served at once, and a freed buffer
    // goes back to the cache again (no waiter keeps the pools under pressure).
    let again = BufferSet::new()
        .pinned(&host, 3 * MIB)
        .device(&dev, 4 * MIB, &s)
        .try_alloc()
        .await
        .expect("room, and no one ahead");
    drop(again);
    let taken = host.stats().num_host_alloc;
    drop(host.alloc(3 * MIB).await.unwrap());
    assert_eq!(host.stats().num_host_alloc, taken, "served from the cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_alloc_of_a_set_without_room_now_says_so_and_holds_nothing() {
    let (host, dev, sim) = capped(4 * MIB, 8 * MIB);
    let s = sim.stream();
    let held = dev.alloc(6 * MIB, &s).await.unwrap();
    let err = BufferSet::new()
        .pinned(&host, MIB)
        .device(&dev, 4 * MIB, &s)
        .try_alloc()
        .await
        .err()
        .expect("no room now");
    assert!(
        matches!(
            err,
            Error::OutOfMemory {
                cause: OomCause::NoRoomNow,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.never_fits());
    eventually_nothing_in_use(&host).await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_lowered_under_a_waiting_set_fails_it_as_never_fitting() {
    let (host, dev, sim) = capped(4 * MIB, 8 * MIB);
    let s = sim.stream();
    let held = dev.alloc(6 * MIB, &s).await.unwrap();
    let waiter = {
        let (dev, s) = (dev.clone(), s.clone());
        tokio::spawn(async move {
            BufferSet::<SimRuntime>::new()
                .device(&dev, 4 * MIB, &s)
                .alloc()
                .await
                .map(drop)
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    dev.set_max_bytes(0, Some(3 * MIB)).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken by the new cap")
        .unwrap()
        .expect_err("refused");
    assert!(err.never_fits(), "{err:?}");
    drop((held, host));
}

#[test]
fn the_blocking_twin_refuses_a_current_thread_runtime_and_serves_other_threads() {
    let rt = pinpool_testkit::current_thread();
    let (host, dev, sim) = rt.block_on(async { capped(4 * MIB, 8 * MIB) });
    let s = sim.stream();
    let err = rt.block_on(async {
        BufferSet::new()
            .pinned(&host, MIB)
            .device(&dev, MIB, &s)
            .alloc_blocking()
            .err()
            .expect("would deadlock")
    });
    assert!(matches!(err, Error::WouldDeadlock { .. }), "{err:?}");
    // A plain thread blocks while the runtime's thread runs the actors.
    let (h, d, st) = (host.clone(), dev.clone(), s.clone());
    let lens = rt.block_on(pinpool_testkit::on_plain_thread(move || {
        let t = BufferSet::new()
            .pinned(&h, MIB)
            .device(&d, 2 * MIB, &st)
            .alloc_blocking()
            .unwrap();
        (t.pinned[0].len(), t.device[0].len())
    }));
    assert_eq!(lens, (MIB, 2 * MIB));

    // On a multi-thread runtime's worker it blocks in place and waits like the async call.
    let rt = pinpool_testkit::multi_thread(2);
    let (host, dev, sim) = rt.block_on(async { capped(4 * MIB, 8 * MIB) });
    let s = sim.stream();
    let held = rt.block_on(dev.alloc(6 * MIB, &s)).unwrap();
    let waiter = {
        let (host, dev, s) = (host.clone(), dev.clone(), s.clone());
        rt.spawn(async move {
            BufferSet::new()
                .pinned(&host, MIB)
                .device(&dev, 4 * MIB, &s)
                .alloc_blocking()
                .map(|t| t.device[0].len())
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiter.is_finished(), "it waits for room");
    drop(held);
    let got = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("served")
            .unwrap()
    });
    assert_eq!(got.unwrap(), 4 * MIB);
}
