//! Recording a run on the allocator, planning it, validating a later run against the plan
//! and serving later runs from one pinned arena.

use pinpool::plan::Lifetime;
use pinpool::plan::{
    check, ArenaPlan, ArenaSession, Mismatch, Plan, PlanSessionError, Planner, Recording,
};
use pinpool::sim::{SimDeviceBuffer, SimRuntime};
use pinpool::PinnedAllocator;
use pinpool_testkit::{on_plain_thread, sim_pool};

/// One step of a workload: allocate `size` bytes, or free allocation number `k`.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
}

/// A random workload of `n` allocations; some live to the end. Deterministic in `seed`.
fn workload(seed: u64, n: usize) -> Vec<Op> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ops = Vec::new();
    let mut live: Vec<usize> = Vec::new();
    for k in 0..n {
        while !live.is_empty() && next() % 3 == 0 {
            let i = (next() % live.len() as u64) as usize;
            ops.push(Op::Free(live.swap_remove(i)));
        }
        let size = match next() % 4 {
            0 => 1 + (next() % 100) as usize,
            1 => 4096,
            2 => 1 + (next() % 20_000) as usize,
            _ => (next() % 3000) as usize, // sometimes 0
        };
        ops.push(Op::Alloc(size));
        live.push(k);
    }
    for k in live.into_iter().filter(|k| k % 5 != 0) {
        ops.push(Op::Free(k));
    }
    ops
}

async fn record(pool: &PinnedAllocator<SimRuntime>, ops: &[Op]) -> Recording {
    let rec = pool.record_plan().unwrap();
    let mut bufs = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc(size) => bufs.push(Some(rec.alloc(size).await.unwrap())),
            Op::Free(k) => drop(bufs[k].take()),
        }
    }
    rec.finish()
}

/// Serves `ops` once, filling each buffer with its own byte and checking it at its free;
/// returns what each allocation got as a plan to check: (lifetime, arena offset), for the
/// served ones.
async fn serve_once(session: &mut ArenaSession<SimRuntime>, ops: &[Op]) -> Vec<(Lifetime, u64)> {
    let base = session.arena_ptr() as usize;
    let mut bufs = Vec::new();
    let mut seen: Vec<(Lifetime, u64)> = Vec::new();
    let mut index_of = Vec::new();
    for (t, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc(size) => {
                let mut buf = session.alloc(size).await.unwrap();
                assert_eq!(buf.len(), size);
                let k = bufs.len();
                buf.fill((k % 251) as u8 + 1);
                if buf.is_served() {
                    let offset = (buf.as_ptr() as usize - base) as u64;
                    assert_eq!(Some(offset as usize), buf.arena_offset());
                    index_of.push(Some(seen.len()));
                    seen.push((
                        Lifetime {
                            id: k,
                            size: size as u64,
                            start: t as u64,
                            end: ops.len() as u64,
                        },
                        offset,
                    ));
                } else {
                    index_of.push(None);
                }
                bufs.push(Some(buf));
            }
            Op::Free(k) => {
                let buf = bufs[k].take().unwrap();
                let byte = (k % 251) as u8 + 1;
                assert!(
                    buf.iter().all(|&b| b == byte),
                    "allocation {k} was overwritten while alive"
                );
                if let Some(i) = index_of[k] {
                    seen[i].0.end = t as u64;
                }
            }
        }
    }
    for (k, buf) in bufs.into_iter().enumerate() {
        if let Some(buf) = buf {
            let byte = (k % 251) as u8 + 1;
            assert!(buf.iter().all(|&b| b == byte), "allocation {k} overwritten");
        }
    }
    seen
}

/// The plan checker, run on what the arena actually handed out.
fn assert_disjoint(seen: Vec<(Lifetime, u64)>, arena_size: u64) {
    let (lifetimes, offsets): (Vec<_>, Vec<_>) = seen.into_iter().unzip();
    let observed = Plan::from_parts(lifetimes, offsets, 1, arena_size).unwrap();
    check(&observed).expect("served buffers overlapped while alive");
}

