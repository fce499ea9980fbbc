//! Special-token partition: cutting literal special-token text out of the input before BPE.
//!
//! Mirrors llama.cpp's `tokenizer_st_partition`. Special tokens (control, unknown and
//! user-defined) are taken longest first; each one cuts every still-unprocessed text fragment at
//! all of its (non-overlapping, leftmost-first) occurrences. Control and unknown tokens only take
//! part when the caller asks to parse special tokens; user-defined tokens always do, as in
//! Hugging Face tokenizers. Longest-first matters: `<|im_start|>` must not be cut by a shorter
//! special that happens to be a substring of it.

/// One special token the partition looks for.
#[derive(Debug, Clone)]
pub(super) struct SpecialToken {
    pub(super) id: u32,
    pub(super) text: String,
    /// Control/unknown tokens (true) are matched only with `parse_special`.
    pub(super) needs_parse_special: bool,
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
    let mut fragments = Vec::new();
    if text.is_empty() {
        return fragments;
    }
    fragments.push(Fragment::Text(text));
    for special in specials {
        if special.needs_parse_special && !parse_special {
            continue;
        }
        // Fast path: most texts contain no special token at all.
        let occurs = fragments
            .iter()
            .any(|f| matches!(f, Fragment::Text(t) if t.contains(special.text.as_str())));
        if !occurs {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            match fragment {
                Fragment::Text(t) => split_at_occurrences(t, special, &mut next),
                token => next.push(token),
            }
        }
        fragments = next;
    }
    fragments
}

fn split_at_occurrences<'t>(text: &'t str, special: &SpecialToken, out: &mut Vec<Fragment<'t>>) {
    let mut last = 0;
    for (start, matched) in text.match_indices(special.text.as_str()) {
        if start > last {
            out.push(Fragment::Text(&text[last..start]));
        }
        out.push(Fragment::Token(special.id));
        last = start + matched.len();
    }
    if last < text.len() {
        out.push(Fragment::Text(&text[last..]));
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
    fn longest_special_wins() {
        use Fragment::*;
        let s = specials();
        assert_eq!(partition("<s>x<s>", &s, true), [Token(2), Token(1)]);
        assert_eq!(partition("", &s, true), []);
    }
}
