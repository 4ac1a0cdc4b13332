//! Configuration of device-memory allocation, parsed from `PINPOOL_DEVICE_CONF` in the
//! grammar of `PINPOOL_CONF` (and in the spirit of `PYTORCH_CUDA_ALLOC_CONF`, whose keys it
//! takes where they mean the same).
//!
//! Owns [`DeviceConfig`]. Every key is optional; a malformed string is a typed
//! [`ConfigError`] naming the key or entry, never a panic and never an ignored key.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{grammar, ConfigError};
use crate::actors::DEFAULT_LINGER;

/// The environment variable [`DeviceConfig::from_env`] reads.
pub const DEVICE_ENV_VAR: &str = "PINPOOL_DEVICE_CONF";

/// Settings of the device allocator.
///
/// ```
/// use pinpool::config::DeviceConfig;
///
/// let c: DeviceConfig = "max_split_size_mb:256, roundup_power2_divisions:4".parse()?;
/// assert_eq!(c.max_split_size, Some(256 << 20));
/// assert_eq!(c.roundup_power2_divisions, 4);
/// assert!(c.expandable_segments);
/// assert_eq!(c.to_string().parse::<DeviceConfig>()?, c);
/// # Ok::<(), pinpool::config::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeviceConfig {
    /// Blocks above this size are never cut out of a larger free range, and free ranges
    /// above it are not split for smaller requests (key `max_split_size_mb`, in MiB, at
    /// least 20; `unlimited` by default): large blocks then cannot fragment memory that
    /// smaller ones need. They count as oversize in the statistics.
    pub max_split_size: Option<usize>,
    /// Requests above 1 MiB round up to one of this many steps per power of two (key
    /// `roundup_power2_divisions`: a power of two from 1 to 64; 0, the default, rounds to
    /// 512 bytes only): more reuse of freed blocks for requests of varying size, at the
    /// price of more bytes per block.
    pub roundup_power2_divisions: u32,
    /// Before fresh memory would take reserved bytes above this share of the memory limit,
    /// cached memory nobody uses goes back first (key `garbage_collection_threshold`,
    /// strictly between 0 and 1; only with a limit; off by default).
    pub garbage_collection_threshold: Option<f64>,
    /// Cut blocks out of one expandable range per pool and stream, mapped granule by
    /// granule (key `expandable_segments`, default `true`), rather than separate segments.
    pub expandable_segments: bool,
    /// Freed blocks up to this size stay with the threads, which split them for their
    /// requests without the pool actor (key `thread_cache_mb`, whole MiB; 0, the default:
    /// blocks above 1 MiB go back to the pool actor). Faster on repeating patterns of large
    /// requests, with more memory reserved for the same peak (see `DeviceFit::thread_cache`).
    pub thread_cache: usize,
    /// Before fresh memory would take a pool's reserved bytes above this multiple of its
    /// peak of live bytes, memory it maps but no block uses is moved to where the request
    /// needs it, or given back (key `reserve_cap`: a number, at least 1; default 1). `None`
    /// (`reserve_cap:none`) keeps such memory until `empty_cache` or a limit needs it: no
    /// driver calls in a repeating workload's steady state, for more memory reserved.
    pub reserve_cap: Option<f64>,
    /// How long a pool actor stays awake after a miss for the next one (key `linger_us`,
    /// whole microseconds, at most 100 000; default 50). A request the actor answers while it
    /// sleeps waits for its thread to wake, tens of microseconds more (`device_bench`'s
    /// `dev_miss_us`); a longer linger keeps one of the actors' worker threads busy that
    /// much longer after each such request.
    pub linger: Duration,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            max_split_size: None,
            roundup_power2_divisions: 0,
            garbage_collection_threshold: None,
            expandable_segments: true,
            thread_cache: 0,
            reserve_cap: Some(DEFAULT_RESERVE_CAP),
            linger: DEFAULT_LINGER,
        }
    }
}

/// The reserve cap when the key is not given (the device policy's own).
const DEFAULT_RESERVE_CAP: f64 = 1.0;

