//! A model-free backend and decoder for engine tests.
//!
//! [`FakeBackend`] keeps a real paged "KV cache" of (token, position) per slot: every step writes
//! the scheduled tokens at their slots, and every logits row is computed from the context read
//! back through the block table. A wrong slot, a stale block after preemption or a bad position
//! makes it fail or change its output, so comparing against [`reference_greedy`] checks the
//! whole scheduler → batch → backend path.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};

use crate::backend::{Backend, BackendError, BatchInputs, MemoryUsage};
use crate::engine::TokenDecoder;
use crate::sampler::argmax;

pub const VOCAB: usize = 64;
pub const EOS: u32 = 0;

/// How the next token follows from the context.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Pseudo-random logits from a hash of the whole context; EOS is impossible.
    Hash,
    /// Generation `i` (context length − `prompt_len`) is `tokens[i]`, EOS after the end.
    Script { prompt_len: usize, tokens: Vec<u32> },
}

pub struct FakeBackend {
    pub mode: Mode,
    block_size: usize,
    kv: Vec<Option<(u32, u32)>>,
    /// Fail the forward call with this index (0-based).
    pub fail_at_call: Option<usize>,
    calls: usize,
    /// Before each forward: announce on `entered`, then wait for `gate` (until it is dropped).
    pub gate: Option<(Sender<()>, Receiver<()>)>,
    /// Read a slot nothing was written to as token 0 instead of failing (a real backend reads
    /// whatever the block holds: calibration's deep decodes time such reads).
    pub unwritten_kv_reads_as_zero: bool,
    /// The longest context any forward call attended to.
    pub deepest_context: Arc<AtomicUsize>,
}

impl FakeBackend {
    pub fn new(mode: Mode, block_size: usize, num_blocks: usize) -> FakeBackend {
        FakeBackend {
            mode,
            block_size,
            kv: vec![None; block_size * num_blocks],
            fail_at_call: None,
            calls: 0,
            gate: None,
            unwritten_kv_reads_as_zero: false,
            deepest_context: Arc::default(),
        }
    }

    fn context(&self, inputs: &BatchInputs, seq: usize) -> Result<Vec<u32>, BackendError> {
        let s = &inputs.seqs[seq];
        (0..s.context_len)
            .map(|pos| {
                let block = s.block_table[pos / self.block_size] as usize;
                let slot = block * self.block_size + pos % self.block_size;
                match self.kv.get(slot).copied().flatten() {
                    Some((token, at)) if at as usize == pos => Ok(token),
                    _ if self.unwritten_kv_reads_as_zero && slot < self.kv.len() => Ok(0),
                    other => Err(BackendError::InvalidInputs(format!(
                        "slot {slot} for position {pos} holds {other:?}"
                    ))),
                }
            })
            .collect()
    }
}

/// Logits of the hash model for `context`.
pub fn hash_logits(context: &[u32], row: &mut [f32]) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    for (j, out) in row.iter_mut().enumerate() {
        let x = (h ^ (j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .wrapping_mul(0xff51_afd7_ed55_8ccd);
        *out = (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0;
    }
    row[EOS as usize] = f32::NEG_INFINITY;
}

/// What greedy decoding of the hash model produces, computed directly.
pub fn reference_greedy(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut context = prompt.to_vec();
    let mut row = vec![0.0; VOCAB];
    for _ in 0..max_tokens {
        hash_logits(&context, &mut row);
        context.push(argmax(&row));
    }
    context.split_off(prompt.len())
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        if let Some((entered, gate)) = &self.gate {
            let _ = entered.send(());
            let _ = gate.recv();
        }
        self.calls += 1;
        if self.fail_at_call == Some(self.calls - 1) {
            return Err(BackendError::Other("injected failure".into()));
        }
        let n = inputs.token_ids.len();
        if inputs.positions.len() != n || inputs.slot_mapping.len() != n {
            return Err(BackendError::InvalidInputs("ragged inputs".into()));
        }
        for i in 0..n {
            let slot = inputs.slot_mapping[i] as usize;
            let cell = self.kv.get_mut(slot).ok_or_else(|| {
                BackendError::InvalidInputs(format!("slot {slot} outside the cache"))
            })?;
            *cell = Some((inputs.token_ids[i], inputs.positions[i]));
        }
        logits.clear();
        let deepest = inputs.seqs.iter().map(|s| s.context_len).max().unwrap_or(0);
        self.deepest_context.fetch_max(deepest, Ordering::Relaxed);
        for (index, seq) in inputs.seqs.iter().enumerate() {
            if !seq.needs_logits {
                continue;
            }
            let context = self.context(inputs, index)?;
            let start = logits.len();
            logits.resize(start + VOCAB, 0.0);
            let row = &mut logits[start..];
            match &self.mode {
                Mode::Hash => hash_logits(&context, row),
                Mode::Script { prompt_len, tokens } => {
                    let next = tokens
                        .get(context.len() - prompt_len)
                        .copied()
                        .unwrap_or(EOS);
                    row[next as usize] = 1.0;
                }
            }
        }
        Ok(())
    }

    fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            weights_bytes: 1000,
            kv_bytes: self.kv.len() as u64 * 8,
            workspace_bytes: 0,
            device: None,
        }
    }
}

/// Token `i` spells one letter, unless overridden; EOS is special and end-of-generation.
pub struct FakeDecoder {
    pub pieces: Vec<Vec<u8>>,
}

impl FakeDecoder {
    pub fn letters() -> FakeDecoder {
        FakeDecoder {
            pieces: (0..VOCAB).map(|i| vec![b'a' + (i % 26) as u8]).collect(),
        }
    }

    /// Letters, with `overrides` replacing the bytes of the given ids.
    pub fn with(overrides: &[(u32, &[u8])]) -> FakeDecoder {
        let mut decoder = FakeDecoder::letters();
        for &(id, bytes) in overrides {
            decoder.pieces[id as usize] = bytes.to_vec();
        }
        decoder
    }
}

impl TokenDecoder for FakeDecoder {
    fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }
    fn is_eog(&self, id: u32) -> bool {
        id == EOS
    }
    fn is_special(&self, id: u32) -> bool {
        id == EOS
    }
}