#[tokio::test]
async fn recording_captures_sizes_and_lifetimes_in_order_and_ignores_outside_allocations() {
    let (pool, _sim) = sim_pool();
    let rec = pool.record_plan().unwrap();
    let a = rec.alloc(1000).await.unwrap();
    let outside = pool.alloc(5000).await.unwrap();
    let b = rec.alloc(3000).await.unwrap();
    drop(a);
    drop(pool.alloc(7000).await.unwrap());
    let r = rec.clone();
    let c = on_plain_thread(move || r.alloc_blocking(900).unwrap()).await;
    drop(b);
    let recording = rec.finish();
    drop(c); // after the recording: c lives to its end
    drop(outside);

    let got: Vec<(u64, u64, u64)> = recording
        .lifetimes()
        .iter()
        .map(|l| (l.size, l.start, l.end))
        .collect();
    // a@0 b@1 free a@2 c@3 free b@4, end 5
    assert_eq!(got, [(1000, 0, 2), (3000, 1, 4), (900, 3, 5)]);
    assert_eq!(
        recording.allocator_id(),
        pinpool::tuning::engine(&pool).id()
    );
}

#[tokio::test]
async fn recording_from_several_tasks_notes_every_allocation() {
    let (pool, _sim) = sim_pool();
    let rec = pool.record_plan().unwrap();
    let mut tasks = Vec::new();
    for t in 0..4usize {
        let rec = rec.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25usize {
                let buf = rec.alloc(64 * (t + 1) + i).await.unwrap();
                tokio::task::yield_now().await;
                drop(buf);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let recording = rec.finish();
    assert_eq!(recording.lifetimes().len(), 100);
    let mut sizes: Vec<u64> = recording.lifetimes().iter().map(|l| l.size).collect();
    sizes.sort_unstable();
    let mut expected: Vec<u64> = (0..4u64)
        .flat_map(|t| (0..25u64).map(move |i| 64 * (t + 1) + i))
        .collect();
    expected.sort_unstable();
    assert_eq!(sizes, expected);
    // Every allocation is freed before the end, and after it starts.
    let end = 200;
    assert!(recording
        .lifetimes()
        .iter()
        .all(|l| l.start < l.end && l.end < end));
    let plan = recording.plan().unwrap();
    check(plan.plan()).unwrap();
}

#[tokio::test]
async fn recorder_clones_refuse_to_allocate_after_finish() {
    let (pool, _sim) = sim_pool();
    let rec = pool.record_plan().unwrap();
    let other = rec.clone();
    let _ = rec.finish();
    assert_eq!(
        other.alloc(64).await.unwrap_err(),
        PlanSessionError::Finished
    );
    // The allocator is free for another session at once.
    drop(pool.record_plan().unwrap());
}

#[tokio::test]
async fn record_plan_with_records_what_the_body_allocates() {
    let (pool, _sim) = sim_pool();
    let (out, recording) = pool
        .record_plan_with(|rec| async move {
            let a = rec.alloc(10).await?;
            let b = rec.alloc(20).await?;
            drop(a);
            Ok::<_, PlanSessionError>(b.len())
        })
        .await
        .unwrap();
    assert_eq!(out.unwrap(), 20);
    assert_eq!(recording.lifetimes().len(), 2);
    let p = pool.clone();
    let (_, recording) = on_plain_thread(move || {
        p.record_plan_with_blocking(|rec| drop(rec.alloc_blocking(30).unwrap()))
            .unwrap()
    })
    .await;
    assert_eq!(recording.lifetimes()[0].size, 30);
}

#[tokio::test]
async fn validation_accepts_the_recorded_run_and_reports_the_first_mismatch() {
    let (pool, _sim) = sim_pool();
    let ops = workload(1, 40);
    let plan = record(&pool, &ops).await.plan().unwrap();

    let check_run = |ops: Vec<Op>| {
        let pool = pool.clone();
        let plan = plan.clone();
        async move {
            let validator = pool.validate_plan(&plan).unwrap();
            let mut bufs = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let buf = validator.alloc(size).await.unwrap();
                        assert_eq!(buf.len(), size, "served by the pool as usual");
                        bufs.push(Some(buf));
                    }
                    Op::Free(k) => drop(bufs[k].take()),
                }
            }
            validator.finish()
        }
    };
    assert_eq!(check_run(ops.clone()).await, Ok(()));

    // Allocation number 3 asks for one byte more.
    let mut changed = ops.clone();
    let (event, size) = changed
        .iter_mut()
        .enumerate()
        .filter_map(|(e, op)| match op {
            Op::Alloc(size) => Some((e, size)),
            Op::Free(_) => None,
        })
        .nth(3)
        .unwrap();
    let expected = *size as u64;
    *size += 1;
    let err = check_run(changed).await.unwrap_err();
    assert_eq!(err.event, event);
    assert_eq!(
        err.mismatch,
        Mismatch::SizeMismatch {
            number: 3,
            expected,
            seen: expected + 1
        }
    );
}

