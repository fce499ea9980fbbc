//! Tokenizers built from a GGUF vocabulary, token for token equal to llama.cpp's.
//!
//! Encoding is llama.cpp's pipeline: cut out special tokens ([`special`]), then encode each
//! remaining plain-text fragment with the vocabulary's model:
//! - byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM2, Llama 3, Qwen2, Mistral's
//!   Tekken; [`bpe`]):
//!   pre-tokenize into words ([`pretokenize`]), then merge each word's bytes by merge rank on
//!   tiktoken-rs's `CoreBPE`;
//! - SentencePiece (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Phi-3; [`spm`]): spaces
//!   become `▁` (with one in front of text that starts the input or follows a special token,
//!   `add_space_prefix`), then characters merge by piece score, with `<0xXX>` byte fallback.
//!
//! Decoding maps each token back to raw bytes: the GPT-2 byte spelling ([`byte_level`]) for BPE,
//! `▁` → space and `<0xXX>` → that byte for SentencePiece. Control tokens decode to nothing,
//! like llama.cpp's detokenizer with `special = false`; [`Tokenizer::decode_with_special`]
//! renders them.

mod bpe;
mod byte_level;
mod chat;
mod merge_bpe;
mod pretokenize;
mod special;
mod spm;
mod stream;
#[cfg(test)]
mod tests;
mod vocab;

pub(crate) use byte_level::byte_to_char;
pub use stream::{StreamDecoder, Utf8Stream};
pub use vocab::TokenKind;

use crate::chat_template::{ChatMessage, ChatTemplate, FALLBACK_CHATML, TemplateError};
use crate::gguf::GgufFile;
use bpe::BpeModel;
use byte_level::ByteDecoder;
use special::{Fragment, SpecialToken};
use spm::SpmModel;
use std::collections::BTreeSet;
use vocab::{ModelKind, Vocab};

/// Why a GGUF vocabulary cannot be turned into a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF file has no `{0}`")]
    Missing(&'static str),
    #[error(
        "tokenizer model `{0}` is not supported: kvgate implements byte-level BPE (`gpt2`) and \
         SentencePiece (`llama`)"
    )]
    UnsupportedModel(String),
    #[error(
        "pre-tokenizer `{0}` is not supported (supported: gpt-2, smollm, llama-bpe, qwen2, \
         tekken and their aliases)"
    )]
    UnsupportedPreTokenizer(String),
    #[error("invalid vocabulary: {0}")]
    Invalid(String),
    #[error("pre-tokenizer regex does not compile: {0}")]
    Regex(String),
}

/// A GGUF tokenizer (byte-level BPE or SentencePiece). `Send + Sync`; share it behind an `Arc`.
pub struct Tokenizer {
    texts: Vec<String>,
    kinds: Vec<TokenKind>,
    spellings: TokenSpellings,
    model: Model,
    specials: Vec<SpecialToken>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: BTreeSet<u32>,
    chat_template: Result<ChatTemplate, TemplateError>,
}

/// How plain text becomes tokens: the part of the tokenizer that differs between models.
/// Both are boxed: each carries kilobyte-sized per-byte tables inline.
enum Model {
    BytePairs(Box<BpeModel>),
    SentencePiece(Box<SpmModel>),
}

