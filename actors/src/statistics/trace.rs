//! The vocabulary of history: trace entries (PyTorch's `TraceEntry`), the recorded history,
//! out-of-memory reports, and the callbacks that observe them. Plain data; the history actor
//! (`history`) and the observer task (`observe`) move it around.

use std::backtrace::Backtrace;
use std::fmt;
use std::sync::Arc;

use crate::vocab::memory::MemoryKind;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::StreamId;

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
    /// Granules of a reserved (expandable) range were mapped: the segment grew.
    SegmentMap,
    /// Granules of a reserved (expandable) range were unmapped: the segment shrank.
    SegmentUnmap,
    /// A snapshot of the allocator was taken (ties snapshots to the trace).
    Snapshot,
    /// A request failed for want of memory (`size` is the request).
    Oom,
    /// A user annotation (`record_annotation` of an allocator); `name` holds it.
    UserDefined,
    /// A capture began allocating to a capture pool.
    CaptureBegin,
    /// A capture stopped allocating to a capture pool.
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
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Snapshot => "snapshot",
            TraceAction::Oom => "oom",
            TraceAction::UserDefined => "user_defined",
            TraceAction::CaptureBegin => "capture_begin",
            TraceAction::CaptureEnd => "capture_end",
        }
    }
}

impl TraceAction {
    /// Every action, in declaration order.
    const ALL: [TraceAction; 12] = [
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
        TraceAction::SegmentAlloc,
        TraceAction::SegmentFree,
        TraceAction::SegmentMap,
        TraceAction::SegmentUnmap,
        TraceAction::Snapshot,
        TraceAction::Oom,
        TraceAction::UserDefined,
        TraceAction::CaptureBegin,
        TraceAction::CaptureEnd,
    ];

    /// The action's bit in a set of actions.
    pub(crate) fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// Parses a name [`TraceAction::as_str`] gives (PyTorch's `skip_actions` names).
impl std::str::FromStr for TraceAction {
    type Err = crate::vocab::error::Error;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let all = TraceAction::ALL;
        all.into_iter().find(|a| a.as_str() == name).ok_or_else(|| {
            let valid: Vec<_> = all.iter().map(|a| a.as_str()).collect();
            crate::vocab::error::Error::InvalidConfig {
                message: format!("unknown trace action `{name}`; valid: {}", valid.join(", ")),
            }
        })
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
    pub(crate) fn to_u8(self) -> u8 {
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
    /// Address of the block or segment (0 for entries without one); for `Oom`, the bytes
    /// the memory source's driver still had free (0 where it cannot tell).
    pub addr: usize,
    /// Bytes of the block or segment; for `Oom`, the bytes requested.
    pub size: usize,
    /// Bytes the user asked for (`Alloc`, `FreeRequested`); 0 otherwise.
    pub requested: usize,
    /// The first stream recorded on a freed buffer (`FreeRequested`, `FreeCompleted`).
    pub stream: Option<StreamId>,
    /// The stream that owns the pool, in a stream-ordered pool (device memory): the stream
    /// the block or segment belongs to.
    pub owner: Option<StreamId>,
    /// The annotation (`UserDefined`) or the error (`Oom`).
    pub name: Option<Arc<str>>,
    /// The call site, when [`HistoryContext`] asked for it.
    pub context: Option<Arc<Backtrace>>,
}

impl TraceEntry {
    pub(crate) fn new(action: TraceAction, time_us: u64, pool: PoolId) -> Self {
        TraceEntry {
            action,
            time_us,
            pool,
            addr: 0,
            size: 0,
            requested: 0,
            stream: None,
            owner: None,
            name: None,
            context: None,
        }
    }
}

/// The recorded history, as an allocator's `history` returns it.
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
    /// The clock of the entries' `time_us` when the history was read.
    pub now_us: u64,
}

/// What an OOM observer is told when a request fails for want of pinned memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OomReport {
    /// The pool the request was for.
    pub pool: PoolId,
    /// Bytes requested.
    pub requested: usize,
    /// Bytes the pool had reserved when the request failed.
    pub reserved: usize,
    /// The cap on reserved bytes, if one is set.
    pub limit: Option<usize>,
    /// Microseconds since the allocator started.
    pub time_us: u64,
    /// The memory the pool takes from: pinned host memory, or a device.
    pub memory: MemoryKind,
    /// Bytes of the pool's blocks in use (handed out, or freed and waiting on events).
    pub allocated: usize,
    /// Bytes the memory source could still give, as its driver reported them after the
    /// failure (`None` where it cannot tell).
    pub driver_free: Option<usize>,
}

/// A callback told of every trace entry while history is on.
pub(crate) type TraceTracker = Arc<dyn Fn(&TraceEntry) + Send + Sync>;
/// A callback told of every out-of-memory failure.
pub(crate) type OomObserver = Arc<dyn Fn(&OomReport) + Send + Sync>;

#[cfg(all(test, not(pinpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_action_parses_from_its_name_and_an_unknown_name_lists_the_valid_ones() {
        for a in TraceAction::ALL {
            assert_eq!(a.as_str().parse::<TraceAction>().unwrap(), a);
        }
        let err = "free".parse::<TraceAction>().unwrap_err().to_string();
        assert!(err.contains("`free`") && err.contains("free_requested, free_completed"));
    }
}
