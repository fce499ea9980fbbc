//! llama.cpp's merge-list BPE over raw bytes, for the words CoreBPE cannot take.
//!
//! CoreBPE only accepts `&str` and needs a token for every byte. Byte-level vocabularies can lack
//! tokens for a few bytes (SmolLM2 has none for six ASCII control bytes and for 0xF1/0xF2, the
//! lead bytes of code points U+40000..U+BFFFF). llama.cpp drops such a byte and no merge crosses
//! it, while the bytes around it still merge, even a lone continuation byte that no longer forms
//! valid UTF-8. This module runs that algorithm directly on bytes: repeatedly merge the adjacent
//! pair with the lowest merge rank (leftmost on ties), with a heap so long words stay O(n log n).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge tables keyed by token ids.
pub(super) struct MergeBpe {
    /// Token of each single byte; `None` for bytes the vocabulary cannot spell.
    byte_token: [Option<u32>; 256],
    /// (left id, right id) → (merge rank, merged id).
    pairs: HashMap<(u32, u32), (u32, u32)>,
}

/// One live symbol of the word being merged, in a doubly linked list over the original bytes.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    next: Option<usize>,
    merged_away: bool,
}

impl MergeBpe {
    /// `merges` are (left id, right id, merged id), in priority order.
    pub(super) fn new(byte_token: [Option<u32>; 256], merges: &[(u32, u32, u32)]) -> Self {
        let mut pairs = HashMap::with_capacity(merges.len());
        for (rank, &(left, right, merged)) in merges.iter().enumerate() {
            pairs.entry((left, right)).or_insert((rank as u32, merged));
        }
        Self { byte_token, pairs }
    }

    /// Appends the tokens of `word` to `ids`. Bytes without a token are dropped and split the
    /// word: merges never reach across them.
    pub(super) fn encode(&self, word: &[u8], ids: &mut Vec<u32>) {
        let mut segment = Vec::new();
        for &b in word {
            match self.byte_token[b as usize] {
                Some(id) => segment.push(id),
                None => self.encode_segment(std::mem::take(&mut segment), ids),
            }
        }
        self.encode_segment(segment, ids);
    }

    fn encode_segment(&self, byte_ids: Vec<u32>, ids: &mut Vec<u32>) {
        let n = byte_ids.len();
        let mut symbols: Vec<Symbol> = byte_ids
            .into_iter()
            .enumerate()
            .map(|(i, id)| Symbol {
                id,
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
                merged_away: false,
            })
            .collect();
        // Min-heap on (rank, left position): lowest rank first, leftmost on ties, as llama.cpp.
        let mut heap = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize| {
            let right = symbols[left].next?;
            let &(rank, _) = self.pairs.get(&(symbols[left].id, symbols[right].id))?;
            Some(Reverse((rank, left, symbols[left].id, symbols[right].id)))
        };
        heap.extend((0..n).filter_map(|i| candidate(&symbols, i)));
        while let Some(Reverse((_, left, left_id, right_id))) = heap.pop() {
            let Some(right) = symbols[left].next else {
                continue;
            };
            // Skip pairs made stale by an earlier merge on either side.
            if symbols[left].merged_away
                || symbols[left].id != left_id
                || symbols[right].id != right_id
            {
                continue;
            }
            let Some(&(_, merged)) = self.pairs.get(&(left_id, right_id)) else {
                continue;
            };
            symbols[left].id = merged;
            symbols[left].next = symbols[right].next;
            symbols[right].merged_away = true;
            if let Some(after) = symbols[right].next {
                symbols[after].prev = Some(left);
            }
            if let Some(before) = symbols[left].prev {
                heap.extend(candidate(&symbols, before));
            }
            heap.extend(candidate(&symbols, left));
        }
        ids.extend(symbols.iter().filter(|s| !s.merged_away).map(|s| s.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes a..=e are tokens 0..=4 (0x04 has none); merges: "b c" → 10, "a b" → 11,
    /// "a bc" → 12, "bc d" → 13.
    fn tiny() -> MergeBpe {
        let mut byte_token = [None; 256];
        for (i, b) in (b'a'..=b'e').enumerate() {
            byte_token[b as usize] = Some(i as u32);
        }
        MergeBpe::new(
            byte_token,
            &[(1, 2, 10), (0, 1, 11), (0, 10, 12), (10, 3, 13)],
        )
    }

    fn encode(word: &[u8]) -> Vec<u32> {
        let mut ids = Vec::new();
        tiny().encode(word, &mut ids);
        ids
    }

    #[test]
    fn lowest_rank_merges_first() {
        assert_eq!(encode(b"abc"), [12]); // b c, then a bc
        assert_eq!(encode(b"ab"), [11]);
        assert_eq!(encode(b"abcd"), [12, 3], "a bc outranks bc d");
        assert_eq!(encode(b"bcd"), [13]);
        assert_eq!(encode(b""), Vec::<u32>::new());
    }

    #[test]
    fn ties_merge_leftmost_first() {
        // "b c" can fire at two places in "bcbc": both merge, left one first.
        assert_eq!(encode(b"bcbc"), [10, 10]);
        assert_eq!(encode(b"abab"), [11, 11]);
    }

    #[test]
    fn bytes_without_tokens_drop_out_and_block_merges() {
        assert_eq!(encode(b"b\x04c"), [1, 2]);
        assert_eq!(encode(b"\x04\x04"), Vec::<u32>::new());
        assert_eq!(encode(b"ab\xF1cd"), [11, 2, 3]);
    }
}
