//! The grammar of configuration strings: `key:value` entries separated by commas, with
//! whitespace tolerated around keys, values and separators, empty entries skipped, and every
//! malformed entry a typed error (unknown, duplicate or empty keys, empty values, missing
//! separators).

use super::ConfigError;

/// The `(key, value)` entries of `text`, trimmed, each key one of `keys` and given once.
pub(crate) fn entries<'a>(
    text: &'a str,
    keys: &'static [&'static str],
) -> Result<Vec<(&'a str, &'a str)>, ConfigError> {
    let mut out: Vec<(&str, &str)> = Vec::new();
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
        if !keys.contains(&key) {
            return Err(ConfigError::UnknownKey {
                key: key.to_owned(),
                valid: keys,
            });
        }
        if out.iter().any(|(k, _)| *k == key) {
            return Err(ConfigError::DuplicateKey {
                key: key.to_owned(),
            });
        }
        if value.is_empty() {
            return Err(ConfigError::EmptyValue {
                key: key.to_owned(),
            });
        }
        out.push((key, value));
    }
    Ok(out)
}

/// A boolean value: `true`/`false`, `1`/`0`, `on`/`off`, `yes`/`no`, in any case.
pub(crate) fn parse_bool(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "yes" => Some(true),
        "false" | "0" | "off" | "no" => Some(false),
        _ => None,
    }
}
