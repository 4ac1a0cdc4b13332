//! The unsafe code on the engine's paths, exercised on short runs small enough for miri
//! (`scripts/miri.sh` runs this file under it, with its data-race detector): blocks moving
//! between threads through the ready slots, blocks parked with pending events and taken back,
//! typed views of a buffer, pieces carved out of shared segments, and views into a plan's
//! arena. Each checks that the bytes a holder wrote are still there, so a block lent twice
//! or freed under its holder fails here too, not only under miri.

use std::sync::Arc;

use pinpool::plan::Planner;
use pinpool::sim::SimRuntime;
use pinpool::tuning::BestFit;
use pinpool::Builder;
use pinpool_testkit::{all_bytes_are, current_thread, on_plain_thread, sim_pool};

const SIZES: [usize; 3] = [64, 512, 4096];

#[test]
fn cached_blocks_move_between_threads_through_the_ready_slots_intact() {
    current_thread().block_on(async {
        let (pool, sim) = sim_pool();
        for size in SIZES {
            drop(pool.alloc(size).await.unwrap());
        }
        let threads: Vec<_> = (1..=2u8)
            .map(|t| {
                let p = pool.clone();
                on_plain_thread(move || {
                    let mut held = Vec::new();
                    for i in 0..6 {
                        let mut b = p.alloc_blocking(SIZES[i % 3]).unwrap();
                        b.fill(t);
                        held.push(b);
                        if held.len() > 2 {
                            let b = held.remove(0);
                            assert!(all_bytes_are(&b, t), "another holder wrote into it");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.await;
        }
        drop(pool);
        pinpool_testkit::eventually("all memory back", || sim.live_bytes() == 0).await;
    });
}

#[test]
fn a_parked_block_is_taken_back_only_once_its_stream_work_is_done() {
    current_thread().block_on(async {
        let (pool, sim) = sim_pool();
        let stream = sim.stream();
        let hold = stream.hold();
        let mut b = pool.alloc(4096).await.unwrap();
        b.fill(1);
        stream.write_host(b.as_mut_ptr(), b.len(), 9).unwrap();
        b.record_stream(&stream).unwrap();
        let parked = b.as_ptr();
        drop(b); // parked in this thread's shard, with an event pending
        let mut other = pool.alloc(4096).await.unwrap();
        assert_ne!(
            other.as_ptr(),
            parked,
            "handed out with its stream work queued"
        );
        other.fill(2);
        drop(hold);
        stream.synchronize().unwrap();
        drop(other);
        let again = pool.alloc(4096).await.unwrap();
        let back = pool.alloc(4096).await.unwrap();
        assert!(again.as_ptr() == parked || back.as_ptr() == parked);
        let taken = if again.as_ptr() == parked {
            &again
        } else {
            &back
        };
        assert!(
            all_bytes_are(taken, 9),
            "the stream's write landed before reuse"
        );
        drop((again, back));
        assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
        drop(pool);
        pinpool_testkit::eventually("all memory back", || sim.live_bytes() == 0).await;
    });
}

#[test]
fn typed_views_cover_exactly_the_buffers_bytes() {
    current_thread().block_on(async {
        let (pool, _sim) = sim_pool();
        let mut b = pool.alloc(100).await.unwrap();
        let words = b.as_mut_slice_of::<u64>().unwrap();
        assert_eq!(words.len(), 12);
        for (i, w) in words.iter_mut().enumerate() {
            *w = i as u64 * 0x0101_0101_0101_0101;
        }
        assert_eq!(b.as_slice_of::<u32>().unwrap().len(), 25);
        assert_eq!(b[8], 1);
        b[99] = 0xEE;
        assert_eq!(b.last(), Some(&0xEE));
        let empty = pool.alloc(0).await.unwrap();
        assert!(empty.is_empty() && empty.as_slice_of::<u16>().unwrap().is_empty());
    });
}

#[test]
fn pieces_carved_from_one_segment_never_share_bytes() {
    current_thread().block_on(async {
        let sim = SimRuntime::new();
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(Arc::new(BestFit::default().separate_segments()))
            .build()
            .unwrap();
        let mut live = Vec::new();
        for i in 0..10u8 {
            let mut b = pool.alloc(1000 + 700 * usize::from(i % 4)).await.unwrap();
            b.fill(i);
            live.push((i, b));
            if i % 3 == 2 {
                let (v, b) = live.remove(0);
                assert!(all_bytes_are(&b, v));
            }
        }
        for (v, b) in &live {
            assert!(all_bytes_are(b, *v), "a piece overlapped another");
        }
        drop(live);
        drop(pool);
        pinpool_testkit::eventually("all memory back", || sim.live_bytes() == 0).await;
    });
}

#[test]
fn views_into_a_plan_arena_hold_their_own_bytes() {
    current_thread().block_on(async {
        let (pool, _sim) = sim_pool();
        let rec = pool.record_plan().unwrap();
        let a = rec.alloc(300).await.unwrap();
        let b = rec.alloc(500).await.unwrap();
        drop(a);
        let c = rec.alloc(200).await.unwrap();
        drop((b, c));
        let plan = rec.finish().plan_with(Planner::Best).unwrap();
        let mut session = pool.serve_plan(&plan).await.unwrap();
        for round in 0..2u8 {
            let mut a = session.alloc(300).await.unwrap();
            a.fill(round);
            let mut b = session.alloc(500).await.unwrap();
            b.fill(round + 10);
            drop(a);
            let mut c = session.alloc(200).await.unwrap();
            c.fill(round + 20);
            assert!(b.is_served() && c.is_served());
            assert!(all_bytes_are(&b, round + 10));
            assert!(all_bytes_are(&c, round + 20));
            drop((b, c));
            session.reset().await.unwrap();
        }
    });
}
