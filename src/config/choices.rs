//! The values of `PINPOOL_CONF` keys that name a choice: how host memory is pinned, and which
//! size policy an allocator uses.

use std::fmt;
use std::sync::Arc;

use crate::Origin;

/// How fresh host memory is page-locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PinStrategy {
    /// `cuMemHostAlloc` (portable, not write-combined). Simple, but holds a driver-wide lock
    /// for the whole call: 350 to 600 ms for 1 GiB on H100 hosts.
    #[default]
    HostAlloc,
    /// `mmap`, optionally transparent huge pages, pages pre-faulted on several threads, then
    /// `cuMemHostRegister`. Much faster for large sizes (about 50 ms for 1 GiB with huge
    /// pages and 16 threads, 120 ms without huge pages); sizes round up to the page size.
    Register,
}

/// Which size policy an allocator built with [`crate::Builder::config`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SizePolicyChoice {
    /// Powers of two up to 512 MiB, sixteenths of a power of two above
    /// ([`crate::tuning::TieredPowerOfTwo`]).
    Tiered,
    /// Round up to a power of two, one free list per power of two, as PyTorch
    /// ([`crate::tuning::PowerOfTwo`]).
    Pow2,
    /// Fine size classes carved out of one expandable range where the runtime can map
    /// pinned memory granule by granule, else out of shared segments ([`crate::tuning::BestFit`]).
    #[default]
    BestFit,
    /// [`crate::tuning::BestFit`] with separate shared segments only
    /// ([`crate::tuning::BestFit::separate_segments`]), for comparison.
    BestFitSegments,
}

impl SizePolicyChoice {
    /// Every choice, in the order reports list them.
    pub const ALL: [SizePolicyChoice; 4] = [
        SizePolicyChoice::Pow2,
        SizePolicyChoice::Tiered,
        SizePolicyChoice::BestFit,
        SizePolicyChoice::BestFitSegments,
    ];

    /// The name that stands for whatever the default choice is ([`SizePolicyChoice::default`]).
    pub const DEFAULT_NAME: &'static str = "default";

    /// The choice called `name` (as written in `PINPOOL_CONF`), if there is one; `"default"`
    /// names the default choice, whichever it is.
    ///
    /// ```
    /// use pinpool::config::SizePolicyChoice;
    /// assert_eq!(SizePolicyChoice::from_name("default"), Some(SizePolicyChoice::default()));
    /// assert_eq!(SizePolicyChoice::from_name("bestfit"), Some(SizePolicyChoice::BestFit));
    /// assert_eq!(SizePolicyChoice::from_name("best"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<Self> {
        if name == Self::DEFAULT_NAME {
            return Some(Self::default());
        }
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// Every name [`SizePolicyChoice::from_name`] knows, `"default"` first.
    pub fn names() -> impl Iterator<Item = &'static str> {
        std::iter::once(Self::DEFAULT_NAME).chain(Self::ALL.iter().map(|c| c.as_str()))
    }

    /// The value as written in `PINPOOL_CONF` (the policy's name).
    pub fn as_str(self) -> &'static str {
        match self {
            SizePolicyChoice::Tiered => "tiered",
            SizePolicyChoice::Pow2 => "pow2",
            SizePolicyChoice::BestFit => "bestfit",
            SizePolicyChoice::BestFitSegments => "bestfit_segments",
        }
    }

    /// The policy itself.
    pub fn policy(self) -> Arc<dyn crate::tuning::SizePolicy> {
        match self {
            SizePolicyChoice::Tiered => Arc::new(crate::tuning::TieredPowerOfTwo::default()),
            SizePolicyChoice::Pow2 => Arc::new(crate::tuning::PowerOfTwo),
            SizePolicyChoice::BestFit => Arc::new(crate::tuning::BestFit::default()),
            SizePolicyChoice::BestFitSegments => {
                Arc::new(crate::tuning::BestFit::default().separate_segments())
            }
        }
    }
}

impl fmt::Display for SizePolicyChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PinStrategy {
    /// The spelling used in `PINPOOL_CONF`.
    pub fn as_str(self) -> &'static str {
        match self {
            PinStrategy::HostAlloc => "host_alloc",
            PinStrategy::Register => "register",
        }
    }
}

impl From<PinStrategy> for Origin {
    fn from(strategy: PinStrategy) -> Self {
        match strategy {
            PinStrategy::HostAlloc => Origin::HostAlloc,
            PinStrategy::Register => Origin::Register,
        }
    }
}

impl fmt::Display for PinStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