#[tokio::test]
async fn a_served_run_does_no_allocator_work() {
    let (pool, sim) = sim_pool();
    let ops = workload(2, 200);
    let plan = record(&pool, &ops).await.plan().unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let before = pool.stats();
    let host_allocs = sim.total_host_allocs();
    for _ in 0..5 {
        let seen = serve_once(&mut session, &ops).await;
        assert_eq!(seen.len(), 200, "every allocation came from the arena");
        session.reset().await.unwrap();
    }
    let after = pool.stats();
    assert_eq!(after.num_host_alloc, before.num_host_alloc);
    assert_eq!(
        after.active_requests.allocated,
        before.active_requests.allocated
    );
    assert_eq!(after.allocations.allocated, before.allocations.allocated);
    assert_eq!(sim.total_host_allocs(), host_allocs);
    assert_eq!(sim.events_recorded(), 0);
    assert_eq!(
        session.stats(),
        pinpool::plan::ServeStats {
            served: 1000,
            fallbacks: 0,
            resets: 5,
            arena_swaps: 0
        }
    );
    assert!(session.mismatch().is_none());
}

#[tokio::test]
async fn served_buffers_are_views_of_the_arena_at_the_planned_offsets() {
    let (pool, _sim) = sim_pool();
    let ops = [
        Op::Alloc(1000),
        Op::Alloc(3000),
        Op::Free(0),
        Op::Alloc(900),
    ];
    let plan = record(&pool, &ops).await.plan().unwrap();
    let offsets = plan.plan().offsets().to_vec();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let base = session.arena_ptr();
    let a = session.alloc(1000).await.unwrap();
    let b = session.alloc(3000).await.unwrap();
    drop(a);
    let (session, c) = on_plain_thread(move || {
        let c = session.alloc_blocking(900).unwrap();
        (session, c)
    })
    .await;
    for (buf, offset) in [(&b, offsets[1]), (&c, offsets[2])] {
        assert!(buf.is_served());
        assert_eq!(buf.as_ptr(), base.wrapping_add(offset as usize));
    }
    assert_eq!(offsets[0], offsets[2], "c reuses a's bytes");
    drop((b, c, session));
}

#[tokio::test]
async fn served_buffers_never_overlap_while_alive() {
    let (pool, _sim) = sim_pool();
    for seed in 0..8 {
        let ops = workload(100 + seed, 120);
        // The best planner is slow in debug builds; the greedy one packs differently.
        let planner = if seed < 2 {
            Planner::Best
        } else {
            Planner::Greedy
        };
        let plan = record(&pool, &ops).await.plan_with(planner).unwrap();
        let mut session = pool.serve_plan(&plan).await.unwrap();
        for _ in 0..2 {
            let seen = serve_once(&mut session, &ops).await;
            assert_disjoint(seen, plan.arena_size());
            session.reset().await.unwrap();
        }
    }
}

#[tokio::test]
async fn a_request_that_departs_from_the_plan_falls_back_to_the_pool() {
    let (pool, _sim) = sim_pool();
    let ops = [
        Op::Alloc(1000),
        Op::Alloc(3000),
        Op::Free(0),
        Op::Alloc(900),
    ];
    let plan = record(&pool, &ops).await.plan().unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();

    // A wrong size.
    let a = session.alloc(1000).await.unwrap();
    let b = session.alloc(3001).await.unwrap();
    assert!(a.is_served() && !b.is_served());
    assert_eq!(
        session.mismatch(),
        Some(&Mismatch::SizeMismatch {
            number: 1,
            expected: 3000,
            seen: 3001
        })
    );
    // The rest of the iteration comes from the pool too.
    let c = session.alloc(3000).await.unwrap();
    assert!(!c.is_served());
    assert_eq!(session.stats().fallbacks, 2);
    drop((a, b, c));
    session.reset().await.unwrap();
    assert!(session.mismatch().is_none());

    // A free that comes too late: c is planned into a's bytes while a is alive.
    let mut a = session.alloc(1000).await.unwrap();
    let b = session.alloc(3000).await.unwrap();
    a.fill(0xAA);
    let mut c = session.alloc(900).await.unwrap();
    assert!(!c.is_served(), "a is alive: c must not get its bytes");
    c.fill(0xCC);
    assert!(a.iter().all(|&x| x == 0xAA));
    assert!(matches!(
        session.mismatch(),
        Some(Mismatch::FreedLate {
            number: 2,
            still_live: 0
        })
    ));
    drop((a, b, c));
    session.reset().await.unwrap();

    // More allocations than planned.
    let a = session.alloc(1000).await.unwrap();
    let b = session.alloc(3000).await.unwrap();
    drop(a);
    let c = session.alloc(900).await.unwrap();
    let d = session.alloc(900).await.unwrap();
    assert!(c.is_served() && !d.is_served());
    assert!(matches!(
        session.mismatch(),
        Some(Mismatch::TooManyAllocations {
            number: 3,
            planned: 3
        })
    ));
    drop((b, c, d));
}

