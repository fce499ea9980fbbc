//! Choosing a replica: a weighted score of KV usage, queue length and prefix affinity, after
//! the Gateway API Inference Extension's default scorers (weights 2, 2, 3; each score in
//! [0, 1]), with SGLang's load guard so affinity never piles work onto a hot replica.
//!
//! * **KV usage** `1 - kv`, where `kv` is the replica's last scrape plus the tokens this gateway
//!   sent it since, over its capacity ([`LoadSample::estimate`]); with no fresh scrape, this
//!   gateway's own in-flight tokens over capacity.
//! * **Queue** `(max - q) / (max - min)` over the candidates, `q` being the scraped waiting
//!   requests plus this gateway's in-flight ones (1 for all when they are equal).
//! * **Prefix** the fraction of the prompt's blocks the replica recently received
//!   (`prefix.rs`).
//!
//! **Load guard**: a replica whose estimated KV usage is at least [`SATURATED_KV`] gets no
//! affinity score; and when the queues are imbalanced (the longest exceeds the shortest by more
//! than [`IMBALANCE_ABS`] requests *and* by more than [`IMBALANCE_REL`] times) nobody does, so
//! the least loaded replica wins. Ties go round-robin.

use std::time::{Duration, Instant};

/// KV usage from which a replica counts as saturated (no affinity bonus).
pub const SATURATED_KV: f64 = 0.9;
/// A scrape older than this is ignored; local counts are used instead.
pub const STALE_AFTER: Duration = Duration::from_secs(2);
/// Queue imbalance, absolute part (requests).
pub const IMBALANCE_ABS: f64 = 4.0;
/// Queue imbalance, relative part (longest > this × shortest).
pub const IMBALANCE_REL: f64 = 1.5;

/// How much each signal counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub kv: f64,
    pub queue: f64,
    pub prefix: f64,
}

impl Default for Weights {
    fn default() -> Weights {
        Weights {
            kv: 2.0,
            queue: 2.0,
            prefix: 3.0,
        }
    }
}

/// What the last scrape of a replica said, and this gateway's counter of tokens sent to it at
/// that moment (to correct the scrape by what was sent since).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scraped {
    pub at: Instant,
    pub kv_usage: f64,
    pub waiting: f64,
    pub tokens_sent_then: u64,
}

/// A replica's load as this gateway knows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSample {
    pub scraped: Option<Scraped>,
    pub in_flight_requests: usize,
    pub in_flight_tokens: usize,
    pub tokens_sent: u64,
    pub capacity_tokens: usize,
}

impl LoadSample {
    /// `(kv usage, queue length)` at `now`.
    pub fn estimate(&self, now: Instant) -> (f64, f64) {
        let capacity = self.capacity_tokens.max(1) as f64;
        let fresh = self
            .scraped
            .filter(|scrape| now.saturating_duration_since(scrape.at) <= STALE_AFTER);
        match fresh {
            Some(scrape) => {
                let sent_since = self.tokens_sent.saturating_sub(scrape.tokens_sent_then);
                (
                    scrape.kv_usage + sent_since as f64 / capacity,
                    scrape.waiting + self.in_flight_requests as f64,
                )
            }
            None => (
                self.in_flight_tokens as f64 / capacity,
                self.in_flight_requests as f64,
            ),
        }
    }
}

/// One routable replica's signals.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub kv_usage: f64,
    pub queue: f64,
    /// Matched prefix blocks ÷ the prompt's blocks (0 when the prompt has none).
    pub prefix: f64,
}

