//! The vocabulary as a GGUF file describes it, with llama.cpp's reading of special tokens.
//!
//! Token kinds come from `tokenizer.ggml.token_type`; special ids from the `*_token_id` keys.
//! llama.cpp then patches what converters leave out, by token text: `<|im_end|>`,
//! `<|endoftext|>` and friends end generation and are forced to be control tokens, and FIM
//! repo/separator/pad tokens also end generation. That patching is reproduced here so that
//! [`Vocab::eog_ids`] is the set llama.cpp stops on for the same file.

use super::{TokenizerError, pretokenize};
use crate::gguf::GgufFile;
use std::collections::{BTreeSet, HashMap};

/// GGUF token types (`llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    Undefined,
}

impl TokenKind {
    fn from_gguf(code: i64) -> Self {
        match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

/// Token texts that end generation (llama.cpp `special_eog_ids` text list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM tokens llama.cpp detects by text when the file names none; each ends generation.
/// (key, candidate texts)
const FIM_EOG: &[(&str, &[&str])] = &[
    (
        "tokenizer.ggml.fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// The two tokenizer models llama.cpp calls `LLAMA_VOCAB_TYPE_BPE` and `LLAMA_VOCAB_TYPE_SPM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ModelKind {
    /// `tokenizer.ggml.model = gpt2`: byte-level BPE over pre-tokenized words, merge ranks.
    BytePairs,
    /// `tokenizer.ggml.model = llama`: SentencePiece pieces with scores and `<0xXX>` byte
    /// fallback (Llama 2, Mistral, Phi-3).
    SentencePiece,
}

/// Everything the tokenizer needs from the file, validated.
pub(super) struct Vocab {
    pub(super) model: ModelKind,
    pub(super) texts: Vec<String>,
    pub(super) kinds: Vec<TokenKind>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities; higher merges first). Empty
    /// when the file has none: llama.cpp then scores every token 0.
    pub(super) scores: Vec<f32>,
    /// `tokenizer.ggml.merges`, in priority order, as (left, right) token strings.
    pub(super) merges: Option<Vec<(String, String)>>,
    pub(super) pre: String,
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    /// llama.cpp's `add_bos` / `add_eos`: a prompt tokenized with `add_special` starts with BOS
    /// / ends with EOS (`tokenizer.ggml.add_bos_token` / `add_eos_token`, else llama.cpp's
    /// default for the model and pre-tokenizer; see [`Vocab::from_gguf`]).
    pub(super) add_bos: bool,
    pub(super) add_eos: bool,
    /// SentencePiece's leading-space rule: text after the start or a special token gets a
    /// space in front (`add_space_prefix`, on by default for SentencePiece vocabularies).
    pub(super) add_space_prefix: bool,
    pub(super) unk: Option<u32>,
    /// Phi-3: llama.cpp strips the whitespace after most special tokens (see
    /// [`Vocab::rstrips`]).
    pub(super) rstrip_specials: bool,
    pub(super) eog_ids: BTreeSet<u32>,
    pub(super) chat_template: Option<String>,
}

/// The string array at `key`: `None` where the file has no such key, an error naming the key
/// where it holds something else (reported as missing, it sent users looking for a key that
/// is there).
fn string_array<'a>(gguf: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>, TokenizerError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(_) => gguf
            .get_str_array(key)
            .map(Some)
            .ok_or_else(|| TokenizerError::Invalid(format!("`{key}` is not an array of strings"))),
    }
}