#[tokio::test]
async fn plan_sessions_do_not_nest() {
    let (pool, _sim) = sim_pool();
    let id = pinpool::tuning::engine(&pool).id();
    let nested = PlanSessionError::Nested { allocator: id };
    let rec = pool.record_plan().unwrap();
    drop(rec.alloc(64).await.unwrap());
    assert_eq!(pool.record_plan().err(), Some(nested.clone()));
    let plan = rec.finish().plan().unwrap();

    let session = pool.serve_plan(&plan).await.unwrap();
    assert_eq!(pool.record_plan().err(), Some(nested.clone()));
    assert_eq!(pool.validate_plan(&plan).err(), Some(nested.clone()));
    assert_eq!(pool.serve_plan(&plan).await.err(), Some(nested.clone()));
    drop(session);

    let validator = pool.validate_plan(&plan).unwrap();
    let (p, pl) = (pool.clone(), plan.clone());
    let blocking = on_plain_thread(move || p.serve_plan_blocking(&pl).err()).await;
    assert_eq!(blocking, Some(nested));
    drop(validator);
    drop(pool.serve_plan(&plan).await.unwrap());

    // Another allocator is independent.
    let (other, _sim2) = sim_pool();
    let _rec = pool.record_plan().unwrap();
    drop(other.record_plan().unwrap());
}

#[tokio::test]
async fn a_plan_for_another_allocator_is_refused() {
    let (pool, _sim) = sim_pool();
    let (other, _sim2) = sim_pool();
    let rec = pool.record_plan().unwrap();
    drop(rec.alloc(64).await.unwrap());
    let plan: ArenaPlan = rec.finish().plan().unwrap();
    let foreign = PlanSessionError::ForeignPlan {
        plan_allocator: pinpool::tuning::engine(&pool).id(),
        allocator: pinpool::tuning::engine(&other).id(),
    };
    assert_eq!(other.serve_plan(&plan).await.err(), Some(foreign.clone()));
    assert_eq!(other.validate_plan(&plan).err(), Some(foreign));
    // Nothing was claimed: the other allocator can start a session.
    drop(other.record_plan().unwrap());
}

#[tokio::test]
async fn adopting_a_plan_checks_it() {
    let (pool, _sim) = sim_pool();
    let l = |id, start, end| Lifetime {
        id,
        size: 64,
        start,
        end,
    };
    let overlapping = Plan::from_parts(vec![l(0, 0, 2), l(1, 1, 3)], vec![0, 0], 64, 64).unwrap();
    assert!(matches!(
        pool.adopt_plan(overlapping),
        Err(PlanSessionError::Unsound(_))
    ));
    let empty = Plan::from_parts(vec![l(0, 0, 4), l(1, 2, 2)], vec![0, 0], 64, 128).unwrap();
    assert_eq!(
        pool.adopt_plan(empty).err(),
        Some(PlanSessionError::EmptyLifetime { index: 1 })
    );
    let good = Planner::Greedy.plan(&[l(0, 0, 2), l(1, 1, 3)]).unwrap();
    let plan = pool.adopt_plan(good).unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let (a, b) = (
        session.alloc(64).await.unwrap(),
        session.alloc(64).await.unwrap(),
    );
    assert!(a.is_served() && b.is_served());
    assert_ne!(a.as_ptr(), b.as_ptr());
}

