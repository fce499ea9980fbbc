//! Incremental detokenization: token bytes in, complete UTF-8 text out.
//!
//! A byte-level BPE token can end in the middle of a character (an emoji is often two or three
//! tokens), so streaming each token's bytes as text would emit broken characters. [`Utf8Stream`]
//! holds back an incomplete character until the bytes that complete it arrive; it never holds
//! more than 3 bytes, and bytes that can never become valid UTF-8 are emitted as U+FFFD at once.

use super::Tokenizer;

/// Assembles UTF-8 text from arbitrary byte chunks. Owns no tokenizer, so it can live inside a
/// sequence's state; feed it [`Tokenizer::token_bytes`].
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    /// Start of a character whose remaining bytes have not arrived yet (at most 3 bytes).
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes` and returns every character that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    out.push_str(valid);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid_up_to` bytes are valid UTF-8 by the error's contract.
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        // An invalid sequence: it can never complete, so replace it now.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // A truncated character at the end: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whatever is still held back, lossily (an unfinished character becomes U+FFFD).
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes currently held back (0..=3).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

/// Streams the text of generated tokens; control tokens contribute nothing (as llama.cpp's
/// `token_to_piece` with `special = false`).
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    utf8: Utf8Stream,
}

impl<'a> StreamDecoder<'a> {
    pub(super) fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            utf8: Utf8Stream::new(),
        }
    }

    /// The text that token `id` completes: only whole UTF-8 characters.
    pub fn push(&mut self, id: u32) -> String {
        self.utf8.push_bytes(self.tokenizer.token_bytes(id))
    }

    /// Leftover bytes of an unfinished character, lossily.
    pub fn flush(&mut self) -> String {
        self.utf8.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn holds_a_split_character_until_complete() {
        let mut s = Utf8Stream::new();
        let crab = "🦀".as_bytes();
        assert_eq!(s.push_bytes(b"a"), "a");
        assert_eq!(s.push_bytes(&crab[..1]), "");
        assert_eq!(s.push_bytes(&crab[1..3]), "");
        assert_eq!(s.pending_len(), 3);
        assert_eq!(s.push_bytes(&[crab[3], b'b']), "🦀b");
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn invalid_bytes_are_replaced_not_held() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push_bytes(&[0xFF, b'x']), "\u{FFFD}x");
        assert_eq!(s.push_bytes(&[0xE2, 0x82]), "");
        // The pending start byte is followed by a non-continuation byte: replace, keep going.
        assert_eq!(s.push_bytes(b"y"), "\u{FFFD}y");
        assert_eq!(s.push_bytes(&[0xF0]), "");
        assert_eq!(s.flush(), "\u{FFFD}");
        assert_eq!(s.pending_len(), 0);
    }

    proptest! {
        /// Any chunking of valid UTF-8 streams back to the same text, never holding > 3 bytes.
        #[test]
        fn any_chunking_reassembles(text in "\\PC{0,40}", cuts in prop::collection::vec(0usize..200, 0..8)) {
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = Utf8Stream::new();
            let mut out = String::new();
            let mut last = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                out += &s.push_bytes(&bytes[last..cut]);
                prop_assert!(s.pending_len() <= 3);
                last = cut;
            }
            out += &s.flush();
            prop_assert_eq!(out, text);
        }
    }
}