impl Vocab {
    pub(super) fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let model = gguf
            .get_str("tokenizer.ggml.model")
            .ok_or(TokenizerError::Missing("tokenizer.ggml.model"))?;
        let model = match model {
            "gpt2" => ModelKind::BytePairs,
            "llama" => ModelKind::SentencePiece,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let spm = model == ModelKind::SentencePiece;
        let texts: Vec<String> = string_array(gguf, "tokenizer.ggml.tokens")?
            .ok_or(TokenizerError::Missing("tokenizer.ggml.tokens"))?
            .into_iter()
            .map(str::to_string)
            .collect();
        let kinds = match gguf.get_i64_array("tokenizer.ggml.token_type") {
            Some(codes) if codes.len() == texts.len() => {
                codes.into_iter().map(TokenKind::from_gguf).collect()
            }
            Some(codes) => {
                return Err(TokenizerError::Invalid(format!(
                    "tokenizer.ggml.token_type has {} entries for {} tokens",
                    codes.len(),
                    texts.len()
                )));
            }
            None => vec![TokenKind::Normal; texts.len()],
        };
        let scores = match gguf.get("tokenizer.ggml.scores") {
            None => Vec::new(),
            Some(value) => value
                .as_array()
                .and_then(|items| items.iter().map(|v| v.as_f32()).collect::<Option<Vec<_>>>())
                .filter(|scores| scores.len() == texts.len())
                .ok_or_else(|| {
                    TokenizerError::Invalid(format!(
                        "tokenizer.ggml.scores must be {} numbers, one per token",
                        texts.len()
                    ))
                })?,
        };
        let merges = match string_array(gguf, "tokenizer.ggml.merges")? {
            Some(lines) => Some(parse_merges(&lines)?),
            None => None,
        };
        let n_tokens = texts.len();
        // A special-token id the file names, if it is inside the vocabulary. `Err` names the
        // key, the id and the vocabulary size; callers return it only where the id would be
        // used (llama.cpp warns and falls back, which would silently change what is sent to
        // the model or where generation stops).
        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            let Some(value) = gguf.get(key) else {
                return Ok(None);
            };
            let Some(id) = value.as_i64() else {
                // Not an integer that fits an i64: a u64 above i64::MAX, a string, a float.
                return match value.as_u64() {
                    Some(id) => Err(out_of_vocab(key, &id.to_string(), n_tokens)),
                    None => Ok(None),
                };
            };
            match u32::try_from(id) {
                Ok(id) if (id as usize) < n_tokens => Ok(Some(id)),
                _ => Err(out_of_vocab(key, &id.to_string(), n_tokens)),
            }
        };
        // llama.cpp's defaults for SentencePiece vocabularies whose file names no ids.
        let spm_default = |id: u32| (spm && (id as usize) < n_tokens).then_some(id);
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        // llama.cpp's defaults when the keys are absent: SentencePiece vocabularies start with
        // BOS and a space, byte-level BPE ones with neither, except the pre-tokenizers llama.cpp
        // sets `add_bos` for (Llama 3's `llama-bpe` and its aliases, `tekken`); no supported
        // model adds EOS by default. The keys, when present, win (as in llama.cpp).
        let add_bos = gguf
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(spm || pretokenize::adds_bos_by_default(pre));
        let add_eos = gguf
            .get_bool("tokenizer.ggml.add_eos_token")
            .unwrap_or(false);
        // BOS is used only when prompts start with it; an unusable one is otherwise ignored.
        let bos = match token_id("tokenizer.ggml.bos_token_id") {
            Ok(id) => id,
            Err(e) if add_bos => return Err(e),
            Err(_) => None,
        }
        .or_else(|| spm_default(1));
        // EOS, EOT and EOM always end generation; FIM pad/repo/separator ids do when named.
        let eos = token_id("tokenizer.ggml.eos_token_id")?.or_else(|| spm_default(2));
        let mut explicit_eog = Vec::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            explicit_eog.extend(token_id(key)?);
        }
        let fim_ids = FIM_EOG
            .iter()
            .map(|(key, _)| token_id(key))
            .collect::<Result<Vec<_>, _>>()?;
        // UNK stands in for bytes without a token, in SentencePiece vocabularies only.
        let unk = match token_id("tokenizer.ggml.unknown_token_id") {
            Ok(id) => id,
            Err(e) if spm => return Err(e),
            Err(_) => None,
        }
        .or_else(|| spm_default(0));
        if add_eos && eos.is_none() {
            // llama.cpp asserts here at the first tokenization; refuse the file up front.
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.add_eos_token is set but the vocabulary names no EOS token".into(),
            ));
        }
        let mut vocab = Self {
            pre: pre.to_string(),
            add_bos,
            add_eos,
            add_space_prefix: gguf
                .get_bool("tokenizer.ggml.add_space_prefix")
                .unwrap_or(spm),
            unk,
            rstrip_specials: gguf.get_str("general.name").is_some_and(is_phi3_name),
            model,
            scores,
            chat_template: gguf.get_str("tokenizer.chat_template").map(str::to_string),
            eog_ids: eos.into_iter().chain(explicit_eog).collect(),
            texts,
            kinds,
            merges,
            bos,
            eos,
        };
        vocab.mark_end_of_generation(&fim_ids);
        Ok(vocab)
    }

    /// llama.cpp's text-based patching of end-of-generation tokens (see the module doc).
    pub(super) fn mark_end_of_generation(&mut self, fim_ids: &[Option<u32>]) {
        // Later ids win on duplicate texts, as in llama.cpp's `token_to_id`.
        let id_of: HashMap<&str, u32> = self
            .texts
            .iter()
            .enumerate()
            .map(|(id, text)| (text.as_str(), id as u32))
            .collect();
        let mut eog: Vec<u32> = EOG_TEXTS
            .iter()
            .filter_map(|t| id_of.get(t).copied())
            .collect();
        for ((_, candidates), explicit) in FIM_EOG.iter().zip(fim_ids) {
            match explicit {
                Some(id) => {
                    self.eog_ids.insert(*id);
                }
                // llama.cpp takes whichever candidate its hash map yields first; take the lowest.
                None => eog.extend(
                    candidates
                        .iter()
                        .filter_map(|t| id_of.get(t).copied())
                        .min(),
                ),
            }
        }
        for id in eog {
            if let Some(kind) = self.kinds.get_mut(id as usize) {
                // Tokens stopping generation must never be rendered or merged as plain text.
                *kind = TokenKind::Control;
            }
            self.eog_ids.insert(id);
        }
    }
}

