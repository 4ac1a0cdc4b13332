//! The one error type of pinpool: every fallible call returns `Result<_, Error>`.
//!
//! Keeps invariant 7: bad input gets a typed error and changes nothing.

use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::RuntimeError;

/// Everything that can go wrong when using the allocator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request is larger than any block the size policy can describe.
    #[error("a request of {requested} bytes is larger than the largest block ({max} bytes)")]
    SizeTooLarge {
        /// Bytes asked for.
        requested: usize,
        /// The largest request the policy accepts.
        max: usize,
    },
    /// No memory could be had for the request (pinned or device memory: the pool's).
    /// `cause` says whether it can never fit ([`OomCause::never_fits`]: larger than the cap
    /// or the device, where waiting is pointless) or found no room right now (other buffers
    /// hold the memory: it may fit once they come back).
    #[error("out of memory: {requested} bytes requested with {reserved} bytes reserved{}: {cause}", limit_text(*.limit))]
    OutOfMemory {
        /// Bytes asked for (for a request of several buffers, all of them together, of the
        /// allocator that refused).
        requested: usize,
        /// Bytes reserved by the allocator when the request failed.
        reserved: usize,
        /// The configured cap on reserved bytes, if any.
        limit: Option<usize>,
        /// Whether the request can never fit, or only not now.
        cause: OomCause,
    },
    /// A request waited for room under the memory limit longer than its timeout.
    #[error("gave up waiting for {requested} bytes of memory after {timeout:?}")]
    Timeout {
        /// Bytes asked for.
        requested: usize,
        /// How long it waited.
        timeout: std::time::Duration,
    },
    /// A memory limit that cannot be set: a fraction outside (0, 1], a cap of 0 bytes, or
    /// host memory that could not be read.
    #[error("invalid memory limit: {reason}")]
    InvalidLimit {
        /// What is wrong.
        reason: String,
    },
    /// The CUDA (or simulated) runtime reported a failure.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// `begin_allocate_to_pool` for a pool that is already being captured into.
    #[error("capture pool {0} is already being allocated to")]
    PoolAlreadyCapturing(PoolId),
    /// `end_allocate_to_pool` for a pool that no capture is allocating to.
    #[error("capture pool {0} is not being allocated to")]
    PoolNotCapturing(PoolId),
    /// A capture-pool call named a pool that does not exist.
    #[error("unknown capture pool {0}")]
    UnknownPool(PoolId),
    /// `release_pool` more often than the pool was begun.
    #[error("capture pool {0} has already been released")]
    PoolAlreadyReleased(PoolId),
    /// `release_pool` of a pool's last use while a capture still allocates to it.
    #[error("capture pool {0} is still being allocated to: end it before releasing its last use")]
    PoolCapturing(PoolId),
    /// The id names the default pool, which cannot be used as a capture pool.
    #[error("pool id 0 is the default pool and cannot be used for capture")]
    DefaultPoolId,
    /// A buffer was handed to an allocator that did not allocate it.
    #[error("the buffer was allocated by another allocator")]
    ForeignBuffer,
    /// `record_stream` (or a request) with a stream of another runtime than the allocator's:
    /// no event could ever tell when its work is done. Nothing was recorded. The stream is of
    /// the same kind of runtime (its type is the allocator's), made by another instance of
    /// it: make streams with the allocator's `runtime().new_stream()`, and build allocators
    /// that share streams on one runtime (`.runtime(a.runtime().clone())` on the builder of
    /// the second).
    #[error(
        "stream {stream} belongs to another {runtime} runtime than the allocator's: make it \
         with the allocator's runtime().new_stream(), and build allocators that share streams \
         on one runtime (.runtime(a.runtime().clone()) on the second's builder)"
    )]
    ForeignStream {
        /// The stream's id.
        stream: u64,
        /// The allocator's runtime.
        runtime: &'static str,
    },
    /// The allocator's actors have stopped (the allocator was dropped or its tokio runtime shut down).
    #[error("the allocator has shut down")]
    Shutdown,
    /// A typed view of a buffer's bytes is not possible (alignment, or an element type larger
    /// than the buffer).
    #[error("cannot view the buffer as {type_name}: {reason}")]
    BadView {
        /// The element type asked for.
        type_name: &'static str,
        /// Why not.
        reason: &'static str,
    },
    /// The allocator was built outside a tokio runtime and no handle was given.
    #[error("no tokio runtime: build the allocator inside one, or give the builder a handle")]
    NoTokioRuntime,
    /// `record_history(true, 0, ..)`: a history ring needs room for at least one entry.
    #[error("a history ring needs room for at least one entry (max_entries was 0)")]
    EmptyHistoryRing,
    /// The GPU runtime could not start: no CUDA driver, a driver too old, or a failed
    /// initialisation call. The message says which.
    #[error("no usable CUDA device: {message}")]
    DeviceUnavailable {
        /// What went wrong, in the runtime's words.
        message: String,
    },
    /// The driver works, but there is no device with this ordinal.
    #[error("no CUDA device {ordinal}: {count} device(s) present")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// The configuration (e.g. the `PINPOOL_CONF` environment variable) is malformed.
    #[error("invalid configuration: {message}")]
    InvalidConfig {
        /// What is wrong with it.
        message: String,
    },
    /// A raw device pointer that the allocator did not hand out, or that was already freed.
    #[error("{ptr:#x} is not a live raw allocation of this allocator")]
    UnknownPointer {
        /// The pointer.
        ptr: u64,
    },
    /// A `*_blocking` call made where blocking the thread would deadlock: on a thread that
    /// runs a current-thread tokio runtime's tasks, which the allocator's actors need to
    /// answer. Nothing was done; from async code, call `use_instead`.
    #[error("{call} would block a thread that runs a current-thread tokio runtime's tasks and wait for ever: from async code, use {use_instead}")]
    WouldDeadlock {
        /// The blocking call.
        call: &'static str,
        /// The async call to use instead.
        use_instead: &'static str,
    },
    /// The call cannot be made with this runtime or configuration (the simulated runtime
    /// has no inter-process memory; blocks of expandable segments cannot be exported with
    /// `cuIpcGetMemHandle`). `reason` says what would make it possible.
    #[error("{operation} is not supported: {reason}")]
    NotSupported {
        /// The refused call.
        operation: &'static str,
        /// Why, and what to change.
        reason: String,
    },
    /// An inter-process memory handle that cannot be used: bytes that are not a handle, or
    /// one the driver refuses to open (its exporting process has exited and its memory is
    /// gone, it came from this very process, or from another machine).
    #[error("invalid IPC handle: {reason}")]
    InvalidIpcHandle {
        /// What is wrong with it.
        reason: String,
    },
    /// Device `device` cannot access the memory of device `peer` (no peer-to-peer path
    /// between them).
    #[error("device {device} cannot access the memory of device {peer}")]
    PeerAccessUnsupported {
        /// The device that would access.
        device: usize,
        /// The device whose memory it would access.
        peer: usize,
    },
    /// A peer-to-peer copy asked for (`p2p`) where `enable_peer_access(device, peer)` was
    /// not called first.
    #[error("peer access from device {device} to device {peer} is not enabled")]
    PeerAccessNotEnabled {
        /// The device of the stream the copy runs on.
        device: usize,
        /// The other device of the copy.
        peer: usize,
    },
    /// A copy between two devices enqueued on a stream of neither.
    #[error("a copy from device {src_device} to device {dst_device} cannot run on a stream of device {stream_device}")]
    StreamOnOtherDevice {
        /// The device of the stream.
        stream_device: usize,
        /// The destination's device.
        dst_device: usize,
        /// The source's device.
        src_device: usize,
    },
    /// `set_checkpoint_pool_state` would have to free blocks that the allocator does not own
    /// (buffers a user still holds): nothing was changed. Drop those buffers first (or
    /// allocate them with the raw-pointer calls, whose blocks a restore may free).
    #[error("capture pool {pool} cannot be restored: blocks at {ptrs:x?} are allocated now, free in the checkpoint, and owned by a buffer the allocator cannot free")]
    CheckpointConflict {
        /// The pool.
        pool: PoolId,
        /// Addresses of the blocks in the way.
        ptrs: Vec<u64>,
    },
    /// `set_checkpoint_pool_state` cannot bring back a block of the checkpoint: the memory
    /// at its address was given back to the device since (a separate segment freed by
    /// `empty_cache`), and only an expandable range can map memory at the same address
    /// again. Nothing was changed.
    #[error("capture pool {pool} cannot be restored: the memory at {address:#x} ({size} bytes) is no longer the pool's")]
    CheckpointUnavailable {
        /// The pool.
        pool: PoolId,
        /// Address of the checkpoint's block.
        address: u64,
        /// Bytes of the block.
        size: usize,
    },
    /// A checkpoint that cannot be this pool's state: taken on another device, or with
    /// blocks that overlap or are not aligned. Nothing was changed.
    #[error("invalid checkpoint: {reason}")]
    InvalidCheckpoint {
        /// What is wrong with it.
        reason: String,
    },
    /// A copy whose destination is shorter than its source.
    #[error("cannot copy {src_len} bytes into a destination of {dst_len} bytes")]
    LengthMismatch {
        /// Bytes of the source.
        src_len: usize,
        /// Bytes of the destination.
        dst_len: usize,
    },
    /// A copy of more bytes than its source or its destination holds.
    #[error(
        "cannot copy {requested} bytes: the source holds {src_len} and the destination {dst_len}"
    )]
    CopyOutOfRange {
        /// Bytes asked for.
        requested: usize,
        /// Bytes of the source.
        src_len: usize,
        /// Bytes of the destination.
        dst_len: usize,
    },
}

