//! Checks one [`BatchInputs`] against the seam's contract and derives what the forward pass
//! needs per token (which sequence it belongs to) and which rows get logits.
//!
//! The backend trusts nothing it is handed: a slot outside the cache or a slot that disagrees
//! with the block table would silently corrupt another sequence's KV, so each is rejected with
//! a message naming the sequence and token.

use crate::backend::{BackendError, BatchInputs};

/// Per-step facts derived from the inputs; buffers are reused across steps.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Index into `inputs.seqs` of each token.
    pub token_seq: Vec<usize>,
    /// Token rows whose logits are returned, in seq order.
    pub logit_rows: Vec<usize>,
}

/// Limits the inputs are checked against.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub max_tokens: usize,
    pub vocab_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

fn invalid(msg: String) -> BackendError {
    BackendError::InvalidInputs(msg)
}

impl StepPlan {
    /// Validates `inputs` and fills the plan.
    pub fn build(&mut self, inputs: &BatchInputs, limits: StepLimits) -> Result<(), BackendError> {
        self.token_seq.clear();
        self.logit_rows.clear();
        let n = inputs.token_ids.len();
        if inputs.positions.len() != n || inputs.slot_mapping.len() != n {
            return Err(invalid(format!(
                "ragged arrays: {n} token ids, {} positions, {} slots",
                inputs.positions.len(),
                inputs.slot_mapping.len()
            )));
        }
        if n > limits.max_tokens {
            return Err(invalid(format!(
                "{n} tokens in one step exceed the backend's max_batched_tokens {}",
                limits.max_tokens
            )));
        }
        if let Some(bad) = inputs
            .token_ids
            .iter()
            .find(|&&t| t as usize >= limits.vocab_size)
        {
            return Err(invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                limits.vocab_size
            )));
        }
        for (index, seq) in inputs.seqs.iter().enumerate() {
            if seq.token_start != self.token_seq.len() || seq.num_tokens == 0 {
                return Err(invalid(format!(
                    "seq {index}: tokens {}..+{} do not follow the previous sequence back to back",
                    seq.token_start, seq.num_tokens
                )));
            }
            let end = seq.token_start + seq.num_tokens;
            if end > n {
                return Err(invalid(format!(
                    "seq {index}: tokens end at {end}, step has {n}"
                )));
            }
            check_seq(inputs, index, limits)?;
            self.token_seq.resize(end, index);
            if seq.needs_logits {
                self.logit_rows.push(end - 1);
            }
        }
        if self.token_seq.len() != n {
            return Err(invalid(format!(
                "sequences cover {} of the step's {n} tokens",
                self.token_seq.len()
            )));
        }
        Ok(())
    }
}

/// Block table covers the context, block ids are in the cache, and every token's position and
/// slot agree with the block table.
fn check_seq(inputs: &BatchInputs, index: usize, limits: StepLimits) -> Result<(), BackendError> {
    let seq = &inputs.seqs[index];
    let bs = limits.block_size;
    if seq.context_len < seq.num_tokens {
        return Err(invalid(format!(
            "seq {index}: context_len {} is shorter than its {} new tokens",
            seq.context_len, seq.num_tokens
        )));
    }
    let blocks_needed = seq.context_len.div_ceil(bs);
    if seq.block_table.len() < blocks_needed {
        return Err(invalid(format!(
            "seq {index}: block table has {} blocks, context of {} tokens needs {blocks_needed}",
            seq.block_table.len(),
            seq.context_len
        )));
    }
    if let Some(bad) = seq.block_table[..blocks_needed]
        .iter()
        .find(|&&b| b as usize >= limits.num_blocks)
    {
        return Err(invalid(format!(
            "seq {index}: block id {bad} is outside the cache of {} blocks",
            limits.num_blocks
        )));
    }
    let first_pos = seq.context_len - seq.num_tokens;
    for i in 0..seq.num_tokens {
        let t = seq.token_start + i;
        let pos = first_pos + i;
        if inputs.positions[t] as usize != pos {
            return Err(invalid(format!(
                "seq {index}: token {t} has position {}, expected {pos} (context_len {})",
                inputs.positions[t], seq.context_len
            )));
        }
        let slot = seq.block_table[pos / bs] as usize * bs + pos % bs;
        if inputs.slot_mapping[t] as usize != slot {
            return Err(invalid(format!(
                "seq {index}: token {t} maps to slot {}, but its block table puts position {pos} in slot {slot}",
                inputs.slot_mapping[t]
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqInputs;

    const LIMITS: StepLimits = StepLimits {
        max_tokens: 64,
        vocab_size: 100,
        num_blocks: 8,
        block_size: 4,
    };

    /// One prefill of 5 tokens (blocks 3, 1) and one decode at position 6 (blocks 0, 2).
    fn batch() -> BatchInputs {
        BatchInputs {
            token_ids: vec![1, 2, 3, 4, 5, 9],
            positions: vec![0, 1, 2, 3, 4, 6],
            slot_mapping: vec![12, 13, 14, 15, 4, 10],
            seqs: vec![
                SeqInputs {
                    token_start: 0,
                    num_tokens: 5,
                    context_len: 5,
                    block_table: vec![3, 1],
                    needs_logits: true,
                    prompt_len: 0,
                },
                SeqInputs {
                    token_start: 5,
                    num_tokens: 1,
                    context_len: 7,
                    block_table: vec![0, 2],
                    needs_logits: true,
                    prompt_len: 0,
                },
            ],
        }
    }

    #[test]
    fn valid_batch_yields_token_owners_and_logit_rows() {
        let mut plan = StepPlan::default();
        plan.build(&batch(), LIMITS).expect("valid batch");
        assert_eq!(plan.token_seq, vec![0, 0, 0, 0, 0, 1]);
        assert_eq!(plan.logit_rows, vec![4, 5]);
    }

    #[test]
    fn each_contract_violation_is_rejected() {
        type Corruption = (&'static str, fn(&mut BatchInputs));
        let cases: Vec<Corruption> = vec![
            ("ragged", |b| {
                b.positions.pop();
            }),
            ("vocab", |b| b.token_ids[0] = 100),
            ("slot", |b| b.slot_mapping[4] = 5),
            ("position", |b| b.positions[5] = 5),
            ("block id", |b| b.seqs[1].block_table[1] = 8),
            ("short table", |b| b.seqs[1].block_table.truncate(1)),
            ("gap", |b| b.seqs[1].token_start = 6),
            ("uncovered", |b| {
                b.seqs.pop();
            }),
            ("context", |b| b.seqs[0].context_len = 4),
        ];
        for (name, corrupt) in cases {
            let mut b = batch();
            corrupt(&mut b);
            let mut plan = StepPlan::default();
            assert!(plan.build(&b, LIMITS).is_err(), "{name} accepted");
        }
        let mut plan = StepPlan::default();
        let tight = StepLimits {
            max_tokens: 5,
            ..LIMITS
        };
        assert!(plan.build(&batch(), tight).is_err(), "over budget accepted");
    }
}