#[tokio::test]
async fn reset_waits_until_every_buffer_of_the_iteration_is_dropped() {
    let (pool, _sim) = sim_pool();
    let ops = [
        Op::Alloc(1000),
        Op::Alloc(3000),
        Op::Free(0),
        Op::Alloc(900),
    ];
    let plan = record(&pool, &ops).await.plan().unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let a = session.alloc(1000).await.unwrap();
    let b = session.alloc(3000).await.unwrap();
    assert_eq!(session.live(), 2);
    assert_eq!(session.try_reset(), Err(PlanSessionError::Busy { live: 2 }));
    drop(a);
    // A buffer dropped on another task lets the waiting reset go on.
    let dropper = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        drop(b);
    });
    session.reset().await.unwrap();
    dropper.await.unwrap();
    assert_eq!((session.live(), session.position()), (0, 0));
    assert_eq!(session.try_reset(), Ok(()));
    let a = session.alloc(1000).await.unwrap();
    assert!(a.is_served());
}

#[tokio::test]
async fn stream_work_on_served_buffers_is_never_overwritten() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let ops = [Op::Alloc(4096), Op::Free(0), Op::Alloc(4096), Op::Free(1)];
    let plan = record(&pool, &ops).await.plan().unwrap();
    let offsets = plan.plan().offsets();
    assert_eq!(offsets[0], offsets[1], "the plan reuses the bytes");
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let (dev1, dev2, dev3) = (
        SimDeviceBuffer::new(4096),
        SimDeviceBuffer::new(4096),
        SimDeviceBuffer::new(4096),
    );

    let hold = stream.hold();
    // Iteration 1: a's copy is queued when a is freed; b is planned into a's bytes.
    let mut a = session.alloc(4096).await.unwrap();
    a.fill(0xA1);
    stream.copy_to_device(a.as_ptr(), 4096, &dev1).unwrap();
    a.record_stream(&stream).unwrap();
    drop(a);
    let mut b = session.alloc(4096).await.unwrap();
    assert!(
        !b.is_served(),
        "a's copy has not run: b must not get its bytes"
    );
    b.fill(0xB2);
    stream.copy_to_device(b.as_ptr(), 4096, &dev2).unwrap();
    b.record_stream(&stream).unwrap();
    drop(b);
    assert_eq!(session.try_reset(), Err(PlanSessionError::StreamsPending));

    // The next iteration gets another arena while the copies are queued.
    let old_arena = session.arena_ptr();
    session.reset().await.unwrap();
    assert_eq!(session.stats().arena_swaps, 1);
    assert_ne!(session.arena_ptr(), old_arena);
    let mut a = session.alloc(4096).await.unwrap();
    assert!(a.is_served());
    a.fill(0xC3);
    stream.copy_to_device(a.as_ptr(), 4096, &dev3).unwrap();
    a.record_stream(&stream).unwrap();
    drop(a);

    hold.release();
    stream.synchronize().unwrap();
    assert_eq!(dev1.to_vec(), vec![0xA1; 4096]);
    assert_eq!(dev2.to_vec(), vec![0xB2; 4096]);
    assert_eq!(dev3.to_vec(), vec![0xC3; 4096]);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());

    // Once the copies are done, the bytes are served again, and reset keeps the arena.
    let b = session.alloc(4096).await.unwrap();
    assert!(b.is_served());
    drop(b);
    session.reset().await.unwrap();
    assert_eq!(session.stats().arena_swaps, 1);
}

#[tokio::test]
async fn random_runs_with_queued_copies_see_no_early_reuse() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let ops = workload(7, 60);
    let plan = record(&pool, &ops).await.plan().unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    for iteration in 0..4u8 {
        let hold = (iteration % 2 == 0).then(|| stream.hold());
        let mut bufs = Vec::new();
        let mut copies = Vec::new();
        for op in &ops {
            match *op {
                Op::Alloc(size) => {
                    let mut buf = session.alloc(size).await.unwrap();
                    let byte = (bufs.len() % 200) as u8 + iteration;
                    buf.fill(byte);
                    if size > 0 {
                        let dev = SimDeviceBuffer::new(size);
                        stream.copy_to_device(buf.as_ptr(), size, &dev).unwrap();
                        buf.record_stream(&stream).unwrap();
                        copies.push((dev, byte, size));
                    }
                    bufs.push(Some(buf));
                }
                Op::Free(k) => drop(bufs[k].take()),
            }
        }
        drop(bufs);
        session.reset().await.unwrap();
        drop(hold);
        stream.synchronize().unwrap();
        for (dev, byte, size) in copies {
            assert_eq!(dev.to_vec(), vec![byte; size]);
        }
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert!(session.stats().served > 0);
}

