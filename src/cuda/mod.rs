//! The CUDA runtime (stub).
