//! The observer task: runs user callbacks (trace trackers and OOM observers).
//!
//! Owns the callbacks. Nothing waits on it: the history actor and the OOM path hand it events
//! with `try_send` on a bounded queue and drop what does not fit. It runs each batch of
//! callbacks on a blocking thread (invariant 6), one batch at a time so that callbacks see
//! events in order, and catches a callback's panic. A callback that blocks, or that calls
//! back into the allocator (`alloc_blocking`, `stats`, ...), holds up only later callbacks,
//! never an allocation.

use std::panic::{catch_unwind, AssertUnwindSafe};

use flume::Receiver;

use crate::vocab::blocking::off_runtime;

use crate::statistics::trace::{OomObserver, OomReport, TraceEntry, TraceTracker};
use crate::vocab::spawn::spawn_named;

/// Events the observer queue holds before new ones are dropped.
pub(crate) const EVENT_BOUND: usize = 1 << 14;
/// Events handed to one blocking-thread batch at most.
const BATCH: usize = 256;

/// Attaching a callback.
pub(crate) enum ObserverMsg {
    Tracker(TraceTracker),
    Oom(OomObserver),
}

/// Something to tell the callbacks.
pub(crate) enum ObserverEvent {
    Trace(TraceEntry),
    Oom(OomReport),
}

/// Starts the observer task; it stops once the history actor and every recorder are gone.
pub(crate) fn start_observer(
    attach: Receiver<ObserverMsg>,
    events: Receiver<ObserverEvent>,
    handle: &tokio::runtime::Handle,
) {
    let task = Observer {
        attach,
        events,
        trackers: Vec::new(),
        oom: Vec::new(),
    };
    spawn_named("pinpool::observer", handle, task.run());
}

struct Observer {
    attach: Receiver<ObserverMsg>,
    events: Receiver<ObserverEvent>,
    trackers: Vec<TraceTracker>,
    oom: Vec<OomObserver>,
}

impl Observer {
    async fn run(mut self) {
        let mut attach_open = true;
        loop {
            // Attachments first: a callback attached before an event was made sees it.
            while let Ok(msg) = self.attach.try_recv() {
                self.add(msg);
            }
            let first = if attach_open {
                tokio::select! {
                    biased;
                    msg = self.attach.recv_async() => {
                        match msg {
                            Ok(msg) => self.add(msg),
                            Err(_) => attach_open = false,
                        }
                        continue;
                    }
                    ev = self.events.recv_async() => ev,
                }
            } else {
                self.events.recv_async().await
            };
            let Ok(first) = first else { break };
            let mut batch = vec![first];
            batch.extend(self.events.try_iter().take(BATCH - 1));
            self.dispatch(batch).await;
        }
        tracing::debug!("observer task stopped");
    }

    fn add(&mut self, msg: ObserverMsg) {
        match msg {
            ObserverMsg::Tracker(f) => self.trackers.push(f),
            ObserverMsg::Oom(f) => self.oom.push(f),
        }
    }

    async fn dispatch(&self, batch: Vec<ObserverEvent>) {
        let trackers = self.trackers.clone();
        let oom = self.oom.clone();
        if trackers.is_empty() && oom.is_empty() {
            return;
        }
        // A callback may call the blocking API: this thread runs no runtime's tasks.
        let job = tokio::task::spawn_blocking(move || {
            off_runtime(|| {
                for ev in &batch {
                    match ev {
                        ObserverEvent::Trace(e) => {
                            for f in &trackers {
                                call("trace tracker", || f(e));
                            }
                        }
                        ObserverEvent::Oom(r) => {
                            for f in &oom {
                                call("OOM observer", || f(r));
                            }
                        }
                    }
                }
            })
        });
        if let Err(e) = job.await {
            tracing::error!(error = %e, "observer callbacks failed");
        }
    }
}

/// Runs one callback, containing a panic.
fn call(what: &str, f: impl FnOnce()) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string panic".to_string());
        tracing::error!(callback = what, panic = %message, "an allocator callback panicked; it stays attached");
    }
}
