//! A sequence's generated text as it streams: token bytes in, safe text deltas out.
//!
//! Two things make per-token text unsafe to forward as-is. A byte-level token can end inside a
//! UTF-8 character, so incomplete characters are held until completed ([`Utf8Stream`]). And a
//! stop string can span several tokens, so any tail of the text that could still become the
//! start of a stop string is held back; when a stop string completes, only the text before it
//! is released and the sequence ends. Nothing after a stop string is ever emitted.

use crate::tokenizer::Utf8Stream;

/// Text released by one token.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextDelta {
    pub text: String,
    /// A stop string completed; `text` ends right before it.
    pub stopped: bool,
}

/// Incremental detokenizer with stop-string hold-back.
#[derive(Debug, Clone, Default)]
pub struct OutputText {
    utf8: Utf8Stream,
    stop_strings: Vec<String>,
    /// Decoded text not yet released: it could be the beginning of a stop string.
    held: String,
}

impl OutputText {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stop_strings: &[String]) -> OutputText {
        OutputText {
            utf8: Utf8Stream::new(),
            stop_strings: stop_strings
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            held: String::new(),
        }
    }

    /// Appends one token's bytes and returns what may be emitted now.
    pub fn push(&mut self, bytes: &[u8]) -> TextDelta {
        let completed = self.utf8.push_bytes(bytes);
        self.held.push_str(&completed);
        if let Some(stop_at) = self.earliest_stop_match() {
            self.held.truncate(stop_at);
            return TextDelta {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep_from = self.earliest_partial_stop();
        let rest = self.held.split_off(keep_from);
        TextDelta {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// Releases everything still held at the end of generation (no stop string matched, so the
    /// held tail is ordinary text; an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let mut text = std::mem::take(&mut self.held);
        text.push_str(&self.utf8.flush());
        text
    }

    /// Byte offset in `held` of the earliest complete stop string.
    fn earliest_stop_match(&self) -> Option<usize> {
        self.stop_strings
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min()
    }

    /// Earliest char boundary from which the rest of `held` is a proper prefix of some stop
    /// string; `held.len()` when no tail could start one. Everything before it is safe.
    fn earliest_partial_stop(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stop_strings.iter().map(String::len).max().unwrap_or(0);
        let window_start = held.len().saturating_sub(longest);
        held.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= window_start)
            .find(|&i| {
                self.stop_strings
                    .iter()
                    .any(|stop| stop.starts_with(&held[i..]))
            })
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> OutputText {
        let owned: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        OutputText::new(&owned)
    }

    /// Feeds pieces and returns (released text, stopped) after the whole run.
    fn run(out: &mut OutputText, pieces: &[&[u8]]) -> (String, bool) {
        let mut text = String::new();
        for piece in pieces {
            let delta = out.push(piece);
            text.push_str(&delta.text);
            if delta.stopped {
                return (text, true);
            }
        }
        text.push_str(&out.finish());
        (text, false)
    }

    #[test]
    fn without_stop_strings_text_flows_immediately() {
        let mut out = stops(&[]);
        assert_eq!(out.push(b"Hello").text, "Hello");
        assert_eq!(out.push(b" world").text, " world");
    }

    #[test]
    fn stop_string_across_tokens_cuts_before_it() {
        let mut out = stops(&["STOP"]);
        assert_eq!(out.push(b"abc S").text, "abc ", "'S' may start STOP");
        assert_eq!(out.push(b"T").text, "");
        let delta = out.push(b"OP and more");
        assert_eq!(
            delta,
            TextDelta {
                text: String::new(),
                stopped: true
            }
        );
    }

    #[test]
    fn false_alarm_is_released_once_it_cannot_match() {
        let mut out = stops(&["STOP"]);
        assert_eq!(out.push(b"ST").text, "");
        assert_eq!(out.push(b"ART").text, "START");
        assert_eq!(
            run(&mut out, &[b"x S"]),
            ("x S".to_string(), false),
            "held tail flushed"
        );
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let mut out = stops(&["world", "lo w"]);
        assert_eq!(
            run(&mut out, &[b"hel", b"lo world"]),
            ("hel".to_string(), true)
        );
    }

    #[test]
    fn overlapping_prefix_keeps_the_earliest_candidate() {
        // "aab": after "aa" both "a" positions could start it.
        let mut out = stops(&["aab"]);
        assert_eq!(out.push(b"xaa").text, "x");
        assert_eq!(out.push(b"a").text, "a");
        assert_eq!(out.push(b"b").text, "");
    }

    #[test]
    fn utf8_split_across_tokens_is_assembled() {
        let crab = "🦀".as_bytes();
        let mut out = stops(&[]);
        assert_eq!(out.push(&crab[..2]).text, "");
        assert_eq!(out.push(&crab[2..]).text, "🦀");
        let mut out = stops(&[]);
        assert_eq!(
            run(&mut out, &[b"a", &crab[..1]]),
            ("a\u{FFFD}".to_string(), false)
        );
    }

    #[test]
    fn multibyte_stop_string_split_inside_a_character() {
        let text = "résumé END";
        let bytes = text.as_bytes();
        let pieces: Vec<&[u8]> = bytes.chunks(1).collect();
        let mut out = stops(&["é E"]);
        assert_eq!(run(&mut out, &pieces), ("résum".to_string(), true));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut out = stops(&[""]);
        assert_eq!(out.push(b"abc").text, "abc");
    }
}
