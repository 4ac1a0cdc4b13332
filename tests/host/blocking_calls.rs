//! The blocking API where blocking would deadlock: on a thread that runs a current-thread
//! runtime's tasks, every `*_blocking` call is `Error::WouldDeadlock` at once, naming the
//! async call to use, and changes nothing; on a multi-thread runtime's worker it works (it
//! blocks inside `block_in_place`); outside any runtime it blocks as before, also while the
//! actors run on a runtime built without timers.
//!
//! Each scenario runs on a thread of its own behind a watchdog, so that a regression fails
//! the test instead of hanging the suite.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use pinpool::plan::{PlanSessionError, Planner};
use pinpool::sim::SimRuntime;
use pinpool::{DeviceBuilder, Error, HistoryContext, TraceAction};
use pinpool_testkit::sim_device_pool as device_pool;
use pinpool_testkit::{current_thread, multi_thread, sim_pool};

/// Runs `scenario` on a thread of its own; fails the test if it has not finished within
/// `limit` (it hung), and re-raises its panic if it panicked.
fn within<T: Send + 'static>(limit: Duration, scenario: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let out = scenario();
        let _ = tx.send(());
        out
    });
    match rx.recv_timeout(limit) {
        Ok(()) => thread.join().expect("the scenario panicked"),
        Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Ok(out) => out,
            Err(panic) => std::panic::resume_unwind(panic),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!(
                "the scenario hung for {limit:?}: a blocking call waited on actors that cannot run"
            )
        }
    }
}

fn assert_would_deadlock<T>(result: Result<T, Error>, call: &str, use_instead: &str) {
    match result {
        Err(Error::WouldDeadlock {
            call: c,
            use_instead: u,
        }) => {
            assert_eq!(c, call);
            assert_eq!(u, use_instead);
        }
        Err(other) => panic!("{call}: expected WouldDeadlock, got {other}"),
        Ok(_) => panic!("{call}: expected WouldDeadlock, got a value"),
    }
}

fn assert_plan_would_deadlock<T>(result: Result<T, PlanSessionError>, call: &str) {
    match result {
        Err(PlanSessionError::Alloc(Error::WouldDeadlock { call: c, .. })) => assert_eq!(c, call),
        Err(other) => panic!("{call}: expected WouldDeadlock, got {other}"),
        Ok(_) => panic!("{call}: expected WouldDeadlock, got a value"),
    }
}

/// Code tested with a warm cache must behave as it will with a cold one: on a thread that
/// runs a current-thread runtime's tasks, a blocking allocation is refused whether or not the
/// cached path would serve it (it was served when cached, refused when not), and nothing
/// changes; on a plain thread both are served.
#[test]
fn alloc_blocking_on_a_current_thread_runtime_is_refused_whether_or_not_the_cache_would_serve_it() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, sim) = sim_pool();
            let (device, dsim) = device_pool();
            let s = dsim.stream();
            drop(pool.alloc(1 << 20).await.unwrap());
            drop(device.alloc(1 << 20, &s).await.unwrap());
            let (allocs, device_allocs) = (sim.total_host_allocs(), device.stats(0).unwrap());
            for size in [1 << 20, 3 << 20] {
                // The first size is cached, the second is not: the same answer.
                assert_would_deadlock(
                    pool.alloc_blocking(size),
                    "alloc_blocking",
                    "alloc(..).await",
                );
                assert_would_deadlock(
                    pool.alloc_blocking_timeout(size, Duration::from_secs(1)),
                    "alloc_blocking_timeout",
                    "alloc_timeout(..).await",
                );
                assert_would_deadlock(
                    device.alloc_blocking(size, &s),
                    "alloc_blocking",
                    "alloc(..).await",
                );
                assert_would_deadlock(
                    device.try_alloc_blocking(size, &s),
                    "try_alloc_blocking",
                    "try_alloc(..).await",
                );
                assert!(matches!(
                    device.raw_alloc_with_stream(size, &s),
                    Err(Error::WouldDeadlock {
                        call: "raw_alloc_with_stream",
                        ..
                    })
                ));
            }
            // A task the runtime runs is refused alike, cached or not.
            let (p, d, st) = (pool.clone(), device.clone(), s.clone());
            let in_task = tokio::spawn(async move {
                [
                    p.alloc_blocking(1 << 20).map(drop),
                    p.alloc_blocking(3 << 20).map(drop),
                    d.alloc_blocking(1 << 20, &st).map(drop),
                ]
            })
            .await
            .unwrap();
            for r in in_task {
                assert!(matches!(r, Err(Error::WouldDeadlock { .. })), "{r:?}");
            }
            // Nothing was taken, nothing was lent.
            assert_eq!(sim.total_host_allocs(), allocs);
            assert_eq!(pool.stats().active_requests.allocated, 1);
            let d = device.stats(0).unwrap();
            assert_eq!(d.num_device_alloc, device_allocs.num_device_alloc);
            assert_eq!(d.allocation.all.allocated, 1);
            // A plain thread may block: the cached and the uncached request are served.
            let (p, d, st) = (pool.clone(), device.clone(), s.clone());
            let served = pinpool_testkit::on_plain_thread(move || {
                [1 << 20, 3 << 20].map(|n| {
                    (
                        p.alloc_blocking(n).map(|b| b.len()),
                        d.alloc_blocking(n, &st).map(|b| b.len()),
                    )
                })
            })
            .await;
            assert_eq!(
                served,
                [(Ok(1 << 20), Ok(1 << 20)), (Ok(3 << 20), Ok(3 << 20))]
            );
        })
    });
}