/// Whether `x` is a reserve cap the `reserve_cap` key takes: finite, and at least 1.
fn valid_reserve_cap(x: f64) -> bool {
    x >= 1.0 && x.is_finite()
}

/// The longest linger the `linger_us` key takes.
const MAX_LINGER: Duration = Duration::from_millis(100);

/// The smallest `max_split_size_mb` (PyTorch's minimum too).
const MIN_SPLIT_MIB: usize = 20;

impl DeviceConfig {
    /// Every key `PINPOOL_DEVICE_CONF` accepts, in the order `Display` prints them.
    pub const KEYS: &'static [&'static str] = &[
        "max_split_size_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "expandable_segments",
        "thread_cache_mb",
        "reserve_cap",
        "linger_us",
    ];

    /// Reads [`DEVICE_ENV_VAR`] (`PINPOOL_DEVICE_CONF`); the defaults when it is unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(DEVICE_ENV_VAR) {
            Ok(text) => text.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::NotUnicode),
        }
    }

    /// Parses a `key:value,key:value` string; keys left out keep their defaults.
    ///
    /// ```
    /// use pinpool::config::{ConfigError, DeviceConfig};
    ///
    /// let err = "max_split_size_mb:4".parse::<DeviceConfig>().unwrap_err();
    /// assert!(matches!(err, ConfigError::InvalidValue { .. }));
    /// ```
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for (key, value) in grammar::entries(text, Self::KEYS)? {
            config.set(key, value)?;
        }
        Ok(config)
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |expected: &'static str| ConfigError::InvalidValue {
            key: key.to_owned(),
            value: value.to_owned(),
            expected,
        };
        match key {
            "max_split_size_mb" => {
                const EXPECTED: &str = "`unlimited` or a whole number of MiB, at least 20";
                self.max_split_size = if value == "unlimited" {
                    None
                } else {
                    let mb: usize = value.parse().map_err(|_| invalid(EXPECTED))?;
                    let bytes = mb.checked_mul(1 << 20).ok_or_else(|| invalid(EXPECTED))?;
                    if mb < MIN_SPLIT_MIB {
                        return Err(invalid(EXPECTED));
                    }
                    Some(bytes)
                };
            }
            "roundup_power2_divisions" => {
                const EXPECTED: &str = "0, or a power of two from 1 to 64";
                let d: u32 = value.parse().map_err(|_| invalid(EXPECTED))?;
                if d > 64 || (d > 0 && !d.is_power_of_two()) {
                    return Err(invalid(EXPECTED));
                }
                self.roundup_power2_divisions = d;
            }
            "garbage_collection_threshold" => {
                const EXPECTED: &str = "a number strictly between 0 and 1";
                let t: f64 = value.parse().map_err(|_| invalid(EXPECTED))?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(invalid(EXPECTED));
                }
                self.garbage_collection_threshold = Some(t);
            }
            "expandable_segments" => {
                self.expandable_segments =
                    grammar::parse_bool(value).ok_or_else(|| invalid("a boolean"))?
            }
            "thread_cache_mb" => {
                const EXPECTED: &str = "a whole number of MiB";
                let mb: usize = value.parse().map_err(|_| invalid(EXPECTED))?;
                self.thread_cache = mb.checked_mul(1 << 20).ok_or_else(|| invalid(EXPECTED))?;
            }
            "reserve_cap" => {
                const EXPECTED: &str = "`none`, or a number at least 1";
                self.reserve_cap = if value == "none" {
                    None
                } else {
                    let x: f64 = value.parse().map_err(|_| invalid(EXPECTED))?;
                    if !valid_reserve_cap(x) {
                        return Err(invalid(EXPECTED));
                    }
                    Some(x)
                };
            }
            "linger_us" => {
                const EXPECTED: &str = "a whole number of microseconds, at most 100000";
                let us: u64 = value.parse().map_err(|_| invalid(EXPECTED))?;
                let linger = Duration::from_micros(us);
                if linger > MAX_LINGER {
                    return Err(invalid(EXPECTED));
                }
                self.linger = linger;
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_owned(),
                    valid: Self::KEYS,
                })
            }
        }
        Ok(())
    }
}

