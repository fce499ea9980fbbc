//! `--metrics-compat vllm`: the vLLM v1 metric names that routers and autoscalers scrape
//! (Gateway API Inference Extension EPP, llm-d, KEDA recipes), so kvgate can sit behind them.
//!
//! Faithful to vLLM's exposition: every series carries `model_name` and `engine="0"`; counters
//! are exposed the way `prometheus_client` writes them, with the `_total` suffix in both the
//! TYPE line and the sample (`vllm:num_preemptions_total`); `vllm:cache_config_info` is a gauge
//! fixed at 1 whose labels are the cache configuration, values as Python prints them.
//!
//! Meaning: `num_requests_waiting` counts every accepted request not yet running, i.e. the
//! gateway's admission queues plus the engine's waiting list, because a router balancing on it
//! wants the whole backlog. `kv_cache_usage_perc` is used blocks / total (0–1), like vLLM.

use super::MetricsConfig;
use super::exposition::Writer;
use super::state::Snapshot;

pub(super) fn write(out: &mut Writer, snap: &Snapshot, config: &MetricsConfig) {
    let ids = [("engine", "0"), ("model_name", config.model.as_str())];
    let mut gauge = |name: &str, help: &str, value: f64| {
        out.family(name, "gauge", help);
        out.sample(name, &ids, value);
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        snap.stats.running as f64,
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        snap.waiting_requests() as f64,
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        snap.occupancy.usage_ratio(),
    );

    let counters = [
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            snap.stats.preemptions_total,
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            snap.stats.prompt_tokens_total,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            snap.stats.generation_tokens_total,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            snap.stats.prefix_cache_queries_total,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            snap.stats.prefix_cache_hits_total,
        ),
    ];
    for (name, help, value) in counters {
        out.family(name, "counter", help);
        out.sample(name, &ids, value as f64);
    }

    let block_size = snap.occupancy.block_size.to_string();
    let num_blocks = snap.occupancy.total_blocks.to_string();
    let info = [
        ("block_size", block_size.as_str()),
        ("cache_dtype", "auto"),
        (
            "enable_prefix_caching",
            if snap.stats.prefix_caching {
                "True"
            } else {
                "False"
            },
        ),
        ("engine", "0"),
        ("num_cpu_blocks", "None"),
        ("num_gpu_blocks", num_blocks.as_str()),
    ];
    out.family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    out.sample("vllm:cache_config_info", &info, 1.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::TenantQueueSnapshot;
    use crate::metrics::exposition::Scrape;
    use kvgate_runtime::block_pool::Occupancy;
    use kvgate_runtime::engine::EngineStats;

    #[test]
    fn exports_the_names_and_labels_an_epp_scrapes() {
        let snap = Snapshot {
            stats: EngineStats {
                running: 2,
                waiting: 1,
                preemptions_total: 3,
                prefix_cache_queries_total: 400,
                prefix_cache_hits_total: 320,
                prefix_caching: true,
                ..EngineStats::default()
            },
            occupancy: Occupancy {
                total_blocks: 200,
                used_blocks: 50,
                block_size: 16,
                ..Occupancy::default()
            },
            queues: Some(vec![TenantQueueSnapshot {
                tenant: "t".into(),
                queued_requests: 4,
                queued_tokens: 0,
                in_flight: 2,
            }]),
            resident_bytes: None,
        };
        let mut out = Writer::default();
        write(
            &mut out,
            &snap,
            &MetricsConfig {
                model: "smol".into(),
                ..MetricsConfig::default()
            },
        );
        let text = out.finish();
        let scrape = match Scrape::parse(&text) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        let ids = [("model_name", "smol"), ("engine", "0")];
        assert_eq!(scrape.value("vllm:num_requests_running", &ids), Some(2.0));
        assert_eq!(
            scrape.value("vllm:num_requests_waiting", &ids),
            Some(5.0),
            "queue + engine"
        );
        assert_eq!(scrape.value("vllm:kv_cache_usage_perc", &ids), Some(0.25));
        assert_eq!(scrape.value("vllm:num_preemptions_total", &ids), Some(3.0));
        assert_eq!(scrape.types["vllm:num_preemptions_total"], "counter");
        assert_eq!(
            scrape.value("vllm:prefix_cache_queries_total", &ids),
            Some(400.0)
        );
        assert_eq!(
            scrape.value("vllm:prefix_cache_hits_total", &ids),
            Some(320.0)
        );
        assert_eq!(scrape.types["vllm:prefix_cache_hits_total"], "counter");
        assert_eq!(
            scrape.value(
                "vllm:cache_config_info",
                &[
                    ("block_size", "16"),
                    ("num_gpu_blocks", "200"),
                    ("enable_prefix_caching", "True")
                ]
            ),
            Some(1.0)
        );
        assert!(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .all(|l| l.starts_with("vllm:"))
        );
    }
}
