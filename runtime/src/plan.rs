//! Capacity planning for `kvgate plan`: how much KV one request needs, how many blocks a memory
//! budget buys, and how many full-length requests fit at once.
//!
//! The shape comes from a GGUF file (the same [`ModelConfig::kv_shape`] the engine uses) or from
//! explicit flags, and every number is computed with [`crate::kv_math`], the arithmetic that
//! sizes the real block pool, so the plan and the running server cannot disagree.
//!
//! Budget semantics: `memory` is the KV pool budget, exactly what `kvgate serve --kv-memory`
//! takes, so the plan's block count is the server's. The model's weights are reported next to
//! it (and added into `total_bytes`) rather than subtracted, because the server sizes its pool
//! from `--kv-memory` alone. The safety `margin` never shrinks the pool: it is headroom kept
//! free when counting concurrent requests, like the gateway's admission watermark.

use std::fmt;
use std::path::PathBuf;

use crate::gguf::{GgufError, GgufFile};
use crate::kv_math::{self, HumanSize, KvDtype, KvShape, SizeParseError};
use crate::model::{ModelConfig, ModelError};

/// Default tokens per KV block, as in the engine and vLLM.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Default fraction of the pool kept free when counting concurrent requests.
pub const DEFAULT_MARGIN: f64 = 0.15;

/// The inputs of a plan, one field per CLI flag (the CLI forwards them unchanged).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanArgs {
    /// A GGUF model to read the shape and weight size from.
    pub model: Option<PathBuf>,
    pub layers: Option<usize>,
    pub kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    /// Model width, for a shape without grouped-query attention (`kv_heads × head_dim`).
    pub hidden: Option<usize>,
    /// KV element type ("f16", "bf16", "f32", "q8"); f16 when absent, as the CPU backend stores.
    pub dtype: Option<String>,
    /// KV pool budget, e.g. "40GiB" (the same value as `kvgate serve --kv-memory`).
    pub memory: String,
    /// Tokens of one full-length request (prompt + generation); the model's context by default.
    pub max_context: Option<usize>,
    pub block_size: usize,
    pub margin: f64,
}

impl Default for PlanArgs {
    fn default() -> Self {
        PlanArgs {
            model: None,
            layers: None,
            kv_heads: None,
            head_dim: None,
            hidden: None,
            dtype: None,
            memory: String::new(),
            max_context: None,
            block_size: DEFAULT_BLOCK_SIZE,
            margin: DEFAULT_MARGIN,
        }
    }
}

/// Why a plan could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {source}")]
    Model { path: PathBuf, source: ModelError },
    #[error("--{flag}: {source}")]
    Parse {
        flag: &'static str,
        source: SizeParseError,
    },
    #[error(
        "no model shape: give --model PATH, or --layers N with --kv-heads N --head-dim N or --hidden N"
    )]
    MissingShape,
    #[error("--model and explicit shape flags (--{0}) cannot be combined")]
    ModelAndShape(&'static str),
    #[error("--layers is required with an explicit shape")]
    MissingLayers,
    #[error("give either --kv-heads with --head-dim, or --hidden, not both")]
    AmbiguousWidth,
    #[error("--kv-heads and --head-dim must be given together")]
    IncompleteHeads,
    #[error("an explicit shape needs its width: --kv-heads N --head-dim N, or --hidden N")]
    MissingWidth,
    #[error("--{flag} must be at least 1")]
    Zero { flag: &'static str },
    #[error("--max-context is required with an explicit shape (the model's context is unknown)")]
    MissingMaxContext,
    #[error("--margin must be in [0, 1), got {0}")]
    Margin(f64),
    /// A size the plan computes is more than a `usize` holds: `quantity` overflows as computed
    /// from `detail`; `lower` names the flags to change.
    #[error("{quantity} overflows: {detail} is more than 2^64 bytes; lower {lower}")]
    Overflow {
        quantity: &'static str,
        detail: String,
        lower: &'static str,
    },
    /// Not one block fits: the server refuses to start with this budget (its
    /// `KvBudgetTooSmall`), so there is nothing to plan.
    #[error(
        "--memory {budget} is smaller than one KV block ({block} for {block_size} tokens): the \
         server would refuse to start; raise --memory or lower --block-size"
    )]
    BudgetBelowOneBlock {
        budget: HumanSize,
        block: HumanSize,
        block_size: usize,
    },
}

