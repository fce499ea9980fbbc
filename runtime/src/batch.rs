//! Lowers a [`ScheduledBatch`] (which sequences, how many tokens each) into the flat arrays a
//! backend consumes: token ids, positions, KV slot mapping and per-sequence block tables.
//!
//! This is the only place where block tables become slot numbers:
//! `slot = block_table[pos / block_size] * block_size + pos % block_size`. The [`BatchInputs`]
//! it fills is kept by the engine and reused every step, including each sequence's block-table
//! vector, so steady-state decoding does not allocate here.

use crate::backend::{BatchInputs, SeqInputs};
use crate::kv_math::blocks_for_tokens;
use crate::scheduler::ScheduledBatch;
use crate::sequence::{SeqId, Sequence};

/// A scheduled chunk the sequence's blocks do not cover: a scheduler bug, reported instead of
/// handing the backend an out-of-range slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "scheduled chunk of {seq} ends at token {end} but its {blocks} blocks or {len} tokens do not cover it"
)]
pub struct UncoveredChunk {
    pub seq: SeqId,
    pub end: usize,
    pub blocks: usize,
    pub len: usize,
}

/// The KV slot of position `pos` of a sequence whose blocks are `block_table` (which must
/// cover it).
pub fn slot_of(block_table: &[u32], pos: usize, block_size: usize) -> u32 {
    let block = block_table[pos / block_size] as usize;
    (block * block_size + pos % block_size) as u32
}

/// Fills `inputs` for `batch`. `running` is the scheduler's running list the batch indexes into.
pub fn build_inputs(
    batch: &ScheduledBatch,
    running: &[Sequence],
    block_size: usize,
    inputs: &mut BatchInputs,
) -> Result<(), UncoveredChunk> {
    inputs.token_ids.clear();
    inputs.positions.clear();
    inputs.slot_mapping.clear();
    let mut used_seqs = 0;
    for entry in &batch.seqs {
        let Some(seq) = running.get(entry.index) else {
            continue;
        };
        let end = entry.start + entry.num_tokens;
        let table_len = blocks_for_tokens(end, block_size);
        if end > seq.len() || table_len > seq.block_table.len() {
            inputs.seqs.truncate(used_seqs);
            return Err(UncoveredChunk {
                seq: seq.id,
                end,
                blocks: seq.block_table.len(),
                len: seq.len(),
            });
        }
        let token_start = inputs.token_ids.len();
        inputs
            .token_ids
            .extend_from_slice(&seq.token_ids[entry.start..end]);
        for pos in entry.start..end {
            inputs.positions.push(pos as u32);
            inputs
                .slot_mapping
                .push(slot_of(&seq.block_table, pos, block_size));
        }
        if used_seqs == inputs.seqs.len() {
            inputs.seqs.push(SeqInputs::default());
        }
        let out = &mut inputs.seqs[used_seqs];
        used_seqs += 1;
        out.token_start = token_start;
        out.num_tokens = entry.num_tokens;
        out.context_len = end;
        out.needs_logits = entry.needs_logits;
        out.prompt_len = seq.prompt_len;
        out.block_table.clear();
        out.block_table
            .extend_from_slice(&seq.block_table[..table_len]);
    }
    inputs.seqs.truncate(used_seqs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::block_pool::BlockPool;
    use crate::scheduler::ScheduledSeq;
    use crate::sequence::{SamplingParams, StopParams};

    fn running_seq(
        pool: &std::sync::Arc<BlockPool>,
        id: u64,
        tokens: Vec<u32>,
        blocks: Vec<u32>,
    ) -> Sequence {
        let (tx, _rx) = mpsc::channel(1);
        let mut seq = Sequence::new(
            SeqId(id),
            "t".into(),
            tokens,
            SamplingParams::default(),
            StopParams {
                max_tokens: 4,
                ..StopParams::default()
            },
            pool.empty_reservation(),
            tx,
        );
        seq.block_table = blocks;
        seq
    }

    #[test]
    fn prefill_chunk_and_decode_share_one_batch() {
        let pool = BlockPool::new(16, 4, 1);
        // Seq 0: 10-token prompt, second chunk (positions 4..10) over blocks [7, 2, 9].
        // Seq 1: decode of position 5 over blocks [3, 5].
        let a = running_seq(&pool, 1, (100..110).collect(), vec![7, 2, 9]);
        let b = running_seq(&pool, 2, vec![1, 2, 3, 4, 5, 6], vec![3, 5]);
        let batch = ScheduledBatch {
            seqs: vec![
                ScheduledSeq {
                    index: 0,
                    start: 4,
                    num_tokens: 6,
                    needs_logits: true,
                },
                ScheduledSeq {
                    index: 1,
                    start: 5,
                    num_tokens: 1,
                    needs_logits: true,
                },
            ],
            num_tokens: 7,
            num_preempted: 0,
            ..ScheduledBatch::default()
        };
        let mut inputs = BatchInputs::default();
        build_inputs(&batch, &[a, b], 4, &mut inputs).expect("covered");
        assert_eq!(inputs.token_ids, vec![104, 105, 106, 107, 108, 109, 6]);
        assert_eq!(inputs.positions, vec![4, 5, 6, 7, 8, 9, 5]);
        // pos 4..8 → block 2 (slots 8..12), pos 8,9 → block 9 (36, 37); pos 5 → block 5, slot 21.
        assert_eq!(inputs.slot_mapping, vec![8, 9, 10, 11, 36, 37, 21]);
        assert_eq!(
            inputs.seqs[0],
            SeqInputs {
                token_start: 0,
                num_tokens: 6,
                context_len: 10,
                block_table: vec![7, 2, 9],
                needs_logits: true,
                prompt_len: 10,
            }
        );
        assert_eq!(inputs.seqs[1].token_start, 6);
        assert_eq!(inputs.seqs[1].context_len, 6);
        assert_eq!(inputs.seqs[1].block_table, vec![3, 5]);
    }

    #[test]
    fn block_table_is_cut_to_the_context_and_buffers_are_reused() {
        let pool = BlockPool::new(16, 4, 1);
        let a = running_seq(&pool, 1, (0..12).collect(), vec![1, 2, 3]);
        let first = ScheduledBatch {
            seqs: vec![ScheduledSeq {
                index: 0,
                start: 0,
                num_tokens: 5,
                needs_logits: false,
            }],
            num_tokens: 5,
            num_preempted: 0,
            ..ScheduledBatch::default()
        };
        let mut inputs = BatchInputs::default();
        build_inputs(&first, std::slice::from_ref(&a), 4, &mut inputs).expect("covered");
        assert_eq!(inputs.seqs[0].block_table, vec![1, 2]);
        assert!(!inputs.seqs[0].needs_logits);
        // A chunk not covered by blocks is an error, not an out-of-range slot.
        let bad = ScheduledBatch {
            seqs: vec![ScheduledSeq {
                index: 0,
                start: 10,
                num_tokens: 4,
                needs_logits: true,
            }],
            num_tokens: 4,
            num_preempted: 0,
            ..ScheduledBatch::default()
        };
        let err = build_inputs(&bad, std::slice::from_ref(&a), 4, &mut inputs);
        assert_eq!(
            err,
            Err(UncoveredChunk {
                seq: SeqId(1),
                end: 14,
                blocks: 3,
                len: 12
            })
        );
    }
}
