//! Layer 3, observation: what runs user code and keeps the record — the observer task, the
//! history actor and the recorder the hot paths call, and the user's free-memory callbacks.

pub(crate) mod observe;
pub(crate) mod history;
pub(crate) mod free_memory;
