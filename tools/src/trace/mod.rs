//! Allocation trace files: recorded streams of allocation requests, read into one in-memory
//! [`Trace`] whatever their format.
//!
//! Owns the [`Trace`] type and its invariants (ids dense in `0..n`, each allocated once,
//! freed at most once and only after it was allocated), the two readers — the text format
//! (`a <id> <bytes> <stream>` / `f <id>`, gzip or plain) in `text` and MiniMalloc's CSV
//! (`id,lower,upper,size`) in `csv` — and the typed errors in `error`. Reading never
//! panics: a malformed file yields a [`TraceError`] naming the file, the line and the fault.
//!
//! # Example
//!
//! ```
//! use pinpool_tools::trace::{Trace, TraceEvent};
//!
//! let text = "# two buffers\na 0 4096 0\na 1 512 7\nf 0\n";
//! let trace = Trace::read_text(text.as_bytes(), "inline")?;
//! assert_eq!(trace.events()[1], TraceEvent::Alloc { id: 1, bytes: 512, stream: 7 });
//! // Time is the event index; allocation 1 is never freed, so it lives to the end (3).
//! let lifetimes = trace.lifetimes();
//! assert_eq!((lifetimes[0].start, lifetimes[0].end), (0, 2));
//! assert_eq!((lifetimes[1].start, lifetimes[1].end), (1, 3));
//! assert_eq!(trace.peak_live_bytes(), 4608);
//!
//! let err = Trace::read_text("a 0 64 0\nf 1\n".as_bytes(), "bad").unwrap_err();
//! assert_eq!(err.to_string(), "bad:2: free of unknown allocation id 1");
//! # Ok::<(), pinpool_tools::trace::TraceError>(())
//! ```

mod build;
mod csv;
mod error;
mod text;

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

pub use error::{TraceError, TraceErrorKind};

use pinpool::plan::{Lifetime, Observed};

/// One event of a trace, in time order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceEvent {
    /// Allocation `id` of `bytes` bytes, requested on `stream`.
    Alloc {
        /// Dense allocation id, `0..n`.
        id: usize,
        /// Requested size in bytes.
        bytes: u64,
        /// Stream the request was made on (0 where the format has no streams).
        stream: u64,
    },
    /// Allocation `id` is freed.
    Free {
        /// Id of an allocation that is live at this point.
        id: usize,
    },
}

/// A validated allocation trace: its events in time order and, per allocation id, its
/// lifetime.
///
/// Invariants: allocation ids are dense in `0..n`; each id is allocated exactly once, and
/// freed at most once, after its allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    events: Vec<TraceEvent>,
    lifetimes: Vec<Lifetime>,
}

impl Trace {
    /// Reads a trace file, choosing the format by name: `*.csv` is MiniMalloc CSV, anything
    /// else the text format (gzip-compressed or not; detected from the content).
    ///
    /// Errors name the path and, for malformed content, the line.
    pub fn open(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let file = File::open(path).map_err(|source| TraceError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let reader = BufReader::new(file);
        let is_csv = path
            .extension()
            .is_some_and(|ext| ext.eq_ignore_ascii_case("csv"));
        if is_csv {
            csv::read(reader, &origin)
        } else {
            text::read(reader, &origin)
        }
    }

    /// Reads the text format (`a <id> <bytes> <stream>`, `f <id>`, `#` comments) from
    /// `reader`, gzip-compressed or plain. `origin` names the source in errors.
    pub fn read_text(reader: impl std::io::Read, origin: &str) -> Result<Trace, TraceError> {
        text::read(reader, origin)
    }

    /// Reads MiniMalloc CSV (`id,lower,upper,size` with that header; buffer live over
    /// `[lower, upper)`) from `reader`. Events are ordered by time, frees before allocations
    /// at equal times; lifetimes are then re-expressed in event indices, which keeps every
    /// overlap of the file and no other. `origin` names the source in errors.
    pub fn read_csv(reader: impl std::io::Read, origin: &str) -> Result<Trace, TraceError> {
        csv::read(reader, origin)
    }

    /// Builds a trace from events, checking the same invariants as the readers. Errors give
    /// `origin` `"events"` and, as line, the 1-based event number.
    pub fn from_events(events: Vec<TraceEvent>) -> Result<Trace, TraceError> {
        let n = events
            .iter()
            .filter(|e| matches!(e, TraceEvent::Alloc { .. }))
            .count();
        let mut builder = build::Builder::new(build::IdRule::DenseBelow(n));
        for (i, event) in events.into_iter().enumerate() {
            builder
                .push(event)
                .map_err(|kind| TraceError::invalid("events", i + 1, kind))?;
        }
        Ok(builder.finish())
    }

    /// The events, in time order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// The lifetimes, indexed by allocation id (`lifetimes()[i].id == i`), with time the
    /// index of an event in [`Trace::events`].
    pub fn lifetimes(&self) -> &[Lifetime] {
        &self.lifetimes
    }

    /// Number of allocations.
    pub fn allocation_count(&self) -> usize {
        self.lifetimes.len()
    }

    /// Peak live bytes: the maximum over time of the sum of the sizes of live allocations
    /// (saturating at `u64::MAX`).
    pub fn peak_live_bytes(&self) -> u64 {
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        for event in &self.events {
            match *event {
                TraceEvent::Alloc { bytes, .. } => {
                    live = live.saturating_add(bytes);
                    peak = peak.max(live);
                }
                TraceEvent::Free { id } => {
                    live = live.saturating_sub(self.lifetimes[id].size);
                }
            }
        }
        peak
    }
}

impl From<TraceEvent> for Observed {
    fn from(event: TraceEvent) -> Observed {
        match event {
            TraceEvent::Alloc { bytes, .. } => Observed::Alloc { size: bytes },
            TraceEvent::Free { id } => Observed::Free { id },
        }
    }
}
