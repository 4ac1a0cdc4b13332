//! Errors of the CUDA runtime: why it could not start ([`CudaInitError`]), and how a failed
//! driver call becomes the engine's [`RuntimeError`] (out of memory flagged as such).

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

use crate::RuntimeError;

/// Why [`CudaRuntime::new`](super::CudaRuntime::new) could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaInitError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver here.
    #[error("the CUDA driver library (libcuda) is not installed or cannot be loaded")]
    NoDriver,
    /// The driver library lacks an entry point the runtime needs: it is too old.
    #[error("the CUDA driver is too old: it has no `{symbol}`")]
    UnsupportedDriver {
        /// The missing entry point.
        symbol: &'static str,
    },
    /// The driver loaded, but there is no device with this ordinal.
    #[error("no CUDA device {ordinal}: {count} device(s) present")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed while starting (cuInit, retaining the primary context...).
    #[error("CUDA initialisation failed in {op}: {message}")]
    Init {
        /// The call that failed.
        op: &'static str,
        /// The driver's error code.
        code: CUresult,
        /// The driver's name and description of the error.
        message: String,
    },
}

impl CudaInitError {
    pub(crate) fn driver(op: &'static str, error: DriverError) -> Self {
        CudaInitError::Init {
            op,
            code: error.0,
            message: describe(error),
        }
    }
}

/// The driver's name and description of `error`, e.g.
/// `CUDA_ERROR_OUT_OF_MEMORY: out of memory`.
pub(crate) fn describe(error: DriverError) -> String {
    let name = error
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    match error.error_string() {
        Ok(text) => format!("{name}: {}", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// Converts a failed driver call into the engine's error, flagging out-of-memory.
pub(crate) fn runtime_error(op: &'static str, error: DriverError) -> RuntimeError {
    if error.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        RuntimeError::out_of_memory(op, describe(error))
    } else {
        RuntimeError::new(op, describe(error))
    }
}

/// Converts a failed libc call (`errno` in `error`) into the engine's error; `ENOMEM` is
/// out-of-memory.
pub(crate) fn os_error(op: &'static str, error: std::io::Error) -> RuntimeError {
    if error.raw_os_error() == Some(libc::ENOMEM) {
        RuntimeError::out_of_memory(op, error.to_string())
    } else {
        RuntimeError::new(op, error.to_string())
    }
}
