//! What can be wrong with a configuration string (`PINPOOL_CONF`, `PINPOOL_DEVICE_CONF`).

/// What is wrong with a configuration string. The messages name the key or entry, not the
/// variable: whoever read the variable says which it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key that pinpool does not know (often a typo).
    #[error("unknown key `{key}`; valid keys: {}", .valid.join(", "))]
    UnknownKey {
        /// The key as written.
        key: String,
        /// Every valid key.
        valid: &'static [&'static str],
    },
    /// A known key with a value it cannot take.
    #[error("invalid value `{value}` for `{key}`; expected {expected}")]
    InvalidValue {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// A key followed by `:` and nothing else.
    #[error("empty value for `{key}`")]
    EmptyValue {
        /// The key.
        key: String,
    },
    /// The same key given twice.
    #[error("key `{key}` given more than once")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// An entry with no `:` between key and value.
    #[error("entry `{entry}` is not of the form key:value")]
    MissingSeparator {
        /// The entry as written.
        entry: String,
    },
    /// An entry with nothing before its `:`.
    #[error("entry `{entry}` has an empty key")]
    EmptyKey {
        /// The entry as written.
        entry: String,
    },
    /// The variable is set but is not valid Unicode.
    #[error("the variable is not valid Unicode")]
    NotUnicode,
    /// A `[` without its `]`, or the other way round.
    #[error("unbalanced brackets in `{text}`")]
    UnbalancedBrackets {
        /// The text as written.
        text: String,
    },
    /// A key of PyTorch's `PYTORCH_CUDA_ALLOC_CONF` that pinpool cannot honour.
    #[error("`{key}` is not supported by pinpool: {reason}")]
    Unsupported {
        /// The key.
        key: String,
        /// Why, and what to do instead.
        reason: &'static str,
    },
}
