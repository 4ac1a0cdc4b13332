//! Snapshots in PyTorch's layout: a [`MemorySnapshot`] and the recorded histories written as
//! the pickle that `torch.cuda.memory._dump_snapshot()` writes, so that PyTorch's memory
//! visualizer (`pytorch.org/memory_viz`) and `torch.cuda._memory_viz` read it.
//!
//! Owns the mapping from pinpool's snapshot and trace entries to PyTorch's keys; the bytes
//! are written by [`crate::statistics::pickle`].
//!
//! The layout (PyTorch 2.x, `torch/csrc/cuda/memory_snapshot.cpp`; the keys of every dict
//! match those of `torch.cuda.memory._snapshot()` in torch 2.11): a dict of
//!
//! - `segments`: one dict per segment — `device`, `address`, `total_size`, `allocated_size`
//!   (bytes of blocks in use), `active_size` (in use or freed and not yet reusable),
//!   `requested_size` (requested bytes of the active blocks), `stream`, `segment_type`
//!   (`'small'` up to 2 MiB, else `'large'`), `segment_pool_id` (a tuple), `is_expandable`,
//!   `frames`, and `blocks`: dicts of `address`, `size`, `requested_size`, `state`
//!   (`'active_allocated'`, `'active_pending_free'`, `'inactive'`) and `frames`. The blocks
//!   tile the segment in address order (readers compute each block's address from the sizes
//!   before it), so a stretch no block covers is listed as an inactive block;
//! - `device_traces`: one list per device of trace entries — `action`, `addr` (`device_free`
//!   for `'oom'`), `size`, `stream`, `compile_context` (`'N/A'`, as PyTorch writes it
//!   outside compiled regions), `user_metadata`, `frames`, `time_us` (here: microseconds
//!   since the allocator started);
//! - `allocator_settings`: a dict of settings;
//! - `external_annotations`: dicts with `name`, `device` and `time_us`.

use std::collections::HashMap;

use crate::statistics::device_stats::SMALL_SEGMENT;
use crate::statistics::pickle::{self, Value};
use crate::statistics::snapshot::{BlockInfo, BlockStatus, MemorySnapshot, SegmentInfo};
use crate::statistics::trace::{History, TraceAction, TraceEntry};

impl MemorySnapshot {
    /// The snapshot, and `histories[d]` as device `d`'s trace, in the pickle layout of
    /// `torch.cuda.memory._snapshot()` (protocol 2): drop the bytes, saved to a file, onto
    /// `pytorch.org/memory_viz`, or `pickle.load` them in Python.
    ///
    /// How pinpool's states map to PyTorch's: a block in use is `'active_allocated'`; a block
    /// freed and waiting on the events of its streams, or kept for graph replays, is
    /// `'active_pending_free'`; a cached block or free range is `'inactive'`. A segment's
    /// `stream` is the stream that owns its pool (0 outside stream-ordered pools; an id is
    /// written as an int64 of its bits, as PyTorch writes a stream's handle), its
    /// `segment_pool_id` is `(0, pool)` (`(0, 0)` for the default and stream pools), and it
    /// is expandable when it is a run of granules mapped into a reserved range.
    ///
    /// Pinned host memory has no place of its own in PyTorch's layout: a snapshot of a
    /// `PinnedAllocator` reads as device 0 (the visualizer lists devices by their index in
    /// `device_traces`, so a negative device would hide everything).
    ///
    /// Trace entries keep their order. `Alloc`, `FreeRequested` and `FreeCompleted` give the
    /// requested bytes as `size` (as PyTorch does), segment entries the segment's bytes, and
    /// an `Oom` gives the bytes requested and, as `device_free`, what the driver had free.
    /// Annotations and capture markers, which PyTorch's trace has no action for, go to
    /// `external_annotations`. Call sites recorded with the history become `frames`.
    ///
    /// ```
    /// use pinpool::{BlockInfo, BlockStatus, ConfigInfo, History, MemorySnapshot, SegmentInfo};
    ///
    /// let snap = MemorySnapshot {
    ///     segments: vec![SegmentInfo {
    ///         address: 0x7f00_0000_0000,
    ///         total_size: 2 << 20,
    ///         pool: 0,
    ///         pin_method: "device".into(),
    ///         blocks: vec![BlockInfo {
    ///             address: 0x7f00_0000_0000,
    ///             size: 1 << 20,
    ///             requested_size: 1000,
    ///             state: BlockStatus::InUse,
    ///             streams: vec![],
    ///         }],
    ///         device: Some(0),
    ///         stream: Some(0),
    ///     }],
    ///     config: ConfigInfo {
    ///         policy: "device-fit".into(),
    ///         max_bytes: None,
    ///         alloc_timeout_ms: None,
    ///         shards: 1,
    ///         runtime: "cuda".into(),
    ///     },
    ///     reserved_bytes: 2 << 20,
    /// };
    /// let bytes = snap.to_pickle(&[History::default()]);
    /// assert_eq!(&bytes[..2], &[0x80, 2]); // protocol 2
    /// assert_eq!(bytes.last(), Some(&b'.'));
    /// ```
    pub fn to_pickle(&self, histories: &[History]) -> Vec<u8> {
        pickle::to_bytes(&self.torch_layout(histories))
    }