/// The result of a plan; `Display` prints it for people (one line per fact, each ending in a
/// newline), `Serialize` for `--json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PlanReport {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: &'static str,
    /// Bytes of tensor data in the model file, when a model was given.
    pub weights_bytes: Option<u64>,
    /// Bytes the KV pool may use (`--memory`).
    pub kv_budget_bytes: usize,
    /// Weights plus KV pool, when the weights are known.
    pub total_bytes: Option<u64>,
    pub block_size: usize,
    pub kv_bytes_per_token: usize,
    pub kv_bytes_per_block: usize,
    pub max_context: usize,
    /// Blocks one full-length request reserves (rounded up to whole blocks).
    pub blocks_per_request: usize,
    /// Bytes one full-length request reserves (`blocks_per_request` whole blocks).
    pub kv_bytes_per_request: usize,
    /// Blocks the pool gets: exactly what the engine allocates for the same KV budget.
    pub num_blocks: usize,
    pub pool_tokens: usize,
    /// Full-length requests that fit in the whole pool.
    pub max_concurrency: usize,
    pub margin: f64,
    /// Full-length requests that fit while keeping `margin` of the pool free.
    pub max_concurrency_with_margin: usize,
    /// Problems a user should act on (e.g. a single request does not fit).
    pub warnings: Vec<String>,
}

/// Where the KV shape came from.
struct Shape {
    kv: KvShape,
    weights_bytes: Option<u64>,
    model_context: Option<usize>,
}

impl PlanReport {
    /// Reads the model (if any), validates the flags and computes the plan.
    pub fn compute(args: &PlanArgs) -> Result<PlanReport, PlanError> {
        let dtype = match &args.dtype {
            Some(text) => KvDtype::parse(text).map_err(|source| PlanError::Parse {
                flag: "dtype",
                source,
            })?,
            None => KvDtype::F16,
        };
        let shape = resolve_shape(args, dtype)?;
        if args.block_size == 0 {
            return Err(PlanError::Zero { flag: "block-size" });
        }
        if !(0.0..1.0).contains(&args.margin) {
            return Err(PlanError::Margin(args.margin));
        }
        let max_context = args
            .max_context
            .or(shape.model_context)
            .ok_or(PlanError::MissingMaxContext)?;
        if max_context == 0 {
            return Err(PlanError::Zero {
                flag: "max-context",
            });
        }
        let kv_budget_bytes =
            kv_math::parse_size(&args.memory).map_err(|source| PlanError::Parse {
                flag: "memory",
                source,
            })?;
        Self::from_parts(shape, dtype, max_context, kv_budget_bytes, args)
    }

    fn from_parts(
        shape: Shape,
        dtype: KvDtype,
        max_context: usize,
        kv_budget_bytes: usize,
        args: &PlanArgs,
    ) -> Result<PlanReport, PlanError> {
        let kv = shape.kv;
        let block_size = args.block_size;
        let kv_bytes_per_token =
            kv.checked_bytes_per_token()
                .ok_or_else(|| PlanError::Overflow {
                    quantity: "KV bytes per token",
                    detail: format!(
                        "2 × {} layers × {} KV heads × {} values of {}",
                        kv.layers,
                        kv.kv_heads,
                        kv.head_dim,
                        dtype.name()
                    ),
                    lower: "--layers, --kv-heads, --head-dim or --hidden",
                })?;
        let kv_bytes_per_block =
            kv.checked_bytes_per_block(block_size)
                .ok_or_else(|| PlanError::Overflow {
                    quantity: "KV bytes per block",
                    detail: format!(
                        "{kv_bytes_per_token} bytes per token × --block-size {block_size}"
                    ),
                    lower: "--block-size",
                })?;
        let num_blocks = kv.blocks_for_budget(kv_budget_bytes, block_size);
        if num_blocks == 0 {
            return Err(PlanError::BudgetBelowOneBlock {
                budget: HumanSize(kv_budget_bytes),
                block: HumanSize(kv_bytes_per_block),
                block_size,
            });
        }
        let blocks_per_request = kv_math::blocks_for_tokens(max_context, block_size);
        let kv_bytes_per_request = blocks_per_request
            .checked_mul(kv_bytes_per_block)
            .ok_or_else(|| PlanError::Overflow {
                quantity: "KV bytes per request",
                detail: format!(
                    "{blocks_per_request} blocks ({max_context} tokens) × {kv_bytes_per_block} \
                     bytes per block"
                ),
                lower: "--max-context",
            })?;
        // Blocks usable while keeping the margin free; floor so the margin is never eaten into.
        let usable_blocks = (num_blocks as f64 * (1.0 - args.margin)).floor() as usize;
        let per_request = blocks_per_request.max(1);
        let mut warnings = Vec::new();
        if blocks_per_request > num_blocks {
            warnings.push(format!(
                "one {max_context}-token request needs {blocks_per_request} blocks but the pool has \
                 {num_blocks}: the server would reject it; raise the memory or lower --max-context"
            ));
        } else if blocks_per_request > usable_blocks {
            warnings.push(format!(
                "one {max_context}-token request fits only by eating into the {:.0}% margin",
                args.margin * 100.0
            ));
        }
        Ok(PlanReport {
            layers: kv.layers,
            kv_heads: kv.kv_heads,
            head_dim: kv.head_dim,
            dtype: dtype.name(),
            weights_bytes: shape.weights_bytes,
            kv_budget_bytes,
            total_bytes: shape
                .weights_bytes
                .map(|w| w.saturating_add(kv_budget_bytes as u64)),
            block_size,
            kv_bytes_per_token,
            kv_bytes_per_block,
            max_context,
            blocks_per_request,
            kv_bytes_per_request,
            num_blocks,
            // num_blocks × block_size × kv_bytes_per_token ≤ the budget, so this cannot
            // overflow; saturating all the same rather than trusting that in release builds.
            pool_tokens: num_blocks.saturating_mul(block_size),
            max_concurrency: num_blocks / per_request,
            margin: args.margin,
            max_concurrency_with_margin: usable_blocks / per_request,
            warnings,
        })
    }
}

