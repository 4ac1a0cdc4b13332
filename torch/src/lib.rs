//! pinpool as PyTorch's CUDA allocator.
//!
//! A shared library that `torch.cuda.memory.CUDAPluggableAllocator` loads (and any C or C++
//! program, libtorch's included, can call): `pinpool_alloc` and `pinpool_free` over one
//! [`pinpool::DeviceAllocator`] for the process, with stream-ordered pools per PyTorch
//! stream, plus the hooks PyTorch offers beside them (record_stream, empty_cache, the memory
//! fraction, graph pools) and what its statistics calls cannot give with an external
//! allocator (statistics with PyTorch's keys as JSON, snapshots for `memory_viz`). The
//! Python package `pinpool_torch` (in `python/`) wires it up; see `docs/torch.md`.
//!
//! Modules: `plugin` (the hooks' meaning, generic over the runtime), `abi` (the C boundary's
//! rules: no panic crosses it, errors become null or -1 and a last-error string),
//! `exports` (the C symbols), `snapshot` (snapshots as C records for PyTorch's
//! allocator front), `call_times` (the alloc and free calls' time, where asked),
//! `start` (the plugin made once a start succeeds, retried after a failed one), `fork`
//! (a forked child refuses the parent's allocator at once), and `cuda` (the process's plugin
//! on the CUDA runtime and PyTorch's stream handles as cudarc streams; feature `cuda`).

mod abi;
#[cfg(test)]
mod boundary_tests;
mod call_times;
#[cfg(feature = "cuda")]
mod cuda;
pub mod exports;
mod fork;
mod plugin;
pub mod snapshot;
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
mod start;
#[cfg(test)]
mod tests;
