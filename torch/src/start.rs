//! [`Started`]: a value made on first use, once it can be; a failed start is tried again at
//! the next use instead of being kept for the life of the process (a driver that was not
//! ready, a device busy for a moment, a setting fixed in the environment before the next
//! call).
//!
//! Owns the start's lock: one start runs at a time, and a value once made is read without
//! it (one atomic load).

use std::sync::{Mutex, OnceLock, PoisonError};

/// A value made by the first start that succeeds.
pub(crate) struct Started<T> {
    value: OnceLock<T>,
    starting: Mutex<()>,
}

impl<T> Started<T> {
    pub(crate) const fn new() -> Self {
        Self {
            value: OnceLock::new(),
            starting: Mutex::new(()),
        }
    }

    /// The value, made by `start` if no start has succeeded yet; `start`'s error otherwise
    /// (the next call starts again). Threads that call at once wait for one start.
    pub(crate) fn get_or_start<E>(&self, start: impl FnOnce() -> Result<T, E>) -> Result<&T, E> {
        if let Some(v) = self.value.get() {
            return Ok(v);
        }
        // A start that panicked left nothing behind: the lock is taken all the same.
        let _one = self.starting.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = self.value.get() {
            return Ok(v);
        }
        let made = start()?;
        Ok(self.value.get_or_init(|| made))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_failed_start_is_tried_again_and_a_successful_one_is_kept() {
        let started = Started::new();
        let tries = AtomicUsize::new(0);
        let start = || {
            let n = tries.fetch_add(1, Ordering::SeqCst);
            if n < 2 {
                Err(format!("not ready ({n})"))
            } else {
                Ok(n)
            }
        };
        assert_eq!(
            started.get_or_start(start),
            Err("not ready (0)".to_string())
        );
        assert_eq!(
            started.get_or_start(start),
            Err("not ready (1)".to_string())
        );
        assert_eq!(started.get_or_start(start), Ok(&2));
        assert_eq!(started.get_or_start(start), Ok(&2));
        assert_eq!(tries.load(Ordering::SeqCst), 3, "kept once made");
    }

    #[test]
    fn threads_that_ask_at_once_wait_for_one_start() {
        let started = Started::new();
        let tries = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let got = started.get_or_start(|| {
                        tries.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        Ok::<_, ()>(7)
                    });
                    assert_eq!(got, Ok(&7));
                });
            }
        });
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_start_that_panicked_is_tried_again() {
        let started = Started::new();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            started.get_or_start(|| -> Result<u8, ()> { panic!("boom") })
        }));
        assert!(panicked.is_err());
        assert_eq!(started.get_or_start(|| Ok::<_, ()>(3)), Ok(&3));
    }
}
