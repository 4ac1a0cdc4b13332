//! The simulated CUDA runtime (stub).
