//! `/metrics` against a real engine thread driven by a gated fake backend: the gate holds a
//! sequence in its first step, so "while running" and "after" are states we wait for, not
//! moments we hope to catch.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvgate_runtime::backend::{Backend, BackendError, BatchInputs, MemoryUsage};
use kvgate_runtime::engine::{
    Engine, EngineConfig, GenerationRequest, SamplingParams, StopParams, TokenDecoder, TokenEvent,
};

use super::exposition::Scrape;
use super::*;

mod examples;

const VOCAB: usize = 8;

/// Opens once; every forward pass waits for it.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn open(&self) {
        let (lock, cvar) = &*self.0;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cvar.notify_all();
    }
    fn wait(&self) {
        let (lock, cvar) = &*self.0;
        let mut open = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !*open {
            open = cvar.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
}

struct GatedBackend(Gate);

impl Backend for GatedBackend {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.wait();
        logits.clear();
        logits.resize(inputs.num_logits_rows() * VOCAB, 0.0);
        for row in logits.chunks_mut(VOCAB) {
            row[1] = 1.0;
        }
        Ok(())
    }
    fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            weights_bytes: 1000,
            kv_bytes: 6400,
            workspace_bytes: 24,
            device: None,
        }
    }
}

struct Letters;

impl TokenDecoder for Letters {
    fn token_bytes(&self, _id: u32) -> &[u8] {
        b"a"
    }
    fn is_eog(&self, _id: u32) -> bool {
        false
    }
    fn is_special(&self, _id: u32) -> bool {
        false
    }
}

fn engine(gate: &Gate) -> Engine {
    let config = EngineConfig {
        num_blocks: 64,
        block_size: 16,
        bytes_per_block: 100,
        ..EngineConfig::default()
    };
    match Engine::spawn(
        Box::new(GatedBackend(gate.clone())),
        Arc::new(Letters),
        config,
    ) {
        Ok(engine) => engine,
        Err(e) => panic!("{e}"),
    }
}

fn scrape(metrics: &Metrics) -> Scrape {
    match Scrape::parse(&metrics.render()) {
        Ok(s) => s,
        Err(e) => panic!("render produced invalid exposition: {e}"),
    }
}

/// Polls until `done` (a liveness bound, not a timing assertion).
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn config(compat: Compat) -> MetricsConfig {
    MetricsConfig {
        compat,
        version: "0.1.0".into(),
        backend: "gated".into(),
        model: "fake".into(),
        memory_budget_bytes: Some(10_000),
    }
}

