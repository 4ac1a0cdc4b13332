//! Settings given to a builder are never dropped silently: switching the runtime keeps the
//! cap, the timeout, the policy and the configuration, on the pinned and the device builder
//! alike.

use std::sync::Arc;
use std::time::Duration;

use pinpool::config::{Config, DeviceConfig, SizePolicyChoice};
use pinpool::sim::SimRuntime;
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{DeviceAllocator, Error, PinnedAllocator};

#[tokio::test]
async fn the_pinned_builder_keeps_its_cap_and_timeout_when_the_runtime_changes() {
    let sim = SimRuntime::new();
    let pool = PinnedAllocator::builder()
        .max_bytes(1 << 20)
        .alloc_timeout(Duration::from_millis(10))
        .runtime(Arc::new(sim.clone()))
        .build()
        .unwrap();
    assert_eq!(pool.max_bytes(), Some(1 << 20));
    // The first request gets a generous wait of its own, so that a loaded machine cannot time
    // it out; the second uses the builder's.
    let held = pool
        .alloc_timeout(1 << 20, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        sim.live_bytes() >= 1 << 20,
        "the new runtime gives the memory"
    );
    let err = pool.alloc(1 << 20).await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout { timeout, .. } if timeout == Duration::from_millis(10)),
        "{err:?}"
    );
    drop(held);
}

#[tokio::test]
async fn the_pinned_builder_keeps_its_policy_and_configuration_when_the_runtime_changes() {
    let policy = PinnedAllocator::builder()
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .runtime(Arc::new(SimRuntime::new()))
        .build()
        .unwrap();
    assert_eq!(pinpool::tuning::engine(&policy).policy().name(), "tiered");
    let config = Config::default().with_size_policy(SizePolicyChoice::Pow2);
    let configured = PinnedAllocator::builder()
        .config(&config)
        .runtime(Arc::new(SimRuntime::new()))
        .build()
        .unwrap();
    assert_eq!(pinpool::tuning::engine(&configured).policy().name(), "pow2");
}

#[tokio::test]
async fn an_explicit_policy_wins_over_the_configurations_size_policy() {
    let config = Config::default().with_size_policy(SizePolicyChoice::Pow2);
    for pool in [
        PinnedAllocator::builder()
            .policy(Arc::new(TieredPowerOfTwo::default()))
            .config(&config)
            .build()
            .unwrap(),
        PinnedAllocator::builder()
            .config(&config)
            .policy(Arc::new(TieredPowerOfTwo::default()))
            .build()
            .unwrap(),
    ] {
        assert_eq!(pinpool::tuning::engine(&pool).policy().name(), "tiered");
    }
}

#[tokio::test]
async fn the_last_cap_given_is_the_cap() {
    let bytes = PinnedAllocator::builder()
        .memory_fraction(0.5)
        .max_bytes(1 << 20)
        .build()
        .unwrap();
    assert_eq!(bytes.max_bytes(), Some(1 << 20));
    let fraction = PinnedAllocator::builder()
        .max_bytes(1 << 20)
        .memory_fraction(2.0)
        .build()
        .err();
    assert!(
        matches!(fraction, Some(Error::InvalidLimit { .. })),
        "{fraction:?}"
    );
}

#[tokio::test]
async fn the_device_builder_keeps_its_cap_and_configuration_when_the_runtime_changes() {
    let config: DeviceConfig = "max_split_size_mb:64".parse().unwrap();
    let sim = SimRuntime::builder().device_capacity(1 << 30).build();
    let pool = DeviceAllocator::builder()
        .max_bytes(256 << 20)
        .config(&config)
        .runtime(Arc::new(sim))
        .build()
        .unwrap();
    assert_eq!(pool.max_bytes(0).unwrap(), Some(256 << 20));
    assert_eq!(pool.config().max_split_size, Some(64 << 20));
}
