//! `--gpu-memory-utilization`: how device memory is divided before anything is allocated —
//! weights, the workspace of the largest step, and every remaining byte up to the utilization
//! limit to KV blocks, sized with the same [`KvShape`] formula as `kvgate plan`. Pure
//! arithmetic over numbers the device reports (total memory, free memory after the context
//! was created), so it is tested on the CPU.

use std::fmt;

use crate::kv_math::{HumanSize, KvShape};

/// What the plan is computed from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPlanInputs {
    /// `cuMemGetInfo` total.
    pub device_total: u64,
    /// `cuMemGetInfo` free, before the model is loaded (other processes and the CUDA context
    /// already hold the difference).
    pub device_free: u64,
    /// Fraction of `device_total` kvgate may hold, in (0, 1].
    pub utilization: f64,
    pub weights_bytes: u64,
    pub workspace_bytes: u64,
    pub kv_shape: KvShape,
    pub block_size: usize,
    /// The model's context length (for "full-length requests").
    pub context_length: usize,
}

/// The division of device memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPlan {
    /// `utilization × total`, capped by what is free.
    pub budget: u64,
    pub weights_bytes: u64,
    pub workspace_bytes: u64,
    pub num_blocks: usize,
    pub kv_bytes: u64,
    /// Tokens the KV blocks hold.
    pub kv_tokens: usize,
    /// Requests of the full context length that fit at once.
    pub max_full_length_requests: usize,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum MemoryPlanError {
    #[error("--gpu-memory-utilization must be in (0, 1], got {0}")]
    BadUtilization(f64),
    #[error(
        "the device budget of {budget} ({utilization} of {total}, {free} free) does not hold \
         the weights ({weights}), the workspace ({workspace}) and one KV block ({block}); \
         raise --gpu-memory-utilization, lower --max-batched-tokens, or free the device"
    )]
    TooSmall {
        budget: HumanSize,
        utilization: f64,
        total: HumanSize,
        free: HumanSize,
        weights: HumanSize,
        workspace: HumanSize,
        block: HumanSize,
    },
}

fn human(bytes: u64) -> HumanSize {
    HumanSize(usize::try_from(bytes).unwrap_or(usize::MAX))
}

impl MemoryPlan {
    pub fn compute(i: &MemoryPlanInputs) -> Result<MemoryPlan, MemoryPlanError> {
        if !(i.utilization > 0.0 && i.utilization <= 1.0) {
            return Err(MemoryPlanError::BadUtilization(i.utilization));
        }
        // The limit is a share of the whole device (vLLM's meaning), but memory another
        // process holds cannot be planned for, so the free figure caps it.
        let share = (i.device_total as f64 * i.utilization).floor() as u64;
        let budget = share.min(i.device_free);
        let block_bytes = i.kv_shape.bytes_per_block(i.block_size) as u64;
        let fixed = i.weights_bytes.saturating_add(i.workspace_bytes);
        let left = budget.saturating_sub(fixed);
        let num_blocks = left
            .checked_div(block_bytes)
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
        if num_blocks == 0 {
            return Err(MemoryPlanError::TooSmall {
                budget: human(budget),
                utilization: i.utilization,
                total: human(i.device_total),
                free: human(i.device_free),
                weights: human(i.weights_bytes),
                workspace: human(i.workspace_bytes),
                block: human(block_bytes),
            });
        }
        let kv_tokens = num_blocks.saturating_mul(i.block_size);
        Ok(MemoryPlan {
            budget,
            weights_bytes: i.weights_bytes,
            workspace_bytes: i.workspace_bytes,
            num_blocks,
            kv_bytes: num_blocks as u64 * block_bytes,
            kv_tokens,
            max_full_length_requests: kv_tokens / i.context_length.max(1),
        })
    }

    /// Everything the plan allocates.
    pub fn planned_bytes(&self) -> u64 {
        self.weights_bytes + self.workspace_bytes + self.kv_bytes
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU memory plan: budget {}, weights {}, workspace {}, KV {} blocks = {} tokens ({}), \
             {} full-length requests at once",
            human(self.budget),
            human(self.weights_bytes),
            human(self.workspace_bytes),
            self.num_blocks,
            self.kv_tokens,
            human(self.kv_bytes),
            self.max_full_length_requests
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// Llama-2-13B on an H200 (the brief's worked example): 40 layers × 40 KV heads × 128 dims
    /// × 2 (K, V) × 2 bytes = 800 KiB per token, 12.5 MiB per 16-token block.
    fn llama13b_on_h200(utilization: f64) -> MemoryPlanInputs {
        MemoryPlanInputs {
            device_total: 141 * GIB,
            device_free: 140 * GIB,
            utilization,
            weights_bytes: 7_365_000_000, // Q4_0
            workspace_bytes: GIB,
            kv_shape: KvShape {
                layers: 40,
                kv_heads: 40,
                head_dim: 128,
                dtype: crate::kv_math::KvDtype::F16,
            },
            block_size: 16,
            context_length: 4096,
        }
    }

    #[test]
    fn kv_gets_what_is_left_of_the_utilization_share_in_whole_blocks() {
        let i = llama13b_on_h200(0.9);
        let plan = MemoryPlan::compute(&i).expect("fits");
        let budget = (141.0 * GIB as f64 * 0.9).floor() as u64;
        assert_eq!(plan.budget, budget);
        let block = 16 * 819_200u64;
        assert_eq!(i.kv_shape.bytes_per_block(16) as u64, block);
        let blocks = (budget - 7_365_000_000 - GIB) / block;
        assert_eq!(plan.num_blocks as u64, blocks);
        assert_eq!(plan.kv_tokens as u64, blocks * 16);
        assert_eq!(plan.max_full_length_requests as u64, blocks * 16 / 4096);
        assert!(plan.planned_bytes() <= plan.budget);
        assert!(
            plan.budget - plan.planned_bytes() < block,
            "no whole block left unused"
        );
        let line = plan.to_string();
        assert!(line.contains(&format!("KV {blocks} blocks")), "{line}");
    }

    #[test]
    fn memory_other_processes_hold_caps_the_budget() {
        let mut i = llama13b_on_h200(0.9);
        i.device_free = 40 * GIB;
        let plan = MemoryPlan::compute(&i).expect("fits");
        assert_eq!(plan.budget, 40 * GIB);
        assert!(plan.planned_bytes() <= 40 * GIB);
    }

    #[test]
    fn a_budget_without_room_for_one_block_and_bad_fractions_are_refused() {
        let mut i = llama13b_on_h200(0.055); // 8.33 GB < weights + workspace
        let err = MemoryPlan::compute(&i).unwrap_err();
        assert!(matches!(err, MemoryPlanError::TooSmall { .. }), "{err}");
        assert!(
            err.to_string().contains("raise --gpu-memory-utilization"),
            "{err}"
        );
        for bad in [0.0, -0.5, 1.01, f64::NAN] {
            i.utilization = bad;
            assert!(matches!(
                MemoryPlan::compute(&i),
                Err(MemoryPlanError::BadUtilization(_))
            ));
        }
    }
}
