//! pinpool-tools: what pinpool's benchmarks, examples and tests use beside the allocator,
//! kept out of the published crates.
//!
//! - [`trace`]: allocation trace files (the text format and MiniMalloc's CSV) read into one
//!   in-memory [`trace::Trace`], whose lifetimes the planners of [`pinpool::plan`] take and
//!   whose events the replays play against an allocator.
//! - [`torch_layout`]: PyTorch's device layout with expandable segments, emulated on a
//!   trace: what it would reserve for the same requests.

pub mod torch_layout;
pub mod trace;
