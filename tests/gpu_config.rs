//! A malformed `PINPOOL_CONF` is a typed error from the builder, with or without a GPU
//! (feature `cuda`). Its own test binary, with one test, because it sets the environment.
#![cfg(feature = "cuda")]

use pinpool::{Error, PinnedAllocator};

#[test]
fn a_malformed_pinpool_conf_is_an_invalid_config_error_with_or_without_a_gpu() {
    // The only test in this binary: no other thread reads the environment meanwhile.
    std::env::set_var(pinpool::config::ENV_VAR, "pin_methd:register");
    let cuda = PinnedAllocator::builder().cuda(0).err();
    let best = PinnedAllocator::builder().best_available(0).err();
    std::env::remove_var(pinpool::config::ENV_VAR);
    for err in [cuda, best] {
        match err {
            Some(Error::InvalidConfig { message }) => {
                assert!(message.contains("pin_methd"), "{message}");
                println!("invalid PINPOOL_CONF: {message}");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
}