    /// The segments as PyTorch's snapshot lists them (what the pickle and PyTorch's
    /// allocator front both give).
    #[doc(hidden)]
    pub fn torch_segments(&self) -> Vec<TorchSegment> {
        self.segments.iter().map(TorchSegment::of).collect()
    }

    fn torch_layout(&self, histories: &[History]) -> Value {
        let devices = self
            .segments
            .iter()
            .map(|s| device_of(s) + 1)
            .chain([histories.len(), 1])
            .max()
            .unwrap_or(1);
        let mut annotations = Vec::new();
        let traces: Vec<Value> = (0..devices)
            .map(|d| match histories.get(d) {
                Some(h) => {
                    let (entries, notes) = h.torch_trace();
                    annotations.extend(notes.into_iter().map(|e| annotation(e, d)));
                    Value::List(entries.iter().map(trace_entry).collect())
                }
                None => Value::List(Vec::new()),
            })
            .collect();
        let expandable = self.segments.iter().any(is_expandable);
        Value::dict([
            (
                "segments",
                Value::List(self.torch_segments().iter().map(segment).collect()),
            ),
            ("device_traces", Value::List(traces)),
            (
                "allocator_settings",
                Value::dict([
                    ("expandable_segments", expandable.into()),
                    ("pinpool_policy", self.config.policy.as_str().into()),
                    ("pinpool_runtime", self.config.runtime.as_str().into()),
                    (
                        "pinpool_max_bytes",
                        self.config.max_bytes.map_or(Value::None, Value::from),
                    ),
                    ("pinpool_reserved_bytes", self.reserved_bytes.into()),
                ]),
            ),
            ("external_annotations", Value::List(annotations)),
        ])
    }
}

/// One segment as PyTorch's snapshot lists it: its blocks tile it in address order, and the
/// sizes are sums over them.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchSegment {
    pub device: usize,
    pub address: usize,
    pub total_size: usize,
    /// Bytes of blocks in use.
    pub allocated_size: usize,
    /// Bytes of blocks in use or freed and not yet reusable.
    pub active_size: usize,
    /// Requested bytes of the active blocks.
    pub requested_size: usize,
    /// The id of the stream that owns the segment's pool, 0 outside stream pools.
    pub stream: u64,
    /// Over PyTorch's small-segment size.
    pub is_large: bool,
    /// A run of granules mapped into a reserved range.
    pub is_expandable: bool,
    /// pinpool's pool id: 0 for the default and stream pools.
    pub pool: u64,
    pub blocks: Vec<TorchBlock>,
}

/// One block of a [`TorchSegment`]'s tiling.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchBlock {
    pub address: usize,
    pub size: usize,
    pub requested_size: usize,
    /// `"active_allocated"`, `"active_pending_free"` or `"inactive"`.
    pub state: &'static str,
}