impl DeviceConfig {
    /// This configuration with `max_split_size` set (`None`: unlimited), as the key would
    /// set it: rounded up to whole MiB, at least 20 MiB.
    pub fn with_max_split_size(mut self, bytes: Option<usize>) -> Self {
        self.max_split_size = bytes.map(|b| b.max(MIN_SPLIT_MIB << 20).next_multiple_of(1 << 20));
        self
    }

    /// This configuration with `roundup_power2_divisions` set, as the key would set it: a
    /// power of two up to 64 (rounded up), or 0.
    pub fn with_roundup_power2_divisions(mut self, divisions: u32) -> Self {
        self.roundup_power2_divisions = match divisions {
            0 => 0,
            d => d.next_power_of_two().min(64),
        };
        self
    }

    /// This configuration with `garbage_collection_threshold` set; a threshold the key would
    /// refuse (not strictly between 0 and 1) sets none.
    pub fn with_garbage_collection_threshold(mut self, threshold: Option<f64>) -> Self {
        self.garbage_collection_threshold = threshold.filter(|t| *t > 0.0 && *t < 1.0);
        self
    }

    /// This configuration with `expandable_segments` set.
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self
    }

    /// This configuration with `reserve_cap` set (`None`: no cap); a cap the key would
    /// refuse (below 1, or not finite) sets the default.
    pub fn with_reserve_cap(mut self, times_peak_live: Option<f64>) -> Self {
        self.reserve_cap = match times_peak_live {
            Some(x) if !valid_reserve_cap(x) => Some(DEFAULT_RESERVE_CAP),
            other => other,
        };
        self
    }

    /// This configuration with `linger` set, as the key would set it: whole microseconds
    /// (rounded up), at most 100 ms.
    pub fn with_linger(mut self, linger: Duration) -> Self {
        let us = linger.as_nanos().div_ceil(1000).min(MAX_LINGER.as_micros());
        self.linger = Duration::from_micros(us as u64);
        self
    }

    /// This configuration with `thread_cache` set, as the key would set it: rounded up to
    /// whole MiB.
    pub fn with_thread_cache(mut self, bytes: usize) -> Self {
        self.thread_cache = bytes.next_multiple_of(1 << 20);
        self
    }
}

