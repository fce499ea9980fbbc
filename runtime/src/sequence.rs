//! One generation request as the engine tracks it: its tokens, how many of them are in the KV
//! cache, which blocks hold them, what it may still allocate, and how it should stop.
//!
//! The scheduler only reads and writes the integer fields (token ids, `num_computed_tokens`,
//! `block_table`, `credit`, `status`); the engine owns the rest (event channel, sampler RNG,
//! output text). The request-level parameter and event types live here too because a
//! `Sequence` carries them; `engine` re-exports them as its public API.

mod output_text;

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::mpsc;

use crate::block_pool::{BlockHash, BlockId, Reservation};
use crate::kv_math::blocks_for_tokens;

pub use output_text::{OutputText, TextDelta};

/// Engine-wide unique id of a sequence (one per submitted request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq-{}", self.0)
    }
}

/// How the next token is drawn from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Seed of this sequence's RNG: same seed and prompt, same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// When generation ends.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopParams {
    /// Generated tokens at most (finish reason "length").
    pub max_tokens: usize,
    /// Texts that end generation; the stop text and anything after it is not emitted.
    pub stop_strings: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// Why a sequence finished normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum FinishReason {
    /// End-of-generation token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI's spelling: "stop" / "length".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a sequence's stream carries, in order: `Token`s, then exactly one `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenEvent {
    /// One generated token and the UTF-8 text it completes (possibly empty: part of a character,
    /// a special token, or text held back because it may begin a stop string).
    Token {
        id: u32,
        text: String,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose K/V came from the prefix cache instead of being computed (at
        /// the sequence's first admission; OpenAI's `prompt_tokens_details.cached_tokens`).
        cached_tokens: usize,
    },
    Error(String),
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SeqStatus {
    /// Queued, never run.
    Waiting,
    /// Holds blocks and is being scheduled.
    Running,
    /// Was running, lost its blocks, waits to be recomputed.
    Preempted,
    /// Done (stopped, length, cancelled or failed); about to be removed.
    Finished,
}

/// One request inside the engine.
#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Who asked (tenant name): `/admin/kv` shows it, and the scheduler shares prompt tokens
    /// fairly between the tenants it names.
    pub label: Arc<str>,
    /// The tenant's fair-share weight (its policy `weight`): under contention for prompt
    /// tokens, tenants get them in proportion to it.
    pub weight: NonZeroU32,
    /// Scheduler step at which it was first queued; kept across preemptions, so a long prompt
    /// ages towards the front of its tenant's prefill order.
    pub arrival_step: u64,
    /// Prompt followed by the tokens generated so far.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache. The last sampled token is not, until the next step.
    pub num_computed_tokens: usize,
    /// Tokens the current step computes for this sequence (set by the scheduler, 0 if none).
    pub num_scheduled_tokens: usize,
    /// Blocks holding this sequence's KV, in position order.
    pub block_table: Vec<BlockId>,
    /// Capacity promised by the gateway; allocation draws on it before free blocks.
    pub credit: Reservation,
    /// The prefix-cache salt: only sequences with the same salt share cached blocks. `None`:
    /// this sequence neither reads nor fills the cache.
    pub cache_salt: Option<Arc<str>>,
    /// Hashes of the leading full blocks of `block_table` that are registered in (or were
    /// taken from) the prefix cache, in order; the chain the next full block extends.
    pub block_hashes: Vec<BlockHash>,
    /// Chained hashes of the leading full blocks of `token_ids` under `cache_salt`, whether
    /// cached or not, filled on demand by the scheduler's hold-back check and kept across
    /// preemptions (appending tokens never changes an earlier block's hash), so each block is
    /// hashed once per sequence.
    pub token_block_hashes: Vec<BlockHash>,
    /// Prompt tokens taken from the prefix cache at first admission.
    pub num_cached_tokens: usize,
    pub status: SeqStatus,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    pub events: mpsc::Sender<TokenEvent>,
    pub rng: StdRng,
    pub output: OutputText,
    pub num_preemptions: u32,
    /// `Finished` or `Error`, sent only after the sequence's blocks are back in the pool, so a
    /// client that sees the end of its stream can rely on the capacity being free again.
    pub final_event: Option<TokenEvent>,
    pub arrived_at: Instant,
    pub first_token_at: Option<Instant>,
}