/// The decision is kept per task, not per thread: a thread that blocks plainly, then runs a
/// current-thread runtime (refused), then a multi-thread one (served), then none (served),
/// gets each runtime's answer, cached request or not.
#[test]
fn one_thread_gets_each_runtimes_answer_as_it_enters_and_leaves_them() {
    within(Duration::from_secs(20), || {
        let actors = multi_thread(1);
        let (pool, _sim) = pinpool_testkit::best_fit_pool_on(&actors);
        drop(pool.alloc_blocking(4096).unwrap());
        assert!(pool.alloc_blocking(4096).is_ok(), "a plain thread");
        let current = current_thread();
        for _ in 0..2 {
            let r = current.block_on(async { pool.alloc_blocking(4096).map(drop) });
            assert!(matches!(r, Err(Error::WouldDeadlock { .. })), "{r:?}");
            let p = pool.clone();
            let r = current.block_on(async move {
                tokio::spawn(async move { p.alloc_blocking(4096).map(drop) })
                    .await
                    .unwrap()
            });
            assert!(matches!(r, Err(Error::WouldDeadlock { .. })), "{r:?}");
            let p = pool.clone();
            let r = actors.block_on(async move {
                tokio::spawn(async move { p.alloc_blocking(4096).map(drop) })
                    .await
                    .unwrap()
            });
            assert!(r.is_ok(), "a multi-thread runtime's task: {r:?}");
            assert!(pool.alloc_blocking(4096).is_ok(), "a plain thread again");
        }
    });
}

#[test]
fn every_blocking_call_of_the_pinned_allocator_is_refused_on_a_current_thread_runtime() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, sim) = sim_pool();
            let s = sim.stream();
            assert_would_deadlock(
                pool.alloc_blocking_on(64, &s),
                "alloc_blocking_on",
                "alloc_on(..).await",
            );
            assert_would_deadlock(
                pool.alloc_blocking_timeout(64, Duration::from_secs(1)),
                "alloc_blocking_timeout",
                "alloc_timeout(..).await",
            );
            assert_would_deadlock(
                pool.empty_cache_blocking(),
                "empty_cache_blocking",
                "empty_cache().await",
            );
            assert_would_deadlock(
                pool.history_blocking(),
                "history_blocking",
                "history().await",
            );
            let id = pinpool::PoolId::fresh();
            assert_would_deadlock(
                pool.begin_allocate_to_pool_blocking(id, |_| true),
                "begin_allocate_to_pool_blocking",
                "begin_allocate_to_pool(..).await",
            );
            assert_would_deadlock(
                pool.end_allocate_to_pool_blocking(id),
                "end_allocate_to_pool_blocking",
                "end_allocate_to_pool(..).await",
            );
            assert_would_deadlock(
                pool.release_pool_blocking(id),
                "release_pool_blocking",
                "release_pool(..).await",
            );
            // Nothing happened: no memory, and no capture began (the async calls see the
            // pool as never begun).
            assert_eq!(sim.total_host_allocs(), 0);
            assert_eq!(pool.release_pool(id).await, Err(Error::UnknownPool(id)));
        })
    });
}

