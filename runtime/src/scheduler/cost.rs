//! What a step costs, learned from the steps the engine has run.
//!
//! A step's wall time is modelled as `c0 + cp·prefill_tokens + cd·decode_seqs + ca·attended`,
//! where `attended` counts, over every token computed, the context that token attends to. The
//! same four terms describe a CPU (weights read once per step, matmul work per token, attention
//! per cached token) and a GPU (launch overhead, the same), only the coefficients differ, so
//! they are not configured: the engine feeds every measured step to [`StepCostModel::observe`],
//! which refits them by exponentially weighted least squares (recent steps count most, so the
//! model follows a machine that gets busier). A weak prior keeps the fit defined before the
//! first steps and when one kind of work has not been seen for a while (all coefficients are
//! pulled towards it, relative to its size).
//!
//! The scheduler asks [`StepCostModel::prefill_cap`] how many prompt tokens it may add to a step
//! that already carries its decodes without the predicted time exceeding the target.

use std::time::Duration;

/// The work of one step, in the units the cost model prices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Prompt tokens computed (prefill chunks, and recomputation after a preemption).
    pub prefill_tokens: usize,
    /// Sequences computing their one next token.
    pub decode_seqs: usize,
    /// Σ over computed tokens of the context each attends to (its position + 1).
    pub attended_tokens: u64,
}

impl StepShape {
    /// A prefill chunk of `n` tokens starting at position `start`.
    pub fn add_prefill(&mut self, start: usize, n: usize) {
        self.prefill_tokens += n;
        self.attended_tokens += attended_by_chunk(start, n);
    }

    /// One decode token at position `start`.
    pub fn add_decode(&mut self, start: usize) {
        self.decode_seqs += 1;
        self.attended_tokens += start as u64 + 1;
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

/// Context attended by the tokens `start..start + n`: Σ (position + 1).
pub fn attended_by_chunk(start: usize, n: usize) -> u64 {
    let (start, n) = (start as u64, n as u64);
    n * start + n * (n + 1) / 2
}

/// Features are scaled to be of order 1 in a typical step, so that one prior weight suits all
/// of them and the normal equations stay well conditioned.
const PREFILL_UNIT: f64 = 100.0;
const DECODE_UNIT: f64 = 10.0;
const ATTENDED_UNIT: f64 = 10_000.0;
const TERMS: usize = 4;

/// Milliseconds per unit before any measurement: a small CPU (5 ms per step, 1 ms per prompt
/// token, 2 ms per decoding sequence, 0.5 µs per attended token). The first measured steps
/// override it.
const PRIOR_MS: [f64; TERMS] = [5.0, 100.0, 20.0, 5.0];
/// Strength of the prior. It is relative: moving a coefficient away from its prior by the
/// prior's own size costs as much as 1 ms² of squared error in one step, so a term the recent
/// steps do not exercise stays near its prior, while the terms they do are fitted freely
/// whatever the machine's scale.
const PRIOR_WEIGHT: f64 = 1.0;
/// Each older observation counts this much less than the next: an effective memory of ~50 steps.
const FORGET: f64 = 0.98;
/// Once the model has seen this many steps, a step measured at more than [`OUTLIER_RATIO`] × the
/// prediction (the process was descheduled, a page fault storm) is recorded as that bound, so
/// one hiccup does not shrink the prefill cap for the next fifty steps. A lasting slowdown still
/// moves the model: each clipped step raises the prediction.
const WARM_STEPS: u64 = 20;
const OUTLIER_RATIO: f64 = 3.0;

/// Exponentially weighted least squares over the four step terms.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCostModel {
    /// Σ λ^age · x xᵀ and Σ λ^age · x y over observed steps (x scaled, y in ms).
    xtx: [[f64; TERMS]; TERMS],
    xty: [f64; TERMS],
    /// Current fit, ms per unit, every entry ≥ 0.
    coef: [f64; TERMS],
    observed: u64,
}

impl Default for StepCostModel {
    fn default() -> Self {
        StepCostModel {
            xtx: [[0.0; TERMS]; TERMS],
            xty: [0.0; TERMS],
            coef: PRIOR_MS,
            observed: 0,
        }
    }
}

/// The fitted coefficients in natural units, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepCost {
    pub per_step_us: f64,
    pub per_prefill_token_us: f64,
    pub per_decode_seq_us: f64,
    pub per_attended_token_ns: f64,
}

