//! The grammar of configuration strings (PyTorch's `PYTORCH_CUDA_ALLOC_CONF` grammar):
//! `key:value` entries separated by commas, a value that is a bracketed list keeping its
//! commas (`roundup_power2_divisions:[256:1,>:4]`), whitespace tolerated around keys, values
//! and separators, empty entries skipped, and every malformed entry a typed error (unknown,
//! duplicate or empty keys, empty values, missing separators, unbalanced brackets).

use super::ConfigError;

/// The `(key, value)` entries of `text`, trimmed, each key one of `keys` and given once.
pub(crate) fn entries<'a>(
    text: &'a str,
    keys: &'static [&'static str],
) -> Result<Vec<(&'a str, &'a str)>, ConfigError> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for entry in split_outside_brackets(text, ',')? {
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

/// `text` split at each `sep` outside square brackets; unbalanced brackets are an error
/// naming the text.
pub(crate) fn split_outside_brackets(text: &str, sep: char) -> Result<Vec<&str>, ConfigError> {
    let unbalanced = || ConfigError::UnbalancedBrackets {
        text: text.trim().to_owned(),
    };
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(unbalanced)?,
            c if c == sep && depth == 0 => {
                parts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(unbalanced());
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// The `(key, value)` items of a bracketed list value (`[256:1, >:4]`), trimmed; `None`
/// when `value` is not bracketed. An item without `:` or with an empty side is an error.
pub(crate) fn list_items<'a>(
    key: &str,
    value: &'a str,
) -> Option<Result<Vec<(&'a str, &'a str)>, ConfigError>> {
    let inner = value.strip_prefix('[')?.strip_suffix(']')?;
    let items = split_outside_brackets(inner, ',').and_then(|items| {
        items
            .into_iter()
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(|item| match item.split_once(':') {
                Some((a, b)) if !a.trim().is_empty() && !b.trim().is_empty() => {
                    Ok((a.trim(), b.trim()))
                }
                _ => Err(ConfigError::InvalidValue {
                    key: key.to_owned(),
                    value: value.to_owned(),
                    expected: "a list of `size:value` items",
                }),
            })
            .collect()
    });
    Some(items)
}
