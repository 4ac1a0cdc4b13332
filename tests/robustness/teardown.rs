//! Teardown and cancellation on the simulated runtime: the tokio runtime shut down under
//! the allocator (requests waiting at the cap, blocks waiting on events, capture pools
//! holding blocks), futures dropped at every await point, and tasks aborted while they hold
//! buffers. Nothing panics, no block is handed out twice, and once everything is dropped
//! and the streams' work is done, every byte of pinned memory is back.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use pinpool::plan::Planner;
use pinpool::sim::SimRuntime;
use pinpool::tuning::BestFit;
use pinpool::{Builder, Error, HistoryContext, PinnedAllocator};
use pinpool_testkit::{
    assert_books_balance, eventually, eventually_blocking, multi_thread, sim_pool,
};

const MIB: usize = 1 << 20;

/// An allocator on a fresh simulated runtime whose actors run on `rt`.
fn pool_on(rt: &tokio::runtime::Runtime) -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    (pool, sim)
}

/// What holds once everything is dropped and the streams are idle: the runtime got every
/// byte back, freed each allocation once, and no copy ever read or wrote a block that was
/// handed out again before its work was done.
fn assert_all_memory_back(sim: &SimRuntime) {
    eventually_blocking("all memory back", || sim.live_bytes() == 0);
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// A task's outcome once its runtime is gone (`JoinHandle`s can still be awaited).
fn outcome<T: Send + 'static>(
    task: tokio::task::JoinHandle<T>,
) -> Result<T, tokio::task::JoinError> {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(task)
}

#[test]
fn shutting_the_runtime_down_while_requests_wait_at_the_cap_cancels_them_and_loses_nothing() {
    let sim = SimRuntime::new();
    let rt = multi_thread(2);
    let pool = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .max_bytes(MIB)
        .alloc_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let held = pool.alloc_blocking(MIB).unwrap();
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let p = pool.clone();
            rt.spawn(async move { p.alloc(MIB / 2 + i * 4096).await.map(|b| b.len()) })
        })
        .collect();
    let blocking = {
        let p = pool.clone();
        std::thread::spawn(move || p.alloc_blocking(MIB).map(|b| b.len()))
    };
    // Let them reach the cap (one that has not yet is cancelled all the same).
    std::thread::sleep(Duration::from_millis(20));
    assert!(waiters.iter().all(|w| !w.is_finished()), "none got room");
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(blocking.join().unwrap(), Err(Error::Shutdown));
    for w in waiters {
        assert!(outcome(w).unwrap_err().is_cancelled());
    }
    // The buffer held across the shutdown still works, and goes back when dropped.
    let mut held = held;
    held.fill(7);
    assert!(held.iter().all(|&b| b == 7));
    drop(held);
    assert_eq!(pool.alloc_blocking(64).unwrap_err(), Error::Shutdown);
    drop(pool);
    assert_all_memory_back(&sim);
}

#[test]
fn shutting_the_runtime_down_after_stream_work_finished_frees_blocks_that_waited_on_it() {
    // Blocks freed with events recorded, whose work is done by the time the runtime goes:
    // whether or not the poller noticed yet, they go back.
    for round in 0..20 {
        let rt = multi_thread(2);
        let (pool, sim) = pool_on(&rt);
        let stream = sim.stream();
        let hold = stream.hold();
        for i in 0..8 {
            let mut b = pool.alloc_blocking(4096 << (i % 3)).unwrap();
            stream.write_host(b.as_mut_ptr(), b.len(), i as u8).unwrap();
            b.record_stream(&stream).unwrap();
            drop(b); // waits on the stream's event
        }
        drop(hold);
        stream.synchronize().unwrap();
        if round % 2 == 1 {
            std::thread::sleep(Duration::from_millis(5)); // the poller may have seen them
        }
        drop(rt);
        drop(pool);
        assert_all_memory_back(&sim);
    }
}

#[test]
fn shutting_the_runtime_down_while_blocks_wait_on_unfinished_work_never_frees_them_early() {
    // The work still queued on the stream writes into the freed blocks after the runtime is
    // gone: those blocks must not have gone back to the runtime (leaked, with a warning,
    // rather than freed under running work).
    let sim = SimRuntime::new();
    let rt = multi_thread(2);
    let pool = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .policy(Arc::new(BestFit::default().separate_segments()))
        .build()
        .unwrap();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut cached = Vec::new();
    for i in 0..6 {
        let mut b = pool.alloc_blocking(8192 * (i + 1)).unwrap();
        stream.write_host(b.as_mut_ptr(), b.len(), 0xA5).unwrap();
        b.record_stream(&stream).unwrap();
        drop(b);
        cached.push(pool.alloc_blocking(100_000 + i).unwrap());
    }
    drop(cached);
    drop(rt);
    drop(pool);
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert_eq!(
        sim.total_host_allocs(),
        sim.total_host_frees() + sim.live_allocations(),
    );
}

