//! Turns one logits row into one token: greedy, or temperature / top-k / top-p sampling driven
//! by the sequence's own seeded RNG, so the same seed and prompt give the same tokens no matter
//! what else is in the batch.
//!
//! The [`Sampler`] keeps its candidate buffer between calls, so sampling does not allocate once
//! the buffer has grown to the vocabulary size. NaN logits are treated as impossible tokens.

use std::cmp::Ordering;

use rand::Rng;

use crate::sequence::SamplingParams;

/// Reusable scratch space for sampling.
#[derive(Debug, Default)]
pub struct Sampler {
    /// (token id, scaled logit), turned in place into (token id, unnormalised probability).
    candidates: Vec<(u32, f32)>,
}

/// Index of the largest logit; ties go to the lowest id; NaN never wins. 0 for an empty row.
///
/// Two passes, the first eight lanes wide so that it compiles to vector max instructions
/// (greedy decoding runs this over the whole vocabulary for every sequence of every step).
pub fn argmax(logits: &[f32]) -> u32 {
    // `if v > m { v } else { m }` skips NaN (every comparison with NaN is false).
    let keep_larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = logits.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = keep_larger(*lane, v);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| keep_larger(m, v));
    // The first id holding the maximum; none when every logit is NaN.
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Descending by logit, then ascending by id, so the order never depends on the input order.
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    pub fn new() -> Sampler {
        Sampler::default()
    }

    /// Picks the next token from `logits`. Temperature ≤ 0 (or not finite) means greedy.
    pub fn sample<R: Rng + ?Sized>(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        rng: &mut R,
    ) -> u32 {
        let greedy = !(params.temperature.is_finite() && params.temperature > 0.0);
        if greedy || params.top_k == 1 {
            return argmax(logits);
        }
        let inv_temperature = 1.0 / params.temperature;
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
                .map(|(id, &l)| (id as u32, l * inv_temperature)),
        );
        if self.candidates.is_empty() {
            return argmax(logits);
        }
        if params.top_k > 0 && params.top_k < self.candidates.len() {
            self.candidates
                .select_nth_unstable_by(params.top_k - 1, best_first);
            self.candidates.truncate(params.top_k);
        }
        let use_top_p = params.top_p > 0.0 && params.top_p < 1.0;
        if use_top_p {
            self.candidates.sort_unstable_by(best_first);
        }
        let max = self
            .candidates
            .iter()
            .map(|c| c.1)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f64;
        for candidate in &mut self.candidates {
            // exp(l - max) is in (0, 1]; an infinite max makes every finite weight 0 and itself 1.
            let weight = if candidate.1 == max {
                1.0
            } else {
                (candidate.1 - max).exp()
            };
            candidate.1 = weight;
            total += f64::from(weight);
        }
        if use_top_p {
            let target = total * f64::from(params.top_p);
            let mut cumulative = 0.0f64;
            let mut keep = self.candidates.len();
            for (i, candidate) in self.candidates.iter().enumerate() {
                cumulative += f64::from(candidate.1);
                if cumulative >= target {
                    keep = i + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
            total = cumulative.min(total);
        }
        let mut threshold = rng.random::<f64>() * total;
        for &(id, weight) in &self.candidates {
            threshold -= f64::from(weight);
            if threshold < 0.0 {
                return id;
            }
        }
        // Rounding left a sliver past the end: the last candidate owns it.
        self.candidates.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            seed,
        }
    }

    fn draw(logits: &[f32], p: SamplingParams, n: usize) -> Vec<u32> {
        let mut sampler = Sampler::new();
        let mut rng = StdRng::seed_from_u64(p.seed);
        (0..n)
            .map(|_| sampler.sample(logits, &p, &mut rng))
            .collect()
    }

    #[test]
    fn argmax_prefers_lowest_id_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN; 3]), 0);
        // Longer than one 8-lane chunk, maximum in the remainder, ties across lanes.
        let mut row: Vec<f32> = (0..37).map(|i| (i % 7) as f32).collect();
        assert_eq!(argmax(&row), 6);
        row[35] = 9.0;
        row[36] = f32::NAN;
        assert_eq!(argmax(&row), 35);
        row[3] = 9.0;
        assert_eq!(argmax(&row), 3);
    }

    #[test]
    fn temperature_zero_is_greedy() {
        let logits = [0.1, 5.0, 4.9, -2.0];
        assert_eq!(draw(&logits, params(0.0, 0, 1.0, 7), 20), vec![1; 20]);
        assert_eq!(draw(&logits, params(f32::NAN, 0, 1.0, 7), 3), vec![1; 3]);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let a = draw(&logits, params(1.0, 0, 1.0, 42), 64);
        assert_eq!(a, draw(&logits, params(1.0, 0, 1.0, 42), 64));
        assert_ne!(a, draw(&logits, params(1.0, 0, 1.0, 43), 64));
    }

    #[test]
    fn top_k_limits_the_candidates() {
        let logits = [0.0, 1.0, 2.0, 3.0, 2.5];
        let tokens = draw(&logits, params(5.0, 2, 1.0, 1), 200);
        assert!(tokens.iter().all(|&t| t == 3 || t == 4), "{tokens:?}");
        assert!(tokens.contains(&3) && tokens.contains(&4));
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // Probabilities ≈ [0.6, 0.3, 0.1] (log-space): top_p 0.8 keeps ids 0 and 1.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let tokens = draw(&logits, params(1.0, 0, 0.8, 3), 300);
        assert!(tokens.iter().all(|&t| t < 2), "{tokens:?}");
        assert!(tokens.contains(&1));
        // A tiny top_p keeps only the best token.
        assert_eq!(draw(&logits, params(1.0, 0, 0.01, 3), 20), vec![0; 20]);
    }

    #[test]
    fn impossible_tokens_are_never_drawn() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0];
        let tokens = draw(&logits, params(1.0, 0, 1.0, 9), 200);
        assert!(tokens.iter().all(|&t| t == 1 || t == 3));
    }

    #[test]
    fn sampling_follows_the_distribution_roughly() {
        // p(1) = e/(1+e) ≈ 0.73; 2000 draws stay well within ±0.06 of it for any sane RNG.
        let logits = [0.0, 1.0];
        let ones = draw(&logits, params(1.0, 0, 1.0, 11), 2000)
            .iter()
            .filter(|&&t| t == 1)
            .count();
        let share = ones as f64 / 2000.0;
        assert!((share - 0.731).abs() < 0.06, "share {share}");
    }
}