#[test]
fn occupancy_rises_while_a_sequence_runs_and_returns_after() {
    let gate = Gate::default();
    let engine = engine(&gate);
    let metrics = match Metrics::new(config(Compat::Vllm), engine.clone(), None) {
        Ok(m) => m,
        Err(e) => panic!("{e}"),
    };
    let idle = scrape(&metrics);
    assert_eq!(idle.value(KV_BLOCKS, &[("state", "total")]), Some(64.0));
    assert_eq!(idle.value(KV_BLOCKS, &[("state", "used")]), Some(0.0));
    assert_eq!(
        idle.value(BUILD_INFO, &[("backend", "gated"), ("model", "fake")]),
        Some(1.0)
    );
    assert_eq!(
        idle.value("vllm:cache_config_info", &[("num_gpu_blocks", "64")]),
        Some(1.0)
    );
    // Memory is published when the engine starts, not after its first step.
    assert_eq!(idle.value(ENGINE_STEPS_TOTAL, &[]), Some(0.0));
    assert_eq!(
        idle.value(MEMORY_ALLOCATED_BYTES, &[("kind", "weights")]),
        Some(1000.0)
    );
    assert_eq!(
        idle.value(MEMORY_ALLOCATED_BYTES, &[("kind", "kv")]),
        Some(6400.0)
    );
    assert_eq!(idle.value(MEMORY_PEAK_ALLOCATED_BYTES, &[]), Some(7424.0));
    assert_eq!(idle.value("kvgate_batch_size_count", &[]), Some(0.0));
    assert_eq!(idle.check_histograms(), Ok(()));

    let request = GenerationRequest {
        prompt: vec![2; 100],
        sampling: SamplingParams::default(),
        stop: StopParams {
            max_tokens: 3,
            stop_strings: Vec::new(),
            ignore_eos: true,
        },
        reservation: None,
        label: "tenant-a".into(),
        weight: std::num::NonZeroU32::MIN,
        cache_salt: None,
    };
    let mut handle = match engine.submit(request) {
        Ok(h) => h,
        Err(e) => panic!("{e}"),
    };
    wait_until("the sequence to hold blocks", || {
        engine.pool().snapshot().used_blocks > 0
    });
    let busy = scrape(&metrics);
    let used = busy.value(KV_BLOCKS, &[("state", "used")]).unwrap_or(0.0);
    assert!(
        used >= 7.0,
        "100 prompt tokens need 7 blocks of 16, saw {used}"
    );
    assert!(busy.value(KV_USAGE_RATIO, &[]).unwrap_or(0.0) > 0.1);
    assert_eq!(
        busy.value("vllm:kv_cache_usage_perc", &[("model_name", "fake")]),
        busy.value(KV_USAGE_RATIO, &[])
    );

    gate.open();
    let mut finished = false;
    while let Some(event) = handle.events.blocking_recv() {
        finished |= matches!(event, TokenEvent::Finished { .. });
    }
    assert!(finished, "the stream ends with Finished");
    wait_until("the blocks to come back", || {
        engine.pool().snapshot().used_blocks == 0
    });
    wait_until("the engine to report the step", || {
        engine.stats().running == 0
    });

    let after = scrape(&metrics);
    assert_eq!(after.value(KV_BLOCKS, &[("state", "used")]), Some(0.0));
    assert_eq!(after.value(KV_BLOCKS, &[("state", "free")]), Some(64.0));
    // The peak covers weights + KV + workspace.
    let peak = after.value(MEMORY_PEAK_ALLOCATED_BYTES, &[]).unwrap_or(0.0);
    assert!(peak >= 7424.0, "peak {peak}");
    assert_eq!(
        scrape(&metrics).value(MEMORY_PEAK_ALLOCATED_BYTES, &[]),
        Some(peak),
        "peak never decreases"
    );
    // One prefill step (100 tokens) and two decode steps, each of one sequence: the batch
    // histograms hold exactly these steps, cumulatively.
    assert_eq!(after.value(ENGINE_STEPS_TOTAL, &[]), Some(3.0));
    assert_eq!(after.check_histograms(), Ok(()));
    let steps = |name: &str, le: &str| after.value(name, &[("le", le)]);
    assert_eq!(steps("kvgate_batch_size_bucket", "1"), Some(3.0));
    assert_eq!(steps("kvgate_batch_size_bucket", "+Inf"), Some(3.0));
    assert_eq!(after.value("kvgate_batch_size_count", &[]), Some(3.0));
    assert_eq!(after.value("kvgate_batch_size_sum", &[]), Some(3.0));
    assert_eq!(steps("kvgate_batch_tokens_bucket", "64"), Some(2.0));
    assert_eq!(steps("kvgate_batch_tokens_bucket", "128"), Some(3.0));
    assert_eq!(after.value("kvgate_batch_tokens_sum", &[]), Some(102.0));
    assert!(
        after
            .value("vllm:generation_tokens_total", &[])
            .unwrap_or(0.0)
            >= 3.0
    );
    engine.shutdown();
}

