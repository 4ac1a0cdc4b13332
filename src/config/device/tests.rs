//! Tests of `DeviceConfig`: parsing, printing back, merging, and the typed errors of bad
//! keys and values.

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
fn pytorchs_list_form_of_roundup_power2_divisions_sets_divisions_per_size() {
    let c = DeviceConfig::parse("roundup_power2_divisions:[256:1,>:4]").unwrap();
    let mut want = [0; ROUNDUP_INTERVALS];
    want[8..].fill(4); // 1 division (none) below 256 MiB, 4 from there
    assert_eq!(c.roundup_power2_divisions_by_size, Some(want));
    let c = DeviceConfig::parse(
        "roundup_power2_divisions: [ 64:2, 512:8 , >:16 ], expandable_segments:True",
    )
    .unwrap();
    let mut want = [2; ROUNDUP_INTERVALS];
    want[6..9].fill(8);
    want[9..].fill(16);
    assert_eq!(c.roundup_power2_divisions_by_size, Some(want));
    assert!(
        c.expandable_segments,
        "the entry after the list is read too"
    );
    // Without `>` the larger sizes are not rounded.
    let c = DeviceConfig::parse("roundup_power2_divisions:[1024:4]").unwrap();
    let mut want = [0; ROUNDUP_INTERVALS];
    want[..10].fill(4);
    assert_eq!(c.roundup_power2_divisions_by_size, Some(want));
    // Printed in the list form, which reads back to the same table.
    for text in ["[256:1,>:4]", "[64:2,512:8,>:16]", "[1024:4]", "[>:8]"] {
        let c = DeviceConfig::parse(&format!("roundup_power2_divisions:{text}")).unwrap();
        assert_eq!(
            DeviceConfig::parse(&c.to_string()).unwrap(),
            c,
            "{text}: {c}"
        );
    }
    // The number form replaces a list given before it in a merge.
    let c = c.merged("roundup_power2_divisions:2").unwrap();
    assert_eq!(c.roundup_power2_divisions_by_size, None);
    assert_eq!(c.roundup_power2_divisions, 2);
}

#[test]
fn bad_lists_and_brackets_are_typed_errors() {
    for text in [
        "roundup_power2_divisions:[256:3]",
        "roundup_power2_divisions:[300:2]",
        "roundup_power2_divisions:[256:128]",
        "roundup_power2_divisions:[256]",
        "roundup_power2_divisions:[:4]",
        "roundup_power2_divisions:[256:x,>:4]",
    ] {
        let err = DeviceConfig::parse(text).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidValue { key, .. } if key == "roundup_power2_divisions"),
            "{text}: {err:?}"
        );
    }
    for text in [
        "roundup_power2_divisions:[256:1,>:4",
        "roundup_power2_divisions:256:1]",
    ] {
        assert!(
            matches!(
                DeviceConfig::parse(text),
                Err(ConfigError::UnbalancedBrackets { .. })
            ),
            "{text}"
        );
    }
}

#[test]
fn a_full_pytorch_alloc_conf_string_is_accepted() {
    let c = DeviceConfig::parse(
        "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.8,\
         roundup_power2_divisions:[256:1,512:2,>:4],backend:native,\
         release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
         pinned_num_register_threads:8,pinned_use_background_threads:False,\
         graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:64,\
         per_process_memory_fraction:0.5",
    )
    .unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, Some(128 << 20));
    assert_eq!(c.garbage_collection_threshold, Some(0.8));
    assert_eq!(c.memory_fraction, Some(0.5));
    assert!(c.roundup_power2_divisions_by_size.is_some());
    assert_eq!(DeviceConfig::parse(&c.to_string()).unwrap(), c);
    // PyTorch's keys that pinpool cannot honour, or values that would mean another
    // allocator, are refused by name.
    assert!(matches!(
        DeviceConfig::parse("backend:cudaMallocAsync"),
        Err(ConfigError::InvalidValue { key, .. }) if key == "backend"
    ));
    assert!(matches!(
        DeviceConfig::parse("max_non_split_rounding_mb:40"),
        Err(ConfigError::Unsupported { key, .. }) if key == "max_non_split_rounding_mb"
    ));
    for text in [
        "per_process_memory_fraction:0",
        "per_process_memory_fraction:1.5",
        "pinned_num_register_threads:3",
        "release_lock_on_cudamalloc:maybe",
    ] {
        assert!(
            matches!(
                DeviceConfig::parse(text),
                Err(ConfigError::InvalidValue { .. })
            ),
            "{text}"
        );
    }
}

#[test]
fn a_string_merged_over_a_configuration_sets_only_the_keys_it_names() {
    let base = DeviceConfig::default()
        .with_thread_cache(256 << 20)
        .with_reserve_cap(Some(1.1));
    let c = base.clone().merged("expandable_segments:false").unwrap();
    assert_eq!(c.thread_cache, 256 << 20);
    assert_eq!(c.reserve_cap, Some(1.1));
    assert!(!c.expandable_segments);
    let c = base.clone().merged("reserve_cap:none").unwrap();
    assert_eq!((c.thread_cache, c.reserve_cap), (256 << 20, None));
    assert_eq!(base.clone().merged("").unwrap(), base);
    // A bad string sets nothing: the error is all there is.
    assert!(base.merged("thread_cache_mb:8,linger_us:-1").is_err());
}

#[test]
fn an_unknown_key_names_every_valid_key() {
    let err = DeviceConfig::parse("expandable_segment:true").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("`expandable_segment`"), "{text}");
    for key in DeviceConfig::KEYS {
        assert!(text.contains(key), "{key} missing from: {text}");
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
