//! History: a bounded ring of trace entries, kept by the history actor.
//!
//! Owns the recorder (the on/off flag the hot paths read, and the senders to the history
//! actor), the history actor itself (the ring), and the hook functions that the alloc, free,
//! segment, OOM and capture paths call. Keeps invariant 5: while history is off, each hook on
//! the cached path costs one relaxed load of a flag that nobody writes while it is off.
//! While history is on (opt-in), a hook sends its entry to the history actor over a bounded
//! channel and never waits: an entry that finds the channel full is counted as lost.
//!
//! User callbacks (trace trackers, OOM observers) never run here: entries and OOM reports are
//! forwarded to the observer task ([`crate::observe`]).

use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use flume::{Receiver, Sender};

use crate::block::Block;
use crate::error::Error;
use crate::observe::{start_observer, ObserverEvent, ObserverMsg, OomReport};
use crate::pool::{PoolShared, Reply};
use crate::pool_id::PoolId;
use crate::runtime::{HostMemory, Runtime, StreamId};
use crate::shard::CachePadded;
use crate::spawn::spawn_named;

/// What a trace entry records (PyTorch's `TraceEntry::Action`, plus capture markers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TraceAction {
    /// A buffer was handed out (cached path or not).
    Alloc,
    /// A buffer was dropped by its user.
    FreeRequested,
    /// The block of a dropped buffer became reusable: at once when no stream used it, once
    /// its recorded events completed otherwise. Blocks kept for graph replays never get one.
    FreeCompleted,
    /// Fresh pinned memory was taken from the runtime.
    SegmentAlloc,
    /// Pinned memory was given back to the runtime.
    SegmentFree,
    /// A snapshot of the allocator was taken (ties snapshots to the trace).
    Snapshot,
    /// A request failed for want of memory (`size` is the request).
    Oom,
    /// A user annotation ([`crate::Engine::record_annotation`]); `name` holds it.
    UserDefined,
    /// A capture began allocating to a private pool.
    CaptureBegin,
    /// A capture stopped allocating to a private pool.
    CaptureEnd,
}

impl TraceAction {
    /// A short lower-case name: `"alloc"`, `"free_requested"`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::Snapshot => "snapshot",
            TraceAction::Oom => "oom",
            TraceAction::UserDefined => "user_defined",
            TraceAction::CaptureBegin => "capture_begin",
            TraceAction::CaptureEnd => "capture_end",
        }
    }
}

impl fmt::Display for TraceAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which call sites are captured with the trace (PyTorch's `RecordContext`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum HistoryContext {
    /// No call sites: the cheapest history.
    #[default]
    None,
    /// The call site of every allocation (`std::backtrace::Backtrace`).
    Alloc,
    /// The call sites of allocations and of frees.
    All,
}

impl HistoryContext {
    fn to_u8(self) -> u8 {
        match self {
            HistoryContext::None => 0,
            HistoryContext::Alloc => 1,
            HistoryContext::All => 2,
        }
    }
}

/// One event of the allocator's history.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Microseconds since the allocator started.
    pub time_us: u64,
    /// The pool it happened in.
    pub pool: PoolId,
    /// Address of the block or segment (0 for entries without one).
    pub addr: usize,
    /// Bytes of the block or segment; for `Oom`, the bytes requested.
    pub size: usize,
    /// Bytes the user asked for (`Alloc`, `FreeRequested`); 0 otherwise.
    pub requested: usize,
    /// The first stream recorded on a freed buffer (`FreeRequested`, `FreeCompleted`).
    pub stream: Option<StreamId>,
    /// The annotation (`UserDefined`) or the error (`Oom`).
    pub name: Option<Arc<str>>,
    /// The call site, when [`HistoryContext`] asked for it.
    pub context: Option<Arc<Backtrace>>,
}