/// The KV shape from the model file, or from explicit flags.
fn resolve_shape(args: &PlanArgs, dtype: KvDtype) -> Result<Shape, PlanError> {
    let explicit = [
        ("layers", args.layers),
        ("kv-heads", args.kv_heads),
        ("head-dim", args.head_dim),
        ("hidden", args.hidden),
    ];
    if let Some(path) = &args.model {
        if let Some((flag, _)) = explicit.iter().find(|(_, v)| v.is_some()) {
            return Err(PlanError::ModelAndShape(flag));
        }
        let gguf = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&gguf).map_err(|source| PlanError::Model {
            path: path.clone(),
            source,
        })?;
        return Ok(Shape {
            kv: KvShape {
                dtype,
                ..config.kv_shape()
            },
            weights_bytes: Some(gguf.tensor_bytes()),
            model_context: Some(config.context_length),
        });
    }
    if explicit.iter().all(|(_, v)| v.is_none()) {
        return Err(PlanError::MissingShape);
    }
    for (flag, value) in explicit {
        if value == Some(0) {
            return Err(PlanError::Zero { flag });
        }
    }
    let layers = args.layers.ok_or(PlanError::MissingLayers)?;
    let (kv_heads, head_dim) = match (args.kv_heads, args.head_dim, args.hidden) {
        (Some(heads), Some(dim), None) => (heads, dim),
        // No GQA: every head has its own K and V, so a token's row per layer is the full width.
        (None, None, Some(hidden)) => (1, hidden),
        (None, None, None) => return Err(PlanError::MissingWidth),
        (Some(_), Some(_), Some(_)) | (Some(_), None, Some(_)) | (None, Some(_), Some(_)) => {
            return Err(PlanError::AmbiguousWidth);
        }
        _ => return Err(PlanError::IncompleteHeads),
    };
    Ok(Shape {
        kv: KvShape {
            layers,
            kv_heads,
            head_dim,
            dtype,
        },
        weights_bytes: None,
        model_context: None,
    })
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "shape            {} layers, KV width {} ({} heads × {}), {}",
            self.layers,
            self.kv_heads * self.head_dim,
            self.kv_heads,
            self.head_dim,
            self.dtype
        )?;
        match self.weights_bytes {
            Some(w) => writeln!(f, "weights          {}", HumanSize(w as usize))?,
            None => writeln!(f, "weights          unknown (no --model)")?,
        }
        writeln!(f, "KV pool budget   {}", HumanSize(self.kv_budget_bytes))?;
        if let Some(total) = self.total_bytes {
            writeln!(f, "weights + KV     {}", HumanSize(total as usize))?;
        }
        writeln!(
            f,
            "KV per token     {} ({} per {}-token block)",
            HumanSize(self.kv_bytes_per_token),
            HumanSize(self.kv_bytes_per_block),
            self.block_size
        )?;
        writeln!(
            f,
            "KV per request   {} ({} tokens = {} blocks)",
            HumanSize(self.kv_bytes_per_request),
            self.max_context,
            self.blocks_per_request
        )?;
        writeln!(
            f,
            "pool             {} blocks = {} tokens",
            self.num_blocks, self.pool_tokens
        )?;
        writeln!(
            f,
            "max concurrency  {} full-length requests",
            self.max_concurrency
        )?;
        writeln!(
            f,
            "with {:.0}% margin  {} full-length requests",
            self.margin * 100.0,
            self.max_concurrency_with_margin
        )?;
        for warning in &self.warnings {
            writeln!(f, "warning: {warning}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