#[test]
fn recorded_events_render_with_their_buckets_and_help() {
    let handle = match install_recorder() {
        Ok(h) => h,
        Err(e) => panic!("{e}"),
    };
    assert!(
        install_recorder().is_ok(),
        "installing twice reuses the recorder"
    );
    let tenant = "recorded-events-tenant";
    record_request(tenant, "chat", RequestOutcome::Rejected);
    record_rejection(tenant, RejectReason::KvSaturation);
    record_queue_wait(tenant, Duration::from_millis(30));
    let model = "recorded-events-model";
    record_request_finished(tenant, model, Duration::from_secs(2), 40, 9, Some(32));
    record_request_finished(tenant, model, Duration::from_secs(1), 20, 0, None);
    record_request_finished(tenant, "other-model", Duration::from_secs(1), 5, 1, None);
    record_time_to_first_token(tenant, model, Duration::from_millis(70));
    record_inter_token_latency(tenant, model, Duration::from_millis(20));

    let scrape = match Scrape::parse(&handle.render()) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let ours = [("tenant", tenant)];
    assert_eq!(
        scrape.value(
            REQUESTS_TOTAL,
            &[("tenant", tenant), ("outcome", "rejected")]
        ),
        Some(1.0)
    );
    assert_eq!(
        scrape.value(
            REQUESTS_REJECTED_TOTAL,
            &[("tenant", tenant), ("reason", "kv_saturation")]
        ),
        Some(1.0)
    );
    let ours_in = |model| [("tenant", tenant), ("model", model)];
    assert_eq!(
        scrape.value(PROMPT_TOKENS_TOTAL, &ours_in(model)),
        Some(60.0)
    );
    assert_eq!(
        scrape.value(PROMPT_TOKENS_TOTAL, &ours_in("other-model")),
        Some(5.0),
        "each model its own series"
    );
    assert_eq!(scrape.sum(PROMPT_TOKENS_TOTAL, &ours), 65.0);
    assert_eq!(scrape.value(PREFIX_CACHE_QUERIES_TOTAL, &ours), Some(40.0));
    assert_eq!(scrape.value(PREFIX_CACHE_HITS_TOTAL, &ours), Some(32.0));
    assert_eq!(
        scrape.value(GENERATION_TOKENS_TOTAL, &ours_in(model)),
        Some(9.0)
    );
    for (family, count) in [
        (TIME_TO_FIRST_TOKEN_SECONDS, 1.0),
        (INTER_TOKEN_LATENCY_SECONDS, 1.0),
    ] {
        let name = format!("{family}_count");
        assert_eq!(scrape.value(&name, &ours_in(model)), Some(count), "{name}");
    }
    // The families without a tenant label still say which model.
    for family in [REQUEST_DURATION_SECONDS, PROMPT_TOKENS, GENERATION_TOKENS] {
        let name = format!("{family}_count");
        assert_eq!(
            scrape.value(&name, &[("model", model)]),
            Some(2.0),
            "{name}"
        );
        assert_eq!(
            scrape.value(&name, &[("model", "other-model")]),
            Some(1.0),
            "{name}"
        );
    }
    let bucket = |le| {
        scrape.value(
            "kvgate_queue_wait_seconds_bucket",
            &[("tenant", tenant), ("le", le)],
        )
    };
    assert_eq!(bucket("0.025"), Some(0.0));
    assert_eq!(bucket("0.05"), Some(1.0));
    assert_eq!(bucket("+Inf"), Some(1.0));
    assert_eq!(
        scrape.types.get(QUEUE_WAIT_SECONDS).map(String::as_str),
        Some("histogram")
    );
    assert!(
        handle
            .render()
            .contains("# HELP kvgate_requests_rejected_total Refused requests by reason")
    );
}

#[test]
fn reason_labels_are_distinct() {
    use std::collections::HashSet;
    let labels: HashSet<_> = RejectReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(labels.len(), RejectReason::ALL.len(), "labels are distinct");
}

#[test]
fn compat_flag_parses() {
    assert_eq!("vllm".parse::<Compat>().ok(), Some(Compat::Vllm));
    assert_eq!("none".parse::<Compat>().ok(), Some(Compat::None));
    assert!("tgi".parse::<Compat>().is_err());
}