impl TraceEntry {
    fn new(action: TraceAction, time_us: u64, pool: PoolId) -> Self {
        TraceEntry {
            action,
            time_us,
            pool,
            addr: 0,
            size: 0,
            requested: 0,
            stream: None,
            name: None,
            context: None,
        }
    }
}

/// The recorded history, as [`crate::Engine::history`] returns it.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct History {
    /// Entries in the order the history actor received them (oldest first).
    pub entries: Vec<TraceEntry>,
    /// Whether recording is on.
    pub enabled: bool,
    /// The ring's bound.
    pub max_entries: usize,
    /// Entries pushed out of the ring by newer ones.
    pub overwritten: u64,
    /// Entries lost on the way because the history actor was behind.
    pub lost: u64,
}

/// Entries the channel to the history actor holds before new ones are counted as lost.
const CHANNEL_BOUND: usize = 1 << 16;

/// Messages to the history actor other than entries.
enum Control {
    Configure { max_entries: usize },
    Read { reply: Reply<History> },
}

/// The flags the hot paths read, on cache lines of their own: written only by
/// `record_history` when the setting changes.
struct Flags {
    enabled: AtomicBool,
    context: AtomicU8,
}

/// The recording side of history, shared by the engine and its pools.
pub(crate) struct Recorder {
    flags: CachePadded<Flags>,
    start: Instant,
    entries: Sender<TraceEntry>,
    control: Sender<Control>,
    observers: Sender<ObserverMsg>,
    observer_events: Sender<ObserverEvent>,
    /// Trace trackers attached (the history actor forwards entries only when there are some).
    trackers: Arc<AtomicUsize>,
    /// Written only when an entry finds the channel full (history on, actor behind).
    lost: Arc<AtomicU64>,
}

/// Starts the history actor and the observer task; returns the recorder.
pub(crate) fn start(handle: &tokio::runtime::Handle) -> Arc<Recorder> {
    let (entries_tx, entries_rx) = flume::bounded(CHANNEL_BOUND);
    let (control_tx, control_rx) = flume::unbounded();
    let (observers_tx, observers_rx) = flume::unbounded();
    let (events_tx, events_rx) = flume::bounded(crate::observe::EVENT_BOUND);
    let trackers = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    start_observer(observers_rx, events_rx, handle);
    let actor = HistoryActor {
        entries: entries_rx,
        control: control_rx,
        ring: VecDeque::new(),
        max_entries: 0,
        overwritten: 0,
        lost: lost.clone(),
        trackers: trackers.clone(),
        observer_events: events_tx.clone(),
        observer_lost: 0,
    };
    spawn_named("pinpool::history", handle, actor.run());
    Arc::new(Recorder {
        flags: CachePadded(Flags {
            enabled: AtomicBool::new(false),
            context: AtomicU8::new(0),
        }),
        start: Instant::now(),
        entries: entries_tx,
        control: control_tx,
        observers: observers_tx,
        observer_events: events_tx,
        trackers,
        lost,
    })
}

