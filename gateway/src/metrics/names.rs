//! Every kvgate metric family in one table: name, type, help text, and where its value comes
//! from. Names follow Prometheus conventions (base units, `_total` counters, `_seconds`,
//! `_bytes`, `_ratio`); a test below enforces them so a new metric cannot drift.

// ---- recorded on the request path (metrics facade → shared recorder) -------------------------
pub const REQUESTS_TOTAL: &str = "kvgate_requests_total";
pub const REQUESTS_REJECTED_TOTAL: &str = "kvgate_requests_rejected_total";
pub const QUEUE_ABANDONED_TOTAL: &str = "kvgate_queue_abandoned_total";
pub const QUEUE_WAIT_SECONDS: &str = "kvgate_queue_wait_seconds";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "kvgate_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "kvgate_inter_token_latency_seconds";
pub const REQUEST_DURATION_SECONDS: &str = "kvgate_request_duration_seconds";
pub const PROMPT_TOKENS: &str = "kvgate_prompt_tokens";
pub const GENERATION_TOKENS: &str = "kvgate_generation_tokens";
pub const PROMPT_TOKENS_TOTAL: &str = "kvgate_prompt_tokens_total";
pub const GENERATION_TOKENS_TOTAL: &str = "kvgate_generation_tokens_total";
pub const POLICY_RELOADS_TOTAL: &str = "kvgate_policy_reloads_total";
pub const UPSTREAM_RELOADS_TOTAL: &str = "kvgate_upstream_reloads_total";
pub const UPSTREAM_BREAKER_TOTAL: &str = "kvgate_upstream_breaker_transitions_total";
pub const UPSTREAM_REQUESTS_TOTAL: &str = "kvgate_upstream_requests_total";
pub const SHARED_STORE_ERRORS_TOTAL: &str = "kvgate_shared_store_errors_total";
pub const SHARED_COMPENSATIONS_TOTAL: &str = "kvgate_shared_compensations_total";
pub const UPSTREAM_RESPONSE_SECONDS: &str = "kvgate_upstream_response_seconds";
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "kvgate_prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "kvgate_prefix_cache_hits_total";

// ---- read from the engine and admission at scrape time ---------------------------------------
pub const KV_BLOCKS: &str = "kvgate_kv_blocks";
pub const KV_USAGE_RATIO: &str = "kvgate_kv_usage_ratio";
pub const KV_COMMITTED_RATIO: &str = "kvgate_kv_committed_ratio";
pub const KV_CAPACITY_BYTES: &str = "kvgate_kv_capacity_bytes";
pub const KV_BLOCK_SIZE_TOKENS: &str = "kvgate_kv_block_size_tokens";
pub const KV_WASTE_SLOTS: &str = "kvgate_kv_waste_slots";
pub const MEMORY_ALLOCATED_BYTES: &str = "kvgate_memory_allocated_bytes";
pub const MEMORY_RESERVED_BYTES: &str = "kvgate_memory_reserved_bytes";
pub const MEMORY_PEAK_ALLOCATED_BYTES: &str = "kvgate_memory_peak_allocated_bytes";
pub const MEMORY_BUDGET_BYTES: &str = "kvgate_memory_budget_bytes";
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "kvgate_process_resident_memory_bytes";
pub const DEVICE_MEMORY_USED_BYTES: &str = "kvgate_device_memory_used_bytes";
pub const DEVICE_MEMORY_TOTAL_BYTES: &str = "kvgate_device_memory_total_bytes";
pub const SEQUENCES: &str = "kvgate_sequences";
pub const REQUESTS_IN_FLIGHT: &str = "kvgate_requests_in_flight";
pub const REQUESTS_QUEUED: &str = "kvgate_requests_queued";
pub const QUEUED_TOKENS: &str = "kvgate_queued_tokens";
pub const PREEMPTIONS_TOTAL: &str = "kvgate_preemptions_total";
pub const CANCELLATIONS_TOTAL: &str = "kvgate_cancellations_total";
pub const ENGINE_STEPS_TOTAL: &str = "kvgate_engine_steps_total";
pub const BATCH_SIZE: &str = "kvgate_batch_size";
pub const BATCH_TOKENS: &str = "kvgate_batch_tokens";
pub const ENGINE_STEP_DURATION_SECONDS: &str = "kvgate_engine_step_duration_seconds";
pub const ENGINE_PREFILL_CAP_TOKENS: &str = "kvgate_engine_prefill_cap_tokens";
pub const ENGINE_TARGET_ITL_SECONDS: &str = "kvgate_engine_target_itl_seconds";
pub const BUILD_INFO: &str = "kvgate_build_info";
pub const UPSTREAM_CAPACITY_TOKENS: &str = "kvgate_upstream_capacity_tokens";
pub const UPSTREAM_REPLICAS: &str = "kvgate_upstream_replicas";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: name, type, labels (documentation and tests), help text.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

