//! Pool identities: the default pool and the capture pools of graph capture.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Names a pool. `PoolId::DEFAULT` (0) is the default pool; any other id names a capture
/// pool (PyTorch's private pool), as PyTorch's `MempoolId_t` does. Fresh ids come from [`PoolId::fresh`].
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct PoolId(pub u64);

static NEXT: AtomicU64 = AtomicU64::new(1);

impl PoolId {
    /// The default pool.
    pub const DEFAULT: PoolId = PoolId(0);

    /// A capture pool id no other call of `fresh` in this process returns
    /// (ids chosen by hand should stay below `1 << 32` to keep clear of these).
    pub fn fresh() -> PoolId {
        PoolId((1 << 32) + NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether this is the default pool.
    pub fn is_default(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