impl Recorder {
    /// Whether history is on: the one load the cached path pays.
    #[inline(always)]
    pub(crate) fn is_on(&self) -> bool {
        self.flags.enabled.load(Relaxed)
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn context(&self) -> HistoryContext {
        match self.flags.context.load(Relaxed) {
            0 => HistoryContext::None,
            1 => HistoryContext::Alloc,
            _ => HistoryContext::All,
        }
    }

    fn send(&self, entry: TraceEntry) {
        if let Err(flume::TrySendError::Full(_)) = self.entries.try_send(entry) {
            self.lost.fetch_add(1, Relaxed);
        }
    }

    /// Turns recording on or off and sets the ring's bound and the call sites captured.
    pub(crate) fn configure(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
    ) -> Result<(), Error> {
        if enabled && max_entries == 0 {
            return Err(Error::EmptyHistoryRing);
        }
        if enabled {
            // The actor sizes its ring before any entry sent after the flag is set reaches it.
            self.control
                .send(Control::Configure { max_entries })
                .map_err(|_| Error::Shutdown)?;
            if self.flags.context.load(Relaxed) != context.to_u8() {
                self.flags.context.store(context.to_u8(), Relaxed);
            }
            if !self.is_on() {
                self.flags.enabled.store(true, Relaxed);
            }
            tracing::info!(max_entries, ?context, "history recording on");
        } else if self.is_on() {
            // Never written while off: the cached path's line stays shared-clean.
            self.flags.enabled.store(false, Relaxed);
            tracing::info!("history recording off");
        }
        Ok(())
    }

    /// Asks the history actor for the ring.
    pub(crate) fn read(&self) -> Result<Receiver<History>, Error> {
        let (tx, rx) = flume::bounded(1);
        self.control
            .send(Control::Read { reply: tx })
            .map_err(|_| Error::Shutdown)?;
        Ok(rx)
    }

    /// Records a user annotation (nothing while history is off).
    pub(crate) fn annotate(&self, name: &str) {
        if !self.is_on() {
            return;
        }
        let mut e = TraceEntry::new(TraceAction::UserDefined, self.now_us(), PoolId::DEFAULT);
        e.name = Some(Arc::from(name));
        self.send(e);
    }

    /// Records that a snapshot was taken.
    pub(crate) fn snapshot_taken(&self) {
        if self.is_on() {
            self.send(TraceEntry::new(
                TraceAction::Snapshot,
                self.now_us(),
                PoolId::DEFAULT,
            ));
        }
    }

    pub(crate) fn attach(&self, msg: ObserverMsg) {
        if matches!(msg, ObserverMsg::Tracker(_)) {
            self.trackers.fetch_add(1, Relaxed);
        }
        // The observer task lives as long as any recorder: the send cannot fail.
        let _ = self.observers.send(msg);
    }
}

// ---- hooks: one-line calls from the engine's paths ----

/// Hook (lease made, cached path included): records an `Alloc`.
#[inline(always)]
pub(crate) fn on_alloc<R: Runtime>(block: &Block<R>, requested: usize) {
    if block.pool.history.is_on() {
        record_alloc(block, requested);
    }
}

#[cold]
#[inline(never)]
fn record_alloc<R: Runtime>(block: &Block<R>, requested: usize) {
    let h = &*block.pool.history;
    let mut e = TraceEntry::new(TraceAction::Alloc, h.now_us(), block.pool.id);
    e.addr = block.memory.ptr.as_ptr() as usize;
    e.size = block.size;
    e.requested = requested;
    if h.context() != HistoryContext::None {
        e.context = Some(Arc::new(Backtrace::force_capture()));
    }
    h.send(e);
}

/// Hook (buffer dropped, cached path included): records a `FreeRequested`, and the
/// `FreeCompleted` too when no stream used the block (it is reusable at once).
#[inline(always)]
pub(crate) fn on_free<R: Runtime>(block: &Block<R>, requested: usize) {
    if block.pool.history.is_on() {
        record_free(block, requested);
    }
}

#[cold]
#[inline(never)]
fn record_free<R: Runtime>(block: &Block<R>, requested: usize) {
    let h = &*block.pool.history;
    let t = h.now_us();
    let mut e = TraceEntry::new(TraceAction::FreeRequested, t, block.pool.id);
    e.addr = block.memory.ptr.as_ptr() as usize;
    e.size = block.size;
    e.requested = requested;
    e.stream = block.streams.first().map(|(s, _)| *s);
    if h.context() == HistoryContext::All {
        e.context = Some(Arc::new(Backtrace::force_capture()));
    }
    let done = block.streams.is_empty().then(|| {
        let mut d = TraceEntry::new(TraceAction::FreeCompleted, t, block.pool.id);
        d.addr = e.addr;
        d.size = e.size;
        d
    });
    h.send(e);
    if let Some(d) = done {
        h.send(d);
    }
}

/// Hook (the events of a freed block completed): records a `FreeCompleted`.
#[inline]
pub(crate) fn on_free_completed<R: Runtime>(block: &Block<R>) {
    let h = &*block.pool.history;
    if h.is_on() {
        let mut e = TraceEntry::new(TraceAction::FreeCompleted, h.now_us(), block.pool.id);
        e.addr = block.memory.ptr.as_ptr() as usize;
        e.size = block.size;
        h.send(e);
    }
}

/// Hook (fresh memory taken): records a `SegmentAlloc`.
pub(crate) fn on_segment_alloc<R: Runtime>(pool: &PoolShared<R>, memory: &HostMemory) {
    segment(pool, memory, TraceAction::SegmentAlloc);
}

/// Hook (memory given back to the runtime): records a `SegmentFree`.
pub(crate) fn on_segment_free<R: Runtime>(pool: &PoolShared<R>, memory: &HostMemory) {
    tracing::debug!(pool = %pool.id, bytes = memory.size, "pinned memory given back");
    segment(pool, memory, TraceAction::SegmentFree);
}

fn segment<R: Runtime>(pool: &PoolShared<R>, memory: &HostMemory, action: TraceAction) {
    let h = &*pool.history;
    if h.is_on() {
        let mut e = TraceEntry::new(action, h.now_us(), pool.id);
        e.addr = memory.ptr.as_ptr() as usize;
        e.size = memory.size;
        h.send(e);
    }
}

/// Hook (a capture began or ended allocating to `pool`): records a marker.
pub(crate) fn on_capture<R: Runtime>(pool: &PoolShared<R>, begin: bool) {
    let h = &*pool.history;
    if h.is_on() {
        let action = if begin {
            TraceAction::CaptureBegin
        } else {
            TraceAction::CaptureEnd
        };
        h.send(TraceEntry::new(action, h.now_us(), pool.id));
    }
}

/// Hook (a request is about to fail with `err`): when it is an out-of-memory error, logs it,
/// records an `Oom` and tells the OOM observers. Returns `err` unchanged, so that it wraps
/// the error where it is made: `return Err(on_oom(&self.shared, err))`.
pub(crate) fn on_oom<R: Runtime>(pool: &PoolShared<R>, err: Error) -> Error {
    if let Error::OutOfMemory {
        requested,
        reserved,
        limit,
    } = err
    {
        let h = &*pool.history;
        let time_us = h.now_us();
        tracing::warn!(pool = %pool.id, requested, reserved, ?limit, "out of pinned memory");
        if h.is_on() {
            let mut e = TraceEntry::new(TraceAction::Oom, time_us, pool.id);
            e.size = requested;
            e.name = Some(Arc::from(err.to_string()));
            h.send(e);
        }
        let report = OomReport {
            pool: pool.id,
            requested,
            reserved,
            limit,
            time_us,
        };
        // Never waits: a report that finds the observer's queue full is dropped.
        let _ = h.observer_events.try_send(ObserverEvent::Oom(report));
    }
    err
}

// ---- the actor ----

struct HistoryActor {
    entries: Receiver<TraceEntry>,
    control: Receiver<Control>,
    ring: VecDeque<TraceEntry>,
    max_entries: usize,
    overwritten: u64,
    lost: Arc<AtomicU64>,
    trackers: Arc<AtomicUsize>,
    observer_events: Sender<ObserverEvent>,
    observer_lost: u64,
}

impl HistoryActor {
    /// Control messages go first, so that a ring is sized before the entries that follow its
    /// `Configure` arrive (entries sent earlier are then held to the new bound too).
    async fn run(mut self) {
        loop {
            tokio::select! {
                biased;
                msg = self.control.recv_async() => match msg {
                    Ok(msg) => self.handle(msg),
                    Err(_) => break,
                },
                entry = self.entries.recv_async() => match entry {
                    Ok(e) => self.push(e),
                    Err(_) => break,
                },
            }
        }
        tracing::debug!(
            overwritten = self.overwritten,
            observer_lost = self.observer_lost,
            "history actor stopped"
        );
    }

