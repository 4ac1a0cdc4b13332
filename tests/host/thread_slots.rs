//! Per-thread ready slots and parked blocks: what each thread keeps in front of the shared
//! queues is still the pool's — other threads find it, `empty_cache` frees it, a thread that
//! exits loses nothing — and a parked block is reused only after its events complete.

use std::sync::{Arc, Barrier};

use pinpool_testkit::{assert_books_balance, eventually, sim_pool};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_by_a_thread_that_exited_is_reused_without_fresh_memory() {
    let (pool, sim) = sim_pool();
    let p = pool.clone();
    let ptr = std::thread::spawn(move || {
        let b = p.alloc_blocking(4096).unwrap();
        let ptr = b.as_ptr() as usize;
        drop(b);
        ptr
    })
    .join()
    .unwrap();
    let again = pool.alloc(4096).await.unwrap();
    assert_eq!(again.as_ptr() as usize, ptr);
    assert_eq!(sim.total_host_allocs(), 1);
    drop(again);
    assert_books_balance(&pool, &sim, 0).await;
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.live_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_cache_frees_the_blocks_cached_by_every_live_thread() {
    let (pool, sim) = sim_pool();
    let threads = 6;
    let cached = Arc::new(Barrier::new(threads + 1));
    let emptied = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, cached, emptied) = (pool.clone(), cached.clone(), emptied.clone());
            std::thread::spawn(move || {
                drop(pool.alloc_blocking(1024 << t).unwrap());
                cached.wait(); // the block sits in this thread's slot
                emptied.wait();
                drop(pool.alloc_blocking(1024 << t).unwrap());
            })
        })
        .collect();
    tokio::task::block_in_place(|| cached.wait());
    assert_books_balance(&pool, &sim, 0).await;
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_blocks, threads);
    assert_eq!(report.reserved_after, 0);
    assert_eq!(sim.live_bytes(), 0);
    tokio::task::block_in_place(|| emptied.wait());
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(
        sim.total_host_allocs(),
        2 * threads as u64,
        "fresh after emptying"
    );
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_threads_sharing_one_class_lose_no_block() {
    let (pool, sim) = sim_pool();
    let threads = 24; // more than the shards: some threads share a shard
    std::thread::scope(|s| {
        for _ in 0..threads {
            let pool = &pool;
            s.spawn(move || {
                for i in 0..2000 {
                    let a = pool.alloc_blocking(4096).unwrap();
                    if i % 3 == 0 {
                        let b = pool.alloc_blocking(4096).unwrap();
                        drop(a);
                        drop(b);
                    } else {
                        drop(a);
                    }
                }
            });
        }
    });
    let s = pool.stats();
    assert_eq!(s.active_requests.current, 0);
    assert_eq!(s.active_bytes.current, 0);
    assert_eq!(s.active_requests.allocated, s.active_requests.freed);
    assert_books_balance(&pool, &sim, 0).await;
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_blocks as u64, sim.total_host_allocs());
    assert_eq!(sim.live_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_queued_past_a_threads_slots_are_found_by_other_threads_and_by_empty_cache() {
    // Best fit: fine classes, so that 70 sizes are 70 classes (more than one 64-class word
    // of queue marks). Four blocks in each, all freed by one thread: one per class fills
    // its slot, three per class go to its queues.
    let (pool, sim) = pinpool_testkit::best_fit_pool();
    // On a thread of its own: four blocks of each size, held together, then all freed.
    let four_of_each_on_a_thread = || {
        let p = pool.clone();
        std::thread::spawn(move || {
            let held: Vec<_> = (1..=70usize)
                .flat_map(|i| [i * 8192; 4])
                .map(|s| p.alloc_blocking(s).unwrap())
                .collect();
            drop(held);
        })
        .join()
        .unwrap();
    };
    four_of_each_on_a_thread();
    let fresh = sim.total_host_allocs();
    // Another thread takes them all back without fresh memory.
    four_of_each_on_a_thread();
    assert_eq!(
        sim.total_host_allocs(),
        fresh,
        "every queued block was found"
    );
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_blocks as u64, fresh);
    assert_eq!(sim.live_bytes(), 0);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_balance_when_buffers_are_freed_on_other_threads() {
    let (pool, sim) = sim_pool();
    let bufs: Vec<_> = (0..50).map(|_| pool.alloc_blocking(512).unwrap()).collect();
    assert_eq!(pool.stats().active_requests.current, 50);
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    let s = pool.stats();
    assert_eq!(s.active_requests.current, 0);
    assert_eq!(s.active_requests.allocated, 50);
    assert_eq!(s.active_requests.freed, 50);
    assert_eq!(s.active_bytes.peak, 50 * 512);
    pool.reset_accumulated_stats();
    pool.reset_peak_stats();
    let s = pool.stats();
    assert_eq!(
        (s.active_requests.allocated, s.active_requests.freed),
        (0, 0)
    );
    assert_eq!(s.active_bytes.peak, 0);
    drop(pool.alloc_blocking(512).unwrap());
    let s = pool.stats();
    assert_eq!(s.active_requests.current, 0);
    assert_eq!(s.active_requests.allocated, 1);
    assert_eq!(s.active_bytes.peak, 512);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_block_is_not_reused_by_any_thread_before_its_event_completes() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut a = pool.alloc_blocking(1 << 16).unwrap();
    let ptr = a.as_ptr() as usize;
    a.record_stream(&stream).unwrap();
    drop(a); // parked in this thread's shard, its event pending
    assert_eq!(pool.stats().waiting_blocks, 1);
    let same = pool.alloc_blocking(1 << 16).unwrap();
    assert_ne!(
        same.as_ptr() as usize,
        ptr,
        "the freeing thread waits for the event"
    );
    let p = pool.clone();
    let other = std::thread::spawn(move || p.alloc_blocking(1 << 16).unwrap().as_ptr() as usize)
        .join()
        .unwrap();
    assert_ne!(other, ptr, "so does every other thread");
    drop(same);
    drop(hold);
    stream.synchronize().unwrap();
    // Nobody asks: the poller, watching the parked slots, brings the block home.
    eventually("parked block home", || pool.stats().waiting_blocks == 0).await;
    let mut seen = false;
    let held: Vec<_> = (0..3)
        .map(|_| pool.alloc_blocking(1 << 16).unwrap())
        .inspect(|b| seen |= b.as_ptr() as usize == ptr)
        .collect();
    assert!(seen, "the block is reused once its event completed");
    assert_eq!(
        sim.total_host_allocs(),
        3,
        "and no more fresh memory was taken"
    );
    drop(held);
    assert_eq!(sim.violations(), 0);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_freeing_thread_reuses_its_parked_block_once_the_event_completed() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    for _ in 0..200 {
        let mut b = pool.alloc_blocking(1 << 20).unwrap();
        b.record_stream(&stream).unwrap();
        // Busy at the free: the free records an event and parks the block.
        let hold = stream.hold();
        drop(b);
        drop(hold);
        stream.synchronize().unwrap();
    }
    assert_eq!(sim.total_host_allocs(), 1, "one block serves every round");
    assert_eq!(sim.violations(), 0);
    eventually("nothing waiting", || pool.stats().waiting_blocks == 0).await;
    // Each free handed back the event of the one before (the block kept it, completed);
    // the last goes back with the block's memory.
    assert_eq!(sim.events_released(), sim.events_recorded() - 1);
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.events_recorded(), sim.events_released());
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_blocks_are_freed_when_the_allocator_is_dropped() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    for _ in 0..6 {
        // more than a shard's parked slots: the oldest go to the poller
        let mut b = pool.alloc_blocking(4096).unwrap();
        b.record_stream(&stream).unwrap();
        drop(b);
    }
    assert_eq!(pool.stats().waiting_blocks, 6);
    drop(pool);
    drop(hold);
    stream.synchronize().unwrap();
    eventually("all memory given back", || sim.live_bytes() == 0).await;
}