const fn family(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Family {
    Family {
        name,
        kind,
        labels,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram};

/// Families recorded through the `metrics` facade on the request path.
pub const RECORDED: &[Family] = &[
    family(
        REQUESTS_TOTAL,
        Counter,
        &["tenant", "route", "outcome"],
        "Requests that reached a handler, by final outcome: admitted, rejected (refused, with a reason in kvgate_requests_rejected_total), failed (a server fault), or abandoned (the handler never answered: the client left, or the request timed out).",
    ),
    family(
        REQUESTS_REJECTED_TOTAL,
        Counter,
        &["tenant", "reason"],
        "Refused requests by reason: auth, length, rate, quota, queue_full, queue_timeout, kv_saturation, concurrency_saturation, bad_request, unavailable.",
    ),
    family(
        SHARED_STORE_ERRORS_TOTAL,
        Counter,
        &["tenant", "behaviour"],
        "Shared rate-limit store (Redis) calls that failed or timed out, by the on_store_error behaviour applied: local, allow, deny.",
    ),
    family(
        SHARED_COMPENSATIONS_TOTAL,
        Counter,
        &["tenant", "outcome"],
        "Cancels sent after a shared admission call failed or timed out, by outcome: undone (it had run; its lease and charge were removed), not_run (it is now barred from running), already_cancelled, failed (never answered; what it took lapses with the lease ttl), dropped (not sent: too many cancels in flight; lapses the same way).",
    ),
    family(
        QUEUE_ABANDONED_TOTAL,
        Counter,
        &["tenant"],
        "Queued requests dropped because their client went away.",
    ),
    family(
        QUEUE_WAIT_SECONDS,
        Histogram,
        &["tenant"],
        "Time from entering admission to starting (queue wait plus KV reservation).",
    ),
    family(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Histogram,
        &["tenant", "model"],
        "Time from request arrival to the first generated token.",
    ),
    family(
        INTER_TOKEN_LATENCY_SECONDS,
        Histogram,
        &["tenant", "model"],
        "Time between successive tokens of one stream.",
    ),
    family(
        REQUEST_DURATION_SECONDS,
        Histogram,
        &["model"],
        "Time from request arrival to the end of its response.",
    ),
    family(
        PROMPT_TOKENS,
        Histogram,
        &["model"],
        "Prompt length of finished requests, in tokens.",
    ),
    family(
        GENERATION_TOKENS,
        Histogram,
        &["model"],
        "Generated tokens per finished request.",
    ),
    family(
        PROMPT_TOKENS_TOTAL,
        Counter,
        &["tenant", "model"],
        "Prompt tokens of finished requests.",
    ),
    family(
        PREFIX_CACHE_QUERIES_TOTAL,
        Counter,
        &["tenant"],
        "Prompt tokens of finished requests looked up in the prefix cache (vLLM's prefix_cache_queries).",
    ),
    family(
        PREFIX_CACHE_HITS_TOTAL,
        Counter,
        &["tenant"],
        "Prompt tokens the prefix cache served instead of computing them (vLLM's prefix_cache_hits).",
    ),
    family(
        GENERATION_TOKENS_TOTAL,
        Counter,
        &["tenant", "model"],
        "Tokens generated for finished requests.",
    ),
    family(
        POLICY_RELOADS_TOTAL,
        Counter,
        &["result"],
        "Policy file reloads by result (success or failure).",
    ),
    family(
        UPSTREAM_RELOADS_TOTAL,
        Counter,
        &["result"],
        "Upstreams file reloads by result (success or failure).",
    ),
    family(
        UPSTREAM_BREAKER_TOTAL,
        Counter,
        &["upstream", "replica", "to"],
        "Upstream replicas ejected (to=ejected) and readmitted (to=readmitted) by their \
         circuit breaker.",
    ),
    family(
        UPSTREAM_REQUESTS_TOTAL,
        Counter,
        &["upstream", "replica", "result"],
        "Requests sent to upstream replicas (retries included) by result: ok, client_error \
         (4xx), server_error (5xx), unreachable (no connection or no response in time).",
    ),
    family(
        UPSTREAM_RESPONSE_SECONDS,
        Histogram,
        &["upstream"],
        "Time from sending a request to an upstream replica to its response headers (a \
         stream's first byte; a non-streamed answer's whole generation).",
    ),
];

/// Families written from engine and admission state at scrape time.
pub const STATE: &[Family] = &[
    family(
        UPSTREAM_CAPACITY_TOKENS,
        Gauge,
        &["model"],
        "Declared KV capacity (tokens) of an upstream model's replicas whose circuit breaker is closed.",
    ),
    family(
        UPSTREAM_REPLICAS,
        Gauge,
        &["model", "state"],
        "Replicas of an upstream model by circuit-breaker state: healthy (closed), ejected (open), half_open (its trial is out).",
    ),
    family(
        KV_BLOCKS,
        Gauge,
        &["state"],
        "KV blocks by state: total, used (holding tokens), reserved (promised to admitted requests), free; cached (unreferenced blocks still holding a cached prefix, counted in free or reserved).",
    ),
    family(
        KV_USAGE_RATIO,
        Gauge,
        &[],
        "Fraction of KV blocks holding tokens (used / total).",
    ),
    family(
        KV_COMMITTED_RATIO,
        Gauge,
        &[],
        "Fraction of KV blocks used or reserved: what admission compares with its watermark.",
    ),
    family(KV_CAPACITY_BYTES, Gauge, &[], "Bytes of the KV block pool."),
    family(KV_BLOCK_SIZE_TOKENS, Gauge, &[], "Tokens per KV block."),
    family(
        KV_WASTE_SLOTS,
        Gauge,
        &[],
        "Allocated KV slots of running sequences not holding a token (partially filled last blocks).",
    ),
    family(
        MEMORY_ALLOCATED_BYTES,
        Gauge,
        &["kind"],
        "Bytes the backend holds, by kind: weights, kv, workspace.",
    ),
    family(
        MEMORY_RESERVED_BYTES,
        Gauge,
        &[],
        "Bytes the backend has reserved in total (on the CPU backend every reserved byte is allocated).",
    ),
    family(
        MEMORY_PEAK_ALLOCATED_BYTES,
        Gauge,
        &[],
        "Largest total backend allocation since start; never decreases.",
    ),
    family(
        MEMORY_BUDGET_BYTES,
        Gauge,
        &[],
        "Memory budget the server was given (0 when none).",
    ),
    family(
        PROCESS_RESIDENT_MEMORY_BYTES,
        Gauge,
        &[],
        "Resident set size of the kvgate process.",
    ),
    family(
        DEVICE_MEMORY_USED_BYTES,
        Gauge,
        &[],
        "GPU memory in use as the driver reports it (cuMemGetInfo), every process on the device included; absent on the CPU.",
    ),
    family(
        DEVICE_MEMORY_TOTAL_BYTES,
        Gauge,
        &[],
        "GPU memory in total as the driver reports it; absent on the CPU.",
    ),
    family(
        SEQUENCES,
        Gauge,
        &["state"],
        "Engine sequences by state: running, waiting.",
    ),
    family(
        REQUESTS_IN_FLIGHT,
        Gauge,
        &["tenant"],
        "Admitted requests not yet finished.",
    ),
    family(
        REQUESTS_QUEUED,
        Gauge,
        &["tenant"],
        "Requests waiting in the admission queue.",
    ),
    family(
        QUEUED_TOKENS,
        Gauge,
        &["tenant"],
        "Tokens (prompt + max_tokens) of requests waiting in the admission queue.",
    ),
    family(
        PREEMPTIONS_TOTAL,
        Counter,
        &[],
        "Sequences preempted (their KV freed, to be recomputed) to make room.",
    ),
    family(
        CANCELLATIONS_TOTAL,
        Counter,
        &[],
        "Sequences cancelled because their client went away.",
    ),
    family(ENGINE_STEPS_TOTAL, Counter, &[], "Engine scheduler steps."),
    family(
        BATCH_SIZE,
        Histogram,
        &[],
        "Sequences per engine step, every step since start (the engine's own cumulative histogram).",
    ),
    family(
        BATCH_TOKENS,
        Histogram,
        &[],
        "Tokens computed per engine step (prefill chunks plus decodes), every step since start.",
    ),
    family(
        ENGINE_STEP_DURATION_SECONDS,
        Histogram,
        &[],
        "Wall time of every engine step, from scheduling to streamed tokens: what a decoding stream waits per token.",
    ),
    family(
        ENGINE_PREFILL_CAP_TOKENS,
        Gauge,
        &[],
        "Most prompt tokens the last engine step could take: below the step budget when the step-time target capped it because sequences were decoding.",
    ),
    family(
        ENGINE_TARGET_ITL_SECONDS,
        Gauge,
        &[],
        "Step-time target the prefill cap keeps steps under while sequences decode (0 when off).",
    ),
    family(
        BUILD_INFO,
        Gauge,
        &["version", "backend", "model"],
        "Always 1; the labels describe this server.",
    ),
];

/// Histogram buckets of the recorded histograms (upper bounds; +Inf is implicit). The state
/// histograms use the engine's fixed bounds: `kvgate_runtime::engine::STEP_BUCKET_BOUNDS` for
/// [`BATCH_SIZE`] and [`BATCH_TOKENS`], `STEP_MICROS_BUCKET_BOUNDS` for
/// [`ENGINE_STEP_DURATION_SECONDS`].
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (
        UPSTREAM_RESPONSE_SECONDS,
        &[
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
        ],
    ),
    (
        QUEUE_WAIT_SECONDS,
        &[
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
        ],
    ),
    (
        TIME_TO_FIRST_TOKEN_SECONDS,
        &[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
        ],
    ),
    (
        INTER_TOKEN_LATENCY_SECONDS,
        &[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
        ],
    ),
    (
        REQUEST_DURATION_SECONDS,
        &[
            0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
        ],
    ),
    (PROMPT_TOKENS, TOKEN_BUCKETS),
    (GENERATION_TOKENS, TOKEN_BUCKETS),
];

const TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0,
];