impl FromStr for DeviceConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// Prints the configuration in `PINPOOL_DEVICE_CONF` form; parsing the output gives it back.
impl fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.max_split_size {
            // Whole MiB, at least the key's minimum (what the builder methods store).
            Some(b) => write!(
                f,
                "max_split_size_mb:{}",
                b.div_ceil(1 << 20).max(MIN_SPLIT_MIB)
            )?,
            None => write!(f, "max_split_size_mb:unlimited")?,
        }
        write!(
            f,
            ",roundup_power2_divisions:{}",
            self.roundup_power2_divisions
        )?;
        if let Some(t) = self.garbage_collection_threshold {
            write!(f, ",garbage_collection_threshold:{t}")?;
        }
        write!(f, ",expandable_segments:{}", self.expandable_segments)?;
        if self.thread_cache > 0 {
            write!(
                f,
                ",thread_cache_mb:{}",
                self.thread_cache.div_ceil(1 << 20)
            )?;
        }
        match self.reserve_cap {
            Some(x) if x == DEFAULT_RESERVE_CAP => {}
            Some(x) => write!(f, ",reserve_cap:{x}")?,
            None => write!(f, ",reserve_cap:none")?,
        }
        if self.linger != DEFAULT_LINGER {
            write!(f, ",linger_us:{}", self.linger.as_micros())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_from_an_empty_string_and_round_trip() {
        let c = DeviceConfig::parse("").unwrap();
        assert_eq!(c, DeviceConfig::default());
        assert_eq!(DeviceConfig::parse(&c.to_string()).unwrap(), c);
        let full = DeviceConfig::parse(
            "max_split_size_mb:64,roundup_power2_divisions:8,garbage_collection_threshold:0.6,expandable_segments:false,thread_cache_mb:32,reserve_cap:1.25,linger_us:2000",
        )
        .unwrap();
        assert_eq!(full.reserve_cap, Some(1.25));
        assert_eq!(full.linger, Duration::from_millis(2));
        let none = DeviceConfig::parse("reserve_cap:none").unwrap();
        assert_eq!(none.reserve_cap, None);
        assert_eq!(DeviceConfig::parse(&none.to_string()).unwrap(), none);
        assert_eq!(full.max_split_size, Some(64 << 20));
        assert_eq!(full.thread_cache, 32 << 20);
        assert_eq!(full.garbage_collection_threshold, Some(0.6));
        assert!(!full.expandable_segments);
        assert_eq!(DeviceConfig::parse(&full.to_string()).unwrap(), full);
    }

    #[test]
    fn a_configuration_made_with_the_builder_methods_prints_what_parses_back_to_it() {
        let made = DeviceConfig::default()
            .with_max_split_size(Some((25 << 20) + 1))
            .with_roundup_power2_divisions(3)
            .with_garbage_collection_threshold(Some(1.5))
            .with_expandable_segments(false)
            .with_linger(Duration::from_nanos(2_500));
        assert_eq!(made.max_split_size, Some(26 << 20));
        assert_eq!(made.linger, Duration::from_micros(3));
        assert_eq!(
            DeviceConfig::default()
                .with_linger(Duration::from_secs(5))
                .linger,
            MAX_LINGER
        );
        assert_eq!(made.roundup_power2_divisions, 4);
        assert_eq!(made.garbage_collection_threshold, None);
        let printed = made.to_string();
        assert_eq!(DeviceConfig::parse(&printed).unwrap(), made, "{printed}");
        let small = DeviceConfig::default().with_max_split_size(Some(1 << 20));
        assert_eq!(small.max_split_size, Some(20 << 20));
        assert_eq!(DeviceConfig::parse(&small.to_string()).unwrap(), small);
    }

    #[test]
    fn every_bad_value_is_an_invalid_value_naming_its_key() {
        for (text, key) in [
            ("max_split_size_mb:19", "max_split_size_mb"),
            ("max_split_size_mb:-1", "max_split_size_mb"),
            (
                "max_split_size_mb:99999999999999999999",
                "max_split_size_mb",
            ),
            ("roundup_power2_divisions:3", "roundup_power2_divisions"),
            ("roundup_power2_divisions:128", "roundup_power2_divisions"),
            (
                "garbage_collection_threshold:1",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:0",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:NaN",
                "garbage_collection_threshold",
            ),
            ("expandable_segments:perhaps", "expandable_segments"),
            ("thread_cache_mb:-4", "thread_cache_mb"),
            ("thread_cache_mb:1.5", "thread_cache_mb"),
            ("thread_cache_mb:99999999999999999999", "thread_cache_mb"),
            ("reserve_cap:0.9", "reserve_cap"),
            ("reserve_cap:inf", "reserve_cap"),
            ("reserve_cap:NaN", "reserve_cap"),
            ("reserve_cap:off", "reserve_cap"),
            ("linger_us:100001", "linger_us"),
            ("linger_us:-5", "linger_us"),
            ("linger_us:0.5", "linger_us"),
        ] {
            let err = DeviceConfig::parse(text).unwrap_err();
            assert!(
                matches!(&err, ConfigError::InvalidValue { key: k, .. } if k == key),
                "{text}: {err:?}"
            );
        }
    }

    #[test]
    fn unknown_duplicate_and_malformed_entries_are_typed_errors() {
        assert!(matches!(
            DeviceConfig::parse("max_split_size:10"),
            Err(ConfigError::UnknownKey { .. })
        ));
        assert!(matches!(
            DeviceConfig::parse("expandable_segments:true,expandable_segments:true"),
            Err(ConfigError::DuplicateKey { .. })
        ));
        assert!(matches!(
            DeviceConfig::parse("expandable_segments"),
            Err(ConfigError::MissingSeparator { .. })
        ));
    }
}