impl Tokenizer {
    /// Builds the tokenizer for a byte-level BPE (`tokenizer.ggml.model = gpt2`) or
    /// SentencePiece (`llama`) vocabulary.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        Self::from_vocab(Vocab::from_gguf(gguf)?)
    }

    fn from_vocab(vocab: Vocab) -> Result<Self, TokenizerError> {
        let (spellings, is_plain_bpe_token) = TokenSpellings::new(&vocab);
        let model = match vocab.model {
            ModelKind::BytePairs => Model::BytePairs(Box::new(BpeModel::new(
                &vocab,
                &spellings,
                &is_plain_bpe_token,
            )?)),
            ModelKind::SentencePiece => Model::SentencePiece(Box::new(SpmModel::new(&vocab))),
        };

        let specials = special::matching_order(special_tokens(&vocab));
        let text_of = |id: Option<u32>| {
            id.and_then(|i| vocab.texts.get(i as usize))
                .map_or("", |t| t)
        };
        let chat_template = ChatTemplate::new(
            vocab.chat_template.as_deref().unwrap_or(FALLBACK_CHATML),
            text_of(vocab.bos),
            text_of(vocab.eos),
        );
        Ok(Self {
            texts: vocab.texts,
            kinds: vocab.kinds,
            spellings,
            model,
            specials,
            bos: vocab.bos,
            eos: vocab.eos,
            add_bos: vocab.add_bos,
            add_eos: vocab.add_eos,
            eog: vocab.eog_ids,
            chat_template,
        })
    }

    /// Token ids for `text`, as llama.cpp's `llama_tokenize(text, add_special = false,
    /// parse_special)`. With `parse_special`, control-token text such as `<|im_start|>` becomes
    /// that token; without, it is tokenized as plain text (user input should be).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let fragments = special::partition(text, &self.specials, parse_special);
        self.encode_fragments(fragments, text.len())
    }

    /// Token ids of partitioned text (`text_len` bytes in all, to size the output).
    fn encode_fragments(&self, fragments: Vec<Fragment<'_>>, text_len: usize) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text_len / 3 + 1);
        // SentencePiece's leading space goes before text at the start and after each special
        // token (llama.cpp's `is_prev_special`, true at the start).
        let mut after_special = true;
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => {
                    ids.push(id);
                    after_special = true;
                }
                Fragment::Text(text) => {
                    match &self.model {
                        Model::BytePairs(bpe) => bpe.encode(text, &mut ids),
                        Model::SentencePiece(spm) => {
                            let prefix = spm.add_space_prefix && after_special;
                            spm.encode(&spm::escape_spaces(text, prefix), &mut ids);
                        }
                    }
                    after_special = false;
                }
            }
        }
        ids
    }

    /// [`Self::encode`] with the vocabulary's own special tokens around it, as llama.cpp's
    /// `llama_tokenize(text, add_special = true, parse_special)` (a `/completion` prompt): BOS
    /// first when the vocabulary adds it (`add_bos_token`), EOS last when it adds that
    /// (`add_eos_token`). Neither is checked for in the text: like llama.cpp, a prompt that
    /// already starts with BOS text gets a second one.
    pub fn encode_with_specials(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend(self.encode(text, parse_special));
        if let (true, Some(eos)) = (self.add_eos, self.eos) {
            ids.push(eos);
        }
        ids
    }

    /// Whether prompts encoded with the special tokens start with BOS (`add_bos_token`).
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether prompts encoded with the special tokens end with EOS (`add_eos_token`).
    pub fn adds_eos(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }

    /// Text of `ids`, lossily. Control tokens (BOS, `<|im_end|>`, …) contribute nothing, as in
    /// llama.cpp's detokenizer with `special = false`; user-defined tokens render as their text.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| self.token_bytes(id))
            .copied()
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Like [`Self::decode`], but control tokens render as their text (`<|im_start|>`), so
    /// `decode_with_special(encode(x, true)) == x`.
    pub fn decode_with_special(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.kinds.get(id as usize) {
                Some(TokenKind::Control | TokenKind::Unknown) => {
                    bytes.extend_from_slice(self.texts[id as usize].as_bytes());
                }
                _ => bytes.extend_from_slice(self.token_bytes(id)),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Raw bytes of token `id`: empty for control, unknown and unused tokens and for ids out of
    /// range. May be part of a UTF-8 character; see [`StreamDecoder`].
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.spellings.get(id as usize)
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether generation stops at `id`: eos, eot/eom and llama.cpp's text-detected set
    /// (`<|im_end|>`, `<|endoftext|>`, FIM repo/sep/pad, …).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// End-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }

    /// Control, unknown or user-defined: tokens matched verbatim before BPE.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.kinds.get(id as usize),
            Some(TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined)
        )
    }

    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The token's string as stored in the vocabulary (GPT-2 byte spelling: `Ġthe`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// Renders `messages` with the GGUF's chat template (ChatML if the file has none). To
    /// tokenize a conversation, use [`Tokenizer::encode_chat`]: encoding this text with
    /// `parse_special` lets message content inject control tokens.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        match &self.chat_template {
            Ok(template) => template.render(messages, add_generation_prompt),
            Err(e) => Err(e.clone()),
        }
    }

    /// A decoder for streaming generated tokens as text.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }
}