/// Help text of a family, for the state writer.
pub(crate) fn family_of(name: &str) -> Option<&'static Family> {
    RECORDED.iter().chain(STATE).find(|f| f.name == name)
}

/// Registers HELP texts of the recorded families with the installed recorder.
pub(crate) fn describe_all() {
    for family in RECORDED {
        match family.kind {
            Kind::Counter => metrics::describe_counter!(family.name, family.help),
            Kind::Gauge => metrics::describe_gauge!(family.name, family.help),
            Kind::Histogram => metrics::describe_histogram!(family.name, family.help),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> impl Iterator<Item = &'static Family> {
        RECORDED.iter().chain(STATE)
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        for f in all() {
            assert!(f.name.starts_with("kvgate_"), "{}", f.name);
            assert!(
                f.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}",
                f.name
            );
            assert_eq!(
                f.kind == Kind::Counter,
                f.name.ends_with("_total"),
                "only counters end in _total: {}",
                f.name
            );
            for unit in ["_ms", "_milliseconds", "_kb", "_mb", "_percent", "_perc"] {
                assert!(!f.name.ends_with(unit), "use base units: {}", f.name);
            }
            assert!(
                !f.help.is_empty() && f.help.ends_with('.'),
                "help of {}",
                f.name
            );
            assert!(
                !f.labels.contains(&"le") && !f.labels.contains(&"quantile"),
                "{}",
                f.name
            );
        }
    }

    #[test]
    fn names_are_unique_and_histograms_have_buckets() {
        let mut names: Vec<_> = all().map(|f| f.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "duplicate metric name");
        for f in RECORDED.iter().filter(|f| f.kind == Kind::Histogram) {
            let buckets = HISTOGRAM_BUCKETS
                .iter()
                .find(|(n, _)| *n == f.name)
                .map(|(_, b)| *b);
            let Some(buckets) = buckets else {
                panic!("{} has no buckets", f.name)
            };
            assert!(
                buckets.windows(2).all(|w| w[0] < w[1]),
                "{} buckets must increase",
                f.name
            );
        }
        for f in STATE.iter().filter(|f| f.kind == Kind::Histogram) {
            assert!(
                HISTOGRAM_BUCKETS.iter().all(|(n, _)| *n != f.name),
                "{} is written from the engine's buckets, not recorded",
                f.name
            );
        }
        assert!(
            HISTOGRAM_BUCKETS
                .iter()
                .all(|(n, _)| RECORDED.iter().any(|f| f.name == *n)),
            "buckets only for recorded families"
        );
    }
}
