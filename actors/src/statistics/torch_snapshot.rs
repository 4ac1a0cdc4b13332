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
                Some(h) => trace(&h.entries, d, &mut annotations),
                None => Value::List(Vec::new()),
            })
            .collect();
        let expandable = self.segments.iter().any(is_expandable);
        Value::dict([
            (
                "segments",
                Value::List(self.segments.iter().map(segment).collect()),
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
fn stream(id: Option<u64>) -> Value {
    Value::from(id.unwrap_or(0) as i64)
}

fn pool_id(pool: u64) -> Value {
    Value::Tuple(vec![0u64.into(), pool.into()])
}

/// One block of the tiling: address, size, requested bytes, state.
type Tile = (usize, usize, usize, &'static str);

/// The segment's blocks in address order, covering it exactly: stretches no block covers
/// are inactive blocks, and a block reaching past the end is cut at it.
fn tiles(s: &SegmentInfo) -> Vec<Tile> {
    let mut blocks: Vec<&BlockInfo> = s.blocks.iter().collect();
    blocks.sort_by_key(|b| b.address);
    let end = s.address + s.total_size;
    let mut at = s.address;
    let mut out = Vec::with_capacity(blocks.len() + 1);
    for b in blocks {
        if b.address < at || b.address >= end {
            continue; // overlaps the one before, or lies outside: not drawable
        }
        if b.address > at {
            out.push((at, b.address - at, 0, "inactive"));
        }
        let size = b.size.min(end - b.address);
        out.push((b.address, size, b.requested_size.min(size), state_of(b)));
        at = b.address + size;
    }
    if at < end {
        out.push((at, end - at, 0, "inactive"));
    }
    out
}

fn segment(s: &SegmentInfo) -> Value {
    let tiles = tiles(s);
    let sum = |f: &dyn Fn(&Tile) -> Option<usize>| tiles.iter().filter_map(f).sum::<usize>();
    let allocated = sum(&|t| (t.3 == "active_allocated").then_some(t.1));
    let active = sum(&|t| (t.3 != "inactive").then_some(t.1));
    let requested = sum(&|t| (t.3 != "inactive").then_some(t.2));
    let pool = if s.stream.is_some() { 0 } else { s.pool };
    let blocks = tiles
        .iter()
        .map(|&(address, size, requested, state)| {
            Value::dict([
                ("address", address.into()),
                ("size", size.into()),
                ("requested_size", requested.into()),
                ("state", state.into()),
                ("frames", Value::List(Vec::new())),
            ])
        })
        .collect();
    Value::dict([
        ("device", device_of(s).into()),
        ("address", s.address.into()),
        ("total_size", s.total_size.into()),
        ("allocated_size", allocated.into()),
        ("active_size", active.into()),
        ("requested_size", requested.into()),
        ("stream", stream(s.stream)),
        (
            "segment_type",
            if s.total_size <= SMALL_SEGMENT {
                "small"
            } else {
                "large"
            }
            .into(),
        ),
        ("segment_pool_id", pool_id(pool)),
        ("is_expandable", is_expandable(s).into()),
        ("frames", Value::List(Vec::new())),
        ("blocks", Value::List(blocks)),
    ])
}

/// One device's trace entries; the entries PyTorch has no action for go to `annotations`.
fn trace(entries: &[TraceEntry], device: usize, annotations: &mut Vec<Value>) -> Value {
    // Requested bytes of the blocks allocated in the trace, by address.
    let mut requested: HashMap<usize, usize> = HashMap::new();
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
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
                annotations.push(annotation(e, device));
                continue;
            }
        };
        let addr_key = if e.action == TraceAction::Oom {
            "device_free"
        } else {
            "addr"
        };
        out.push(Value::dict([
            ("action", e.action.as_str().into()),
            (addr_key, e.addr.into()),
            ("size", size.into()),
            ("stream", stream(e.owner.map(|s| s.0))),
            ("compile_context", "N/A".into()),
            ("user_metadata", "".into()),
            ("frames", frames(e)),
            ("time_us", e.time_us.into()),
        ]));
    }
    Value::List(out)
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