impl StepCost {
    /// Predicted wall time of a step of this shape under these coefficients (how admission
    /// prices queued work with the engine's published fit).
    pub fn predict(&self, shape: &StepShape) -> Duration {
        StepCostModel::with_cost(*self).predict(shape)
    }
}

impl StepCostModel {
    /// A model whose fit is `cost` until steps are observed (tests, and callers that know their
    /// machine).
    pub fn with_cost(cost: StepCost) -> StepCostModel {
        StepCostModel {
            coef: [
                cost.per_step_us / 1e3,
                cost.per_prefill_token_us / 1e3 * PREFILL_UNIT,
                cost.per_decode_seq_us / 1e3 * DECODE_UNIT,
                cost.per_attended_token_ns / 1e6 * ATTENDED_UNIT,
            ],
            ..StepCostModel::default()
        }
    }

    fn features(shape: &StepShape) -> [f64; TERMS] {
        [
            1.0,
            shape.prefill_tokens as f64 / PREFILL_UNIT,
            shape.decode_seqs as f64 / DECODE_UNIT,
            shape.attended_tokens as f64 / ATTENDED_UNIT,
        ]
    }

    /// Predicted wall time of a step of this shape.
    pub fn predict(&self, shape: &StepShape) -> Duration {
        Duration::from_secs_f64(self.predict_ms(shape) / 1e3)
    }

    fn predict_ms(&self, shape: &StepShape) -> f64 {
        let x = Self::features(shape);
        let ms: f64 = x.iter().zip(&self.coef).map(|(x, c)| x * c).sum();
        ms.max(0.0)
    }

    /// The coefficients in natural units.
    pub fn cost(&self) -> StepCost {
        StepCost {
            per_step_us: self.coef[0] * 1e3,
            per_prefill_token_us: self.coef[1] * 1e3 / PREFILL_UNIT,
            per_decode_seq_us: self.coef[2] * 1e3 / DECODE_UNIT,
            per_attended_token_ns: self.coef[3] * 1e6 / ATTENDED_UNIT,
        }
    }

    /// Steps observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Adds one measured step and refits.
    pub fn observe(&mut self, shape: &StepShape, elapsed: Duration) {
        if shape.is_empty() {
            return;
        }
        let x = Self::features(shape);
        let mut y = elapsed.as_secs_f64() * 1e3;
        if self.observed >= WARM_STEPS {
            let bound = self.predict_ms(shape) * OUTLIER_RATIO;
            if bound > 0.0 {
                y = y.min(bound);
            }
        }
        for i in 0..TERMS {
            for j in 0..TERMS {
                self.xtx[i][j] = FORGET * self.xtx[i][j] + x[i] * x[j];
            }
            self.xty[i] = FORGET * self.xty[i] + x[i] * y;
        }
        self.observed += 1;
        self.refit();
    }

    /// Ridge regression towards the prior, with coefficients kept non-negative: a term whose
    /// fit comes out negative (collinear features, noise) is pinned at 0 and the others refit,
    /// so no term can make larger steps look cheaper.
    fn refit(&mut self) {
        let mut free = [true; TERMS];
        for _ in 0..TERMS {
            let Some(coef) = self.solve(&free) else {
                return;
            };
            let negative: Vec<usize> = (0..TERMS).filter(|&i| free[i] && coef[i] < 0.0).collect();
            if negative.is_empty() {
                self.coef = coef;
                return;
            }
            for i in negative {
                free[i] = false;
            }
        }
    }

