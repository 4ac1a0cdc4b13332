//! tokio-console shows every actor by name: a console client (console-api's gRPC `instrument`
//! client) connected to the port the console-subscriber layer serves finds the pool, event
//! poller, router, history and observer tasks of a `PinnedAllocator`, then those of a
//! `DeviceAllocator` on the simulated runtime.
//!
//! Task names and task spans exist only under `--cfg tokio_unstable`, and the layer only with
//! the `console` feature; elsewhere this binary is empty (or not built):
//!
//! ```text
//! RUSTFLAGS="--cfg tokio_unstable" cargo test --features console --test console_tasks \
//!     --target-dir target/unstable
//! ```
#![cfg(tokio_unstable)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

use console_api::field::{Name, Value};
use console_api::instrument::instrument_client::InstrumentClient;
use console_api::instrument::InstrumentRequest;
use pinpool::{DeviceAllocator, HistoryContext, PinnedAllocator};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing_subscriber::prelude::*;

/// How long the whole check may take before it fails, naming what it never saw.
const DEADLINE: Duration = Duration::from_secs(60);

/// The actor tasks of a `PinnedAllocator`.
const PINNED_TASKS: [&str; 5] = [
    "pinpool::pool(default)",
    "pinpool::event_poller",
    "pinpool::router",
    "pinpool::history",
    "pinpool::observer",
];

/// The actor tasks of a `DeviceAllocator`'s device 0.
const DEVICE_TASKS: [&str; 5] = [
    "pinpool::device_pool(0, default)",
    "pinpool::event_poller",
    "pinpool::router",
    "pinpool::history",
    "pinpool::observer",
];

/// A loopback port nobody listens on now (not tokio-console's default 6669, so that parallel
/// runs and a console left open do not clash).
fn free_loopback_port() -> u16 {
    let probe = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
    probe.local_addr().expect("the probe's address").port()
}

/// What the console client tells the test: a task it saw for the first time (its console id
/// and its `task.name`, if it has one), or why it stopped.
type Seen = Result<(u64, Option<String>), String>;

/// Connects a console client to `127.0.0.1:port` (retrying until the server is up, or the
/// deadline) and forwards every new task it reports.
async fn watch_tasks(port: u16, deadline: Instant, tx: mpsc::UnboundedSender<Seen>) {
    let url = format!("http://127.0.0.1:{port}");
    let mut client = loop {
        match tokio::time::timeout_at(deadline, InstrumentClient::connect(url.clone())).await {
            Ok(Ok(client)) => break client,
            Ok(Err(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(Err(e)) => {
                let _ = tx.send(Err(format!("no console server at {url}: {e}")));
                return;
            }
            Err(_) => {
                let _ = tx.send(Err(format!("no console server at {url} in time")));
                return;
            }
        }
    };
    let mut updates = match client.watch_updates(InstrumentRequest {}).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = tx.send(Err(format!("watch_updates at {url}: {status}")));
            return;
        }
    };
    loop {
        let update = match updates.message().await {
            Ok(Some(update)) => update,
            Ok(None) => {
                let _ = tx.send(Err(format!("the console server at {url} ended the stream")));
                return;
            }
            Err(status) => {
                let _ = tx.send(Err(format!("reading updates from {url}: {status}")));
                return;
            }
        };
        for task in update.task_update.into_iter().flat_map(|t| t.new_tasks) {
            let Some(id) = task.id.map(|id| id.id) else {
                continue;
            };
            let name = task
                .fields
                .into_iter()
                .find_map(|f| match (f.name, f.value) {
                    (Some(Name::StrName(n)), Some(Value::DebugVal(v) | Value::StrVal(v)))
                        if n == "task.name" =>
                    {
                        Some(v)
                    }
                    _ => None,
                });
            if tx.send(Ok((id, name))).is_err() {
                return;
            }
        }
    }
}

/// Reads what the client saw until every name in `wanted` belongs to some task not in
/// `earlier`; returns those tasks' ids. Panics at the deadline, saying which names never
/// showed.
async fn find_tasks(
    what: &str,
    wanted: &[&str],
    earlier: &BTreeSet<u64>,
    seen: &mut BTreeMap<u64, Option<String>>,
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    deadline: Instant,
) -> BTreeSet<u64> {
    loop {
        let mut found = BTreeSet::new();
        let mut missing = Vec::new();
        for name in wanted {
            let task = seen
                .iter()
                .find(|(id, n)| !earlier.contains(id) && n.as_deref() == Some(*name));
            match task {
                Some((id, _)) => {
                    found.insert(*id);
                }
                None => missing.push(*name),
            }
        }
        if missing.is_empty() {
            return found;
        }
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Ok((id, name)))) => {
                seen.insert(id, name);
            }
            Ok(Some(Err(e))) => panic!("{what}: the console client stopped: {e}"),
            Ok(None) => panic!("{what}: the console client stopped"),
            Err(_) => {
                let names: BTreeSet<_> =
                    seen.values().flatten().filter(|n| !n.is_empty()).collect();
                panic!(
                    "{what}: within {DEADLINE:?}, tokio-console never showed a task named \
                     {missing:?}; it showed {names:?}"
                );
            }
        }
    }
}

#[test]
fn tokio_console_shows_every_actor_task_by_name_for_pinned_and_device_memory() {
    let port = free_loopback_port();
    let console = console_subscriber::ConsoleLayer::builder()
        .server_addr((Ipv4Addr::LOCALHOST, port))
        .publish_interval(Duration::from_millis(100))
        .spawn();
    tracing_subscriber::registry().with(console).init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let deadline = Instant::now() + DEADLINE;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let client = tokio::spawn(watch_tasks(port, deadline, tx));
        let mut seen = BTreeMap::new();

        // History on and an observer attached, so that the history actor and the observer
        // task have work, should they ever start lazily.
        let pinned = PinnedAllocator::builder()
            .build()
            .expect("a pinned allocator");
        pinned
            .record_history(true, 1000, HistoryContext::None)
            .expect("history on");
        pinned.attach_oom_observer(|_| {});
        let pinned_tasks = find_tasks(
            "pinned memory",
            &PINNED_TASKS,
            &BTreeSet::new(),
            &mut seen,
            &mut rx,
            deadline,
        )
        .await;

        // The device allocator's router, poller, history and observer have the same names as
        // the pinned allocator's: they must be other tasks.
        let device = DeviceAllocator::builder()
            .build()
            .expect("a device allocator");
        device
            .record_history(true, 1000, HistoryContext::None)
            .expect("history on");
        device.attach_oom_observer(|_| {});
        // A device's actors start at its first use.
        let stream = device.runtime().new_stream().expect("a stream");
        drop(device.alloc(4096, &stream).await.expect("device memory"));
        let device_tasks = find_tasks(
            "device memory",
            &DEVICE_TASKS,
            &pinned_tasks,
            &mut seen,
            &mut rx,
            deadline,
        )
        .await;
        assert_eq!(device_tasks.len(), DEVICE_TASKS.len());

        client.abort();
        drop((pinned, device));
    });
    rt.shutdown_timeout(Duration::from_secs(5));
}
