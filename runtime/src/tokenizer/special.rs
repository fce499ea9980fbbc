//! Special-token partition: cutting literal special-token text out of the input before BPE.
//!
//! Mirrors llama.cpp's `tokenizer_st_partition`. Special tokens (control, unknown and
//! user-defined) are taken longest first; each one cuts every still-unprocessed text fragment at
//! all of its (non-overlapping, leftmost-first) occurrences. Control and unknown tokens only take
//! part when the caller asks to parse special tokens; user-defined tokens always do, as in
//! Hugging Face tokenizers. Longest-first matters: `<|im_start|>` must not be cut by a shorter
//! special that happens to be a substring of it.

use std::ops::Range;

/// One special token the partition looks for.
#[derive(Debug, Clone)]
pub(super) struct SpecialToken {
    pub(super) id: u32,
    pub(super) text: String,
    /// Control/unknown tokens (true) are matched only with `parse_special`.
    pub(super) needs_parse_special: bool,
    /// Whitespace right after the token is dropped (llama.cpp's `RSTRIP` attribute).
    pub(super) rstrip: bool,
}

/// A piece of the input after the partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fragment<'t> {
    /// Plain text, still to be pre-tokenized and merged.
    Text(&'t str),
    /// A special token found verbatim in the text.
    Token(u32),
}

/// Sorts specials into llama.cpp's matching order: longest text first (ties by id, so the order
/// is deterministic). Tokens with empty text are dropped: they would match everywhere.
pub(super) fn matching_order(mut specials: Vec<SpecialToken>) -> Vec<SpecialToken> {
    specials.retain(|s| !s.text.is_empty());
    specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
    specials
}

/// Cuts `text` into plain-text fragments and special tokens. `specials` must be in
/// [`matching_order`].
pub(super) fn partition<'t>(
    text: &'t str,
    specials: &[SpecialToken],
    parse_special: bool,
) -> Vec<Fragment<'t>> {
    partition_outside(text, specials, parse_special, &[])
}

/// [`partition`], except that a control or unknown token is never matched where it overlaps one
/// of the byte ranges `literal` of `text`: that text stays plain text, as without
/// `parse_special` (user-defined tokens match everywhere, as they always do). Used to keep
/// message content from producing control tokens while the chat template's own markup does.
pub(super) fn partition_outside<'t>(
    text: &'t str,
    specials: &[SpecialToken],
    parse_special: bool,
    literal: &[Range<usize>],
) -> Vec<Fragment<'t>> {
    if text.is_empty() {
        return Vec::new();
    }
    let mut pieces = vec![Piece::Text(0..text.len())];
    for special in specials {
        if special.needs_parse_special && !parse_special {
            continue;
        }
        // Fast path: most texts contain no special token at all.
        let occurs = pieces.iter().any(
            |p| matches!(p, Piece::Text(range) if text[range.clone()].contains(special.text.as_str())),
        );
        if !occurs {
            continue;
        }
        let protected = if special.needs_parse_special {
            literal
        } else {
            &[]
        };
        let mut next = Vec::with_capacity(pieces.len() + 2);
        for piece in pieces {
            match piece {
                Piece::Text(range) => {
                    split_at_occurrences(text, range, special, protected, &mut next);
                }
                token => next.push(token),
            }
        }
        pieces = next;
    }
    pieces
        .into_iter()
        .map(|piece| match piece {
            Piece::Text(range) => Fragment::Text(&text[range]),
            Piece::Token(id) => Fragment::Token(id),
        })
        .collect()
}

/// A fragment while partitioning: text as a byte range of the input, so it can be compared
/// with the literal ranges.
enum Piece {
    Text(Range<usize>),
    Token(u32),
}

fn split_at_occurrences(
    text: &str,
    range: Range<usize>,
    special: &SpecialToken,
    protected: &[Range<usize>],
    out: &mut Vec<Piece>,
) {
    let mut last = range.start;
    for (offset, matched) in text[range.clone()].match_indices(special.text.as_str()) {
        let (start, end) = (range.start + offset, range.start + offset + matched.len());
        if protected.iter().any(|p| p.start < end && start < p.end) {
            continue;
        }
        if start < last {
            // Inside whitespace an earlier match stripped.
            continue;
        }
        if start > last {
            out.push(Piece::Text(last..start));
        }
        out.push(Piece::Token(special.id));
        last = end;
        if special.rstrip {
            let bytes = text.as_bytes();
            // C `isspace`, as llama.cpp: ASCII blanks only, vertical tab included.
            while last < range.end
                && matches!(bytes[last], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
            {
                last += 1;
            }
        }
    }
    if last < range.end {
        out.push(Piece::Text(last..range.end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn special(id: u32, text: &str, needs_parse_special: bool) -> SpecialToken {
        SpecialToken {
            id,
            text: text.to_string(),
            needs_parse_special,
            rstrip: false,
        }
    }

    fn specials() -> Vec<SpecialToken> {
        matching_order(vec![
            special(1, "<s>", true),
            special(2, "<s>x", true),
            special(3, "[U]", false),
            special(4, "", true),
        ])
    }

    #[test]
    fn control_tokens_need_parse_special() {
        use Fragment::*;
        let s = specials();
        assert_eq!(
            partition("a<s>b", &s, true),
            [Text("a"), Token(1), Text("b")]
        );
        assert_eq!(partition("a<s>b", &s, false), [Text("a<s>b")]);
        // User-defined tokens are matched either way.
        assert_eq!(partition("[U][U]", &s, false), [Token(3), Token(3)]);
    }

    #[test]
    fn literal_ranges_keep_control_tokens_as_text() {
        use Fragment::*;
        let s = specials();
        let literal = |range: Range<usize>| vec![range];
        // "<s>" at 0..3 is literal, the one at 4..7 is not.
        assert_eq!(
            partition_outside("<s>a<s>b", &s, true, &literal(0..3)),
            [Text("<s>a"), Token(1), Text("b")]
        );
        // A match that only overlaps a literal range is not taken either.
        assert_eq!(
            partition_outside("a<s>b", &s, true, &literal(0..2)),
            [Text("a<s>b")]
        );
        // User-defined tokens match inside literal text, as they do without parse_special.
        assert_eq!(
            partition_outside("[U]<s>", &s, true, &literal(0..6)),
            [Token(3), Text("<s>")]
        );
    }

    #[test]
    fn rstrip_tokens_drop_the_whitespace_after_them() {
        use Fragment::*;
        let mut s = specials();
        s.iter_mut().for_each(|t| t.rstrip = t.id == 1);
        assert_eq!(
            partition("a <s> \n\x0bb<s>\t", &s, true),
            [Text("a "), Token(1), Text("b"), Token(1)]
        );
        // Only ASCII whitespace, as C's isspace.
        assert_eq!(
            partition("<s>\u{a0}b", &s, true),
            [Token(1), Text("\u{a0}b")]
        );
    }

    #[test]
    fn longest_special_wins() {
        use Fragment::*;
        let s = specials();
        assert_eq!(partition("<s>x<s>", &s, true), [Token(2), Token(1)]);
        assert_eq!(partition("", &s, true), []);
    }
}
