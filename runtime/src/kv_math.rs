//! KV-cache arithmetic: the single place that turns a model's attention shape into bytes per
//! token and per block, and a byte budget into a block count.
//!
//! The block pool sizing at startup and `kvgate plan` both call these functions, so the two can
//! never disagree about how many tokens fit. Human-readable sizes ("40GiB", "256MiB") are parsed
//! and printed here too, because every size a user types ends up in this arithmetic.

use std::fmt;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
    BF16,
    F32,
    /// GGML Q8_0 layout: every run of 32 values is stored as 32 signed bytes plus one f16 scale,
    /// i.e. 34 bytes per 32 values (8.5 bits per value). A row that is not a multiple of 32 is
    /// padded up to the next whole block, as GGML does.
    Q8,
}

/// Values per Q8 block and bytes per Q8 block (32 × i8 + one f16 scale).
const Q8_BLOCK_VALUES: usize = 32;
const Q8_BLOCK_BYTES: usize = Q8_BLOCK_VALUES + 2;

impl KvDtype {
    /// Bytes needed to store one row of `values` elements (e.g. one head's K for one token).
    pub fn row_bytes(self, values: usize) -> usize {
        match self {
            KvDtype::F16 | KvDtype::BF16 => values * 2,
            KvDtype::F32 => values * 4,
            KvDtype::Q8 => values.div_ceil(Q8_BLOCK_VALUES) * Q8_BLOCK_BYTES,
        }
    }

    /// As [`KvDtype::row_bytes`], `None` where the byte count does not fit in a `usize`.
    pub fn checked_row_bytes(self, values: usize) -> Option<usize> {
        match self {
            KvDtype::F16 | KvDtype::BF16 => values.checked_mul(2),
            KvDtype::F32 => values.checked_mul(4),
            KvDtype::Q8 => values.div_ceil(Q8_BLOCK_VALUES).checked_mul(Q8_BLOCK_BYTES),
        }
    }

    /// Parses "f16", "bf16", "f32", "q8" (also "q8_0"), case-insensitively.
    pub fn parse(text: &str) -> Result<KvDtype, SizeParseError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "f16" | "fp16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::BF16),
            "f32" | "fp32" => Ok(KvDtype::F32),
            "q8" | "q8_0" => Ok(KvDtype::Q8),
            other => Err(SizeParseError::UnknownDtype(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::Q8 => "q8_0",
        }
    }
}

/// The attention shape that determines KV size: per token, each layer stores one K and one V
/// row of `head_dim` values for each of its `kv_heads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvShape {
    /// `2 (K and V) × layers × kv_heads × row_bytes(head_dim)`; for plain dtypes this is
    /// `2 × layers × kv_heads × head_dim × dtype_bytes`.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.dtype.row_bytes(self.head_dim)
    }

    pub fn bytes_per_block(&self, block_size: usize) -> usize {
        self.bytes_per_token() * block_size
    }

    /// As [`KvShape::bytes_per_token`], `None` where the product does not fit in a `usize`
    /// (shapes typed on a command line or read from a file can be anything).
    pub fn checked_bytes_per_token(&self) -> Option<usize> {
        2usize
            .checked_mul(self.layers)?
            .checked_mul(self.kv_heads)?
            .checked_mul(self.dtype.checked_row_bytes(self.head_dim)?)
    }

    /// As [`KvShape::bytes_per_block`], `None` where the product does not fit in a `usize`.
    pub fn checked_bytes_per_block(&self, block_size: usize) -> Option<usize> {
        self.checked_bytes_per_token()?.checked_mul(block_size)
    }

    /// Whole blocks that fit in `budget_bytes` (rounded down; 0 for a degenerate shape, and 0
    /// where one block's bytes overflow a `usize`: such a block is larger than any budget).
    pub fn blocks_for_budget(&self, budget_bytes: usize, block_size: usize) -> usize {
        self.checked_bytes_per_block(block_size)
            .and_then(|per_block| budget_bytes.checked_div(per_block))
            .unwrap_or(0)
    }
}

