//! No wait under a cap is silent. A request that has waited a second for room is looked at
//! once: a request that could fit only once buffers its own task (or thread) took come back
//! is refused (`OomCause::HeldByRequester`) instead of waiting for ever; any other wait is
//! logged, once, with the cap, what is held, and the ways out (`BufferSet`,
//! `alloc_timeout`), and goes on.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinpool::sim::SimRuntime;
use pinpool::{BufferSet, DeviceBuilder, Error, OomCause, PinnedAllocator};
use pinpool_testkit::current_thread;

const MIB: usize = 1 << 20;

/// What the warnings about long waits logged on this thread say (each names the way out,
/// `BufferSet`), while the guard lives.
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl Logged {
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let sink = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("BufferSet"))
            .map(str::to_string)
            .collect()
    }
}

impl Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capped(bytes: usize) -> PinnedAllocator<SimRuntime> {
    PinnedAllocator::builder()
        .runtime(Arc::new(SimRuntime::new()))
        .max_bytes(bytes)
        .build()
        .unwrap()
}

fn assert_held_by_requester(r: Result<impl Sized, Error>, requested: usize) {
    match r {
        Err(Error::OutOfMemory {
            requested: n,
            limit: Some(_),
            cause: OomCause::HeldByRequester,
            ..
        }) => assert_eq!(n, requested),
        Err(e) => panic!("expected HeldByRequester, got {e}"),
        Ok(_) => panic!("expected HeldByRequester, got a buffer"),
    }
}

/// The example: a 4 MiB cap, a task that holds 3 MiB and asks for 2 MiB more. Before,
/// it waited for ever with nothing logged; now it is refused after its look (about a second),
/// the refusal is logged and counted, nothing is left behind, and once the task dropped its
/// buffer the same request is served.
#[test]
fn a_task_that_holds_3_mib_of_a_4_mib_cap_and_asks_for_2_more_is_refused_not_left_waiting() {
    let logged = Logged::default();
    let _log = logged.capture();
    current_thread().block_on(async {
        let pinned = capped(4 * MIB);
        let held = pinned.alloc(3 * MIB).await.unwrap();
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), pinned.alloc(2 * MIB))
            .await
            .expect("a refusal, not a silent wait");
        assert_held_by_requester(r, 2 * MIB);
        assert!(
            t0.elapsed() >= Duration::from_millis(900),
            "{:?}",
            t0.elapsed()
        );
        let err = pinned.alloc(2 * MIB).await.map(drop).unwrap_err();
        assert!(
            !err.never_fits(),
            "dropping the held buffer makes room: {err}"
        );
        assert!(err.to_string().contains("BufferSet"), "{err}");
        assert_eq!(pinned.stats().num_ooms, 2);
        let lines = logged.lines();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("BufferSet"), "{lines:?}");
        drop(held);
        assert_eq!(pinned.alloc(2 * MIB).await.unwrap().len(), 2 * MIB);
        // Device memory alike, and a request with a timeout longer than the look.
        let device = DeviceBuilder::new(pinned.runtime().clone())
            .max_bytes(4 * MIB)
            .build()
            .unwrap();
        let s = device.runtime().stream();
        let held = device.alloc(3 * MIB, &s).await.unwrap();
        let r = device
            .alloc_timeout(2 * MIB, &s, Duration::from_secs(30))
            .await;
        assert_held_by_requester(r, 2 * MIB);
        drop(held);
        assert_eq!(device.alloc(2 * MIB, &s).await.unwrap().len(), 2 * MIB);
    });
}

/// The same from a plain thread's blocking call, and for a `BufferSet` whose task already
/// holds what keeps it from fitting.
#[test]
fn a_blocked_thread_or_a_buffer_set_waiting_on_its_own_buffers_is_refused_too() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let pinned = {
        let _in = rt.enter();
        capped(4 * MIB)
    };
    let held = pinned.alloc_blocking(3 * MIB).unwrap();
    assert_held_by_requester(pinned.alloc_blocking(2 * MIB), 2 * MIB);
    let set = BufferSet::new().pinned(&pinned, 2 * MIB).alloc_blocking();
    assert_held_by_requester(set.map(drop), 2 * MIB);
    drop(held);
    assert!(pinned.alloc_blocking(2 * MIB).is_ok());
}

/// A request that waits for memory another task holds is not refused: it is logged once,
/// after about a second (the cap, what is held, the ways out), and served when the other
/// task drops its buffer.
#[test]
fn a_long_wait_for_another_tasks_memory_is_logged_once_and_then_served() {
    let logged = Logged::default();
    let _log = logged.capture();
    current_thread().block_on(async {
        let pinned = capped(4 * MIB);
        let holder = {
            let pinned = pinned.clone();
            tokio::spawn(async move {
                let b = pinned.alloc(3 * MIB).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                drop(b);
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let got = tokio::time::timeout(Duration::from_secs(10), pinned.alloc(2 * MIB))
            .await
            .expect("served once the other task's buffer came back")
            .unwrap();
        assert_eq!(got.len(), 2 * MIB);
        holder.await.unwrap();
        let lines = logged.lines();
        assert_eq!(lines.len(), 1, "one warning for one long wait: {lines:?}");
        let line = &lines[0];
        for word in [
            "requested=2097152",
            "limit=4194304",
            "in_use=",
            "held_by_requester=0",
            "BufferSet",
            "alloc_timeout",
        ] {
            assert!(line.contains(word), "{word} missing from: {line}");
        }
        assert_eq!(pinned.stats().num_ooms, 0);
    });
}

/// Where buffers change hands (one taken by a task was dropped by another), what a task took
/// may be held elsewhere and come back: its long wait is logged, not refused, and served
/// once the buffer it handed over is dropped.
#[test]
fn a_task_whose_buffers_go_to_another_task_is_warned_not_refused() {
    let logged = Logged::default();
    let _log = logged.capture();
    current_thread().block_on(async {
        let pinned = capped(4 * MIB);
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let consumer = tokio::spawn(async move {
            while let Some((b, hold)) = rx.recv().await {
                tokio::time::sleep(hold).await;
                drop::<pinpool::PinnedBuffer<SimRuntime>>(b);
            }
        });
        // The producer takes every buffer; the consumer drops the first at once, then holds
        // each a while.
        let mut hold = Duration::ZERO;
        for _ in 0..3 {
            let b = pinned.alloc(3 * MIB).await.unwrap();
            tx.send((b, hold)).await.unwrap();
            hold = Duration::from_millis(1300);
        }
        drop(tx);
        consumer.await.unwrap();
        assert_eq!(pinned.stats().num_ooms, 0);
        let lines = logged.lines();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("held_by_requester=3145728"), "{lines:?}");
    });
}