    fn handle(&mut self, msg: Control) {
        match msg {
            Control::Configure { max_entries } => {
                self.max_entries = max_entries;
                while self.ring.len() > max_entries {
                    self.ring.pop_front();
                    self.overwritten += 1;
                }
                self.ring
                    .reserve(max_entries.min(4096).saturating_sub(self.ring.len()));
            }
            Control::Read { reply } => {
                // Every entry sent before the request is in the channel: take them first.
                self.drain();
                let _ = reply.send(History {
                    entries: self.ring.iter().cloned().collect(),
                    enabled: false,
                    max_entries: self.max_entries,
                    overwritten: self.overwritten,
                    lost: self.lost.load(Relaxed),
                });
            }
        }
    }

    fn drain(&mut self) {
        while let Ok(e) = self.entries.try_recv() {
            self.push(e);
        }
    }

    fn push(&mut self, entry: TraceEntry) {
        if self.trackers.load(Relaxed) > 0 {
            if let Err(flume::TrySendError::Full(_)) = self
                .observer_events
                .try_send(ObserverEvent::Trace(entry.clone()))
            {
                self.observer_lost += 1;
            }
        }
        if self.max_entries == 0 {
            return;
        }
        if self.ring.len() == self.max_entries {
            self.ring.pop_front();
            self.overwritten += 1;
        }
        self.ring.push_back(entry);
    }
}

// ---- the engine's history calls ----

impl<R: Runtime> crate::engine::Engine<R> {
    /// Turns history recording on or off. While on, the last `max_entries` trace entries are
    /// kept (older ones are pushed out), with call sites as `context` asks. Turning it off
    /// keeps the entries recorded so far. Fails with [`Error::EmptyHistoryRing`] when asked to
    /// record into a ring of 0 entries.
    pub fn record_history(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
    ) -> Result<(), Error> {
        self.recorder().configure(enabled, max_entries, context)
    }

