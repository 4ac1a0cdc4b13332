//! What can be wrong with a configuration string.

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