#[tokio::test]
async fn dropping_the_session_while_buffers_are_alive_keeps_stream_ordering() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let ops = [Op::Alloc(4096), Op::Free(0)];
    let plan = record(&pool, &ops).await.plan().unwrap();
    let mut session = pool.serve_plan(&plan).await.unwrap();
    let hold = stream.hold();
    let dev = SimDeviceBuffer::new(4096);
    let mut a = session.alloc(4096).await.unwrap();
    a.fill(0x5A);
    stream.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&stream).unwrap();
    let arena = session.arena_ptr();
    drop(session);
    assert!(
        a.iter().all(|&x| x == 0x5A),
        "the arena outlives the session"
    );
    drop(a);
    // The arena went back to the pool, held back by the copy's event.
    let mut other = pool.alloc(4096).await.unwrap();
    assert_ne!(other.as_ptr(), arena);
    other.fill(0);
    hold.release();
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), vec![0x5A; 4096]);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[test]
fn the_blocking_api_works_from_plain_threads() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (pool, _sim) = rt.block_on(async { sim_pool() });
    std::thread::spawn(move || {
        let (_, recording) = pool
            .record_plan_with_blocking(|rec| {
                let a = rec.alloc_blocking(100).unwrap();
                let b = rec.alloc_blocking(200).unwrap();
                drop(a);
                drop(b);
            })
            .unwrap();
        let plan = recording.plan_with(Planner::Greedy).unwrap();
        let mut session = pool.serve_plan_blocking(&plan).unwrap();
        for _ in 0..3 {
            let a = session.alloc_blocking(100).unwrap();
            let b = session.alloc_blocking(200).unwrap();
            assert!(a.is_served() && b.is_served());
            drop((a, b));
            session.reset_blocking().unwrap();
        }
    })
    .join()
    .unwrap();
}

/// Runs iterations of a two-buffer plan on `session`, each reset with `reset_blocking` while
/// another thread drops the iteration's last buffer (before, during or after the wait).
fn reset_blocking_while_another_thread_frees(session: &mut ArenaSession<SimRuntime>, rounds: u64) {
    let resets = session.stats().resets;
    for _ in 0..rounds {
        let a = session.alloc_blocking(100).unwrap();
        let b = session.alloc_blocking(200).unwrap();
        assert!(a.is_served() && b.is_served());
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let dropper = std::thread::spawn(move || {
            wait.recv().unwrap();
            drop(b);
        });
        drop(a);
        go.send(()).unwrap();
        session.reset_blocking().unwrap();
        assert_eq!(session.live(), 0);
        dropper.join().unwrap();
    }
    let stats = session.stats();
    assert_eq!(stats.resets, resets + rounds);
    assert_eq!(stats.arena_swaps, 0, "no stream work: the arena is kept");
    assert_eq!(stats.fallbacks, 0);
}

#[test]
fn reset_blocking_waits_for_a_buffer_freed_by_another_thread_on_plain_and_worker_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let (pool, _sim) = rt.block_on(async { sim_pool() });
    let (_, recording) = pool
        .record_plan_with_blocking(|rec| {
            let a = rec.alloc_blocking(100).unwrap();
            let b = rec.alloc_blocking(200).unwrap();
            drop((a, b));
        })
        .unwrap();
    let plan = recording.plan_with(Planner::Greedy).unwrap();
    // A plain thread: the reset is driven outside any runtime.
    let mut session = std::thread::scope(|s| {
        s.spawn(|| {
            let mut session = pool.serve_plan_blocking(&plan).unwrap();
            reset_blocking_while_another_thread_frees(&mut session, 200);
            session
        })
        .join()
        .unwrap()
    });
    // A multi-thread runtime's worker: the reset blocks in place.
    session = rt
        .block_on(rt.spawn(async move {
            reset_blocking_while_another_thread_frees(&mut session, 200);
            session
        }))
        .unwrap();
    assert_eq!(session.stats().resets, 400);
}
