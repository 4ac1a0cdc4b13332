//! `PINPOOL_CONF` and `PINPOOL_DEVICE_CONF` are read the same way on every runtime: a
//! malformed value is an `InvalidConfig` error from `build` on the simulated runtime too,
//! and a well-formed one takes effect there, unless the program gives the configuration
//! (or, for the size policy, the policy) itself.
//!
//! Its own test binary, because it sets the environment; its tests take one lock each, so
//! that no two of them change or read the variables at once.

use std::sync::{Arc, Mutex, MutexGuard};

use pinpool::config::{Config, DeviceConfig, DEVICE_ENV_VAR, ENV_VAR};
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{DeviceAllocator, Error, PinnedAllocator};

static ENV: Mutex<()> = Mutex::new(());

/// Sets `name` to `value` (or removes it) until dropped, holding the lock meanwhile.
struct EnvVar {
    name: &'static str,
    _lock: MutexGuard<'static, ()>,
}

impl EnvVar {
    fn set(name: &'static str, value: Option<&str>) -> Self {
        let lock = ENV.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match value {
            Some(v) => std::env::set_var(name, v),
            None => std::env::remove_var(name),
        }
        Self { name, _lock: lock }
    }
}

impl Drop for EnvVar {
    fn drop(&mut self) {
        std::env::remove_var(self.name);
    }
}

fn invalid_config_naming(err: Option<Error>, var: &str, word: &str) {
    match err {
        Some(Error::InvalidConfig { message }) => {
            assert!(message.contains(var), "{message}");
            assert!(message.contains(word), "{message}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[tokio::test]
async fn a_malformed_pinpool_conf_fails_the_build_on_the_simulated_runtime() {
    let _env = EnvVar::set(ENV_VAR, Some("garbage"));
    invalid_config_naming(PinnedAllocator::builder().build().err(), ENV_VAR, "garbage");
}

#[tokio::test]
async fn a_malformed_pinpool_device_conf_fails_the_build_on_the_simulated_runtime() {
    let _env = EnvVar::set(DEVICE_ENV_VAR, Some("max_split_size_mb:lots"));
    invalid_config_naming(
        DeviceAllocator::builder().build().err(),
        DEVICE_ENV_VAR,
        "max_split_size_mb",
    );
}

#[tokio::test]
async fn the_size_policy_of_pinpool_conf_applies_on_the_simulated_runtime() {
    let _env = EnvVar::set(ENV_VAR, Some("size_policy:tiered"));
    let pool = PinnedAllocator::builder().build().unwrap();
    assert_eq!(pinpool::tuning::engine(&pool).policy().name(), "tiered");
}

#[tokio::test]
async fn the_layout_of_pinpool_device_conf_applies_on_the_simulated_runtime() {
    let _env = EnvVar::set(
        DEVICE_ENV_VAR,
        Some("max_split_size_mb:64, expandable_segments:false"),
    );
    let pool = DeviceAllocator::builder().build().unwrap();
    assert_eq!(pool.config().max_split_size, Some(64 << 20));
    assert!(!pool.config().expandable_segments);
}

#[tokio::test]
async fn settings_the_program_gives_win_over_the_environment() {
    let _env = EnvVar::set(ENV_VAR, Some("size_policy:pow2"));
    let policy = PinnedAllocator::builder()
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .build()
        .unwrap();
    assert_eq!(pinpool::tuning::engine(&policy).policy().name(), "tiered");
    let config = PinnedAllocator::builder()
        .config(&Config::default())
        .build()
        .unwrap();
    assert_eq!(pinpool::tuning::engine(&config).policy().name(), "bestfit");
}

#[tokio::test]
async fn a_configuration_the_program_gives_is_used_instead_of_a_malformed_environment() {
    let _env = EnvVar::set(DEVICE_ENV_VAR, Some("garbage"));
    let pool = DeviceAllocator::builder()
        .config(&DeviceConfig::default())
        .build()
        .unwrap();
    assert_eq!(pool.config(), &DeviceConfig::default());
}

/// With a GPU: `size_policy` from `PINPOOL_CONF` reaches a `.cuda()` builder, and the cap
/// given before `.cuda()` is kept. Without one, `.cuda()` says so and the test has nothing
/// more to check.
#[cfg(feature = "cuda")]
#[tokio::test]
async fn the_size_policy_of_pinpool_conf_and_the_cap_reach_a_cuda_builder() {
    let _env = EnvVar::set(ENV_VAR, Some("size_policy:tiered"));
    match PinnedAllocator::builder().max_bytes(64 << 20).cuda(0) {
        Ok(builder) => {
            let pool = builder.build().unwrap();
            assert_eq!(pinpool::tuning::engine(&pool).policy().name(), "tiered");
            assert_eq!(pool.max_bytes(), Some(64 << 20));
        }
        Err(Error::DeviceUnavailable { message }) => println!("no GPU, skipped: {message}"),
        Err(other) => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn pytorchs_alloc_conf_string_in_pinpool_device_conf_applies_on_the_simulated_runtime() {
    let _env = EnvVar::set(
        DEVICE_ENV_VAR,
        Some("expandable_segments:True,roundup_power2_divisions:[256:1,>:4],per_process_memory_fraction:0.5"),
    );
    let pool = DeviceAllocator::builder().build().unwrap();
    assert!(pool.config().roundup_power2_divisions_by_size.is_some());
    // Half of the simulated 16 GiB device.
    assert_eq!(pool.max_bytes(0).unwrap(), Some(8 << 30));
    // A cap the program gives wins over the configuration's fraction.
    let capped = DeviceAllocator::builder()
        .max_bytes(1 << 30)
        .build()
        .unwrap();
    assert_eq!(capped.max_bytes(0).unwrap(), Some(1 << 30));
}

#[tokio::test]
async fn pinpool_device_conf_sets_only_its_keys_over_a_programs_defaults() {
    let _env = EnvVar::set(DEVICE_ENV_VAR, Some("expandable_segments:false"));
    let defaults = DeviceConfig::default().with_thread_cache(64 << 20);
    let config = defaults.merged_with_env().unwrap();
    assert_eq!(config.thread_cache, 64 << 20);
    assert!(!config.expandable_segments);
}
