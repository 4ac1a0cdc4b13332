//! How long a pool actor keeps polling its mailbox after a request it answered, before it
//! parks (and the next request pays for waking it up). A plain data structure, no actor.
//!
//! Polling costs a core while it lasts; a wake-up costs the next request a system call and
//! the scheduler's latency (microseconds to tens of microseconds). So the actor polls only
//! as long as requests have recently been coming that fast: the window is twice the recent
//! gap between a request's answer and the next request (a moving average), up to the
//! pool's linger; when requests come on average further apart than the linger, it does
//! not poll at all (a request every 100 to 200 µs keeps the actor polling: a core spent
//! to spare each request a wake-up).
//! Gaps are measured from when a request was sent, whether the actor polled or parked
//! meanwhile, so the window opens again as soon as requests come close together.

use std::time::Duration;

/// The weight of the newest gap in the average, as a shift: 1/8.
const WEIGHT_SHIFT: u32 = 3;

/// The moving average of the gaps between requests, and the window it gives.
#[derive(Debug, Clone, Copy)]
pub(super) struct Spin {
    /// The longest window (the pool's linger).
    max: Duration,
    /// The moving average of gaps, in nanoseconds (`None` before the first gap).
    average: Option<u64>,
}

impl Spin {
    /// No gap seen yet: the window is `max` until the first one is.
    pub(super) fn new(max: Duration) -> Self {
        Self { max, average: None }
    }

    /// A request came `gap` after the answer to the one before.
    pub(super) fn gap(&mut self, gap: Duration) {
        let g = u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX);
        self.average = Some(match self.average {
            None => g,
            Some(a) => {
                let a = i128::from(a);
                let moved = a + ((i128::from(g) - a) >> WEIGHT_SHIFT);
                u64::try_from(moved.max(0)).unwrap_or(u64::MAX)
            }
        });
    }

    /// How long to keep polling after an answer: twice the average gap, up to the longest
    /// window; none when requests come on average further apart than the longest window.
    pub(super) fn window(&self) -> Duration {
        let Some(a) = self.average else {
            return self.max;
        };
        if Duration::from_nanos(a) > self.max {
            return Duration::ZERO;
        }
        Duration::from_nanos(a.saturating_mul(2)).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn requests_close_together_open_a_window_of_twice_their_gap() {
        let mut s = Spin::new(100 * US);
        assert_eq!(s.window(), 100 * US, "the longest window before any gap");
        for _ in 0..64 {
            s.gap(10 * US);
        }
        let w = s.window();
        assert!(w >= 19 * US && w <= 21 * US, "{w:?}");
    }

    #[test]
    fn requests_a_little_less_than_the_longest_window_apart_keep_it_whole() {
        // Twice their gap would pass the longest window: the actor polls for all of it, so
        // that the next request, if it comes as the last ones did, finds it awake.
        let mut s = Spin::new(100 * US);
        for _ in 0..64 {
            s.gap(80 * US);
        }
        assert_eq!(s.window(), 100 * US);
    }

    #[test]
    fn requests_further_apart_than_the_longest_window_close_it() {
        let mut s = Spin::new(100 * US);
        for _ in 0..64 {
            s.gap(1000 * US);
        }
        assert_eq!(s.window(), Duration::ZERO);
        // Requests coming close together again open it within a few gaps.
        let mut opened = None;
        for i in 0..64 {
            s.gap(5 * US);
            if s.window() > Duration::ZERO {
                opened = Some(i);
                break;
            }
        }
        assert!(opened.is_some_and(|i| i < 32), "{opened:?}");
    }

    #[test]
    fn a_zero_longest_window_never_polls() {
        let mut s = Spin::new(Duration::ZERO);
        s.gap(US);
        assert_eq!(s.window(), Duration::ZERO);
    }
}