/// `key` names token `id`, which is not in a vocabulary of `n_tokens` tokens.
fn out_of_vocab(key: &str, id: &str, n_tokens: usize) -> TokenizerError {
    TokenizerError::Invalid(format!(
        "{key} is {id}, outside the vocabulary of {n_tokens} tokens (ids 0 to {})",
        n_tokens.saturating_sub(1)
    ))
}

/// llama.cpp recognises Phi-3 by `general.name` (lower-cased, containing `phi-3` or `phi3`).
fn is_phi3_name(name: &str) -> bool {
    let name = name.to_lowercase();
    name.contains("phi-3") || name.contains("phi3")
}

impl Vocab {
    /// Whether whitespace right after special token `id` is dropped when it is cut out of the
    /// text (llama.cpp's `LLAMA_TOKEN_ATTR_RSTRIP`). llama.cpp sets it for Phi-3's special
    /// tokens, which its Hugging Face tokenizer declares with `rstrip`, except `<unk>`, `<s>`
    /// and `<|endoftext|>`: so `<|user|>\nHi` tokenizes as `<|user|>` `▁Hi`.
    pub(super) fn rstrips(&self, id: u32) -> bool {
        let text = self.texts.get(id as usize).map_or("", String::as_str);
        self.rstrip_specials && !matches!(text, "<unk>" | "<s>" | "<|endoftext|>")
    }
}

fn parse_merges(lines: &[&str]) -> Result<Vec<(String, String)>, TokenizerError> {
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            // Mapped token strings never contain a real space, so the first space separates.
            line.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    TokenizerError::Invalid(format!("merge #{i} `{line}` is not `left right`"))
                })
        })
        .collect()
}