    /// Whether history recording is on.
    pub fn is_history_enabled(&self) -> bool {
        self.recorder().is_on()
    }

    /// Adds a `UserDefined` entry named `name` to the history (nothing while it is off).
    pub fn record_annotation(&self, name: &str) {
        self.recorder().annotate(name);
    }

    /// Records a `Snapshot` entry (for code that takes snapshots of the allocator).
    pub fn record_snapshot_taken(&self) {
        self.recorder().snapshot_taken();
    }

    /// The recorded history (a round trip to the history actor).
    pub async fn history(&self) -> Result<History, Error> {
        let rx = self.recorder().read()?;
        let mut h = rx.recv_async().await.map_err(|_| Error::Shutdown)?;
        h.enabled = self.recorder().is_on();
        Ok(h)
    }

    /// [`Engine::history`](crate::Engine::history) for threads outside the tokio runtime.
    pub fn history_blocking(&self) -> Result<History, Error> {
        let rx = self.recorder().read()?;
        let mut h = rx.recv().map_err(|_| Error::Shutdown)?;
        h.enabled = self.recorder().is_on();
        Ok(h)
    }

    /// Calls `f` for every trace entry recorded while history is on, from the observer task
    /// (on a blocking thread), never from an actor or an allocation.
    pub fn attach_trace_tracker(&self, f: impl Fn(&TraceEntry) + Send + Sync + 'static) {
        self.recorder()
            .attach(crate::observe::ObserverMsg::Tracker(Arc::new(f)));
    }

    /// Calls `f` for every request that fails for want of pinned memory, from the observer
    /// task (on a blocking thread).
    pub fn attach_oom_observer(&self, f: impl Fn(&OomReport) + Send + Sync + 'static) {
        self.recorder()
            .attach(crate::observe::ObserverMsg::Oom(Arc::new(f)));
    }
}