/// The index of the best candidate, `None` when there are none. `rotation` (any counter)
/// breaks ties round-robin.
pub fn pick(candidates: &[Candidate], weights: Weights, rotation: usize) -> Option<usize> {
    let n = candidates.len();
    if n == 0 {
        return None;
    }
    let (min_q, max_q) = candidates.iter().fold((f64::MAX, f64::MIN), |(lo, hi), c| {
        (lo.min(c.queue), hi.max(c.queue))
    });
    let imbalanced = max_q - min_q > IMBALANCE_ABS && max_q > IMBALANCE_REL * min_q;
    let score = |c: &Candidate| {
        let kv = 1.0 - c.kv_usage.clamp(0.0, 1.0);
        let queue = if max_q > min_q {
            (max_q - c.queue) / (max_q - min_q)
        } else {
            1.0
        };
        let prefix = if imbalanced || c.kv_usage >= SATURATED_KV {
            0.0
        } else {
            c.prefix.clamp(0.0, 1.0)
        };
        weights.kv * kv + weights.queue * queue + weights.prefix * prefix
    };
    let mut best: Option<(usize, f64)> = None;
    for step in 0..n {
        let index = (rotation + step) % n;
        let value = score(&candidates[index]);
        // A small epsilon so float noise does not defeat the round-robin on ties.
        if best.is_none_or(|(_, top)| value > top + 1e-9) {
            best = Some((index, value));
        }
    }
    best.map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle() -> Candidate {
        Candidate {
            kv_usage: 0.1,
            queue: 0.0,
            prefix: 0.0,
        }
    }

    #[test]
    fn high_kv_usage_sends_work_to_the_other_replica() {
        let busy = Candidate {
            kv_usage: 0.85,
            ..idle()
        };
        for rotation in 0..4 {
            assert_eq!(pick(&[busy, idle()], Weights::default(), rotation), Some(1));
        }
    }

    #[test]
    fn the_shorter_queue_wins_when_kv_is_equal() {
        let queued = Candidate {
            queue: 3.0,
            ..idle()
        };
        assert_eq!(pick(&[queued, idle()], Weights::default(), 0), Some(1));
        assert_eq!(pick(&[idle(), queued], Weights::default(), 1), Some(0));
    }

    #[test]
    fn ties_go_round_robin() {
        let picks: Vec<_> = (0..4)
            .map(|rotation| pick(&[idle(), idle()], Weights::default(), rotation))
            .collect();
        assert_eq!(picks, [Some(0), Some(1), Some(0), Some(1)]);
        assert_eq!(pick(&[], Weights::default(), 0), None);
    }

    #[test]
    fn affinity_wins_under_the_load_guard() {
        // The replica holding the prefix is somewhat busier but not saturated: affinity wins.
        let warm = Candidate {
            kv_usage: 0.5,
            queue: 2.0,
            prefix: 1.0,
        };
        assert_eq!(pick(&[idle(), warm], Weights::default(), 0), Some(1));
    }

    #[test]
    fn affinity_never_wins_over_saturation() {
        let saturated = Candidate {
            kv_usage: SATURATED_KV,
            queue: 1.0,
            prefix: 1.0,
        };
        assert_eq!(pick(&[saturated, idle()], Weights::default(), 0), Some(1));
        // Imbalanced queues switch affinity off for everyone: the least loaded wins.
        let hot = Candidate {
            kv_usage: 0.3,
            queue: 9.0,
            prefix: 1.0,
        };
        let cool = Candidate {
            kv_usage: 0.3,
            queue: 2.0,
            prefix: 0.0,
        };
        assert_eq!(pick(&[hot, cool], Weights::default(), 0), Some(1));
        // Slightly longer queue (not imbalanced): affinity still wins.
        let hot = Candidate { queue: 4.0, ..hot };
        assert_eq!(pick(&[hot, cool], Weights::default(), 0), Some(0));
    }

    #[test]
    fn scrapes_are_corrected_by_what_was_sent_since_and_stale_ones_ignored() {
        let start = Instant::now();
        let sample = LoadSample {
            scraped: Some(Scraped {
                at: start,
                kv_usage: 0.5,
                waiting: 3.0,
                tokens_sent_then: 100,
            }),
            in_flight_requests: 2,
            in_flight_tokens: 400,
            tokens_sent: 300,
            capacity_tokens: 1000,
        };
        let (kv, queue) = sample.estimate(start + Duration::from_millis(100));
        assert!(
            (kv - 0.7).abs() < 1e-9,
            "0.5 scraped + 200 sent since / 1000: {kv}"
        );
        assert_eq!(queue, 5.0, "3 waiting there + 2 in flight from here");
        let (kv, queue) = sample.estimate(start + STALE_AFTER + Duration::from_millis(1));
        assert!((kv - 0.4).abs() < 1e-9, "stale: 400 in flight / 1000: {kv}");
        assert_eq!(queue, 2.0);
        let unscraped = LoadSample {
            scraped: None,
            ..sample
        };
        assert_eq!(unscraped.estimate(start).0, 0.4);
    }
}