impl TorchBlock {
    /// In use by a caller (PyTorch's `allocated`).
    pub fn allocated(&self) -> bool {
        self.state == "active_allocated"
    }

    /// In use or not yet reusable (PyTorch's `active`).
    pub fn active(&self) -> bool {
        self.state != "inactive"
    }
}

impl TorchSegment {
    fn of(s: &SegmentInfo) -> Self {
        let blocks = tiles(s);
        let sum = |f: &dyn Fn(&TorchBlock) -> Option<usize>| blocks.iter().filter_map(f).sum();
        TorchSegment {
            device: device_of(s),
            address: s.address,
            total_size: s.total_size,
            allocated_size: sum(&|b| b.allocated().then_some(b.size)),
            active_size: sum(&|b| b.active().then_some(b.size)),
            requested_size: sum(&|b| b.active().then_some(b.requested_size)),
            stream: s.stream.unwrap_or(0),
            is_large: s.total_size > SMALL_SEGMENT,
            is_expandable: is_expandable(s),
            pool: if s.stream.is_some() { 0 } else { s.pool },
            blocks,
        }
    }
}

/// A trace entry as PyTorch's trace lists it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct TorchTraceEntry<'a> {
    pub entry: &'a TraceEntry,
    /// The bytes PyTorch gives: the requested bytes for allocations and frees, the segment's
    /// bytes for segment entries, the bytes requested for an out-of-memory.
    pub size: usize,
}

impl History {
    /// The entries PyTorch's trace has an action for, in order, each with the size PyTorch
    /// gives it; and the entries it has none for (annotations and capture markers).
    #[doc(hidden)]
    pub fn torch_trace(&self) -> (Vec<TorchTraceEntry<'_>>, Vec<&TraceEntry>) {
        // Requested bytes of the blocks allocated in the trace, by address.
        let mut requested: HashMap<usize, usize> = HashMap::new();
        let mut out = Vec::with_capacity(self.entries.len());
        let mut notes = Vec::new();
        for e in &self.entries {
            let size = match e.action {
                TraceAction::Alloc => {
                    let r = if e.requested > 0 { e.requested } else { e.size };
                    requested.insert(e.addr, r);
                    r
                }
                TraceAction::FreeRequested => match e.requested {
                    0 => requested.get(&e.addr).copied().unwrap_or(e.size),
                    r => r,
                },
                TraceAction::FreeCompleted => requested.remove(&e.addr).unwrap_or(e.size),
                TraceAction::SegmentAlloc
                | TraceAction::SegmentFree
                | TraceAction::SegmentMap
                | TraceAction::SegmentUnmap
                | TraceAction::Snapshot
                | TraceAction::Oom => e.size,
                TraceAction::UserDefined | TraceAction::CaptureBegin | TraceAction::CaptureEnd => {
                    notes.push(e);
                    continue;
                }
            };
            out.push(TorchTraceEntry { entry: e, size });
        }
        (out, notes)
    }
}

fn device_of(s: &SegmentInfo) -> usize {
    s.device.unwrap_or(0)
}

fn is_expandable(s: &SegmentInfo) -> bool {
    matches!(s.pin_method.as_str(), "mapped" | "device_mapped")
}

fn state_of(b: &BlockInfo) -> &'static str {
    match b.state {
        BlockStatus::InUse => "active_allocated",
        BlockStatus::Waiting | BlockStatus::Kept => "active_pending_free",
        BlockStatus::Cached => "inactive",
    }
}

/// A stream id as PyTorch writes a stream's handle: an int64 (the id's bits), 0 for none.
fn stream(id: u64) -> Value {
    Value::from(id as i64)
}

fn pool_id(pool: u64) -> Value {
    Value::Tuple(vec![0u64.into(), pool.into()])
}