/// Blocks needed to hold `tokens` tokens (rounded up). A `block_size` of 0 is treated as 1 so
/// this never divides by zero; the engine rejects a zero block size at startup.
pub fn blocks_for_tokens(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size.max(1))
}

/// Why a size or dtype string could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeParseError {
    #[error("empty size: expected a number of bytes such as 40GiB, 256MiB or 1048576")]
    Empty,
    #[error("invalid number {0:?} in size: expected digits with an optional fraction, e.g. 1.5GiB")]
    InvalidNumber(String),
    #[error(
        "unknown size unit {0:?}: use B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
    )]
    UnknownUnit(String),
    #[error("size {0:?} is too large")]
    Overflow(String),
    #[error("unknown KV dtype {0:?}: use f16, bf16, f32 or q8")]
    UnknownDtype(String),
}

/// Unit multipliers, matched case-insensitively. A bare "k"/"m"/"g"/"t" means the binary unit,
/// as in most memory flags (`-Xmx4g`, docker `--memory 4g`).
const UNITS: &[(&str, u128)] = &[
    ("", 1),
    ("b", 1),
    ("k", 1 << 10),
    ("ki", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mi", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gi", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("ti", 1 << 40),
    ("tib", 1 << 40),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
];

/// Parses "40GiB", "256 MiB", "1.5g", "1048576" into bytes. Fractions are allowed and the
/// result is rounded down to whole bytes.
pub fn parse_size(text: &str) -> Result<usize, SizeParseError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(SizeParseError::Empty);
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, m)| *m)
        .ok_or_else(|| SizeParseError::UnknownUnit(unit.clone()))?;

    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(SizeParseError::InvalidNumber(number.to_string()));
    }
    let overflow = || SizeParseError::Overflow(text.to_string());
    // Exact integer arithmetic: value = (whole·10^f + fraction) · multiplier / 10^f.
    let digits = format!("{whole}{fraction}");
    let scaled: u128 = digits.parse().map_err(|_| overflow())?;
    let denominator = 10u128
        .checked_pow(u32::try_from(fraction.len()).map_err(|_| overflow())?)
        .ok_or_else(overflow)?;
    let bytes = scaled.checked_mul(multiplier).ok_or_else(overflow)? / denominator;
    usize::try_from(bytes).map_err(|_| overflow())
}

/// Prints bytes with the largest binary unit that keeps the number ≥ 1: exact values print
/// without decimals ("40GiB"), others with two ("1.50GiB"). Parses back with [`parse_size`].
pub fn format_size(bytes: usize) -> String {
    HumanSize(bytes).to_string()
}

/// `Display` adapter for a byte count, see [`format_size`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanSize(pub usize);