    /// Solves (XᵀX + W) θ = Xᵀy + W θ₀ with W = diag(w / θ₀²) over the free terms (the others
    /// are 0) by Gaussian elimination; the system is symmetric positive definite thanks to the
    /// prior.
    fn solve(&self, free: &[bool; TERMS]) -> Option<[f64; TERMS]> {
        let idx: Vec<usize> = (0..TERMS).filter(|&i| free[i]).collect();
        let n = idx.len();
        let mut a = vec![vec![0.0; n + 1]; n];
        for (r, &i) in idx.iter().enumerate() {
            for (c, &j) in idx.iter().enumerate() {
                let prior = PRIOR_WEIGHT / (PRIOR_MS[i] * PRIOR_MS[i]);
                a[r][c] = self.xtx[i][j] + if i == j { prior } else { 0.0 };
            }
            a[r][n] = self.xty[i] + PRIOR_WEIGHT / PRIOR_MS[i];
        }
        for col in 0..n {
            let pivot = (col..n).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
            a.swap(col, pivot);
            let p = a[col][col];
            if p.abs() < 1e-12 || !p.is_finite() {
                return None;
            }
            let pivot_row = a[col].clone();
            for (r, row) in a.iter_mut().enumerate() {
                if r != col {
                    let f = row[col] / p;
                    for (x, &y) in row.iter_mut().zip(&pivot_row).skip(col) {
                        *x -= f * y;
                    }
                }
            }
        }
        let mut coef = [0.0; TERMS];
        for (r, &i) in idx.iter().enumerate() {
            coef[i] = a[r][n] / a[r][r];
        }
        coef.iter().all(|c| c.is_finite()).then_some(coef)
    }