#[test]
fn every_blocking_call_of_the_device_allocator_is_refused_on_a_current_thread_runtime() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, sim) = device_pool();
            let s = sim.stream();
            assert_would_deadlock(
                pool.alloc_blocking(64, &s),
                "alloc_blocking",
                "alloc(..).await",
            );
            assert_would_deadlock(
                pool.try_alloc_blocking(64, &s),
                "try_alloc_blocking",
                "try_alloc(..).await",
            );
            assert_would_deadlock(
                pool.alloc_blocking_timeout(64, &s, Duration::from_secs(1)),
                "alloc_blocking_timeout",
                "alloc_timeout(..).await",
            );
            assert_would_deadlock(
                pool.raw_alloc_with_stream(64, &s),
                "raw_alloc_with_stream",
                "alloc(..).await (its DeviceBuffer's device_ptr() is the address)",
            );
            assert_would_deadlock(
                pool.try_raw_alloc_with_stream(64, &s),
                "try_raw_alloc_with_stream",
                "try_alloc(..).await (its DeviceBuffer's device_ptr() is the address)",
            );
            assert_would_deadlock(
                pool.empty_cache_blocking(),
                "empty_cache_blocking",
                "empty_cache().await",
            );
            assert_would_deadlock(
                pool.history_blocking(0),
                "history_blocking",
                "history().await",
            );
            assert_eq!(pool.stats(0).unwrap().num_device_alloc, 0);
            assert_eq!(sim.device_used(0), Some(0));
        })
    });
}

#[test]
fn the_plan_sessions_blocking_calls_are_refused_on_a_current_thread_runtime() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, _sim) = sim_pool();
            let rec = pool.record_plan().unwrap();
            assert_plan_would_deadlock(rec.alloc_blocking(100), "alloc_blocking");
            let a = rec.alloc(100).await.unwrap();
            drop(a);
            let plan = rec.finish().plan_with(Planner::Greedy).unwrap();
            let validator = pool.validate_plan(&plan).unwrap();
            assert_plan_would_deadlock(validator.alloc_blocking(100), "alloc_blocking");
            drop(validator);
            assert_plan_would_deadlock(pool.serve_plan_blocking(&plan), "serve_plan_blocking");
            let mut session = pool.serve_plan(&plan).await.unwrap();
            assert_plan_would_deadlock(session.alloc_blocking(100), "ArenaSession::alloc_blocking");
            assert_plan_would_deadlock(session.reset_blocking(), "ArenaSession::reset_blocking");
            // The session goes on as if the refused calls had not been made.
            let b = session.alloc(100).await.unwrap();
            assert!(b.is_served());
            drop(b);
            session.reset().await.unwrap();
        })
    });
}

#[test]
fn a_task_spawned_on_a_current_thread_runtime_is_refused_too() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, _sim) = sim_pool();
            let p = pool.clone();
            let result = tokio::spawn(async move { p.alloc_blocking(1 << 20).map(|b| b.len()) })
                .await
                .unwrap();
            assert_would_deadlock(result, "alloc_blocking", "alloc(..).await");
        })
    });
}

#[test]
fn a_spawn_blocking_thread_of_a_current_thread_runtime_is_refused_and_can_block_on_the_async_call()
{
    // tokio cannot tell this thread from the one that runs the runtime's tasks, so the rule
    // refuses it too; `Handle::block_on` of the async call is the way from here.
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, _sim) = sim_pool();
            let p = pool.clone();
            let (refused, len) = tokio::task::spawn_blocking(move || {
                let refused = p.alloc_blocking(1 << 20).map(|b| b.len());
                let handle = tokio::runtime::Handle::current();
                let len = handle.block_on(p.alloc(1 << 20)).map(|b| b.len());
                (refused, len)
            })
            .await
            .unwrap();
            assert_would_deadlock(refused, "alloc_blocking", "alloc(..).await");
            assert_eq!(len.unwrap(), 1 << 20);
        })
    });
}

#[test]
fn a_plain_thread_may_block_while_a_current_thread_runtime_runs_the_actors() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, sim) = sim_pool();
            let p = pool.clone();
            let thread = std::thread::spawn(move || {
                let b = p.alloc_blocking(1 << 20)?;
                p.empty_cache_blocking()?;
                p.history_blocking()?;
                Ok::<_, Error>(b.len())
            });
            let len = tokio::task::spawn_blocking(move || thread.join().unwrap())
                .await
                .unwrap();
            assert_eq!(len.unwrap(), 1 << 20);
            assert_eq!(sim.total_host_allocs(), 1);
        })
    });
}

