//! History and observers: the handle's calls to the history recorder (see
//! [`crate::observation::history`]).

use std::sync::Arc;

use super::Engine;
use crate::observation::history::HistorySetting;
use crate::observation::observe::ObserverMsg;
use crate::statistics::trace::{History, OomReport, TraceEntry};
use crate::vocab::error::Error;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> Engine<R> {
    /// Turns history recording on or off. While on, the last `max_entries` trace entries are
    /// kept (older ones are pushed out), with call sites as `context` asks. Turning it off
    /// keeps the entries recorded so far. Fails with [`Error::EmptyHistoryRing`] when asked to
    /// record into a ring of 0 entries.
    #[doc(hidden)]
    pub fn record_history(&self, setting: HistorySetting) -> Result<(), Error> {
        self.recorder().configure(setting)
    }

    /// Whether history recording is on.
    #[doc(hidden)]
    pub fn is_history_enabled(&self) -> bool {
        self.recorder().is_on()
    }

    /// Adds a `UserDefined` entry named `name` to the history (nothing while it is off).
    #[doc(hidden)]
    pub fn record_annotation(&self, name: &str) {
        self.recorder().annotate(name);
    }

    /// Records a `Snapshot` entry (for code that takes snapshots of the allocator).
    #[doc(hidden)]
    pub fn record_snapshot_taken(&self) {
        self.recorder().snapshot_taken();
    }

    /// The recorded history (a round trip to the history actor).
    #[doc(hidden)]
    pub async fn history(&self) -> Result<History, Error> {
        let rx = self.recorder().read()?;
        let mut h = rx.recv_async().await.map_err(|_| Error::Shutdown)?;
        h.enabled = self.recorder().is_on();
        h.now_us = self.recorder().now_us();
        Ok(h)
    }

    /// Calls `f` for every trace entry recorded while history is on, from the observer task
    /// (on a blocking thread), never from an actor or an allocation.
    #[doc(hidden)]
    pub fn attach_trace_tracker(&self, f: impl Fn(&TraceEntry) + Send + Sync + 'static) {
        self.recorder().attach(ObserverMsg::Tracker(Arc::new(f)));
    }

    /// Calls `f` for every request that fails for want of pinned memory, from the observer
    /// task (on a blocking thread).
    #[doc(hidden)]
    pub fn attach_oom_observer(&self, f: impl Fn(&OomReport) + Send + Sync + 'static) {
        self.recorder().attach(ObserverMsg::Oom(Arc::new(f)));
    }
}
