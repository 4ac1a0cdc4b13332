//! [`AutoRuntime`]: the CUDA runtime where a GPU is present, the simulated one elsewhere,
//! behind one type, so that a program builds and runs the same on both kinds of machine.
//!
//! Owns the runtime it chose and nothing else. Detection never panics: it probes for the
//! driver library before calling it (see [`cuda_available`](super::cuda_available)). A
//! stream of one runtime handed to the other is a [`RuntimeError`], never undefined
//! behaviour; the engine then keeps the block rather than reuse it (invariant 1).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::events::PooledEvent;
use super::runtime::{stream_id, CudaRuntime};
use crate::config::Config;
use crate::sim::{SimEvent, SimRuntime, SimStream};
use crate::{MemoryKind, MemorySource, Region, Runtime, RuntimeError, StreamId};

/// The best runtime available: [`CudaRuntime`] for a device when there is one,
/// [`SimRuntime`] otherwise. Make one with [`AutoRuntime::detect`] or
/// [`Builder::best_available`](crate::Builder::best_available); both log which was chosen
/// and why, and [`AutoRuntime::describe`] says so again.
///
/// On the simulated runtime nothing is page-locked and no device exists: the program runs,
/// but copies must go through [`SimStream`]'s own calls.
///
/// ```
/// use pinpool::cuda::{AutoRuntime, AutoStream};
/// use pinpool::Runtime;
///
/// let runtime = AutoRuntime::detect(0);
/// println!("running on {}", runtime.describe());
/// let stream = runtime.new_stream()?;
/// let event = runtime.record_event(&stream)?;
/// if let AutoStream::Sim(s) = &stream {
///     s.synchronize().unwrap();
/// }
/// # if let AutoStream::Cuda(s) = &stream { s.synchronize().unwrap(); }
/// assert!(runtime.query_event(&event)?);
/// runtime.release_event(event);
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Debug)]
pub enum AutoRuntime {
    /// A GPU was found.
    Cuda(CudaRuntime),
    /// No usable GPU: the simulated runtime, with the reason the GPU could not be used.
    Sim {
        /// The simulated runtime.
        runtime: SimRuntime,
        /// Why CUDA was not used (no driver, no such device, a failed initialisation).
        reason: String,
    },
}

/// A stream of an [`AutoRuntime`]: a cudarc stream, or a simulated one.
#[derive(Debug, Clone)]
pub enum AutoStream {
    /// A CUDA stream (the runtime is [`AutoRuntime::Cuda`]).
    Cuda(Arc<CudaStream>),
    /// A simulated stream (the runtime is [`AutoRuntime::Sim`]).
    Sim(SimStream),
}

/// An event of an [`AutoRuntime`].
#[derive(Debug)]
pub enum AutoEvent {
    /// A pooled CUDA event.
    Cuda(PooledEvent),
    /// A simulated event.
    Sim(SimEvent),
}

fn mismatch(op: &'static str) -> RuntimeError {
    RuntimeError::new(op, "the stream or event belongs to the other runtime")
}

impl AutoRuntime {
    /// CUDA device `ordinal` with the default [`Config`] if it can be used, the simulated
    /// runtime otherwise. Logs the choice.
    pub fn detect(ordinal: usize) -> Self {
        Self::detect_with_config(ordinal, Config::default())
    }

    /// [`AutoRuntime::detect`] with `config` for the CUDA runtime.
    pub fn detect_with_config(ordinal: usize, config: Config) -> Self {
        let chosen = match CudaRuntime::with_config(ordinal, config) {
            Ok(runtime) => AutoRuntime::Cuda(runtime),
            Err(error) => AutoRuntime::Sim {
                runtime: SimRuntime::new(),
                reason: error.to_string(),
            },
        };
        match &chosen {
            AutoRuntime::Cuda(_) => {
                tracing::info!(target: "pinpool::cuda", runtime = "cuda", ordinal, "pinpool runtime: CUDA device {ordinal}");
            }
            AutoRuntime::Sim { reason, .. } => {
                tracing::info!(target: "pinpool::cuda", runtime = "sim", %reason, "pinpool runtime: simulated, no CUDA ({reason})");
            }
        }
        chosen
    }

    /// Which runtime was chosen, e.g. `cuda device 0` or
    /// `sim (no CUDA: the CUDA driver library ... cannot be loaded)`.
    pub fn describe(&self) -> String {
        match self {
            AutoRuntime::Cuda(rt) => format!("cuda device {}", rt.ordinal()),
            AutoRuntime::Sim { reason, .. } => format!("sim (no CUDA: {reason})"),
        }
    }

    /// Whether the real GPU runtime was chosen.
    pub fn is_cuda(&self) -> bool {
        matches!(self, AutoRuntime::Cuda(_))
    }

    /// The CUDA runtime, if that is the one chosen.
    pub fn as_cuda(&self) -> Option<&CudaRuntime> {
        match self {
            AutoRuntime::Cuda(rt) => Some(rt),
            AutoRuntime::Sim { .. } => None,
        }
    }

    /// The simulated runtime, if that is the one chosen.
    pub fn as_sim(&self) -> Option<&SimRuntime> {
        match self {
            AutoRuntime::Cuda(_) => None,
            AutoRuntime::Sim { runtime, .. } => Some(runtime),
        }
    }

