//! `Violation`: a record of misuse the simulation caught (early reuse of a buffer whose
//! device work was still queued, freeing memory still in use, freeing memory it never gave,
//! synchronising a device while one of its streams captures).
//!
//! Owns nothing but the record type; the runtime counts violations with an atomic and the
//! ledger actor keeps the log.

use crate::actors::StreamId;

/// What kind of misuse was caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// Host bytes that a queued operation reads (or overwrites) changed between the moment
    /// it was enqueued and the moment it ran: the buffer was reused before its work finished.
    EarlyReuse,
    /// `host_free` of memory that queued operations or live graphs still reference.
    FreedWhileInUse,
    /// `host_free` of memory this runtime did not hand out, or that was already freed.
    InvalidFree,
    /// The device was synchronised (as giving device memory back does: `cuMemFree`, and
    /// the synchronisation before `cuMemUnmap`) while one of its streams was capturing:
    /// CUDA invalidates the capture, and the simulation does too.
    SyncDuringCapture,
}

/// One caught misuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// What happened.
    pub kind: ViolationKind,
    /// The stream whose operation caught it, if any.
    pub stream: Option<StreamId>,
    /// A human-readable description (addresses, lengths, operation).
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.stream {
            Some(s) => write!(f, "{:?} on stream {}: {}", self.kind, s.0, self.message),
            None => write!(f, "{:?}: {}", self.kind, self.message),
        }
    }
}
