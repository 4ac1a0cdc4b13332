//! Allocation planning (stub).