impl fmt::Display for HumanSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        let bytes = self.0 as u128;
        for (name, shift) in NAMES {
            let unit = 1u128 << shift;
            if bytes >= unit {
                return if bytes.is_multiple_of(unit) {
                    write!(f, "{}{name}", bytes / unit)
                } else {
                    write!(f, "{:.2}{name}", bytes as f64 / unit as f64)
                };
            }
        }
        write!(f, "{bytes}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> KvShape {
        // SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
        KvShape {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            dtype: KvDtype::F16,
        }
    }

    #[test]
    fn bytes_per_token_matches_the_formula() {
        assert_eq!(smollm2().bytes_per_token(), 2 * 30 * 3 * 64 * 2);
        assert_eq!(smollm2().bytes_per_block(16), 2 * 30 * 3 * 64 * 2 * 16);
        // Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, f16 = 128 KiB per token.
        let llama = KvShape {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: KvDtype::F16,
        };
        assert_eq!(llama.bytes_per_token(), 128 * 1024);
    }

    #[test]
    fn checked_sizes_agree_with_the_formula_and_see_overflow() {
        assert_eq!(
            smollm2().checked_bytes_per_token(),
            Some(smollm2().bytes_per_token())
        );
        assert_eq!(
            smollm2().checked_bytes_per_block(16),
            Some(smollm2().bytes_per_block(16))
        );
        // `kvgate plan --layers 4294967295 --hidden 4294967295`: 2·(2^32-1)·(2^32-1)·2 > 2^64.
        let huge = KvShape {
            layers: u32::MAX as usize,
            kv_heads: 1,
            head_dim: u32::MAX as usize,
            dtype: KvDtype::F16,
        };
        assert_eq!(huge.checked_bytes_per_token(), None);
        assert_eq!(huge.blocks_for_budget(1 << 30, 16), 0);
        assert_eq!(
            KvShape {
                head_dim: usize::MAX,
                ..smollm2()
            }
            .checked_bytes_per_token(),
            None,
            "the row itself overflows"
        );
        // Fits per token, overflows per block.
        assert_eq!(smollm2().checked_bytes_per_block(usize::MAX / 2), None);
        assert_eq!(smollm2().blocks_for_budget(usize::MAX, usize::MAX / 2), 0);
        assert_eq!(KvDtype::F32.checked_row_bytes(usize::MAX / 2), None);
        assert_eq!(KvDtype::Q8.checked_row_bytes(usize::MAX), None);
        assert_eq!(KvDtype::Q8.checked_row_bytes(64), Some(68));
    }

    #[test]
    fn q8_counts_the_scale_per_32_values() {
        assert_eq!(KvDtype::Q8.row_bytes(64), 68);
        assert_eq!(KvDtype::Q8.row_bytes(33), 68, "a partial block is padded");
        assert_eq!(KvDtype::F32.row_bytes(64), 256);
        assert_eq!(KvDtype::BF16.row_bytes(64), 128);
    }

    #[test]
    fn blocks_round_the_right_way() {
        assert_eq!(blocks_for_tokens(0, 16), 0);
        assert_eq!(blocks_for_tokens(1, 16), 1);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(17, 16), 2);
        let per_block = smollm2().bytes_per_block(16);
        assert_eq!(
            smollm2().blocks_for_budget(per_block * 10 + per_block - 1, 16),
            10
        );
        let empty = KvShape {
            layers: 0,
            ..smollm2()
        };
        assert_eq!(empty.blocks_for_budget(1 << 30, 16), 0);
    }

    #[test]
    fn parses_binary_decimal_and_plain_sizes() {
        assert_eq!(parse_size("40GiB"), Ok(40 << 30));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size(" 256 mib "), Ok(256 << 20));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn rejects_bad_sizes_with_specific_errors() {
        assert_eq!(parse_size(""), Err(SizeParseError::Empty));
        assert_eq!(
            parse_size("GiB"),
            Err(SizeParseError::InvalidNumber(String::new()))
        );
        assert_eq!(
            parse_size("1.2.3MiB"),
            Err(SizeParseError::InvalidNumber("1.2.3".into()))
        );
        assert_eq!(
            parse_size("12 parsecs"),
            Err(SizeParseError::UnknownUnit("parsecs".into()))
        );
        assert_eq!(
            parse_size("-5MiB"),
            Err(SizeParseError::UnknownUnit("-5mib".into()))
        );
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(SizeParseError::Overflow(_))
        ));
        assert!(matches!(
            parse_size("999999999999999999999999999999999999999999"),
            Err(SizeParseError::Overflow(_))
        ));
    }

    #[test]
    fn formats_and_round_trips() {
        assert_eq!(format_size(40 << 30), "40GiB");
        assert_eq!(format_size(3 << 29), "1.50GiB");
        assert_eq!(format_size(512), "512B");
        assert_eq!(format_size(0), "0B");
        for bytes in [0usize, 1, 1023, 1024, 5 << 20, 7 << 40, 123 << 30] {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
        }
    }

    #[test]
    fn parses_dtypes() {
        assert_eq!(KvDtype::parse("F16"), Ok(KvDtype::F16));
        assert_eq!(KvDtype::parse("q8_0"), Ok(KvDtype::Q8));
        assert!(matches!(
            KvDtype::parse("int4"),
            Err(SizeParseError::UnknownDtype(_))
        ));
    }
}
