//! Allocation trace files (stub).
