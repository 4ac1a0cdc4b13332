//! History: a bounded ring of trace entries, off by default, that records each step of a
//! block's life (alloc, free requested, free completed after its events, segments taken and
//! given back), annotations, captures and out-of-memory failures.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::{Builder, Error, History, HistoryContext, TraceAction};
use pinpool_testkit::{eventually, sim_pool};

fn actions(h: &History) -> Vec<TraceAction> {
    h.entries.iter().map(|e| e.action).collect()
}

#[tokio::test]
async fn history_is_off_by_default_and_records_nothing() {
    let (pool, _sim) = sim_pool();
    assert!(!pool.is_history_enabled());
    drop(pool.alloc(4096).await.unwrap());
    pool.record_annotation("ignored");
    let h = pool.history().await.unwrap();
    assert!(!h.enabled);
    assert!(h.entries.is_empty(), "{:?}", actions(&h));
}

#[tokio::test]
async fn the_ring_keeps_only_the_last_max_entries() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 8, HistoryContext::None).unwrap();
    for i in 0..20 {
        pool.record_annotation(&format!("step {i}"));
    }
    let h = pool.history().await.unwrap();
    assert_eq!(h.entries.len(), 8, "the ring is bounded");
    assert_eq!(h.max_entries, 8);
    assert_eq!(h.overwritten, 12, "the oldest entries were pushed out");
    let names: Vec<&str> = h.entries.iter().filter_map(|e| e.name.as_deref()).collect();
    let want: Vec<String> = (12..20).map(|i| format!("step {i}")).collect();
    assert_eq!(names, want, "the newest entries stay, oldest first");
}

#[tokio::test]
async fn the_ring_stays_bounded_under_many_cached_allocations() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 100, HistoryContext::None)
        .unwrap();
    for _ in 0..2_000 {
        drop(pool.alloc(4096).await.unwrap());
    }
    let h = pool.history().await.unwrap();
    assert_eq!(h.entries.len(), 100);
    assert_eq!(
        h.overwritten + h.lost + 100,
        1 + 3 * 2_000,
        "every entry is kept, pushed out or counted as lost"
    );
    assert_eq!(h.entries.last().unwrap().action, TraceAction::FreeCompleted);
}

#[tokio::test]
async fn shrinking_the_ring_drops_the_oldest_entries() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 100, HistoryContext::None)
        .unwrap();
    for i in 0..10 {
        pool.record_annotation(&i.to_string());
    }
    pool.record_history(true, 4, HistoryContext::None).unwrap();
    let h = pool.history().await.unwrap();
    let names: Vec<&str> = h.entries.iter().filter_map(|e| e.name.as_deref()).collect();
    assert_eq!(names, ["6", "7", "8", "9"]);
}

#[tokio::test]
async fn a_ring_of_zero_entries_is_a_typed_error_and_changes_nothing() {
    let (pool, _sim) = sim_pool();
    assert_eq!(
        pool.record_history(true, 0, HistoryContext::None),
        Err(Error::EmptyHistoryRing)
    );
    assert!(!pool.is_history_enabled());
}

#[tokio::test]
async fn a_cached_alloc_and_free_record_alloc_free_requested_and_free_completed() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let buf = pool.alloc(3000).await.unwrap();
    let addr = buf.as_ptr() as usize;
    drop(buf);
    let buf = pool.alloc(3000).await.unwrap(); // cached
    drop(buf);
    let h = pool.history().await.unwrap();
    use TraceAction::*;
    assert_eq!(
        actions(&h),
        [
            SegmentAlloc,
            Alloc,
            FreeRequested,
            FreeCompleted,
            Alloc,
            FreeRequested,
            FreeCompleted
        ]
    );
    for e in &h.entries {
        assert_eq!(e.addr, addr, "{e:?}");
        assert_eq!(e.size, 4096, "block bytes: {e:?}");
        assert!(e.pool.is_default());
        assert!(e.context.is_none(), "no call sites unless asked");
    }
    assert_eq!(h.entries[1].requested, 3000);
    assert!(h.entries.windows(2).all(|w| w[0].time_us <= w[1].time_us));
}

