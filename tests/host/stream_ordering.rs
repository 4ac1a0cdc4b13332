//! Invariant 1: a block is handed out only when every event recorded for it has completed.
//! The simulated streams run copies when they reach them and report a copy whose source
//! bytes changed before it ran (early reuse) as a violation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::{SimDeviceBuffer, SimRuntime, SimStream};
use pinpool::tuning::{SizeClass, SizePolicy, TieredPowerOfTwo};
use pinpool::{Builder, Error, PinnedAllocator};
use pinpool_testkit::{assert_books_balance, eventually, eventually_blocking, sim_pool};

#[tokio::test]
async fn a_buffer_whose_copy_is_still_queued_is_not_handed_out_again() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let dev = SimDeviceBuffer::new(4096);

    let hold = stream.hold();
    let mut a = pool.alloc(4096).await.unwrap();
    a.fill(0xAB);
    stream.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&stream).unwrap();
    let first = a.as_ptr();
    drop(a);

    // The copy has not run: the same class must be served by other memory.
    let mut b = pool.alloc(4096).await.unwrap();
    assert_ne!(b.as_ptr(), first, "handed out while its copy was queued");
    b.fill(0xCD);
    assert_eq!(sim.total_host_allocs(), 2);
    assert_eq!(pool.stats().waiting_blocks, 1);

    hold.release();
    stream.synchronize().unwrap();
    assert_eq!(
        dev.to_vec(),
        vec![0xAB; 4096],
        "the copied data arrived intact"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());

    // Once the copy is done, the first block is reused.
    drop(b);
    let c = pool.alloc(4096).await.unwrap();
    let d = pool.alloc(4096).await.unwrap();
    assert!(
        c.as_ptr() == first || d.as_ptr() == first,
        "the first block came back"
    );
    assert_eq!(sim.total_host_allocs(), 2);
}

