//! History: a bounded ring of trace entries, kept by the history actor.
//!
//! Owns the recorder (the on/off flag the hot paths read, and the senders to the history
//! actor), the history actor itself (the ring), and the hooks that the alloc, free, segment,
//! OOM and capture paths call (they take plain values, so that this module knows nothing of
//! blocks or pools). Keeps invariant 5: while history is off, each hook on
//! the cached path costs one relaxed load of a flag that nobody writes while it is off.
//! While history is on (opt-in), a hook sends its entry to the history actor over a bounded
//! channel and never waits: an entry that finds the channel full is counted as lost.
//!
//! User callbacks (trace trackers, OOM observers) never run here: entries and OOM reports are
//! forwarded to the observer task ([`crate::observation::observe`]).

use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Instant;

use flume::{Receiver, Sender};

use crate::observation::observe::{start_observer, ObserverEvent, ObserverMsg};
use crate::statistics::trace::{History, HistoryContext, OomReport, TraceAction, TraceEntry};
use crate::vocab::error::Error;
use crate::vocab::mailbox::{leftovers, Mailbox};
use crate::vocab::memory::{MemoryKind, Region};
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::StreamId;
use crate::vocab::shard::CachePadded;
use crate::vocab::spawn::spawn_named;

/// Entries the channel to the history actor holds before new ones are counted as lost.
const CHANNEL_BOUND: usize = 1 << 16;

/// Messages to the history actor other than entries.
enum Control {
    /// The ring's bound, and what it keeps.
    Configure(HistorySetting),
    Read {
        reply: Sender<History>,
    },
}

/// The flags the hot paths read, on cache lines of their own: written only by
/// `record_history` when the setting changes.
struct Flags {
    enabled: AtomicBool,
    context: AtomicU8,
}

/// One `record_history` call: whether history is recorded, the ring's bound, the call sites
/// captured, and what the ring does with entries as recording turns on (see
/// [`HistorySetting::with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistorySetting {
    /// Whether history is recorded.
    pub enabled: bool,
    /// How many entries the ring keeps.
    pub max_entries: usize,
    /// The call sites captured.
    pub context: HistoryContext,
    /// PyTorch's `clear_history`: forget the entries recorded so far.
    clear: bool,
    /// PyTorch's `skip_actions`: bits ([`TraceAction::bit`]) of the actions left out of the
    /// ring (trace trackers still get them).
    skip: u32,
}

impl HistorySetting {
    /// Recording on or off, into a ring of `max_entries`, with call sites as `context` asks;
    /// the entries recorded so far kept.
    pub fn new(enabled: bool, max_entries: usize, context: HistoryContext) -> Self {
        HistorySetting {
            enabled,
            max_entries,
            context,
            clear: false,
            skip: 0,
        }
    }

    /// As PyTorch's `clear_history` and `skip_actions`: with `clear`, the entries recorded
    /// so far are forgotten; entries of the `skip` actions are left out of the history
    /// (trace trackers still get them) until the next call.
    pub fn with(self, clear: bool, skip: &[TraceAction]) -> Self {
        let skip = skip.iter().fold(0, |bits, a| bits | a.bit());
        HistorySetting {
            clear,
            skip,
            ..self
        }
    }

    /// The same setting, the entries recorded so far kept (for an engine that starts after
    /// the call: it has nothing to clear).
    pub fn kept(self) -> Self {
        HistorySetting {
            clear: false,
            ..self
        }
    }
}

