//! `GET /admin/kv`: who holds the KV pool right now, for an operator asking "why is the cache
//! full?" (vllm#14412 "only two requests, KV cache 100%?").
//!
//! The report joins three views taken one after another: the pool's block accounting, the
//! engine's per-sequence snapshots (as of its last step), and the admission queues. Per-tenant
//! rows add up each tenant's sequences and queue; `largest` lists the ten biggest holders.
//! Because the views are not one atomic snapshot, `unattributed_*` may be briefly non-zero
//! while sequences start or finish; a value that stays non-zero points at leaked blocks or
//! reservations held outside the engine (admitted requests not yet submitted).

use std::collections::BTreeMap;

use http::HeaderMap;
use kvgate_runtime::block_pool::Occupancy;
use kvgate_runtime::engine::{Engine, EngineStats, SeqSnapshot, SeqStatus};
use serde::Serialize;

use crate::admission::{Admission, TenantQueueSnapshot};
use crate::auth::authenticate_admin;
use crate::error::GatewayError;

/// Sequences listed in [`KvReport::largest`].
pub const LARGEST_HOLDERS: usize = 10;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvReport {
    pub pool: PoolReport,
    /// One row per tenant with sequences or queue state, by tenant name.
    pub tenants: Vec<TenantKv>,
    /// The [`LARGEST_HOLDERS`] sequences holding the most blocks, largest first.
    pub largest: Vec<SeqKv>,
    /// Every live sequence, largest first.
    pub sequences: Vec<SeqKv>,
    /// The engine's prefix-cache counters since start (`pool.cached_blocks` is the cache's
    /// unreferenced part; blocks shared by running sequences count in each one's `blocks`).
    pub prefix_cache: PrefixCacheReport,
}

/// Prompt tokens looked up in the prefix cache and served by it, since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PrefixCacheReport {
    pub enabled: bool,
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    /// hit ÷ queried, 0 before any query.
    pub hit_ratio: f64,
}

impl PrefixCacheReport {
    pub fn of(stats: &EngineStats) -> PrefixCacheReport {
        let (queried, hits) = (
            stats.prefix_cache_queries_total,
            stats.prefix_cache_hits_total,
        );
        PrefixCacheReport {
            enabled: stats.prefix_caching,
            queried_tokens: queried,
            hit_tokens: hits,
            hit_ratio: if queried == 0 {
                0.0
            } else {
                hits as f64 / queried as f64
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolReport {
    #[serde(flatten)]
    pub occupancy: Occupancy,
    pub total_bytes: usize,
    pub used_bytes: usize,
    pub reserved_bytes: usize,
    pub free_bytes: usize,
    pub usage_ratio: f64,
    pub committed_ratio: f64,
    /// Used blocks not held by any listed sequence.
    pub unattributed_used_blocks: usize,
    /// Reserved blocks not promised to any listed sequence (admitted, not yet in the engine).
    pub unattributed_reserved_blocks: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantKv {
    pub tenant: String,
    pub sequences: usize,
    pub running: usize,
    pub blocks: usize,
    pub reserved_blocks: usize,
    pub bytes: usize,
    /// Prompt + generated tokens of its sequences.
    pub tokens: usize,
    pub queued_requests: usize,
    pub queued_tokens: u64,
    pub in_flight: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SeqKv {
    #[serde(flatten)]
    pub seq: SeqSnapshot,
    /// Bytes of the blocks it holds.
    pub bytes: usize,
}

impl KvReport {
    /// Reads the pool, the engine's sequences and (if given) the admission queues.
    pub fn collect(engine: &Engine, admission: Option<&Admission>) -> KvReport {
        let occupancy = engine.pool().snapshot();
        let sequences = engine.inspect();
        let queues = admission.map(Admission::queue_snapshot).unwrap_or_default();
        let mut report = KvReport::build(occupancy, sequences, &queues);
        report.prefix_cache = PrefixCacheReport::of(&engine.stats());
        report
    }

    /// Joins the three views; pure, so it is tested without an engine.
    pub fn build(
        occupancy: Occupancy,
        sequences: Vec<SeqSnapshot>,
        queues: &[TenantQueueSnapshot],
    ) -> KvReport {
        let bytes_per_block = occupancy.bytes_per_block;
        let mut tenants: BTreeMap<String, TenantKv> = BTreeMap::new();
        let row = |tenants: &mut BTreeMap<String, TenantKv>, name: &str| -> TenantKv {
            tenants.remove(name).unwrap_or_else(|| TenantKv {
                tenant: name.to_string(),
                ..TenantKv::default()
            })
        };
        for seq in &sequences {
            let mut tenant = row(&mut tenants, &seq.label);
            tenant.sequences += 1;
            tenant.running += usize::from(seq.state == SeqStatus::Running);
            tenant.blocks += seq.blocks;
            tenant.reserved_blocks += seq.reserved_blocks;
            tenant.bytes += seq.blocks * bytes_per_block;
            tenant.tokens += seq.prompt_tokens + seq.output_tokens;
            tenants.insert(tenant.tenant.clone(), tenant);
        }
        for queue in queues {
            let mut tenant = row(&mut tenants, &queue.tenant);
            tenant.queued_requests = queue.queued_requests;
            tenant.queued_tokens = queue.queued_tokens;
            tenant.in_flight = queue.in_flight;
            tenants.insert(tenant.tenant.clone(), tenant);
        }

        let held: usize = sequences.iter().map(|s| s.blocks).sum();
        let promised: usize = sequences.iter().map(|s| s.reserved_blocks).sum();
        let mut sequences: Vec<SeqKv> = sequences
            .into_iter()
            .map(|seq| SeqKv {
                bytes: seq.blocks * bytes_per_block,
                seq,
            })
            .collect();
        sequences.sort_by(|a, b| {
            b.seq
                .blocks
                .cmp(&a.seq.blocks)
                .then(a.seq.id.cmp(&b.seq.id))
        });
        KvReport {
            pool: PoolReport {
                occupancy,
                total_bytes: occupancy.total_bytes(),
                used_bytes: occupancy.used_bytes(),
                reserved_bytes: occupancy.reserved_bytes(),
                free_bytes: occupancy.free_bytes(),
                usage_ratio: occupancy.usage_ratio(),
                committed_ratio: occupancy.committed_ratio(),
                unattributed_used_blocks: occupancy.used_blocks.saturating_sub(held),
                unattributed_reserved_blocks: occupancy.reserved_blocks.saturating_sub(promised),
            },
            tenants: tenants.into_values().collect(),
            largest: sequences.iter().take(LARGEST_HOLDERS).cloned().collect(),
            sequences,
            prefix_cache: PrefixCacheReport::default(),
        }
    }
}

/// The `/admin/kv` handler body: checks the admin key against the current policy, then
/// reports. Route it as
/// `get(|State(s): State<AppState>, headers: HeaderMap| async move { inspect::admin_kv(&s.engine, &s.admission, &headers) })`.
pub fn admin_kv(
    engine: &Engine,
    admission: &Admission,
    headers: &HeaderMap,
) -> Result<axum::Json<KvReport>, GatewayError> {
    authenticate_admin(&admission.policy_store().current(), headers)?;
    Ok(axum::Json(KvReport::collect(engine, Some(admission))))
}

#[cfg(test)]
mod tests;