/// Cuts text into the words GPT-4's `cl100k_base` encoding and Llama 3 merge inside: the one
/// regex they share (`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`),
/// run by the hand-written scanner the Llama 3 vocabularies use (see `pretokenize.rs`). Lets a
/// caller that holds a cl100k rank table count prompts without a regex engine's per-call set-up.
pub struct Cl100kWords(pretokenize::PreTokenizer);

impl Cl100kWords {
    pub fn new() -> Result<Cl100kWords, TokenizerError> {
        pretokenize::PreTokenizer::for_pre_type("llama-bpe").map(Cl100kWords)
    }

    /// Appends the words of `text` to `words`, in order; their concatenation is `text`.
    pub fn split<'t>(&self, text: &'t str, words: &mut Vec<&'t str>) {
        self.0.split(text, words);
    }
}

impl std::fmt::Debug for Cl100kWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cl100kWords")
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.texts.len())
            .field("specials", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// Raw bytes of every token, back to back.
struct TokenSpellings {
    bytes: Vec<u8>,
    /// Token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<usize>,
}

impl TokenSpellings {
    /// The spellings, and for each token whether it is a plain GPT-2-spelled BPE token.
    fn new(vocab: &Vocab) -> (Self, Vec<bool>) {
        let byte_decoder = ByteDecoder::new();
        let spm = vocab.model == ModelKind::SentencePiece;
        let mut spellings = Self {
            bytes: Vec::new(),
            offsets: vec![0],
        };
        let mut is_plain = Vec::with_capacity(vocab.texts.len());
        for (text, kind) in vocab.texts.iter().zip(&vocab.kinds) {
            let (bytes, all_mapped) = match kind {
                // SentencePiece pieces are UTF-8 with `▁` for a space.
                TokenKind::Normal if spm => (text.replace(spm::SPACE, " ").into_bytes(), false),
                TokenKind::Normal => byte_decoder.decode(text),
                TokenKind::Byte => (parse_byte_token(text).into_iter().collect(), false),
                // Added tokens are stored verbatim, not in the GPT-2 spelling.
                TokenKind::UserDefined => (text.as_bytes().to_vec(), false),
                _ => (Vec::new(), false),
            };
            is_plain.push(*kind == TokenKind::Normal && all_mapped);
            spellings.bytes.extend_from_slice(&bytes);
            spellings.offsets.push(spellings.bytes.len());
        }
        (spellings, is_plain)
    }

    /// Empty for ids out of range.
    fn get(&self, id: usize) -> &[u8] {
        match (self.offsets.get(id), self.offsets.get(id + 1)) {
            (Some(&start), Some(&end)) => &self.bytes[start..end],
            _ => &[],
        }
    }
}

/// Control and unknown tokens (matched with `parse_special`) and user-defined ones (always).
fn special_tokens(vocab: &Vocab) -> Vec<SpecialToken> {
    let special = |(id, kind): (usize, &TokenKind)| {
        let needs_parse_special = match kind {
            TokenKind::Control | TokenKind::Unknown => true,
            TokenKind::UserDefined => false,
            _ => return None,
        };
        Some(SpecialToken {
            id: id as u32,
            text: vocab.texts[id].clone(),
            needs_parse_special,
            rstrip: vocab.rstrips(id as u32),
        })
    };
    vocab.kinds.iter().enumerate().filter_map(special).collect()
}

/// `<0xAB>` → 0xAB: the spelling of byte tokens in vocabularies with byte fallback.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
