//! Typed errors of trace reading: which file, which line, and what is wrong there.

use std::io;
use std::path::PathBuf;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened.
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        /// The path given.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Reading (or decompressing) failed at `line`.
    #[error("{origin}:{line}: read error: {source}")]
    Read {
        /// The file or source name.
        origin: String,
        /// 1-based line being read.
        line: usize,
        /// The underlying error.
        source: io::Error,
    },
    /// The content is malformed at `line`.
    #[error("{origin}:{line}: {kind}")]
    Invalid {
        /// The file or source name.
        origin: String,
        /// 1-based line (or event number, for [`Trace::from_events`](super::Trace::from_events)).
        line: usize,
        /// What is wrong.
        kind: TraceErrorKind,
    },
}

impl TraceError {
    pub(crate) fn invalid(origin: &str, line: usize, kind: TraceErrorKind) -> TraceError {
        TraceError::Invalid {
            origin: origin.to_owned(),
            line,
            kind,
        }
    }

    /// The 1-based line the error is about, where there is one.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Open { .. } => None,
            TraceError::Read { line, .. } | TraceError::Invalid { line, .. } => Some(*line),
        }
    }

    /// What is malformed, for [`TraceError::Invalid`].
    pub fn kind(&self) -> Option<&TraceErrorKind> {
        match self {
            TraceError::Invalid { kind, .. } => Some(kind),
            _ => None,
        }
    }
}

/// What is wrong with one line of a trace.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceErrorKind {
    /// The line is not valid UTF-8.
    #[error("line is not valid UTF-8")]
    NotUtf8,
    /// The line is longer than any line of the formats can be (a few dozen bytes): the
    /// reader stops there rather than hold a line without end.
    #[error("line longer than {limit} bytes")]
    LineTooLong {
        /// The longest line accepted, in bytes (without its newline).
        limit: usize,
    },
    /// The first word is neither `a` nor `f`.
    #[error("unknown event tag {tag:?} (expected `a` or `f`)")]
    UnknownTag {
        /// The word found.
        tag: String,
    },
    /// A field is missing.
    #[error("missing field `{field}`")]
    MissingField {
        /// Name of the missing field.
        field: &'static str,
    },
    /// There is more on the line than the format allows.
    #[error("unexpected extra field {text:?}")]
    ExtraField {
        /// The first extra field.
        text: String,
    },
    /// A field is not a non-negative integer that fits in 64 bits.
    #[error("bad number {text:?} for `{field}`")]
    BadNumber {
        /// Name of the field.
        field: &'static str,
        /// The text found.
        text: String,
    },
    /// The CSV header is not `id,lower,upper,size`.
    #[error("bad header {found:?} (expected `id,lower,upper,size`)")]
    BadHeader {
        /// The header line found (empty for an empty file).
        found: String,
    },
    /// An id is allocated a second time.
    #[error("duplicate allocation id {id}")]
    DuplicateId {
        /// The id.
        id: usize,
    },
    /// Text traces number allocations densely in order; this one skips or repeats.
    #[error("allocation id {id} out of order (expected {expected})")]
    OutOfOrderId {
        /// The id found.
        id: usize,
        /// The next id in order.
        expected: usize,
    },
    /// Ids must be dense in `0..count`; this one is outside.
    #[error("allocation id {id} is not dense: ids must lie in 0..{count}")]
    IdOutOfRange {
        /// The id found.
        id: usize,
        /// The number of allocations.
        count: usize,
    },
    /// A free names an id that was never allocated (before this point).
    #[error("free of unknown allocation id {id}")]
    FreeOfUnknownId {
        /// The id.
        id: usize,
    },
    /// A free names an id that is already freed.
    #[error("free of already-freed allocation id {id}")]
    DoubleFree {
        /// The id.
        id: usize,
    },
    /// A CSV buffer whose lifetime `[lower, upper)` is empty or reversed.
    #[error("empty lifetime [{lower}, {upper}): upper must exceed lower")]
    EmptyLifetime {
        /// Start of the lifetime.
        lower: u64,
        /// End of the lifetime.
        upper: u64,
    },
}