#[tokio::test]
async fn a_block_whose_streams_ran_all_their_work_is_reusable_at_its_free_without_an_event() {
    let (pool, sim) = sim_pool();
    let (s1, s2) = (sim.stream(), sim.stream());
    let dev = SimDeviceBuffer::new(4096);
    let mut a = pool.alloc(4096).await.unwrap();
    a.fill(0xAB);
    s1.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&s1).unwrap();
    a.record_stream(&s2).unwrap();
    s1.synchronize().unwrap(); // the copy has run; s2 never had work
    let first = a.as_ptr();
    drop(a);
    assert_eq!(sim.events_recorded(), 0, "idle streams need no event");
    assert_eq!(pool.stats().waiting_blocks, 0);
    let mut b = pool.alloc(4096).await.unwrap();
    assert_eq!(b.as_ptr(), first, "reusable at once");
    assert_eq!(dev.to_vec(), vec![0xAB; 4096], "the copy read its bytes");

    // One busy stream of two: an event for it alone, and no reuse before it is done.
    b.record_stream(&s1).unwrap();
    b.record_stream(&s2).unwrap();
    let hold = s2.hold();
    drop(b);
    assert_eq!(
        sim.events_recorded(),
        1,
        "an event for the busy stream only"
    );
    let c = pool.alloc(4096).await.unwrap();
    assert_ne!(c.as_ptr(), first, "s2 has not run its work");
    drop(hold);
    s2.synchronize().unwrap();
    drop(c);
    let d = pool.alloc(4096).await.unwrap();
    let e = pool.alloc(4096).await.unwrap();
    assert!(
        d.as_ptr() == first || e.as_ptr() == first,
        "back once s2 is done"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn reuse_waits_for_every_recorded_stream() {
    let (pool, sim) = sim_pool();
    let (s1, s2) = (sim.stream(), sim.stream());
    let h1 = s1.hold();
    let h2 = s2.hold();
    let mut a = pool.alloc(256).await.unwrap();
    a.record_stream(&s1).unwrap();
    a.record_stream(&s2).unwrap();
    a.record_stream(&s1).unwrap();
    assert_eq!(
        a.recorded_streams().len(),
        2,
        "a stream recorded twice counts once"
    );
    let first = a.as_ptr();
    drop(a);
    assert_eq!(sim.events_recorded(), 2);

    h1.release();
    s1.synchronize().unwrap();
    let b = pool.alloc(256).await.unwrap();
    assert_ne!(b.as_ptr(), first, "s2 has not finished");

    h2.release();
    s2.synchronize().unwrap();
    // Wherever it is now (its parked slot, or on its way home with the event poller), the
    // block is found once the poller is done with it.
    eventually("the block is no longer waiting", || {
        pool.stats().waiting_blocks == 0
    })
    .await;
    let c = pool.alloc(256).await.unwrap();
    assert_eq!(c.as_ptr(), first);
    drop((b, c));
    // The block keeps one completed event to record again at its next free; the other
    // went back at once, and the kept one goes back with the block's memory.
    assert_eq!(sim.events_released(), 1);
    pool.empty_cache().await.unwrap();
    eventually("every event released", || sim.events_released() == 2).await;
}

#[tokio::test]
async fn completed_events_are_noticed_before_fresh_memory_is_taken() {
    // PyTorch's process_events: an allocate / record / free loop on an idle stream must not
    // grow memory, even though no background poll has run yet.
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    for _ in 0..200 {
        let mut b = pool.alloc(1 << 16).await.unwrap();
        b.record_stream(&stream).unwrap();
        // Busy at the free (an event is recorded), idle by the next request.
        let hold = stream.hold();
        drop(b);
        drop(hold);
        stream.synchronize().unwrap();
    }
    assert!(sim.events_recorded() >= 200);
    assert_eq!(sim.total_host_allocs(), 1);
    assert_eq!(pool.stats().allocated_bytes.current, 1 << 16);
}

#[tokio::test]
async fn one_slow_event_does_not_hold_up_blocks_behind_it() {
    let (pool, sim) = sim_pool();
    let slow = sim.stream();
    let fast = sim.stream();
    let hold = slow.hold();
    let mut a = pool.alloc(1024).await.unwrap();
    a.record_stream(&slow).unwrap();
    let slow_ptr = a.as_ptr();
    drop(a);
    let mut fast_ptrs = Vec::new();
    for _ in 0..5 {
        let mut b = pool.alloc(1024).await.unwrap();
        b.record_stream(&fast).unwrap();
        fast_ptrs.push(b.as_ptr());
        drop(b);
    }
    fast.synchronize().unwrap();
    // Without any request, the poller returns the fast blocks in the background.
    eventually("fast blocks polled home", || {
        pool.stats().waiting_blocks == 1
    })
    .await;
    let c = pool.alloc(1024).await.unwrap();
    assert!(fast_ptrs.contains(&c.as_ptr()));
    assert_ne!(c.as_ptr(), slow_ptr);
    drop(hold);
}

#[tokio::test]
async fn a_buffer_from_another_allocator_cannot_be_recorded() {
    let (pool_a, sim) = sim_pool();
    let (pool_b, sim_b) = sim_pool();
    let stream = sim.stream();
    let mut b = pool_b.alloc(64).await.unwrap();
    assert_eq!(
        pool_a.record_stream(&mut b, &stream),
        Err(Error::ForeignBuffer)
    );
    assert!(b.recorded_streams().is_empty(), "nothing changed");
    // `stream` is pool A's runtime's: pool B refuses it too.
    assert!(matches!(
        pool_b.record_stream(&mut b, &stream),
        Err(Error::ForeignStream { .. })
    ));
    assert_eq!(pool_b.record_stream(&mut b, &sim_b.stream()), Ok(()));
    assert_eq!(b.recorded_streams().len(), 1);
}

#[tokio::test]
async fn stats_count_blocks_waiting_on_events_as_active() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut a = pool.alloc(1 << 20).await.unwrap();
    a.record_stream(&stream).unwrap();
    drop(a);
    let s = pool.stats();
    assert_eq!(s.active_requests.current, 1);
    assert_eq!(s.waiting_bytes, 1 << 20);
    assert_books_balance(&pool, &sim, 0).await;
    drop(hold);
    stream.synchronize().unwrap();
    eventually("block home", || pool.stats().waiting_blocks == 0).await;
    assert_eq!(pool.stats().active_requests.current, 0);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_stream_delays_never_lead_to_early_reuse() {
    let (pool, sim) = sim_pool();
    sim.set_random_delays(11, Duration::from_micros(200));
    let streams: Vec<_> = (0..3).map(|_| sim.stream()).collect();
    let mut tasks = Vec::new();
    for t in 0..6usize {
        let pool = pool.clone();
        let stream = streams[t % 3].clone();
        tasks.push(tokio::spawn(async move {
            let dev = SimDeviceBuffer::new(1 << 12);
            for i in 0..150usize {
                let size = 512 << (i % 4);
                let mut b = pool.alloc(size).await.unwrap();
                b.fill((t * 31 + i) as u8);
                stream
                    .copy_to_device(b.as_ptr(), size.min(1 << 12), &dev)
                    .unwrap();
                b.record_stream(&stream).unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

/// Set once a [`SlowToDrop`] begins to drop.
static DROPPING: AtomicBool = AtomicBool::new(false);

/// `TieredPowerOfTwo`'s classes, in a policy that takes half a second to drop: the thread
/// that drops its last reference stands still there, as a thread the system deschedules.
struct SlowToDrop(TieredPowerOfTwo);

impl SizePolicy for SlowToDrop {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn num_classes(&self) -> usize {
        self.0.num_classes()
    }
    fn class_of(&self, size: usize) -> Option<SizeClass> {
        self.0.class_of(size)
    }
    fn max_request(&self) -> usize {
        self.0.max_request()
    }
}

impl Drop for SlowToDrop {
    fn drop(&mut self) {
        DROPPING.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A pinned allocator over `sim` whose actors (its event poller among them) run on `rt`.
fn pool_on(
    rt: &tokio::runtime::Runtime,
    sim: &SimRuntime,
    policy: Arc<dyn SizePolicy>,
) -> PinnedAllocator<SimRuntime> {
    Builder::new(Arc::new(sim.clone()))
        .policy(policy)
        .handle(rt.handle().clone())
        .shards(1024)
        .build()
        .unwrap()
}

/// Allocates 1 MiB, records `stream` on it and frees it while the stream is busy: the
/// block is parked in this thread's shard with an event that has completed on return.
fn free_parked(pool: &PinnedAllocator<SimRuntime>, stream: &SimStream) {
    let mut b = pool.alloc_blocking(1 << 20).unwrap();
    b.record_stream(stream).unwrap();
    let hold = stream.hold();
    drop(b);
    drop(hold);
    stream.synchronize().unwrap();
}

/// Invariant 3 while the event poller brings a block home: it finds the block's events
/// completed, stops counting it as waiting, and only then puts it back into the ready
/// queues. A miss that comes in between must not take fresh memory: the block is of its
/// class and reusable. Here the poller stands still in between (it lets go of pools it no
/// longer needs there, one of which is slow to drop), as a descheduled thread would; the
/// request misses the block in its parked slot and asks the pool actor.
#[test]
fn a_miss_while_the_poller_brings_a_completed_block_home_takes_that_block_not_fresh_memory() {
    // The poller runs on a runtime driven by a thread of its own, beside the requests.
    let rt = Arc::new(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let driver = {
        let rt = rt.clone();
        std::thread::spawn(move || rt.block_on(stopped).ok())
    };
    // Eight other allocators on that runtime, each of whose poller brought a block home
    // before it went: the poller's thread still holds their pools (`keepalive`), and lets
    // them go when it next brings home a block of a pool it does not hold yet. The first
    // one's policy is slow to drop.
    let slow = Arc::new(SlowToDrop(TieredPowerOfTwo::default()));
    let last = Arc::downgrade(&slow);
    let mut slow = Some(slow);
    for _ in 0..8 {
        let policy: Arc<dyn SizePolicy> = match slow.take() {
            Some(s) => s,
            None => Arc::new(TieredPowerOfTwo::default()),
        };
        let rt = rt.clone();
        // On a thread that then exits: it lets go of the pools it held across its frees.
        std::thread::spawn(move || {
            let sim = SimRuntime::new();
            let other = pool_on(&rt, &sim, policy);
            free_parked(&other, &sim.stream());
            eventually_blocking("the poller brought the block home", || {
                other.stats().waiting_blocks == 0
            });
        })
        .join()
        .unwrap();
    }
    eventually_blocking("only the poller's thread holds the slow pool", || {
        last.strong_count() == 1
    });
    // A block of this pool freed on a stream that then ran its work: the poller brings it
    // home, standing still on the way, while this thread asks for the same size again.
    let sim = SimRuntime::new();
    let pool = pool_on(&rt, &sim, Arc::new(TieredPowerOfTwo::default()));
    let stream = sim.stream();
    free_parked(&pool, &stream);
    std::thread::sleep(Duration::from_millis(100));
    let again = pool.alloc_blocking(1 << 20).unwrap();
    let (allocs, stood_still) = (sim.total_host_allocs(), DROPPING.load(Ordering::SeqCst));
    drop(again);
    let _ = stop.send(());
    driver.join().unwrap();
    assert!(stood_still, "the poller stood still on its way home");
    assert_eq!(allocs, 1, "fresh memory while a completed block came home");
}
