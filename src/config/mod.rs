//! Configuration, parsed from `PINPOOL_CONF` (pinned memory: [`Config`]) and from
//! `PINPOOL_DEVICE_CONF` (device memory: [`DeviceConfig`]).
//!
//! The format follows PyTorch's `PYTORCH_CUDA_ALLOC_CONF`: comma-separated `key:value`
//! pairs, whitespace around keys, values and separators tolerated, e.g.
//! `pin_method:register, prefault_threads:8`. A malformed string is a [`ConfigError`] naming
//! what is wrong: never a panic, and never a key silently ignored. [`Config::KEYS`] and
//! [`DeviceConfig::KEYS`] list the keys; each field's documentation says what its key takes.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use pinpool::config::{Config, DeviceConfig};
//!
//! let pinned: Config = "size_policy:bestfit".parse()?;
//! let device: DeviceConfig = "max_split_size_mb:64, expandable_segments:false".parse()?;
//! let host = pinpool::PinnedAllocator::builder().config(&pinned).build()?;
//! let gpu = pinpool::DeviceAllocator::builder().config(&device).build()?;
//! assert_eq!(gpu.stats(0)?.max_split_size, Some(64 << 20));
//! assert!("pin_method:glue".parse::<Config>().is_err());
//! # drop(host);
//! # Ok(()) }
//! ```

// This module owns the `Config` struct (the grammar is `grammar`'s, the device keys
// `device`'s). To add a key: add a field (with its default in `Config::default`), add its
// name to `Config::KEYS`, parse it in `Config::set`, and print it in the `Display` impl.
// Malformed input is a typed error, never a panic (invariant 7 of `actors/ARCHITECTURE.md`).

mod choices;
mod device;
mod error;
mod grammar;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

pub use choices::{PinStrategy, SizePolicyChoice};
pub use device::{DeviceConfig, DEVICE_ENV_VAR, ROUNDUP_INTERVALS};
pub use error::ConfigError;

/// The environment variable [`Config::from_env`] reads.
pub const ENV_VAR: &str = "PINPOOL_CONF";

/// Settings of the pinned-memory allocator.
///
/// Build one with [`Config::default`] and the `with_*` methods, parse one from a
/// `PINPOOL_CONF`-style string, or read the environment with [`Config::from_env`].
///
/// ```
/// use pinpool::config::{Config, PinStrategy};
///
/// let config: Config = "pin_method:register, prefault_threads:4, huge_pages:false".parse()?;
/// assert_eq!(config.pin_method, PinStrategy::Register);
/// assert_eq!(config.prefault_threads, 4);
/// assert!(!config.huge_pages);
/// # Ok::<(), pinpool::config::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// How fresh memory is pinned (key `pin_method`: `host_alloc` or `register`).
    pub pin_method: PinStrategy,
    /// Threads that pre-fault the pages of a `register` allocation (key `prefault_threads`,
    /// 1 to [`Config::MAX_PREFAULT_THREADS`]). Default: min(16, available parallelism).
    pub prefault_threads: usize,
    /// Whether `register` allocations ask for transparent huge pages and round sizes to the
    /// huge page size (key `huge_pages`: `true`/`false`, also `1`/`0`, `on`/`off`, `yes`/`no`).
    pub huge_pages: bool,
    /// The size policy (key `size_policy`: `default`, `tiered`, `pow2`, `bestfit` or
    /// `bestfit_segments`), applied by
    /// [`crate::Builder::config`].
    pub size_policy: SizePolicyChoice,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            pin_method: PinStrategy::default(),
            prefault_threads: default_prefault_threads(),
            huge_pages: true,
            size_policy: SizePolicyChoice::default(),
        }
    }
}

fn default_prefault_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(16)
}

impl Config {
    /// Every key `PINPOOL_CONF` accepts, in the order `Display` prints them.
    pub const KEYS: &'static [&'static str] = &[
        "pin_method",
        "prefault_threads",
        "huge_pages",
        "size_policy",
    ];

    /// The largest accepted `prefault_threads`.
    pub const MAX_PREFAULT_THREADS: usize = 1024;

    /// Reads [`ENV_VAR`] (`PINPOOL_CONF`); the defaults when it is unset.
    ///
    /// ```
    /// let config = pinpool::config::Config::from_env()?;
    /// assert!(config.prefault_threads >= 1);
    /// # Ok::<(), pinpool::config::ConfigError>(())
    /// ```
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(text) => text.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::NotUnicode),
        }
    }

    /// Parses a `key:value,key:value` string. Keys left out keep their defaults; an empty
    /// string gives the defaults.
    ///
    /// ```
    /// use pinpool::config::{Config, ConfigError};
    ///
    /// let err = "pin_methd:register".parse::<Config>().unwrap_err();
    /// assert!(matches!(err, ConfigError::UnknownKey { .. }));
    /// ```
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for (key, value) in grammar::entries(text, Self::KEYS)? {
            config.set(key, value)?;
        }
        Ok(config)
    }

    /// Sets one known key from its (trimmed, non-empty) value.
    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |expected: &'static str| ConfigError::InvalidValue {
            key: key.to_owned(),
            value: value.to_owned(),
            expected,
        };
        match key {
            "pin_method" => {
                self.pin_method = match value {
                    "host_alloc" => PinStrategy::HostAlloc,
                    "register" => PinStrategy::Register,
                    _ => return Err(invalid("`host_alloc` or `register`")),
                }
            }
            "prefault_threads" => {
                const EXPECTED: &str = "a whole number from 1 to 1024";
                let threads: usize = value.parse().map_err(|_| invalid(EXPECTED))?;
                if !(1..=Self::MAX_PREFAULT_THREADS).contains(&threads) {
                    return Err(invalid(EXPECTED));
                }
                self.prefault_threads = threads;
            }
            "huge_pages" => {
                self.huge_pages = grammar::parse_bool(value).ok_or_else(|| invalid("a boolean"))?
            }
            "size_policy" => {
                self.size_policy = SizePolicyChoice::from_name(value).ok_or_else(|| {
                    invalid("`default`, `tiered`, `pow2`, `bestfit` or `bestfit_segments`")
                })?
            }
            // `parse` checks keys against `KEYS` first; a key listed there but not handled
            // here is reported rather than ignored.
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_owned(),
                    valid: Self::KEYS,
                })
            }
        }
        Ok(())
    }

    /// This configuration with `pin_method` set.
    pub fn with_pin_method(mut self, pin_method: PinStrategy) -> Self {
        self.pin_method = pin_method;
        self
    }

    /// This configuration with `prefault_threads` set; values are clamped to
    /// 1..=[`Config::MAX_PREFAULT_THREADS`].
    pub fn with_prefault_threads(mut self, threads: usize) -> Self {
        self.prefault_threads = threads.clamp(1, Self::MAX_PREFAULT_THREADS);
        self
    }

    /// This configuration with `size_policy` set.
    pub fn with_size_policy(mut self, size_policy: SizePolicyChoice) -> Self {
        self.size_policy = size_policy;
        self
    }

    /// This configuration with `huge_pages` set.
    pub fn with_huge_pages(mut self, huge_pages: bool) -> Self {
        self.huge_pages = huge_pages;
        self
    }
}

impl FromStr for Config {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// Prints the configuration in `PINPOOL_CONF` form; parsing the output gives it back.
impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pin_method:{},prefault_threads:{},huge_pages:{},size_policy:{}",
            self.pin_method, self.prefault_threads, self.huge_pages, self.size_policy
        )
    }
}
