//! How long the agent waits before trying again while the controller is unreachable:
//! exponential in the number of failures, capped, with jitter so that agents cut off together
//! do not come back together.

use std::time::Duration;

/// The base wait after `failures` consecutive failures, before jitter: 2, 4, 8, ... seconds,
/// growing up to 64 and never above `max` (at least one second).
pub fn base(failures: u32, max: u64) -> f64 {
    let cap = max.max(1) as f64;
    (2u64.saturating_pow(failures.min(6)) as f64).min(cap)
}

/// The wait after `failures` consecutive failures: the base scaled by `jitter`, a number in
/// [0, 1] (random in the agent), to between half the base and the base.
pub fn delay(failures: u32, max: u64, jitter: f64) -> Duration {
    Duration::from_secs_f64(base(failures, max) * (0.5 + jitter.clamp(0.0, 1.0) / 2.0))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn the_delay_lies_between_half_the_base_and_the_base(failures in 1u32..100, max in 0u64..600, jitter in 0.0f64..=1.0) {
            let b = base(failures, max);
            let d = delay(failures, max, jitter).as_secs_f64();
            prop_assert!(d >= b * 0.5 - 1e-9 && d <= b + 1e-9, "{d} outside [{}, {b}]", b * 0.5);
            prop_assert!(d <= max.max(1) as f64 + 1e-9, "{d} above the cap {max}");
        }

        #[test]
        fn the_base_grows_then_saturates(failures in 1u32..100, max in 0u64..600) {
            let now = base(failures, max);
            let next = base(failures + 1, max);
            prop_assert!(next >= now);
            if failures >= 6 {
                prop_assert_eq!(next, now, "saturated");
            }
            prop_assert_eq!(base(failures + 50, max), base(6, max));
        }
    }

    #[test]
    fn the_first_waits_double() {
        assert_eq!([1, 2, 3].map(|f| base(f, 30)), [2.0, 4.0, 8.0]);
        assert_eq!(base(10, 30), 30.0);
    }
}
