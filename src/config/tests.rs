//! Tests of `PINPOOL_CONF` parsing: every key, every kind of malformed input, round trips.

use super::*;
use crate::Origin;

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
    let config = Config::parse("pin_method:register,prefault_threads:3,huge_pages:false").unwrap();
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
    assert_eq!(Origin::from(PinStrategy::HostAlloc), Origin::HostAlloc);
    assert_eq!(Origin::from(PinStrategy::Register), Origin::Register);
}

// ---- size_policy ----

#[test]
fn size_policy_parses_pow2_and_bestfit_and_round_trips() {
    assert_eq!(Config::default().size_policy, SizePolicyChoice::BestFit);
    let c = Config::parse("size_policy: tiered").unwrap();
    assert_eq!(c.size_policy, SizePolicyChoice::Tiered);
    assert_eq!(c.size_policy.policy().name(), "tiered");
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