#[tokio::test]
async fn a_free_that_waits_on_events_completes_when_its_stream_is_done() {
    let (pool, sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let stream = sim.stream();
    let hold = stream.hold();
    let mut buf = pool.alloc(1 << 16).await.unwrap();
    buf.record_stream(&stream).unwrap();
    drop(buf);
    let h = pool.history().await.unwrap();
    use TraceAction::*;
    assert_eq!(actions(&h), [SegmentAlloc, Alloc, FreeRequested]);
    assert_eq!(h.entries[2].stream, Some(stream.id()));

    hold.release();
    stream.synchronize().unwrap();
    let mut h = pool.history().await.unwrap();
    for _ in 0..5000 {
        if h.entries.len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        h = pool.history().await.unwrap();
    }
    assert_eq!(
        actions(&h),
        [SegmentAlloc, Alloc, FreeRequested, FreeCompleted]
    );

    pool.empty_cache().await.unwrap();
    let h = pool.history().await.unwrap();
    assert_eq!(h.entries.last().unwrap().action, SegmentFree);
    assert_eq!(h.entries.last().unwrap().size, 1 << 16);
    assert_eq!(h.entries.last().unwrap().addr, h.entries[0].addr);
}

#[tokio::test]
async fn annotations_land_between_the_allocations_around_them() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let a = pool.alloc(64).await.unwrap();
    pool.record_annotation("phase two");
    let b = pool.alloc(64).await.unwrap();
    let h = pool.history().await.unwrap();
    use TraceAction::*;
    assert_eq!(
        actions(&h),
        [SegmentAlloc, Alloc, UserDefined, SegmentAlloc, Alloc]
    );
    assert_eq!(h.entries[2].name.as_deref(), Some("phase two"));
    drop((a, b));
}

#[tokio::test]
async fn turning_history_off_keeps_what_was_recorded() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    pool.record_history(false, 1000, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    pool.record_annotation("not recorded");
    let h = pool.history().await.unwrap();
    assert!(!h.enabled);
    assert_eq!(h.entries.len(), 4);
}

#[tokio::test]
async fn call_sites_are_captured_only_when_asked() {
    let (pool, _sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::Alloc)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    let h = pool.history().await.unwrap();
    let alloc = h
        .entries
        .iter()
        .find(|e| e.action == TraceAction::Alloc)
        .unwrap();
    assert!(alloc.context.is_some(), "the allocating call site is kept");
    let free = h
        .entries
        .iter()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert!(
        free.context.is_none(),
        "frees only with HistoryContext::All"
    );

    pool.record_history(true, 1000, HistoryContext::All)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    let h = pool.history().await.unwrap();
    let free = h
        .entries
        .iter()
        .rev()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert!(free.context.is_some());
}

#[tokio::test]
async fn captures_are_marked_in_their_pool() {
    let (pool, sim) = sim_pool();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let stream = sim.stream();
    let id = pinpool::PoolId::fresh();
    let target = stream.id();
    pool.begin_allocate_to_pool(id, move |s| s.id() == target)
        .await
        .unwrap();
    let buf = pool.alloc_on(128, &stream).await.unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();
    let h = pool.history().await.unwrap();
    use TraceAction::*;
    assert_eq!(actions(&h), [CaptureBegin, SegmentAlloc, Alloc, CaptureEnd]);
    assert!(h.entries.iter().all(|e| e.pool == id));
    drop(buf);
}

#[tokio::test]
async fn an_out_of_memory_failure_is_recorded() {
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(1 << 20));
    let pool = Builder::new(Arc::new(sim.clone())).build().unwrap();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    let err = pool.alloc(4 << 20).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    let h = pool.history().await.unwrap();
    let oom = h
        .entries
        .iter()
        .find(|e| e.action == TraceAction::Oom)
        .unwrap();
    assert_eq!(oom.size, 4 << 20);
    assert!(oom.name.as_deref().unwrap().contains("out of memory"));
}

#[test]
fn history_blocking_reads_from_a_plain_thread() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (pool, _sim) = rt.block_on(async { sim_pool() });
    pool.record_history(true, 10, HistoryContext::None).unwrap();
    drop(pool.alloc_blocking(64).unwrap());
    let h = pool.history_blocking().unwrap();
    assert_eq!(h.entries.len(), 4);
    rt.block_on(eventually("nothing", || true));
}
