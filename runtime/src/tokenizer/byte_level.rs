//! GPT-2's byte ↔ unicode table, the spelling byte-level BPE vocabularies store tokens in.
//!
//! Byte-level BPE works on raw bytes, but vocabularies (HF `tokenizer.json`, GGUF
//! `tokenizer.ggml.tokens`) store each token as a printable string: every byte is replaced by one
//! unicode character (printable ASCII and Latin-1 map to themselves, the other 68 bytes to
//! U+0100..U+0143, so a space is `Ġ` and a newline `Ċ`). To build a byte encoder, and to turn
//! generated tokens back into text, every token string has to be mapped back to its raw bytes.

/// The character GPT-2 uses for each byte value.
pub(crate) fn byte_to_char(byte: u8) -> char {
    let b = u32::from(byte);
    if is_printable(b) {
        return char::from(byte);
    }
    // Non-printable bytes take the code points 256, 257, ... in byte order.
    let rank = (0..b).filter(|&x| !is_printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

fn is_printable(b: u32) -> bool {
    (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
}

/// Inverse table: index = code point (all mapped characters are below 324), value = byte.
pub(super) struct ByteDecoder {
    byte_of_char: Vec<Option<u8>>,
}

impl ByteDecoder {
    pub(super) fn new() -> Self {
        let mut byte_of_char = vec![None; 324];
        for byte in 0..=255u8 {
            let c = byte_to_char(byte) as usize;
            if let Some(slot) = byte_of_char.get_mut(c) {
                *slot = Some(byte);
            }
        }
        Self { byte_of_char }
    }

    /// The raw bytes a token string stands for, and whether every character was a mapped byte.
    ///
    /// A character outside the table (a vocabulary that stores some token verbatim) keeps its
    /// own UTF-8 bytes: that is more useful than llama.cpp's `[UNK_BYTE_0x..]` placeholder.
    pub(super) fn decode(&self, token_text: &str) -> (Vec<u8>, bool) {
        let mut bytes = Vec::with_capacity(token_text.len());
        let mut all_mapped = true;
        for c in token_text.chars() {
            match self.byte_of_char.get(c as usize).copied().flatten() {
                Some(b) => bytes.push(b),
                None => {
                    all_mapped = false;
                    let mut buf = [0u8; 4];
                    bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        (bytes, all_mapped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpt2_spellings() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(b'!'), '!');
        assert_eq!(byte_to_char(0), 'Ā');
        assert_eq!(byte_to_char(0xAD), 'Ń'); // the last of the 68 non-printable bytes: U+0143
    }

    #[test]
    fn table_is_a_bijection_and_inverts() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(chars.len(), 256);
        let decoder = ByteDecoder::new();
        let all: String = (0..=255u8).map(byte_to_char).collect();
        let (bytes, mapped) = decoder.decode(&all);
        assert!(mapped);
        assert_eq!(bytes, (0..=255u8).collect::<Vec<_>>());
    }

    #[test]
    fn unmapped_characters_keep_their_utf8() {
        let (bytes, mapped) = ByteDecoder::new().decode("aĠ한");
        assert!(!mapped);
        assert_eq!(bytes, "a 한".as_bytes());
    }
}
