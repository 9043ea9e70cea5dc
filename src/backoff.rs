//! Exponential backoff with full jitter
//! (<https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/>):
//! the n-th wait is uniform in `[0, min(max, base * 2^n))`, so instances that
//! failed together do not retry together.

use backon::{BackoffBuilder, ExponentialBuilder};
use std::time::Duration;

/// A retry schedule; [`Backoff::reset`] after a success.
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    steps: backon::ExponentialBackoff,
    attempts: u32,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Self {
        let builder = ExponentialBuilder::default()
            .with_min_delay(base)
            .with_max_delay(max.max(base))
            .without_max_times();
        Backoff {
            steps: builder.build(),
            builder,
            attempts: 0,
        }
    }

    /// The next delay to wait, jittered.
    pub fn next_delay(&mut self) -> Duration {
        self.attempts = self.attempts.saturating_add(1);
        let ceiling = self.steps.next().unwrap_or_default();
        ceiling.mul_f64(fastrand::f64())
    }

    /// Failures since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    pub fn reset(&mut self) {
        self.steps = self.builder.build();
        self.attempts = 0;
    }
}

/// The ceiling of the n-th (1-based) delay of a schedule, without jitter.
pub fn ceiling(base: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(30));
    base.saturating_mul(factor).min(max.max(base))
}

/// A jittered delay for the n-th (1-based) attempt.
pub fn jittered(base: Duration, max: Duration, attempt: u32) -> Duration {
    ceiling(base, max, attempt).mul_f64(fastrand::f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_stay_below_it() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..50 {
            assert!(b.next_delay() <= Duration::from_secs(1));
        }
        assert_eq!(b.attempts(), 50);
        b.reset();
        assert_eq!(b.attempts(), 0);
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn ceilings_double() {
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(10);
        let c: Vec<u64> = (1..=6).map(|n| ceiling(base, max, n).as_secs()).collect();
        assert_eq!(c, vec![1, 2, 4, 8, 10, 10]);
        assert!(jittered(base, max, 40) <= max);
    }
}
