//! Checkpoints of capture pools on the simulated device: `checkpoint_state` lists a pool's
//! segments and blocks; `set_checkpoint_pool_state` frees the raw blocks allocated since
//! and allocates the checkpoint's blocks again at exactly their old addresses, so that
//! graphs replay against them. A buffer a user holds in the way, and bad input, are typed
//! errors that change nothing.

use pinpool::sim::{HoldGuard, SimRuntime, SimStream};
use pinpool::{DeviceAllocator, Error, PoolCheckpoint, PoolId};
use pinpool_testkit::all_bytes_are;
use pinpool_testkit::sim_device_pool as device_pool;

const MIB: usize = 1 << 20;

async fn route(pool: &DeviceAllocator<SimRuntime>, s: &SimStream, id: PoolId) {
    let wanted = s.id();
    pool.begin_allocate_to_pool(0, id, move |t| t.id() == wanted)
        .await
        .unwrap();
}

/// A raw allocation of `size` bytes in capture pool `id`, routed from `s` for this one call.
async fn raw_in_pool(
    pool: &DeviceAllocator<SimRuntime>,
    s: &SimStream,
    id: PoolId,
    size: usize,
) -> u64 {
    route(pool, s, id).await;
    let ptr = pool.raw_alloc_with_stream(size, s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    ptr
}

/// Enqueues on `other`, held back, a copy that reads `ptr`, and records `other` on it;
/// the copy's destination (a raw block of `other`'s own pool) and the hold come back.
fn read_on_held_stream(
    pool: &DeviceAllocator<SimRuntime>,
    other: &SimStream,
    ptr: u64,
) -> (HoldGuard, u64) {
    let hold = other.hold();
    let scratch = pool.raw_alloc_with_stream(4096, other).unwrap();
    other.copy_dtod(ptr, scratch, 4096).unwrap();
    pool.raw_record_stream(ptr, other).unwrap();
    (hold, scratch)
}

/// Starts restoring `state` and stops waiting for it after 50 ms (it is still under way).
async fn give_up_restoring(
    pool: &DeviceAllocator<SimRuntime>,
    state: &PoolCheckpoint,
    s: &SimStream,
) {
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_millis(50),
        pool.set_checkpoint_pool_state(0, state, s),
    )
    .await;
    assert!(gave_up.is_err(), "the restore waits for the held stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restoring_gives_back_the_checkpoints_blocks_at_their_addresses_and_frees_newer_raw_ones() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    route(&pool, &s, id).await;
    let a = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    let b = pool.raw_alloc_with_stream(2 * MIB, &s).unwrap();
    let c = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    pool.raw_delete(c).unwrap(); // freed before the checkpoint
    pool.end_allocate_to_pool(0, id).await.unwrap();
    s.synchronize().unwrap();
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    assert_eq!(checkpoint.pool, id);
    assert_eq!(checkpoint.device, Some(0));
    assert_eq!(
        checkpoint.allocated(),
        {
            let mut v = vec![(a as usize, MIB), (b as usize, 2 * MIB)];
            v.sort();
            v
        },
        "two live blocks; the freed one is not allocated"
    );

    // Later: both live blocks freed, others allocated (some where they were).
    pool.raw_delete(a).unwrap();
    pool.raw_delete(b).unwrap();
    route(&pool, &s, id).await;
    let newer: Vec<u64> = [3 * MIB, MIB / 2, MIB]
        .iter()
        .map(|&n| pool.raw_alloc_with_stream(n, &s).unwrap())
        .collect();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    s.synchronize().unwrap();

    let delta = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap();
    let mut freed = delta.ptrs_freed.clone();
    freed.sort();
    let mut expect_freed = newer.clone();
    expect_freed.sort();
    assert_eq!(freed, expect_freed, "every newer raw block is freed");
    let mut allocd = delta.dataptrs_allocd.clone();
    allocd.sort();
    let mut expect = vec![a, b];
    expect.sort();
    assert_eq!(allocd, expect, "exactly the checkpoint's addresses");
    // A newer block may have been cut where a checkpoint's block was (its stream had run
    // all its work when it was freed): that address is live again, as the checkpoint's.
    for p in newer.iter().filter(|p| !expect.contains(p)) {
        assert_eq!(pool.raw_delete(*p), Err(Error::UnknownPointer { ptr: *p }));
    }
    let now = pool.checkpoint_state(0, id).await.unwrap();
    assert_eq!(now.allocated(), checkpoint.allocated());
    assert!(pool
        .check_pool_live_allocations(0, id, &[a, b])
        .await
        .unwrap());

    // Restoring again to the same state changes nothing.
    let again = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap();
    assert!(again.ptrs_freed.is_empty() && again.dataptrs_allocd.is_empty());
    pool.raw_delete(a).unwrap();
    pool.raw_delete(b).unwrap();
    s.synchronize().unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    // The frees wait for their events, which the poller notices soon.
    let mut active = -1;
    for _ in 0..200 {
        active = pool.pool_stats(0, id).unwrap().active_bytes.all.current;
        if active == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(active, 0, "the books balance");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_buffer_in_the_way_is_a_typed_error_and_changes_nothing() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    route(&pool, &s, id).await;
    let a = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    pool.raw_delete(a).unwrap();
    route(&pool, &s, id).await;
    let held = pool.alloc(3 * MIB, &s).await.unwrap(); // a user's buffer, not in it
    let raw = pool.raw_alloc_with_stream(2 * MIB, &s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    s.synchronize().unwrap();

    // The inventory first: the pool actors take back the blocks that went home without a
    // message (`a`, freed above) before they answer, and their statistics follow then.
    let inventory = pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .inventory()
        .await
        .unwrap();
    let stats = pool.pool_stats(0, id).unwrap();
    let before = pool.checkpoint_state(0, id).await.unwrap();
    let err = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::CheckpointConflict {
            pool: id,
            ptrs: vec![held.device_ptr()],
        }
    );
    assert_eq!(pool.pool_stats(0, id).unwrap(), stats);
    assert_eq!(
        pinpool::tuning::device_engine(&pool, 0)
            .unwrap()
            .inventory()
            .await
            .unwrap(),
        inventory
    );
    assert_eq!(pool.checkpoint_state(0, id).await.unwrap(), before);
    // The raw block it would have freed is still the caller's.
    pool.raw_delete(raw).unwrap();
    // Once the buffer is gone, the restore goes through.
    drop(held);
    s.synchronize().unwrap();
    let delta = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap();
    assert_eq!(delta.dataptrs_allocd, vec![a]);
    pool.raw_delete(a).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_pools_devices_and_bad_states_are_typed_errors() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let unknown = pinpool::PoolId::fresh();
    assert_eq!(
        pool.checkpoint_state(0, unknown).await,
        Err(Error::UnknownPool(unknown))
    );
    assert_eq!(
        pool.checkpoint_state(0, PoolId::DEFAULT).await,
        Err(Error::DefaultPoolId)
    );
    assert!(matches!(
        pool.checkpoint_state(9, unknown).await,
        Err(Error::NoSuchDevice { ordinal: 9, .. })
    ));

    let id = pinpool::PoolId::fresh();
    route(&pool, &s, id).await;
    let a = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    assert_eq!(
        pool.set_checkpoint_pool_state(0, &checkpoint, &s).await,
        Err(Error::PoolCapturing(id)),
        "not while a capture allocates to it"
    );
    pool.end_allocate_to_pool(0, id).await.unwrap();
    assert!(matches!(
        pool.set_checkpoint_pool_state(9, &checkpoint, &s).await,
        Err(Error::NoSuchDevice { .. })
    ));
    let mut other = checkpoint.clone();
    other.pool = unknown;
    assert_eq!(
        pool.set_checkpoint_pool_state(0, &other, &s).await,
        Err(Error::UnknownPool(unknown))
    );
    let mut elsewhere = checkpoint.clone();
    elsewhere.device = Some(3);
    assert!(matches!(
        pool.set_checkpoint_pool_state(0, &elsewhere, &s).await,
        Err(Error::InvalidCheckpoint { .. })
    ));
    // The allocated block listed twice (free pieces may come first in its segment).
    let allocated = |c: &pinpool::PoolCheckpoint| {
        c.segments[0]
            .blocks
            .iter()
            .position(|b| b.state == pinpool::BlockStatus::InUse)
            .expect("the allocated block is listed")
    };
    let mut twice = checkpoint.clone();
    let block = twice.segments[0].blocks[allocated(&checkpoint)].clone();
    twice.segments[0].blocks.push(block);
    assert!(matches!(
        pool.set_checkpoint_pool_state(0, &twice, &s).await,
        Err(Error::InvalidCheckpoint { .. })
    ));
    // A hand-made block whose end wraps around the address space.
    let mut wraps = checkpoint.clone();
    let mut block = wraps.segments[0].blocks[allocated(&checkpoint)].clone();
    block.address += 4 * MIB;
    block.size = usize::MAX - 4 * MIB + 513; // aligned, and the end passes 2^64
    wraps.segments[0].blocks.push(block);
    assert!(matches!(
        pool.set_checkpoint_pool_state(0, &wraps, &s).await,
        Err(Error::InvalidCheckpoint { .. })
    ));
    // Nothing changed: the raw block is still live, and the pool still serves.
    pool.raw_delete(a).unwrap();
    pool.raw_delete(pool.raw_alloc_with_stream(MIB, &s).unwrap())
        .unwrap();
}

/// A restore whose caller stops waiting (its future dropped while the restore waits for a
/// held stream's work on a block to free) still finishes once the work is done, and what it
/// would have lent is freed: the books balance and nothing was reused early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_whose_caller_stopped_waiting_leaves_the_books_balanced() {
    let (pool, sim) = device_pool();
    let (s, other) = (sim.stream(), sim.stream());
    let id = pinpool::PoolId::fresh();
    let a = raw_in_pool(&pool, &s, id, MIB).await;
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    pool.raw_delete(a).unwrap();
    let b = raw_in_pool(&pool, &s, id, 2 * MIB).await;
    // Work on another stream reads `b` and is held back.
    let (hold, scratch) = read_on_held_stream(&pool, &other, b);
    give_up_restoring(&pool, &checkpoint, &s).await;
    // `b` left the raw table with the restore.
    assert!(pool.raw_delete(b).is_err());
    drop(hold);
    other.synchronize().unwrap();
    s.synchronize().unwrap();
    pinpool_testkit::eventually("the restore's blocks back", || {
        pool.stats(0).unwrap().active_bytes.all.current == 4096
    })
    .await;
    let st = pool.stats(0).unwrap();
    assert_eq!(
        st.allocation.all.current, 1,
        "only the scratch block: {st:?}"
    );
    pool.raw_delete(scratch).unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graphs_output_comes_back_at_its_address_and_its_replays_read_the_right_bytes() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    let host = sim.host_alloc(MIB).unwrap();

    // Graph 1 writes its output O and copies it to the host.
    route(&pool, &s, id).await;
    s.begin_capture().unwrap();
    let out = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    s.fill_device(out, MIB, 0x77).unwrap();
    s.copy_dtoh(out, host.ptr.as_ptr(), MIB).unwrap();
    let g1 = s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let checkpoint = pool.checkpoint_state(0, id).await.unwrap();
    assert!(checkpoint.allocated().contains(&(out as usize, MIB)));

    // O dies (kept for the graph), and a graph captured after the checkpoint takes more.
    pool.raw_delete(out).unwrap();
    route(&pool, &s, id).await;
    s.begin_capture().unwrap();
    let later = pool.raw_alloc_with_stream(2 * MIB, &s).unwrap();
    assert_ne!(later, out);
    s.fill_device(later, 2 * MIB, 0x33).unwrap();
    let g2 = s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    g2.launch(&s).unwrap();
    s.synchronize().unwrap();

    let delta = pool
        .set_checkpoint_pool_state(0, &checkpoint, &s)
        .await
        .unwrap();
    assert_eq!(delta.ptrs_freed, vec![later]);
    assert_eq!(
        delta.dataptrs_allocd,
        vec![out],
        "O is back where graph 1 writes it"
    );

    // Another allocation of the pool now, written outside any graph: it must not be O.
    route(&pool, &s, id).await;
    let bystander = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    assert_ne!(bystander, out, "O is lent again, to nobody else");
    s.fill_device(bystander, MIB, 0x55).unwrap();

    sim.host_write(host.ptr.as_ptr(), &vec![0; MIB]).unwrap();
    g1.launch(&s).unwrap();
    s.synchronize().unwrap();
    let read = sim.host_read(host.ptr.as_ptr(), MIB).unwrap();
    assert!(all_bytes_are(&read, 0x77), "the replay read other bytes");
    let seen = sim.host_alloc(MIB).unwrap();
    s.copy_dtoh(bystander, seen.ptr.as_ptr(), MIB).unwrap();
    s.synchronize().unwrap();
    assert!(
        all_bytes_are(&sim.host_read(seen.ptr.as_ptr(), MIB).unwrap(), 0x55),
        "the replay wrote over another allocation"
    );
    pool.raw_delete(bystander).unwrap();
    sim.host_free(seen).unwrap();
    // And what the replay wrote is in O.
    let check = sim.host_alloc(MIB).unwrap();
    s.copy_dtoh(out, check.ptr.as_ptr(), MIB).unwrap();
    s.synchronize().unwrap();
    assert!(all_bytes_are(
        &sim.host_read(check.ptr.as_ptr(), MIB).unwrap(),
        0x77
    ));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    drop((g1, g2));
    pool.raw_delete(out).unwrap();
    sim.host_free(host).unwrap();
    sim.host_free(check).unwrap();
}

/// The restore gives up after its settle timeout (10 s) while a held stream still reads a
/// block to free, and its caller has stopped waiting long before: the block is freed the way
/// its lease would have been, so it is handed out again only after that stream's work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_restore_nobody_waits_for_frees_its_blocks_only_after_their_work() {
    let (pool, sim) = device_pool();
    let (s, other) = (sim.stream(), sim.stream());
    let id = pinpool::PoolId::fresh();
    route(&pool, &s, id).await;
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let empty = pool.checkpoint_state(0, id).await.unwrap();
    let b = raw_in_pool(&pool, &s, id, 2 * MIB).await;
    let (hold, scratch) = read_on_held_stream(&pool, &other, b);
    give_up_restoring(&pool, &empty, &s).await;
    // Past the restore's own timeout: it failed, with nobody to hand `b` back to.
    tokio::time::sleep(std::time::Duration::from_millis(10_500)).await;
    let next = raw_in_pool(&pool, &s, id, 2 * MIB).await;
    assert_ne!(
        next, b,
        "handed out while the held stream may still read it"
    );
    drop(hold);
    other.synchronize().unwrap();
    pool.raw_delete(next).unwrap();
    pool.raw_delete(scratch).unwrap();
    pinpool_testkit::eventually("every block back", || {
        pool.stats(0).unwrap().active_bytes.all.current == 0
    })
    .await;
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}