impl Sequence {
    /// A waiting sequence. `credit` may be an empty reservation.
    pub fn new(
        id: SeqId,
        label: Arc<str>,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        credit: Reservation,
        events: mpsc::Sender<TokenEvent>,
    ) -> Sequence {
        let output = OutputText::new(&stop.stop_strings);
        Sequence {
            id,
            label,
            weight: NonZeroU32::MIN,
            arrival_step: 0,
            prompt_len: prompt.len(),
            token_ids: prompt,
            num_computed_tokens: 0,
            num_scheduled_tokens: 0,
            block_table: Vec::new(),
            credit,
            cache_salt: None,
            block_hashes: Vec::new(),
            token_block_hashes: Vec::new(),
            num_cached_tokens: 0,
            status: SeqStatus::Waiting,
            rng: StdRng::seed_from_u64(sampling.seed),
            sampling,
            stop,
            events,
            output,
            num_preemptions: 0,
            final_event: None,
            arrived_at: Instant::now(),
            first_token_at: None,
        }
    }

    /// Prompt plus generated tokens.
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    /// Tokens not yet in the KV cache (≥ 1 for a sequence that still runs).
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    /// True when its next step computes exactly its last sampled token (it has generated and
    /// its prompt, or recomputed context, is all in the KV cache).
    pub fn is_decoding(&self) -> bool {
        self.num_output_tokens() > 0 && self.num_uncomputed_tokens() == 1
    }

    /// The most tokens this sequence can ever hold in KV: prompt + max_tokens − 1 (the last
    /// generated token is never fed back).
    pub fn max_kv_tokens(&self) -> usize {
        (self.prompt_len + self.stop.max_tokens)
            .saturating_sub(1)
            .max(self.prompt_len)
    }

    /// Blocks still to allocate before this sequence can finish, at most.
    pub fn remaining_block_growth(&self, block_size: usize) -> usize {
        blocks_for_tokens(self.max_kv_tokens(), block_size).saturating_sub(self.block_table.len())
    }

    /// True when its reservation covers everything it may still need: such a sequence never
    /// competes for free blocks, so preempting it helps nobody.
    pub fn is_fully_covered(&self, block_size: usize) -> bool {
        self.credit.blocks() >= self.remaining_block_growth(block_size)
    }

    /// Blocks that preemption would hand back to the shared free pool (blocks drawn from the
    /// reservation go back into it instead).
    pub fn releasable_blocks(&self) -> usize {
        self.block_table.len().saturating_sub(self.credit.drawn())
    }

    /// KV slots allocated but not holding a token (the tail of the last block).
    pub fn wasted_slots(&self, block_size: usize) -> usize {
        // Slots of the step in flight are being written, not wasted.
        (self.block_table.len() * block_size)
            .saturating_sub(self.num_computed_tokens + self.num_scheduled_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::BlockPool;

    fn seq(prompt: usize, max_tokens: usize, credit: Reservation) -> Sequence {
        let (tx, _rx) = mpsc::channel(1);
        let stop = StopParams {
            max_tokens,
            ..StopParams::default()
        };
        let prompt = (0..prompt as u32).collect();
        Sequence::new(
            SeqId(1),
            "t".into(),
            prompt,
            SamplingParams::default(),
            stop,
            credit,
            tx,
        )
    }

    #[test]
    fn growth_counts_the_last_token_as_never_cached() {
        let pool = BlockPool::new(8, 4, 1);
        // 4 prompt + 1 output: the single output token is sampled, never fed back.
        let s = seq(4, 1, pool.empty_reservation());
        assert_eq!(s.max_kv_tokens(), 4);
        assert_eq!(s.remaining_block_growth(4), 1);
        let s = seq(4, 2, pool.empty_reservation());
        assert_eq!(s.remaining_block_growth(4), 2);
    }

    #[test]
    fn coverage_and_releasable_follow_the_credit() {
        let pool = BlockPool::new(8, 4, 1);
        let mut s = seq(6, 3, pool.try_reserve(2).expect("free"));
        assert!(s.is_fully_covered(4), "8 tokens = 2 blocks, 2 reserved");
        assert!(pool.allocate_n(2, &mut s.credit, &mut s.block_table));
        assert_eq!(s.releasable_blocks(), 0);
        let mut t = seq(6, 30, pool.empty_reservation());
        assert!(!t.is_fully_covered(4));
        assert!(pool.allocate_n(1, &mut t.credit, &mut t.block_table));
        assert_eq!(t.releasable_blocks(), 1);
        t.num_computed_tokens = 3;
        assert_eq!(t.wasted_slots(4), 1);
        // A token the step in flight is writing fills the last slot.
        t.num_scheduled_tokens = 1;
        assert_eq!(t.wasted_slots(4), 0);
    }
}
