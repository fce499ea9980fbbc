//! governor clock backed by `tokio::time::Instant`, so rate limits follow tokio's clock:
//! real time in production, paused and advanced by hand in tests.

use std::ops::Add;

use governor::clock::{Clock, Reference};
use governor::nanos::Nanos;
use tokio::time::Instant;

/// A governor [`Clock`] reading `tokio::time::Instant::now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

/// A tokio instant as a governor [`Reference`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct TokioInstant(pub Instant);

impl From<Instant> for TokioInstant {
    fn from(instant: Instant) -> TokioInstant {
        TokioInstant(instant)
    }
}

impl Add<Nanos> for TokioInstant {
    type Output = TokioInstant;

    fn add(self, other: Nanos) -> TokioInstant {
        TokioInstant(self.0 + std::time::Duration::from(other))
    }
}

impl Reference for TokioInstant {
    fn duration_since(&self, earlier: TokioInstant) -> Nanos {
        self.0.saturating_duration_since(earlier.0).into()
    }

    fn saturating_sub(&self, duration: Nanos) -> TokioInstant {
        self.0
            .checked_sub(duration.into())
            .map_or(*self, TokioInstant)
    }
}

impl Clock for TokioClock {
    type Instant = TokioInstant;

    fn now(&self) -> TokioInstant {
        TokioInstant(Instant::now())
    }
}