/// Why a request got [`Error::OutOfMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OomCause {
    /// Larger than the memory cap (one buffer, or a request's buffers together): no wait and
    /// no free makes it fit, only a higher cap (`set_max_bytes`).
    ExceedsLimit,
    /// Larger than the device's memory: it can never fit.
    ExceedsDevice,
    /// It would fit, but there is no room now, after the caches were emptied: buffers in
    /// use hold the memory (under the cap, or on the device). Waiting (`alloc`), or trying
    /// again once buffers came back, may succeed.
    NoRoomNow,
    /// It waited for room under the cap, and it fits only once buffers that its own task (or
    /// thread) took come back: all the others together could not make room for it, so the
    /// wait would never end. Drop those buffers first, or take all of a request's buffers
    /// together with `BufferSet`. (Refused only where no buffer under the cap has ever been
    /// dropped by another task than the one that took it; see "Waiting under a cap" on the
    /// `pinpool` crate's front page.)
    HeldByRequester,
}

impl OomCause {
    /// Whether a request refused for this cause can never fit as things are configured:
    /// waiting for buffers to come back is pointless.
    pub fn never_fits(self) -> bool {
        matches!(self, OomCause::ExceedsLimit | OomCause::ExceedsDevice)
    }
}

impl std::fmt::Display for OomCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OomCause::ExceedsLimit => "it can never fit under the limit",
            OomCause::ExceedsDevice => "it can never fit on the device",
            OomCause::NoRoomNow => "no room now (buffers in use hold the memory)",
            OomCause::HeldByRequester => {
                "it fits only once buffers its own task holds come back, and would wait for \
                 them for ever (drop them first, or take all of a request's buffers together \
                 with BufferSet)"
            }
        })
    }
}

impl Error {
    /// Whether this is an [`Error::OutOfMemory`] for a request that can never fit (larger
    /// than the cap or the device): waiting or trying again is pointless.
    ///
    /// ```
    /// use pinpool::{Error, OomCause};
    ///
    /// let e = Error::OutOfMemory { requested: 8, reserved: 0, limit: Some(4), cause: OomCause::ExceedsLimit };
    /// assert!(e.never_fits());
    /// assert!(e.to_string().ends_with("it can never fit under the limit"));
    /// ```
    pub fn never_fits(&self) -> bool {
        matches!(self, Error::OutOfMemory { cause, .. } if cause.never_fits())
    }
}

fn limit_text(limit: Option<usize>) -> String {
    match limit {
        Some(l) => format!(" of a {l}-byte limit"),
        None => String::new(),
    }
}