#[test]
fn shutting_the_runtime_down_while_a_capture_pool_keeps_blocks_keeps_them_from_reuse() {
    let rt = multi_thread(2);
    let (pool, sim) = pool_on(&rt);
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool_blocking(id, |_| true).unwrap();
    cap.begin_capture().unwrap();
    let mut kept = pool.alloc_blocking_on(4096, &cap).unwrap();
    cap.write_host(kept.as_mut_ptr(), kept.len(), 3).unwrap();
    kept.record_stream(&cap).unwrap();
    drop(kept); // used by captured work: kept while the pool lives
    let live = pool.alloc_blocking_on(1024, &cap).unwrap();
    let graph = cap.end_capture().unwrap();
    rt.shutdown_timeout(Duration::from_secs(5));
    // The graph still replays into the kept block: it was not freed or reused.
    graph.launch(&sim.stream()).unwrap();
    drop(live);
    drop(pool);
    drop(graph);
    eventually_blocking("what is not kept is back", || {
        sim.total_host_frees() + 1 == sim.total_host_allocs()
    });
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// Polls `fut` at most `polls` times (yielding to the runtime between polls), then drops
/// it: `Some(output)` if it finished first.
async fn poll_then_drop<F: Future>(fut: F, polls: usize) -> Option<F::Output> {
    let mut fut = pin!(fut);
    for _ in 0..polls {
        let once = std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        if once.is_some() {
            return once;
        }
        tokio::task::yield_now().await;
    }
    None
}

/// Every async call, dropped after each number of polls from 0 to `max_polls`: the books
/// balance after each, and everything comes back at the end.
async fn drop_at_every_await_point(
    pool: &PinnedAllocator<SimRuntime>,
    sim: &SimRuntime,
    max_polls: usize,
) {
    let stream = sim.stream();
    for polls in 0..=max_polls {
        // A miss (fresh memory), a cached hit, and a stream's pool.
        drop(poll_then_drop(pool.alloc(3 * MIB + polls * 4096), polls).await);
        drop(poll_then_drop(pool.alloc(4096), polls).await);
        drop(poll_then_drop(pool.alloc_on(64 << (polls % 8), &stream), polls).await);
        // Waiting at the cap (the cap is 8 MiB; 5 MiB are held).
        let held = pool.alloc(5 * MIB).await.unwrap();
        drop(poll_then_drop(pool.alloc(4 * MIB), polls).await);
        drop(poll_then_drop(pool.alloc_timeout(4 * MIB, Duration::from_secs(5)), polls).await);
        drop(held);
        // Round trips to the actors.
        drop(poll_then_drop(pool.empty_cache(), polls).await);
        drop(poll_then_drop(pool.history(), polls).await);
        drop(poll_then_drop(pool.snapshot(), polls).await);
        let id = pinpool::PoolId::fresh();
        if let Some(Ok(())) = poll_then_drop(pool.begin_allocate_to_pool(id, |_| true), polls).await
        {
            let _ = poll_then_drop(pool.end_allocate_to_pool(id), polls).await;
            // Whether or not the end went through, finish the pool's life properly.
            let _ = pool.end_allocate_to_pool(id).await;
            pool.release_pool(id).await.unwrap();
        }
        // A plan session: serving, and a reset dropped half way.
        let rec = pool.record_plan().unwrap();
        drop(rec.alloc(1000).await.unwrap());
        let plan = rec.finish().plan_with(Planner::Greedy).unwrap();
        if let Some(Ok(mut session)) = poll_then_drop(pool.serve_plan(&plan), polls).await {
            drop(poll_then_drop(session.alloc(1000), polls).await);
            drop(poll_then_drop(session.reset(), polls).await);
        }
        pinpool_testkit::eventually_nothing_in_use(pool).await;
        eventually("no request in flight", || {
            pool.stats().active_requests.current == 0
        })
        .await;
        pool.empty_cache().await.unwrap();
        assert_books_balance(pool, sim, 0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn futures_dropped_at_every_await_point_leave_the_books_balanced() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(8 * MIB)
        .build()
        .unwrap();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    drop_at_every_await_point(&pool, &sim, 12).await;
    drop(pool);
    eventually("all memory back", || sim.live_bytes() == 0).await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0);
}

#[tokio::test]
async fn futures_dropped_at_every_await_point_on_a_current_thread_runtime_leave_the_books_balanced()
{
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(8 * MIB)
        .build()
        .unwrap();
    drop_at_every_await_point(&pool, &sim, 8).await;
    drop(pool);
    eventually("all memory back", || sim.live_bytes() == 0).await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_aborted_while_holding_buffers_give_them_back_and_none_is_shared() {
    let (pool, sim) = sim_pool();
    let pool = Arc::new(pool);
    for round in 0..10u64 {
        let tasks: Vec<_> = (0..8u8)
            .map(|t| {
                let pool = pool.clone();
                let stream = sim.stream();
                tokio::spawn(async move {
                    let mut held = Vec::new();
                    for i in 0..50usize {
                        let size = 512 << ((i + usize::from(t)) % 6);
                        let mut b = pool.alloc(size).await.unwrap();
                        b.fill(t);
                        if i % 3 == 0 {
                            b.record_stream(&stream).unwrap();
                        }
                        held.push(b);
                        tokio::task::yield_now().await;
                        // No other task writes into a buffer this task holds.
                        assert!(held.iter().all(|b| pinpool_testkit::all_bytes_are(b, t)));
                        if held.len() > 4 {
                            held.remove(0);
                        }
                    }
                })
            })
            .collect();
        // Abort them at different points of their work.
        for (k, task) in tasks.iter().enumerate() {
            if (k as u64 + round) % 3 != 0 {
                for _ in 0..(k as u64 * 3 + round) % 17 {
                    tokio::task::yield_now().await;
                }
                task.abort();
            }
        }
        for task in tasks {
            match task.await {
                Ok(()) => {}
                Err(e) => assert!(e.is_cancelled(), "a task panicked: {e}"),
            }
        }
        pinpool_testkit::eventually_nothing_in_use(&pool).await;
        assert_books_balance(&pool, &sim, 0).await;
    }
    drop(pool);
    eventually("all memory back", || sim.live_bytes() == 0).await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[test]
fn buffers_dropped_on_other_threads_while_the_runtime_shuts_down_all_come_back() {
    // Frees racing the pool actor's teardown: each goes to the ready queue, to the actor, or
    // (the actor gone) straight back to the runtime, and none is stranded in between.
    for round in 0..40 {
        let rt = multi_thread(2);
        let (pool, sim) = pool_on(&rt);
        let bufs: Vec<_> = (0..64)
            .map(|i| pool.alloc_blocking(512 << (i % 5)).unwrap())
            .collect();
        let start = Arc::new(std::sync::Barrier::new(3));
        let mut chunks = bufs.into_iter();
        let droppers: Vec<_> = (0..2)
            .map(|_| {
                let chunk: Vec<_> = chunks.by_ref().take(32).collect();
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    for b in chunk {
                        drop(b);
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        start.wait();
        if round % 2 == 0 {
            std::thread::yield_now();
        }
        drop(rt);
        for d in droppers {
            d.join().unwrap();
        }
        drop(pool);
        assert_all_memory_back(&sim);
    }
}

/// The tokio runtime shut down while the pool actor waits for the memory source to unmap
/// idle memory (here an empty-cache's unmap, which waits for the device's queued work):
/// the actor goes at that wait, the unmap still runs, and what it unmapped must not be
/// unmapped again when the range goes back with its last block.
#[test]
fn shutting_the_runtime_down_while_the_pool_actor_waits_for_an_unmap_unmaps_nothing_twice() {
    let rt = multi_thread(2);
    let sim = SimRuntime::new();
    let pool = pinpool::DeviceBuilder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let s = sim.stream();
    // A live block, and an idle one beside it: its granules are idle once it is freed.
    let live = pool.alloc_blocking(4 * MIB, &s).unwrap();
    drop(pool.alloc_blocking(8 * MIB, &s).unwrap());
    // Work queued on the device: an unmap waits for it.
    let busy = sim.stream();
    busy.delay(Duration::from_millis(500));
    let p = pool.clone();
    let emptying = std::thread::spawn(move || p.empty_cache_blocking());
    // The pool actor is waiting for the unmap of the idle granules.
    std::thread::sleep(Duration::from_millis(100));
    drop(rt);
    let _ = emptying.join().unwrap();
    drop(pool);
    drop(live);
    busy.synchronize().unwrap();
    eventually_blocking("all device memory back", || sim.device_used(0) == Some(0));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// Calls that wait on an actor's answer — the pool actors', the router's (`empty_cache` asks
/// it last, for the released capture pools), the history actor's, the event poller's (a
/// snapshot asks it for the blocks pending) — made again and again while the runtime shuts
/// down: each returns, answered or `Error::Shutdown`, and none waits for ever on a message
/// a gone actor left unread.
#[test]
fn calls_to_the_actors_racing_the_runtimes_shutdown_all_return() {
    for round in 0..60u64 {
        let rt = multi_thread(2);
        let (pool, _sim) = pool_on(&rt);
        let (tx, rx) = std::sync::mpsc::channel();
        let p = pool.clone();
        std::thread::spawn(move || {
            let local = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let err = loop {
                let res = match round % 3 {
                    0 => p.empty_cache_blocking().map(drop),
                    1 => p.history_blocking().map(drop),
                    _ => local.block_on(p.snapshot()).map(drop),
                };
                if let Err(e) = res {
                    break e;
                }
            };
            let _ = tx.send(err);
        });
        std::thread::sleep(Duration::from_millis(round % 5));
        drop(rt);
        let err = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("round {round}: the call never returned"));
        assert_eq!(err, Error::Shutdown, "round {round}");
    }
}
