//! Byte-level BPE encoding of one plain-text fragment (`tokenizer.ggml.model = gpt2`): GPT-2,
//! SmolLM2, Llama 3, Qwen2 and the other tiktoken-style vocabularies.
//!
//! The fragment is cut into words by the pre-tokenizer ([`PreTokenizer`]), then each word's
//! bytes are merged. Merging runs on tiktoken-rs's `CoreBPE` (rank-based, O(n log n) on long
//! words). A rank is a token's merge priority: the position of the merge in
//! `tokenizer.ggml.merges` that creates it, so the result is the merge-list BPE llama.cpp runs
//! (in SmolLM2, Llama 3 and Qwen2 that order is also the token-id order). Words containing a
//! byte the vocabulary has no token for (SmolLM2 lacks six ASCII control bytes and 0xF1/0xF2) go
//! through [`MergeBpe`], which drops that byte and merges around it exactly as llama.cpp does.

use super::merge_bpe::MergeBpe;
use super::pretokenize::PreTokenizer;
use super::vocab::Vocab;
use super::{TokenSpellings, TokenizerError};
use std::collections::HashMap;
use tiktoken_rs::CoreBPE;

pub(super) struct BpeModel {
    bpe: CoreBPE,
    /// Whole-word shortcut: most words are one token, and a hash lookup is far cheaper than a
    /// CoreBPE call (CoreBPE takes the same shortcut, after a regex search). With llama.cpp's
    /// `ignore_merges` (Llama 3) it holds every token, not only those merges create: a word
    /// that is a token is that token, whatever the merges would make of it.
    token_of_word: HashMap<Box<[u8]>, u32>,
    /// CoreBPE speaks ranks (merge priority); this maps them back to token ids.
    pub(super) id_of_rank: Vec<u32>,
    /// Bytes no token spells; words containing one take the `merge_bpe` path.
    unencodable: [bool; 256],
    pub(super) merge_bpe: MergeBpe,
    pre: PreTokenizer,
}

impl BpeModel {
    pub(super) fn new(
        vocab: &Vocab,
        spellings: &TokenSpellings,
        is_plain_bpe_token: &[bool],
    ) -> Result<Self, TokenizerError> {
        let pre = PreTokenizer::for_pre_type(&vocab.pre)?;
        let span = |id: usize| spellings.get(id);
        let merges = vocab
            .merges
            .as_deref()
            .ok_or(TokenizerError::Missing("tokenizer.ggml.merges"))?;
        let ranked = RankedMerges::new(&vocab.texts, merges, is_plain_bpe_token, span);

        let mut byte_token = [None; 256];
        let mut encoder = HashMap::default();
        let mut token_of_word = HashMap::with_capacity(ranked.ids.len());
        let mut id_of_rank = vec![0u32; ranked.ids.len()];
        for (rank, &id) in ranked.ids.iter().enumerate() {
            let token = span(id as usize);
            if let [b] = token {
                byte_token[*b as usize].get_or_insert(id);
            }
            encoder.entry(token.to_vec()).or_insert(rank as u32);
            token_of_word.entry(Box::from(token)).or_insert(id);
            id_of_rank[rank] = id;
        }
        if pre.ignores_merges() {
            for id in (0..vocab.texts.len()).filter(|&id| is_plain_bpe_token[id]) {
                token_of_word
                    .entry(Box::from(span(id)))
                    .or_insert(id as u32);
            }
        }
        let unencodable = byte_token.map(|t| t.is_none());
        // llama.cpp drops a byte no token spells, and so does kvgate (SmolLM2 lacks a few
        // control bytes). A vocabulary missing printable ASCII would drop ordinary text
        // silently ("hi" → nothing): refuse it at load, naming the bytes.
        let missing: Vec<u8> = (b' '..=b'~').filter(|&b| unencodable[b as usize]).collect();
        if let Some(&first) = missing.first() {
            return Err(TokenizerError::Invalid(format!(
                "the byte-level vocabulary has no token for {} of the 95 printable ASCII \
                 characters (the first: {:?}); text containing them could not be encoded",
                missing.len(),
                first as char
            )));
        }
        let merge_bpe = MergeBpe::new(byte_token, &ranked.merges);
        // One pattern matching the whole input: the words are cut by `pre`, CoreBPE only merges.
        let bpe = CoreBPE::new(encoder, HashMap::default(), r"(?s).+")
            .map_err(|e| TokenizerError::Invalid(format!("BPE tables: {e}")))?;
        Ok(Self {
            bpe,
            token_of_word,
            id_of_rank,
            unencodable,
            merge_bpe,
            pre,
        })
    }

    /// Appends the tokens of one plain-text fragment.
    pub(super) fn encode(&self, text: &str, ids: &mut Vec<u32>) {
        let mut words = Vec::new();
        self.pre.split(text, &mut words);
        for word in &words {
            self.encode_word(word, ids);
        }
    }

    pub(super) fn encode_word(&self, word: &str, ids: &mut Vec<u32>) {
        if word.bytes().any(|b| self.unencodable[b as usize]) {
            // Rare (control bytes, unassigned planes); CoreBPE would panic on the missing byte.
            self.merge_bpe.encode(word.as_bytes(), ids);
            return;
        }
        if let Some(&id) = self.token_of_word.get(word.as_bytes()) {
            ids.push(id);
            return;
        }
        let ranks = self.bpe.encode_ordinary(word);
        ids.extend(ranks.into_iter().map(|r| self.id_of_rank[r as usize]));
    }
}

/// The merge list resolved to token ids, and the tokens in rank order (merge priority).
struct RankedMerges {
    /// Single-byte tokens first, then each merge's result in merge order. Tokens no merge
    /// creates are left out: merge-list BPE can never produce them.
    ids: Vec<u32>,
    /// (left id, right id, merged id) in priority order.
    merges: Vec<(u32, u32, u32)>,
}

impl RankedMerges {
    fn new<'b>(
        texts: &[String],
        merges: &[(String, String)],
        is_plain: &[bool],
        span: impl Fn(usize) -> &'b [u8],
    ) -> Self {
        let plain_ids = || (0..texts.len()).filter(|&id| is_plain[id]);
        let mut ids: Vec<u32> = plain_ids()
            .filter(|&id| span(id).len() == 1)
            .map(|id| id as u32)
            .collect();
        let id_of: HashMap<&str, u32> = plain_ids()
            .map(|id| (texts[id].as_str(), id as u32))
            .collect();
        let mut seen = vec![false; texts.len()];
        let mut resolved = Vec::with_capacity(merges.len());
        for (left, right) in merges {
            let merged = id_of.get(format!("{left}{right}").as_str());
            // A merge whose parts or result are not tokens can never fire in llama.cpp either.
            if let (Some(&l), Some(&r), Some(&m)) =
                (id_of.get(left.as_str()), id_of.get(right.as_str()), merged)
            {
                resolved.push((l, r, m));
                if !std::mem::replace(&mut seen[m as usize], true) {
                    ids.push(m);
                }
            }
        }
        Self {
            ids,
            merges: resolved,
        }
    }
}