#[test]
fn a_callback_on_a_current_thread_runtime_may_call_the_blocking_api() {
    within(Duration::from_secs(20), || {
        current_thread().block_on(async {
            let (pool, _sim) = sim_pool();
            let done = Arc::new(AtomicUsize::new(0));
            let (p, d) = (pool.clone(), done.clone());
            pool.attach_trace_tracker(move |e| {
                if e.action == TraceAction::Alloc && d.load(Ordering::Relaxed) == 0 {
                    let b = p.alloc_blocking(1 << 20).expect("alloc from a callback");
                    drop(b);
                    p.history_blocking().expect("history from a callback");
                    d.fetch_add(1, Ordering::Relaxed);
                }
            });
            pool.record_history(true, 1000, HistoryContext::None)
                .unwrap();
            drop(pool.alloc(4096).await.unwrap());
            pinpool_testkit::eventually("the callback finished", || {
                done.load(Ordering::Relaxed) > 0
            })
            .await;
        })
    });
}

#[test]
fn on_a_multi_thread_runtime_every_blocking_call_works_from_a_worker_even_with_one_worker() {
    // With one worker, a blocking call on it that did not hand the worker's tasks over
    // would starve the actors, which run on that same worker.
    within(Duration::from_secs(30), || {
        let rt = multi_thread(1);
        rt.block_on(async {
            let (pool, sim) = sim_pool();
            let p = pool.clone();
            let s = sim.stream();
            tokio::spawn(async move {
                let id = pinpool::PoolId::fresh();
                for size in [4096, 1 << 20, 3 << 20] {
                    let b = p.alloc_blocking(size).unwrap();
                    assert_eq!(b.len(), size);
                }
                drop(p.alloc_blocking_on(1 << 16, &s).unwrap());
                drop(
                    p.alloc_blocking_timeout(5 << 20, Duration::from_secs(5))
                        .unwrap(),
                );
                p.begin_allocate_to_pool_blocking(id, |_| true).unwrap();
                drop(p.alloc_blocking_on(1 << 16, &s).unwrap());
                p.end_allocate_to_pool_blocking(id).unwrap();
                p.release_pool_blocking(id).unwrap();
                p.empty_cache_blocking().unwrap();
                p.record_history(true, 100, HistoryContext::None).unwrap();
                drop(p.alloc_blocking(64).unwrap());
                assert!(!p.history_blocking().unwrap().entries.is_empty());

                let (_, recording) = p
                    .record_plan_with_blocking(|rec| drop(rec.alloc_blocking(100).unwrap()))
                    .unwrap();
                let plan = recording.plan_with(Planner::Greedy).unwrap();
                let mut session = p.serve_plan_blocking(&plan).unwrap();
                assert!(session.alloc_blocking(100).unwrap().is_served());
                session.reset_blocking().unwrap();
            })
            .await
            .unwrap();
            drop(pool);
            pinpool_testkit::eventually("all memory given back", || sim.live_bytes() == 0).await;
        });
    });
}

#[test]
fn on_a_multi_thread_runtime_the_device_allocators_blocking_calls_work_from_a_worker() {
    within(Duration::from_secs(30), || {
        let rt = multi_thread(1);
        rt.block_on(async {
            let (pool, sim) = device_pool();
            let p = pool.clone();
            tokio::spawn(async move {
                let s = sim.stream();
                drop(p.alloc_blocking(1 << 20, &s).unwrap());
                drop(p.try_alloc_blocking(3 << 20, &s).unwrap());
                drop(
                    p.alloc_blocking_timeout(5 << 20, &s, Duration::from_secs(5))
                        .unwrap(),
                );
                let ptr = p.raw_alloc_with_stream(1 << 16, &s).unwrap();
                p.raw_delete(ptr).unwrap();
                p.empty_cache_blocking().unwrap();
                p.history_blocking(0).unwrap();
            })
            .await
            .unwrap();
        });
    });
}

/// A runtime built without timers (no `enable_time`, as `Runtime::new` and `enable_all` would
/// give) runs the pool actors like any other: the pinned and the device allocator keep
/// serving requests after their pools grew past the reserve cap (where an actor waits for a
/// pause in requests before it gives memory back).
#[test]
fn a_runtime_without_timers_keeps_serving_requests_after_the_pools_grow() {
    within(Duration::from_secs(30), || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let (pinned, device, sim) = rt.block_on(async {
            let sim = SimRuntime::new();
            let pinned = pinpool::PinnedAllocator::builder()
                .runtime(Arc::new(sim.clone()))
                .build()
                .unwrap();
            let device = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
            (pinned, device, sim)
        });
        let s = sim.stream();
        for size in [64, 3 << 20, 64 << 10, 8 << 20, 64, 3 << 20] {
            drop(pinned.alloc_blocking(size).unwrap());
            drop(device.alloc_blocking(size, &s).unwrap());
        }
    });
}
