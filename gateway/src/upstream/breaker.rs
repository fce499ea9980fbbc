//! A passive circuit breaker per replica: [`FAILURE_THRESHOLD`] consecutive failures (no
//! connection, no response in time, a 5xx, a stream that broke, a failed probe) eject the
//! replica for a backoff; when the backoff is over it is half-open: one trial (a probe or a
//! request) may go, and its success closes the breaker while its failure ejects the replica
//! again for twice as long (up to [`MAX_BACKOFF`]). Any success resets the count.

use std::time::{Duration, Instant};

/// Consecutive failures that eject a replica.
pub const FAILURE_THRESHOLD: u32 = 3;
/// First ejection's length.
pub const BASE_BACKOFF: Duration = Duration::from_secs(1);
/// Longest ejection.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a half-open trial may stay unanswered before another may go (a trial whose client
/// left never reports back).
pub const TRIAL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed,
    /// Ejected until `until`.
    Open {
        until: Instant,
    },
    /// Backoff over; a trial went at `since` and has not reported.
    Trial {
        since: Instant,
    },
}

/// Where a replica's breaker stands, as `kvgate_upstream_replicas{state}` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Closed: requests go.
    Healthy,
    /// Open: ejected until its backoff is over (then its half-open trial may go).
    Ejected,
    /// Half-open: its one trial (a probe or a request) is out and has not reported.
    HalfOpen,
}

impl BreakerState {
    pub const ALL: [BreakerState; 3] = [
        BreakerState::Healthy,
        BreakerState::Ejected,
        BreakerState::HalfOpen,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Healthy => "healthy",
            BreakerState::Ejected => "ejected",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Breaker {
    state: State,
    failures: u32,
    backoff: Duration,
}

impl Default for Breaker {
    fn default() -> Breaker {
        Breaker {
            state: State::Closed,
            failures: 0,
            backoff: BASE_BACKOFF,
        }
    }
}

impl Breaker {
    /// Whether a request may go now. Past an ejection's backoff this hands out the one
    /// half-open trial, so call it only for the replica actually chosen.
    pub fn try_acquire(&mut self, now: Instant) -> bool {
        match self.state {
            State::Closed => true,
            State::Open { until } if now >= until => {
                self.state = State::Trial { since: now };
                true
            }
            State::Trial { since } if now.saturating_duration_since(since) >= TRIAL_TIMEOUT => {
                self.state = State::Trial { since: now };
                true
            }
            State::Open { .. } | State::Trial { .. } => false,
        }
    }

    /// Whether a request could go now (without taking the trial): for choosing candidates.
    pub fn is_available(&self, now: Instant) -> bool {
        match self.state {
            State::Closed => true,
            State::Open { until } => now >= until,
            State::Trial { since } => now.saturating_duration_since(since) >= TRIAL_TIMEOUT,
        }
    }

    /// Where it stands now.
    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed => BreakerState::Healthy,
            State::Open { .. } => BreakerState::Ejected,
            State::Trial { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether the replica is ejected (open, or half-open with its trial out).
    pub fn is_ejected(&self) -> bool {
        self.state != State::Closed
    }

    /// A request or probe succeeded: closed, count and backoff reset. True when this
    /// readmitted an ejected replica.
    pub fn success(&mut self) -> bool {
        let readmitted = self.state != State::Closed;
        self.state = State::Closed;
        self.failures = 0;
        self.backoff = BASE_BACKOFF;
        readmitted
    }

    /// A health probe was answered: readmits an ejected replica (as [`Breaker::success`]), but
    /// leaves a closed breaker's count of failed requests alone: a server that answers its
    /// probes while its streams keep breaking is still ejected by the third break in a row.
    pub fn probe_success(&mut self) -> bool {
        self.state != State::Closed && self.success()
    }

    /// A request or probe failed at `now`. True when this ejected the replica.
    pub fn failure(&mut self, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        match self.state {
            State::Closed if self.failures >= FAILURE_THRESHOLD => {
                self.state = State::Open {
                    until: now + self.backoff,
                };
                true
            }
            State::Closed => false,
            // The trial failed (or a late failure arrived): eject for longer.
            State::Trial { .. } | State::Open { .. } => {
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                self.state = State::Open {
                    until: now + self.backoff,
                };
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_readmits_but_does_not_forgive_failed_requests() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        for _ in 1..FAILURE_THRESHOLD {
            breaker.failure(now);
        }
        assert!(!breaker.probe_success(), "closed: nothing to readmit");
        assert!(
            breaker.failure(now),
            "the probe did not reset the count: ejected"
        );
        assert!(breaker.probe_success(), "an answered probe readmits it");
        assert_eq!(breaker.state(), BreakerState::Healthy);
    }

    #[test]
    fn consecutive_failures_eject_and_a_success_in_between_resets_the_count() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        assert!(!breaker.failure(now));
        assert!(!breaker.failure(now));
        assert!(!breaker.success(), "it was not ejected");
        assert!(!breaker.failure(now));
        assert!(!breaker.failure(now));
        assert!(breaker.try_acquire(now), "two in a row: still closed");
        assert_eq!(breaker.state(), BreakerState::Healthy);
        assert!(breaker.failure(now), "the third in a row ejects");
        assert!(breaker.is_ejected());
        assert_eq!(breaker.state(), BreakerState::Ejected);
        assert!(!breaker.is_available(now));
        assert!(!breaker.try_acquire(now + BASE_BACKOFF / 2));
    }

    #[test]
    fn after_the_backoff_one_trial_goes_and_decides() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        for _ in 0..FAILURE_THRESHOLD {
            breaker.failure(now);
        }
        let later = now + BASE_BACKOFF;
        assert!(breaker.is_available(later));
        assert_eq!(
            breaker.state(),
            BreakerState::Ejected,
            "until its trial goes"
        );
        assert!(breaker.try_acquire(later), "the half-open trial");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        assert!(!breaker.try_acquire(later), "only one trial at a time");
        assert!(!breaker.is_available(later));
        // The trial fails: ejected for twice as long.
        breaker.failure(later);
        assert!(!breaker.try_acquire(later + BASE_BACKOFF));
        let retry = later + 2 * BASE_BACKOFF;
        assert!(breaker.try_acquire(retry));
        assert!(breaker.success(), "the trial succeeded: readmitted");
        assert!(!breaker.is_ejected());
        assert!(breaker.try_acquire(retry));
        // A lost trial (its client left) does not block the replica forever.
        for _ in 0..FAILURE_THRESHOLD {
            breaker.failure(retry);
        }
        let trial = retry + BASE_BACKOFF;
        assert!(breaker.try_acquire(trial));
        assert!(breaker.try_acquire(trial + TRIAL_TIMEOUT));
    }

    #[test]
    fn backoff_is_capped() {
        let mut now = Instant::now();
        let mut breaker = Breaker::default();
        for _ in 0..FAILURE_THRESHOLD {
            breaker.failure(now);
        }
        for _ in 0..20 {
            now += MAX_BACKOFF;
            assert!(breaker.try_acquire(now));
            breaker.failure(now);
        }
        assert!(breaker.try_acquire(now + MAX_BACKOFF));
    }
}
