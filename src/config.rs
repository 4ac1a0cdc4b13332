//! Configuration of pinned-memory allocation, parsed from `PINPOOL_CONF`.
//!
//! Owns the [`Config`] struct and its parser. The format follows PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF`: comma-separated `key:value` pairs, whitespace around keys,
//! values and separators tolerated, e.g. `pin_method:register, prefault_threads:8`.
//! Keeps invariant 7: a malformed string is a typed [`ConfigError`] naming what is wrong,
//! never a panic and never a silently ignored key.
//!
//! To add a key: add a field (with its default in [`Config::default`]), add its name to
//! [`Config::KEYS`], parse it in `Config::set`, and print it in the `Display` impl.

use std::fmt;
use std::str::FromStr;

use crate::PinMethod;

/// The environment variable [`Config::from_env`] reads.
pub const ENV_VAR: &str = "PINPOOL_CONF";

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
    /// ([`crate::TieredPowerOfTwo`]).
    #[default]
    Tiered,
    /// Round up to a power of two, one free list per power of two, as PyTorch
    /// ([`crate::PowerOfTwo`]).
    Pow2,
    /// Fine size classes carved out of one expandable range where the runtime can map
    /// pinned memory granule by granule, else out of shared segments ([`crate::BestFit`]).
    BestFit,
    /// [`crate::BestFit`] with separate shared segments only
    /// ([`crate::BestFit::separate_segments`]), for comparison.
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

    /// The choice called `name` (as written in `PINPOOL_CONF`), if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
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
    pub fn policy(self) -> std::sync::Arc<dyn crate::SizePolicy> {
        match self {
            SizePolicyChoice::Tiered => std::sync::Arc::new(crate::TieredPowerOfTwo::default()),
            SizePolicyChoice::Pow2 => std::sync::Arc::new(crate::PowerOfTwo),
            SizePolicyChoice::BestFit => std::sync::Arc::new(crate::BestFit::default()),
            SizePolicyChoice::BestFitSegments => {
                std::sync::Arc::new(crate::BestFit::default().separate_segments())
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

impl From<PinStrategy> for PinMethod {
    fn from(strategy: PinStrategy) -> Self {
        match strategy {
            PinStrategy::HostAlloc => PinMethod::HostAlloc,
            PinStrategy::Register => PinMethod::Register,
        }
    }
}

impl fmt::Display for PinStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// The size policy (key `size_policy`: `tiered`, `pow2`, `bestfit` or
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
    /// let err = Config::parse("pin_methd:register").unwrap_err();
    /// assert!(matches!(err, ConfigError::UnknownKey { .. }));
    /// ```
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        let mut seen: Vec<&str> = Vec::new();
        for entry in text.split(',') {
            let entry = entry.trim();
            if entry.is_empty() {
                continue; // tolerate "a:1,,b:2" and a trailing comma
            }
            let Some((key, value)) = entry.split_once(':') else {
                return Err(ConfigError::MissingSeparator {
                    entry: entry.to_owned(),
                });
            };
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty() {
                return Err(ConfigError::EmptyKey {
                    entry: entry.to_owned(),
                });
            }
            if !Self::KEYS.contains(&key) {
                return Err(ConfigError::UnknownKey {
                    key: key.to_owned(),
                    valid: Self::KEYS,
                });
            }
            if seen.contains(&key) {
                return Err(ConfigError::DuplicateKey {
                    key: key.to_owned(),
                });
            }
            seen.push(key);
            if value.is_empty() {
                return Err(ConfigError::EmptyValue {
                    key: key.to_owned(),
                });
            }
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
                self.huge_pages = parse_bool(value).ok_or_else(|| invalid("a boolean"))?
            }
            "size_policy" => {
                self.size_policy = SizePolicyChoice::from_name(value)
                    .ok_or_else(|| invalid("`tiered`, `pow2` or `bestfit`"))?
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

fn parse_bool(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "yes" => Some(true),
        "false" | "0" | "off" | "no" => Some(false),
        _ => None,
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

/// What is wrong with a `PINPOOL_CONF` string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key that pinpool does not know (often a typo).
    #[error("unknown key `{key}` in PINPOOL_CONF; valid keys: {}", .valid.join(", "))]
    UnknownKey {
        /// The key as written.
        key: String,
        /// Every valid key.
        valid: &'static [&'static str],
    },
    /// A known key with a value it cannot take.
    #[error("invalid value `{value}` for `{key}` in PINPOOL_CONF; expected {expected}")]
    InvalidValue {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// A key followed by `:` and nothing else.
    #[error("empty value for `{key}` in PINPOOL_CONF")]
    EmptyValue {
        /// The key.
        key: String,
    },
    /// The same key given twice.
    #[error("key `{key}` given more than once in PINPOOL_CONF")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// An entry with no `:` between key and value.
    #[error("entry `{entry}` in PINPOOL_CONF is not of the form key:value")]
    MissingSeparator {
        /// The entry as written.
        entry: String,
    },
    /// An entry with nothing before its `:`.
    #[error("entry `{entry}` in PINPOOL_CONF has an empty key")]
    EmptyKey {
        /// The entry as written.
        entry: String,
    },
    /// `PINPOOL_CONF` is set but is not valid Unicode.
    #[error("PINPOOL_CONF is not valid Unicode")]
    NotUnicode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_string_gives_the_defaults() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::parse("  , ,").unwrap(), Config::default());
    }

    #[test]
    fn defaults_are_host_alloc_huge_pages_and_at_most_16_threads() {
        let config = Config::default();
        assert_eq!(config.pin_method, PinStrategy::HostAlloc);
        assert!(config.huge_pages);
        assert!((1..=16).contains(&config.prefault_threads));
    }

    #[test]
    fn every_key_parses() {
        let config =
            Config::parse("pin_method:register,prefault_threads:3,huge_pages:false").unwrap();
        assert_eq!(config.pin_method, PinStrategy::Register);
        assert_eq!(config.prefault_threads, 3);
        assert!(!config.huge_pages);
    }

    #[test]
    fn whitespace_around_keys_values_and_commas_is_tolerated() {
        let config = Config::parse("  pin_method : register ,\n\tprefault_threads:\t8 , ").unwrap();
        assert_eq!(config.pin_method, PinStrategy::Register);
        assert_eq!(config.prefault_threads, 8);
        assert!(config.huge_pages);
    }

    #[test]
    fn keys_left_out_keep_their_defaults() {
        let config = Config::parse("huge_pages:off").unwrap();
        assert_eq!(config, Config::default().with_huge_pages(false));
    }

    #[test]
    fn booleans_accept_common_spellings() {
        for yes in ["true", "True", "1", "on", "YES"] {
            assert!(
                Config::parse(&format!("huge_pages:{yes}"))
                    .unwrap()
                    .huge_pages
            );
        }
        for no in ["false", "False", "0", "off", "no"] {
            assert!(
                !Config::parse(&format!("huge_pages:{no}"))
                    .unwrap()
                    .huge_pages
            );
        }
    }

    #[test]
    fn display_round_trips() {
        let config = Config::default()
            .with_pin_method(PinStrategy::Register)
            .with_prefault_threads(5)
            .with_huge_pages(false);
        assert_eq!(config.to_string().parse::<Config>().unwrap(), config);
        assert_eq!(
            Config::default().to_string().parse::<Config>().unwrap(),
            Config::default()
        );
    }

    #[test]
    fn unknown_key_is_named_and_valid_keys_listed() {
        let err = Config::parse("pin_method:register,max_byte:10").unwrap_err();
        assert_eq!(
            err,
            ConfigError::UnknownKey {
                key: "max_byte".into(),
                valid: Config::KEYS
            }
        );
        let message = err.to_string();
        assert!(message.contains("`max_byte`"), "{message}");
        for key in Config::KEYS {
            assert!(message.contains(key), "{message}");
        }
    }

    #[test]
    fn keys_are_case_sensitive() {
        assert!(matches!(
            Config::parse("Pin_Method:register"),
            Err(ConfigError::UnknownKey { .. })
        ));
    }

    #[test]
    fn bad_pin_method_is_an_invalid_value() {
        let err = Config::parse("pin_method:malloc").unwrap_err();
        assert!(matches!(
            &err,
            ConfigError::InvalidValue { key, value, .. } if key == "pin_method" && value == "malloc"
        ));
        assert!(err.to_string().contains("host_alloc"), "{err}");
    }

    #[test]
    fn prefault_threads_must_be_a_number_in_range() {
        for bad in ["0", "-1", "1025", "four", "2.5", "99999999999999999999999"] {
            let err = Config::parse(&format!("prefault_threads:{bad}")).unwrap_err();
            assert!(
                matches!(&err, ConfigError::InvalidValue { key, value, .. }
                    if key == "prefault_threads" && value == bad),
                "{bad}: {err:?}"
            );
        }
        assert_eq!(
            Config::parse("prefault_threads:1024")
                .unwrap()
                .prefault_threads,
            1024
        );
    }

    #[test]
    fn bad_boolean_is_an_invalid_value() {
        assert!(matches!(
            Config::parse("huge_pages:maybe"),
            Err(ConfigError::InvalidValue { key, .. }) if key == "huge_pages"
        ));
    }

    #[test]
    fn empty_value_is_an_error() {
        assert_eq!(
            Config::parse("pin_method:  ").unwrap_err(),
            ConfigError::EmptyValue {
                key: "pin_method".into()
            }
        );
    }

    #[test]
    fn duplicate_key_is_an_error_even_with_the_same_value() {
        assert_eq!(
            Config::parse("huge_pages:true, huge_pages:true").unwrap_err(),
            ConfigError::DuplicateKey {
                key: "huge_pages".into()
            }
        );
    }

    #[test]
    fn entry_without_colon_is_an_error() {
        assert_eq!(
            Config::parse("pin_method=register").unwrap_err(),
            ConfigError::MissingSeparator {
                entry: "pin_method=register".into()
            }
        );
    }

    #[test]
    fn entry_with_empty_key_is_an_error() {
        assert_eq!(
            Config::parse(":register").unwrap_err(),
            ConfigError::EmptyKey {
                entry: ":register".into()
            }
        );
    }

    #[test]
    fn builder_clamps_prefault_threads() {
        assert_eq!(
            Config::default().with_prefault_threads(0).prefault_threads,
            1
        );
        assert_eq!(
            Config::default()
                .with_prefault_threads(usize::MAX)
                .prefault_threads,
            Config::MAX_PREFAULT_THREADS
        );
    }

    #[test]
    fn strategy_maps_to_the_runtime_pin_method() {
        assert_eq!(
            PinMethod::from(PinStrategy::HostAlloc),
            PinMethod::HostAlloc
        );
        assert_eq!(PinMethod::from(PinStrategy::Register), PinMethod::Register);
    }
}

#[cfg(test)]
mod size_policy_tests {
    use super::*;

    #[test]
    fn size_policy_parses_pow2_and_bestfit_and_round_trips() {
        assert_eq!(Config::default().size_policy, SizePolicyChoice::Tiered);
        let c = Config::parse("size_policy: bestfit").unwrap();
        assert_eq!(c.size_policy, SizePolicyChoice::BestFit);
        assert_eq!(c.size_policy.policy().name(), "bestfit");
        assert_eq!(Config::parse(&c.to_string()).unwrap(), c);
        assert_eq!(
            Config::parse("size_policy:pow2")
                .unwrap()
                .size_policy
                .policy()
                .name(),
            "pow2"
        );
        let err = Config::parse("size_policy:lru").unwrap_err();
        assert!(matches!(err, ConfigError::InvalidValue { .. }), "{err}");
    }
}