    /// A new stream of the chosen runtime (a non-blocking cudarc stream on the GPU).
    pub fn new_stream(&self) -> Result<AutoStream, RuntimeError> {
        match self {
            AutoRuntime::Cuda(rt) => rt
                .context()
                .new_stream()
                .map(AutoStream::Cuda)
                .map_err(|e| super::error::runtime_error("cuStreamCreate", e)),
            AutoRuntime::Sim { runtime, .. } => SimStream::try_new_on(runtime, 0)
                .map(AutoStream::Sim)
                .map_err(|e| RuntimeError::new("stream", e.to_string())),
        }
    }
}

// The allocators\' side of the runtime: hidden from the runtime\'s page, whose users call the
// runtime\'s own methods.
#[doc(hidden)]
impl MemorySource for AutoRuntime {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Pinned
    }

    fn alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        match self {
            AutoRuntime::Cuda(rt) => rt.host_alloc(size),
            AutoRuntime::Sim { runtime, .. } => runtime.host_alloc(size),
        }
    }

    fn free(&self, memory: Region) -> Result<(), RuntimeError> {
        match self {
            AutoRuntime::Cuda(rt) => rt.host_free(memory),
            AutoRuntime::Sim { runtime, .. } => runtime.host_free(memory),
        }
    }
}

impl Runtime for AutoRuntime {
    type Stream = AutoStream;
    type Event = AutoEvent;

    fn name(&self) -> &'static str {
        match self {
            AutoRuntime::Cuda(rt) => rt.name(),
            AutoRuntime::Sim { runtime, .. } => runtime.name(),
        }
    }

    fn new_stream(&self) -> Result<AutoStream, RuntimeError> {
        AutoRuntime::new_stream(self)
    }

    fn stream_id(&self, stream: &AutoStream) -> StreamId {
        match stream {
            AutoStream::Cuda(s) => stream_id(s),
            AutoStream::Sim(s) => s.id(),
        }
    }

    fn owns_stream(&self, stream: &AutoStream) -> bool {
        match (self, stream) {
            (AutoRuntime::Cuda(rt), AutoStream::Cuda(s)) => rt.owns_stream(s),
            (AutoRuntime::Sim { runtime, .. }, AutoStream::Sim(s)) => runtime.owns_stream(s),
            _ => false,
        }
    }

    fn is_capturing(&self, stream: &AutoStream) -> Result<bool, RuntimeError> {
        match (self, stream) {
            (AutoRuntime::Cuda(rt), AutoStream::Cuda(s)) => rt.is_capturing(s),
            (AutoRuntime::Sim { runtime, .. }, AutoStream::Sim(s)) => runtime.is_capturing(s),
            _ => Err(mismatch("is_capturing")),
        }
    }

    fn record_event(&self, stream: &AutoStream) -> Result<AutoEvent, RuntimeError> {
        match (self, stream) {
            (AutoRuntime::Cuda(rt), AutoStream::Cuda(s)) => rt.record_event(s).map(AutoEvent::Cuda),
            (AutoRuntime::Sim { runtime, .. }, AutoStream::Sim(s)) => {
                runtime.record_event(s).map(AutoEvent::Sim)
            }
            _ => Err(mismatch("record_event")),
        }
    }

    fn record_event_reusing(
        &self,
        stream: &AutoStream,
        spare: Option<AutoEvent>,
    ) -> Result<AutoEvent, RuntimeError> {
        match (self, stream, spare) {
            (AutoRuntime::Cuda(rt), AutoStream::Cuda(s), Some(AutoEvent::Cuda(e))) => {
                rt.record_event_reusing(s, Some(e)).map(AutoEvent::Cuda)
            }
            (_, _, spare) => {
                if let Some(e) = spare {
                    self.release_event(e);
                }
                self.record_event(stream)
            }
        }
    }

    fn stream_idle(&self, stream: &AutoStream) -> Result<bool, RuntimeError> {
        match (self, stream) {
            (AutoRuntime::Cuda(rt), AutoStream::Cuda(s)) => rt.stream_idle(s),
            (AutoRuntime::Sim { runtime, .. }, AutoStream::Sim(s)) => runtime.stream_idle(s),
            _ => Err(mismatch("stream_idle")),
        }
    }

    fn query_event(&self, event: &AutoEvent) -> Result<bool, RuntimeError> {
        match (self, event) {
            (AutoRuntime::Cuda(rt), AutoEvent::Cuda(e)) => rt.query_event(e),
            (AutoRuntime::Sim { runtime, .. }, AutoEvent::Sim(e)) => runtime.query_event(e),
            _ => Err(mismatch("query_event")),
        }
    }

    fn release_event(&self, event: AutoEvent) {
        match (self, event) {
            (AutoRuntime::Cuda(rt), AutoEvent::Cuda(e)) => rt.release_event(e),
            (AutoRuntime::Sim { runtime, .. }, AutoEvent::Sim(e)) => runtime.release_event(e),
            // An event can only come from this runtime's `record_event`; dropping one of the
            // other kind still frees it.
            (_, event) => drop(event),
        }
    }
}