/// The recording side of history, shared by the engine and its pools.
pub(crate) struct Recorder {
    flags: CachePadded<Flags>,
    start: Instant,
    entries: Sender<TraceEntry>,
    control: Arc<Mailbox<Control>>,
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
    let control = Arc::new(Mailbox::new(control_tx));
    let (observers_tx, observers_rx) = flume::unbounded();
    let (events_tx, events_rx) = flume::bounded(crate::observation::observe::EVENT_BOUND);
    let trackers = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    start_observer(observers_rx, events_rx, handle);
    let actor = HistoryActor {
        entries: entries_rx,
        mailbox: Arc::downgrade(&control),
        control: control_rx,
        ring: VecDeque::new(),
        max_entries: 0,
        skip: 0,
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
        control,
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

    pub(crate) fn now_us(&self) -> u64 {
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

    /// Turns recording on or off, sets the ring's bound and the call sites captured, and what
    /// the ring does with the entries it holds.
    pub(crate) fn configure(&self, setting: HistorySetting) -> Result<(), Error> {
        let HistorySetting {
            enabled,
            max_entries,
            context,
            ..
        } = setting;
        if enabled && max_entries == 0 {
            return Err(Error::EmptyHistoryRing);
        }
        if enabled {
            // The actor sizes its ring before any entry sent after the flag is set reaches it.
            self.control
                .send(Control::Configure(setting))
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

/// A block, or a segment, as the history sees it: its pool and that pool's owner stream, its
/// address and size. Rule: every entry about a piece of memory starts from one, made by
/// [`BlockSeen::entry`], so that the hooks share one shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockSeen {
    pub(crate) pool: PoolId,
    pub(crate) owner: Option<StreamId>,
    pub(crate) addr: usize,
    pub(crate) size: usize,
}

impl BlockSeen {
    /// An entry of `action` at `time_us` about this memory.
    #[inline]
    fn entry(self, action: TraceAction, time_us: u64) -> TraceEntry {
        let mut e = TraceEntry::new(action, time_us, self.pool);
        e.owner = self.owner;
        e.addr = self.addr;
        e.size = self.size;
        e
    }
}

impl Recorder {
    /// Hook (lease made, cached path included): records an `Alloc` of `block`, `requested`
    /// bytes asked for.
    #[inline(always)]
    pub(crate) fn on_alloc(&self, block: BlockSeen, requested: usize) {
        if self.is_on() {
            self.record_alloc(block, requested);
        }
    }

    #[cold]
    #[inline(never)]
    fn record_alloc(&self, block: BlockSeen, requested: usize) {
        let mut e = block.entry(TraceAction::Alloc, self.now_us());
        e.requested = requested;
        if self.context() != HistoryContext::None {
            e.context = Some(Arc::new(Backtrace::force_capture()));
        }
        self.send(e);
    }

    /// Hook (buffer dropped, cached path included): records a `FreeRequested`, and the
    /// `FreeCompleted` too when no stream used the block (it is reusable at once). `stream`
    /// gives the first stream recorded on it; it is asked only while history is on.
    #[inline(always)]
    pub(crate) fn on_free(
        &self,
        block: BlockSeen,
        requested: usize,
        stream: impl FnOnce() -> Option<StreamId>,
    ) {
        if self.is_on() {
            self.record_free(block, requested, stream());
        }
    }

    #[cold]
    #[inline(never)]
    fn record_free(&self, block: BlockSeen, requested: usize, stream: Option<StreamId>) {
        let t = self.now_us();
        let mut e = block.entry(TraceAction::FreeRequested, t);
        e.requested = requested;
        e.stream = stream;
        if self.context() == HistoryContext::All {
            e.context = Some(Arc::new(Backtrace::force_capture()));
        }
        self.send(e);
        if stream.is_none() {
            self.send(block.entry(TraceAction::FreeCompleted, t));
        }
    }

    /// Hook (the events of a freed block completed): records a `FreeCompleted`.
    #[inline]
    pub(crate) fn on_free_completed(&self, block: BlockSeen) {
        if self.is_on() {
            self.send(block.entry(TraceAction::FreeCompleted, self.now_us()));
        }
    }

    /// Hook (fresh memory taken): records a `SegmentAlloc`.
    pub(crate) fn on_segment_alloc(&self, pool: PoolId, owner: Option<StreamId>, region: &Region) {
        self.segment(pool, owner, region, TraceAction::SegmentAlloc);
    }

    /// Hook (memory given back to its source): records a `SegmentFree`.
    pub(crate) fn on_segment_free(&self, pool: PoolId, owner: Option<StreamId>, region: &Region) {
        tracing::debug!(pool = %pool, bytes = region.size, "memory given back");
        self.segment(pool, owner, region, TraceAction::SegmentFree);
    }

    /// Hook (granules of a reserved range mapped): records a `SegmentMap`.
    pub(crate) fn on_segment_map(&self, pool: PoolId, owner: Option<StreamId>, part: &Region) {
        self.segment(pool, owner, part, TraceAction::SegmentMap);
    }

    /// Hook (granules of a reserved range unmapped): records a `SegmentUnmap`.
    pub(crate) fn on_segment_unmap(&self, pool: PoolId, owner: Option<StreamId>, part: &Region) {
        tracing::debug!(pool = %pool, bytes = part.size, "memory unmapped");
        self.segment(pool, owner, part, TraceAction::SegmentUnmap);
    }

    fn segment(&self, pool: PoolId, owner: Option<StreamId>, region: &Region, action: TraceAction) {
        if self.is_on() {
            let seen = BlockSeen {
                pool,
                owner,
                addr: region.addr(),
                size: region.size,
            };
            self.send(seen.entry(action, self.now_us()));
        }
    }

    /// Hook (a capture began or ended allocating to `pool`): records a marker.
    pub(crate) fn on_capture(&self, pool: PoolId, begin: bool) {
        if self.is_on() {
            let action = if begin {
                TraceAction::CaptureBegin
            } else {
                TraceAction::CaptureEnd
            };
            self.send(TraceEntry::new(action, self.now_us(), pool));
        }
    }

    /// Hook (a request is about to fail with `err`): when it is an out-of-memory error, logs
    /// it, records an `Oom` and tells the OOM observers, with what `context` says of the
    /// pool (its memory, the bytes of its blocks in use, what its driver still has free).
    /// Returns `err` unchanged, so that it wraps the error where it is made.
    pub(crate) fn on_oom(
        &self,
        pool: PoolId,
        err: Error,
        context: impl FnOnce() -> (MemoryKind, usize, Option<usize>),
    ) -> Error {
        if let Error::OutOfMemory {
            requested,
            reserved,
            limit,
            ..
        } = err
        {
            let time_us = self.now_us();
            let (memory, allocated, driver_free) = context();
            tracing::warn!(pool = %pool, %memory, requested, reserved, allocated, ?limit, ?driver_free, "out of memory");
            if self.is_on() {
                let mut e = TraceEntry::new(TraceAction::Oom, time_us, pool);
                e.size = requested;
                e.addr = driver_free.unwrap_or(0);
                e.name = Some(Arc::from(err.to_string()));
                self.send(e);
            }
            let report = OomReport {
                pool,
                requested,
                reserved,
                limit,
                time_us,
                memory,
                allocated,
                driver_free,
            };
            // Never waits: a report that finds the observer's queue full is dropped.
            let _ = self.observer_events.try_send(ObserverEvent::Oom(report));
        }
        err
    }
}

// ---- the actor ----

struct HistoryActor {
    entries: Receiver<TraceEntry>,
    mailbox: Weak<Mailbox<Control>>,
    control: Receiver<Control>,
    ring: VecDeque<TraceEntry>,
    max_entries: usize,
    /// Actions left out of the ring (bits of [`TraceAction::bit`]).
    skip: u32,
    overwritten: u64,
    lost: Arc<AtomicU64>,
    trackers: Arc<AtomicUsize>,
    observer_events: Sender<ObserverEvent>,
    observer_lost: u64,
}

/// Gone (its loop ended, or dropped with its runtime): the control messages it did not read
/// are dropped, so that a caller waiting for the history hears `Error::Shutdown`.
impl Drop for HistoryActor {
    fn drop(&mut self) {
        drop(leftovers(&self.mailbox, &self.control));
    }
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
            Control::Configure(setting) => {
                if setting.clear {
                    self.ring.clear();
                }
                self.skip = setting.skip;
                let max_entries = setting.max_entries;
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
                    now_us: 0,
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
        if self.max_entries == 0 || self.skip & entry.action.bit() != 0 {
            return;
        }
        if self.ring.len() == self.max_entries {
            self.ring.pop_front();
            self.overwritten += 1;
        }
        self.ring.push_back(entry);
    }
}