    /// Most prompt tokens a step that already carries `decodes` may add while its predicted
    /// time stays within `target`, each prompt token attending to about `context_per_token`
    /// tokens. Never below `floor` (prefill must progress even when the decodes alone take
    /// longer than the target) nor above `full`.
    pub fn prefill_cap(
        &self,
        target: Duration,
        decodes: &StepShape,
        context_per_token: f64,
        floor: usize,
        full: usize,
    ) -> usize {
        let fixed = self.predict_ms(decodes);
        let per_token =
            self.coef[1] / PREFILL_UNIT + self.coef[3] * context_per_token.max(1.0) / ATTENDED_UNIT;
        let room = target.as_secs_f64() * 1e3 - fixed;
        let cap = if per_token <= 0.0 {
            full
        } else if room <= 0.0 {
            0
        } else {
            (room / per_token).min(full as f64) as usize
        };
        cap.clamp(floor.min(full), full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prefill: usize, decodes: usize, context: usize) -> StepShape {
        let mut s = StepShape::default();
        if prefill > 0 {
            s.add_prefill(context, prefill);
        }
        for _ in 0..decodes {
            s.add_decode(context);
        }
        s
    }

    /// A machine: 4 ms per step, 0.8 ms per prompt token, 1.5 ms per decode, 50 ns per
    /// attended token.
    fn true_ms(s: &StepShape) -> f64 {
        4.0 + 0.8 * s.prefill_tokens as f64
            + 1.5 * s.decode_seqs as f64
            + 50e-6 * s.attended_tokens as f64
    }

    #[test]
    fn attended_counts_each_tokens_context() {
        assert_eq!(attended_by_chunk(0, 3), 1 + 2 + 3);
        assert_eq!(attended_by_chunk(10, 2), 11 + 12);
        let mut s = StepShape::default();
        s.add_decode(99);
        assert_eq!((s.decode_seqs, s.attended_tokens), (1, 100));
    }

    #[test]
    fn learns_the_coefficients_of_a_linear_machine() {
        let mut model = StepCostModel::default();
        for i in 0..300usize {
            let s = shape((i * 37) % 300, (i * 7) % 17, (i * 53) % 900);
            model.observe(&s, Duration::from_secs_f64(true_ms(&s) / 1e3));
        }
        let cost = model.cost();
        assert!((cost.per_step_us - 4000.0).abs() < 100.0, "{cost:?}");
        assert!((cost.per_prefill_token_us - 800.0).abs() < 10.0, "{cost:?}");
        assert!((cost.per_decode_seq_us - 1500.0).abs() < 50.0, "{cost:?}");
        assert!((cost.per_attended_token_ns - 50.0).abs() < 5.0, "{cost:?}");
        let probe = shape(128, 8, 300);
        let predicted = model.predict(&probe).as_secs_f64() * 1e3;
        assert!((predicted - true_ms(&probe)).abs() < 1.0, "{predicted}");
    }

    #[test]
    fn follows_a_machine_that_slows_down() {
        let mut model = StepCostModel::default();
        let feed = |model: &mut StepCostModel, scale: f64| {
            for i in 0..200usize {
                let s = shape((i * 37) % 300, (i * 7) % 17, (i * 53) % 900);
                model.observe(&s, Duration::from_secs_f64(scale * true_ms(&s) / 1e3));
            }
        };
        feed(&mut model, 1.0);
        let before = model.cost().per_prefill_token_us;
        feed(&mut model, 2.0);
        let after = model.cost().per_prefill_token_us;
        assert!((after / before - 2.0).abs() < 0.1, "{before} → {after}");
    }

    #[test]
    fn an_isolated_hiccup_is_clipped() {
        let mut model = StepCostModel::default();
        for i in 0..100usize {
            let s = shape((i * 37) % 300, (i * 7) % 17, 100);
            model.observe(&s, Duration::from_secs_f64(true_ms(&s) / 1e3));
        }
        let probe = shape(100, 4, 100);
        let before = model.predict(&probe);
        model.observe(&probe, Duration::from_secs(5));
        let after = model.predict(&probe);
        assert!(after < before * 4, "{before:?} → {after:?}");
    }

    #[test]
    fn coefficients_stay_non_negative_on_collinear_noise() {
        let mut model = StepCostModel::default();
        // Prefill and decodes always move together, and time falls with both: a fit without
        // the constraint makes one of them negative.
        for i in 0..100usize {
            let k = i % 10;
            let s = shape(k * 10, k, 50);
            let ms = 40.0 - k as f64;
            model.observe(&s, Duration::from_secs_f64(ms / 1e3));
        }
        let c = model.cost();
        for v in [
            c.per_step_us,
            c.per_prefill_token_us,
            c.per_decode_seq_us,
            c.per_attended_token_ns,
        ] {
            assert!(v >= 0.0, "{c:?}");
        }
    }

    #[test]
    fn prefill_cap_is_what_fits_the_target() {
        let model = StepCostModel::with_cost(StepCost {
            per_step_us: 5000.0,
            per_prefill_token_us: 1000.0,
            per_decode_seq_us: 2000.0,
            per_attended_token_ns: 0.0,
        });
        let decodes = shape(0, 10, 100);
        // 5 ms + 10 × 2 ms = 25 ms of decodes; 75 ms of room at 1 ms per prompt token.
        let target = Duration::from_millis(100);
        assert_eq!(model.prefill_cap(target, &decodes, 100.0, 16, 512), 75);
        // A looser target: more tokens, up to the full budget.
        assert_eq!(
            model.prefill_cap(Duration::from_millis(300), &decodes, 100.0, 16, 512),
            275
        );
        assert_eq!(
            model.prefill_cap(Duration::from_secs(2), &decodes, 100.0, 16, 512),
            512
        );
        // Decodes alone over the target: prefill still gets the floor.
        assert_eq!(
            model.prefill_cap(Duration::from_millis(20), &decodes, 100.0, 16, 512),
            16
        );
        // Attention makes each prompt token dearer the deeper its context.
        let attentive = StepCostModel::with_cost(StepCost {
            per_attended_token_ns: 1000.0,
            ..model.cost()
        });
        let deep = attentive.prefill_cap(target, &decodes, 1000.0, 16, 512);
        let shallow = attentive.prefill_cap(target, &decodes, 10.0, 16, 512);
        assert!(deep < shallow, "{deep} vs {shallow}");
    }
}