/// The segment's blocks in address order, covering it exactly: stretches no block covers
/// are inactive blocks, and a block reaching past the end is cut at it.
fn tiles(s: &SegmentInfo) -> Vec<TorchBlock> {
    let mut blocks: Vec<&BlockInfo> = s.blocks.iter().collect();
    blocks.sort_by_key(|b| b.address);
    let end = s.address + s.total_size;
    let mut at = s.address;
    let mut out = Vec::with_capacity(blocks.len() + 1);
    let free = |address, size| TorchBlock {
        address,
        size,
        requested_size: 0,
        state: "inactive",
    };
    for b in blocks {
        if b.address < at || b.address >= end {
            continue; // overlaps the one before, or lies outside: not drawable
        }
        if b.address > at {
            out.push(free(at, b.address - at));
        }
        let size = b.size.min(end - b.address);
        out.push(TorchBlock {
            address: b.address,
            size,
            requested_size: b.requested_size.min(size),
            state: state_of(b),
        });
        at = b.address + size;
    }
    if at < end {
        out.push(free(at, end - at));
    }
    out
}

fn segment(s: &TorchSegment) -> Value {
    let blocks = s
        .blocks
        .iter()
        .map(|b| {
            Value::dict([
                ("address", b.address.into()),
                ("size", b.size.into()),
                ("requested_size", b.requested_size.into()),
                ("state", b.state.into()),
                ("frames", Value::List(Vec::new())),
            ])
        })
        .collect();
    Value::dict([
        ("device", s.device.into()),
        ("address", s.address.into()),
        ("total_size", s.total_size.into()),
        ("allocated_size", s.allocated_size.into()),
        ("active_size", s.active_size.into()),
        ("requested_size", s.requested_size.into()),
        ("stream", stream(s.stream)),
        (
            "segment_type",
            if s.is_large { "large" } else { "small" }.into(),
        ),
        ("segment_pool_id", pool_id(s.pool)),
        ("is_expandable", s.is_expandable.into()),
        ("frames", Value::List(Vec::new())),
        ("blocks", Value::List(blocks)),
    ])
}

fn trace_entry(t: &TorchTraceEntry<'_>) -> Value {
    let e = t.entry;
    let addr_key = if e.action == TraceAction::Oom {
        "device_free"
    } else {
        "addr"
    };
    Value::dict([
        ("action", e.action.as_str().into()),
        (addr_key, e.addr.into()),
        ("size", t.size.into()),
        ("stream", stream(e.owner.map_or(0, |s| s.0))),
        ("compile_context", "N/A".into()),
        ("user_metadata", "".into()),
        ("frames", frames(e)),
        ("time_us", e.time_us.into()),
    ])
}

fn annotation(e: &TraceEntry, device: usize) -> Value {
    let name = match (&e.name, e.action) {
        (Some(n), _) => n.to_string(),
        (None, a) => a.as_str().to_owned(),
    };
    Value::dict([
        ("name", name.into()),
        ("action", e.action.as_str().into()),
        ("segment_pool_id", pool_id(e.pool.0)),
        ("device", device.into()),
        ("time_us", e.time_us.into()),
    ])
}

/// The call site of an entry as PyTorch's frames (`name`, `filename`, `line`), innermost
/// first, read from the backtrace's text; empty when none was captured.
fn frames(e: &TraceEntry) -> Value {
    let Some(bt) = &e.context else {
        return Value::List(Vec::new());
    };
    let mut frames: Vec<(String, String, u64)> = Vec::new();
    for line in bt.to_string().lines() {
        let line = line.trim();
        if let Some(at) = line.strip_prefix("at ") {
            // `file:line:column`
            let mut parts = at.rsplitn(3, ':');
            let (_col, line_no, file) = (parts.next(), parts.next(), parts.next());
            if let (Some(f), Some(last)) = (file, frames.last_mut()) {
                last.1 = f.to_owned();
                last.2 = line_no.and_then(|l| l.parse().ok()).unwrap_or(0);
            }
        } else if let Some((n, name)) = line.split_once(": ") {
            if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() {
                frames.push((name.to_owned(), String::new(), 0));
            }
        }
    }
    Value::List(
        frames
            .into_iter()
            .map(|(name, filename, line)| {
                Value::dict([
                    ("name", name.into()),
                    ("filename", filename.into()),
                    ("line", line.into()),
                ])
            })
            .collect(),
    )
}
