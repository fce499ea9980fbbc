//! The state half of `/metrics`: KV blocks, memory, sequences, queues, engine counters and the
//! engine's per-step histograms, read from one engine and one admission instance at scrape time
//! and written as exposition text.
//!
//! Reading at scrape time (rather than copying into process-wide gauges on a timer) means a
//! scrape always shows the pool as it is now, and several servers in one process (tests) each
//! show their own. The engine's counters and histograms are cumulative over every step, so
//! exporting them is monotonic by construction and no step is missed; the memory peak is
//! additionally kept with `fetch_max` so it can never decrease, whatever the engine reports.

use std::sync::atomic::{AtomicU64, Ordering};

use kvgate_runtime::block_pool::Occupancy;
use kvgate_runtime::engine::{Engine, EngineStats, StepHistogram};

use super::MetricsConfig;
use super::exposition::Writer;
use super::names::{self, *};
use super::{QueueSource, TenantQueueSnapshot, UpstreamCapacitySnapshot};

/// Everything a scrape reports, read in one go.
#[derive(Debug, Clone, Default)]
pub(super) struct Snapshot {
    pub stats: EngineStats,
    pub occupancy: Occupancy,
    /// Per-tenant queue state; `None` without admission (e.g. `kvgate generate`).
    pub queues: Option<Vec<TenantQueueSnapshot>>,
    pub resident_bytes: Option<u64>,
}

impl Snapshot {
    pub fn take(engine: &Engine, queues: Option<&dyn QueueSource>) -> Snapshot {
        Snapshot {
            stats: engine.stats(),
            occupancy: engine.pool().snapshot(),
            queues: queues.map(QueueSource::tenant_queues),
            resident_bytes: resident_memory_bytes(),
        }
    }

    /// Requests waiting anywhere: in the admission queues and in the engine.
    pub fn waiting_requests(&self) -> usize {
        let queued: usize = self
            .queues
            .iter()
            .flatten()
            .map(|q| q.queued_requests)
            .sum();
        queued + self.stats.waiting
    }
}

/// Resident set size from `/proc/self/status` (`VmRSS`, in kB); `None` off Linux.
pub(super) fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_rss(&status)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// What must persist between scrapes: the memory peak.
#[derive(Debug, Default)]
pub(super) struct StateTracker {
    peak_bytes: AtomicU64,
}

impl StateTracker {
    /// Keeps the peak.
    pub fn sample(&self, stats: &EngineStats) {
        self.peak_bytes.fetch_max(
            stats.peak_memory_bytes.max(stats.memory.total_bytes()),
            Ordering::Relaxed,
        );
    }

    pub fn write(&self, out: &mut Writer, snap: &Snapshot, config: &MetricsConfig) {
        self.sample(&snap.stats);
        let occ = &snap.occupancy;
        let stats = &snap.stats;
        let mut family = |name: &str, samples: &[(&[(&str, &str)], f64)]| {
            if let Some(f) = names::family_of(name) {
                out.family(f.name, f.kind.as_str(), f.help);
            }
            for (labels, value) in samples {
                out.sample(name, labels, *value);
            }
        };
        let blocks = [
            (&[("state", "total")][..], occ.total_blocks as f64),
            (&[("state", "used")], occ.used_blocks as f64),
            (&[("state", "reserved")], occ.reserved_blocks as f64),
            (&[("state", "free")], occ.free_blocks as f64),
            (&[("state", "cached")], occ.cached_blocks as f64),
        ];
        family(KV_BLOCKS, &blocks);
        family(KV_USAGE_RATIO, &[(&[], occ.usage_ratio())]);
        family(KV_COMMITTED_RATIO, &[(&[], occ.committed_ratio())]);
        family(KV_CAPACITY_BYTES, &[(&[], occ.total_bytes() as f64)]);
        family(KV_BLOCK_SIZE_TOKENS, &[(&[], occ.block_size as f64)]);
        family(KV_WASTE_SLOTS, &[(&[], stats.kv_waste_slots as f64)]);

        let memory = stats.memory;
        let allocated = [
            (&[("kind", "weights")][..], memory.weights_bytes as f64),
            (&[("kind", "kv")], memory.kv_bytes as f64),
            (&[("kind", "workspace")], memory.workspace_bytes as f64),
        ];
        family(MEMORY_ALLOCATED_BYTES, &allocated);
        family(MEMORY_RESERVED_BYTES, &[(&[], memory.total_bytes() as f64)]);
        family(
            MEMORY_PEAK_ALLOCATED_BYTES,
            &[(&[], self.peak_bytes.load(Ordering::Relaxed) as f64)],
        );
        family(
            MEMORY_BUDGET_BYTES,
            &[(&[], config.memory_budget_bytes.unwrap_or(0) as f64)],
        );
        if let Some(rss) = snap.resident_bytes {
            family(PROCESS_RESIDENT_MEMORY_BYTES, &[(&[], rss as f64)]);
        }
        if let Some(device) = memory.device {
            family(DEVICE_MEMORY_USED_BYTES, &[(&[], device.used_bytes as f64)]);
            family(
                DEVICE_MEMORY_TOTAL_BYTES,
                &[(&[], device.total_bytes as f64)],
            );
        }

        let sequences = [
            (&[("state", "running")][..], stats.running as f64),
            (&[("state", "waiting")], stats.waiting as f64),
        ];
        family(SEQUENCES, &sequences);
        family(PREEMPTIONS_TOTAL, &[(&[], stats.preemptions_total as f64)]);
        family(
            CANCELLATIONS_TOTAL,
            &[(&[], stats.cancellations_total as f64)],
        );
        family(ENGINE_STEPS_TOTAL, &[(&[], stats.steps as f64)]);
        let info = [
            ("version", config.version.as_str()),
            ("backend", config.backend.as_str()),
            ("model", config.model.as_str()),
        ];
        family(BUILD_INFO, &[(&info[..], 1.0)]);

        if let Some(queues) = &snap.queues {
            let per_tenant =
                |value: fn(&TenantQueueSnapshot) -> f64| -> Vec<(Vec<(&str, &str)>, f64)> {
                    queues
                        .iter()
                        .map(|q| (vec![("tenant", q.tenant.as_str())], value(q)))
                        .collect()
                };
            for (name, rows) in [
                (REQUESTS_IN_FLIGHT, per_tenant(|q| q.in_flight as f64)),
                (REQUESTS_QUEUED, per_tenant(|q| q.queued_requests as f64)),
                (QUEUED_TOKENS, per_tenant(|q| q.queued_tokens as f64)),
            ] {
                let samples: Vec<(&[(&str, &str)], f64)> =
                    rows.iter().map(|(l, v)| (l.as_slice(), *v)).collect();
                family(name, &samples);
            }
        }

        family(
            ENGINE_PREFILL_CAP_TOKENS,
            &[(&[], stats.prefill_cap_tokens as f64)],
        );
        let target = stats.target_step_micros.unwrap_or(0) as f64 / 1e6;
        family(ENGINE_TARGET_ITL_SECONDS, &[(&[], target)]);

        write_histogram(out, BATCH_SIZE, &stats.batch_seqs, 1.0);
        write_histogram(out, BATCH_TOKENS, &stats.batch_tokens, 1.0);
        write_histogram(out, ENGINE_STEP_DURATION_SECONDS, &stats.step_micros, 1e6);
    }
}

/// One of the engine's per-step histograms as a Prometheus histogram family, its bounds and
/// sum divided by `unit` (1e6: microseconds to seconds; dividing keeps 25 000 µs "0.025").
fn write_histogram(out: &mut Writer, name: &str, histogram: &StepHistogram, unit: f64) {
    if let Some(f) = names::family_of(name) {
        out.family(f.name, f.kind.as_str(), f.help);
    }
    let buckets = histogram
        .cumulative()
        .filter_map(|(bound, n)| bound.map(|b| (b as f64 / unit, n)));
    out.histogram(
        name,
        &[],
        buckets,
        histogram.sum() as f64 / unit,
        histogram.count(),
    );
}

/// The upstream capacity gauges: per model, the healthy replicas' declared capacity and the
/// replicas in each breaker state (every state written, zeros included, so a panel or alert
/// never sees a state vanish). Nothing without upstream models.
pub(super) fn write_upstreams(out: &mut Writer, rows: &[UpstreamCapacitySnapshot]) {
    if rows.is_empty() {
        return;
    }
    for name in [UPSTREAM_CAPACITY_TOKENS, UPSTREAM_REPLICAS] {
        if let Some(f) = names::family_of(name) {
            out.family(f.name, f.kind.as_str(), f.help);
        }
        for row in rows {
            let model = row.model.as_str();
            if name == UPSTREAM_CAPACITY_TOKENS {
                out.sample(name, &[("model", model)], row.capacity_tokens as f64);
                continue;
            }
            for (state, count) in [
                ("healthy", row.healthy),
                ("ejected", row.ejected),
                ("half_open", row.half_open),
            ] {
                out.sample(name, &[("model", model), ("state", state)], count as f64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exposition::Scrape;
    use kvgate_runtime::backend::{DeviceMemoryView, MemoryUsage};

    fn snapshot() -> Snapshot {
        Snapshot {
            stats: EngineStats {
                running: 3,
                waiting: 2,
                steps: 10,
                preemptions_total: 4,
                cancellations_total: 1,
                kv_waste_slots: 7,
                last_batch_seqs: 3,
                peak_memory_bytes: 5000,
                memory: MemoryUsage {
                    weights_bytes: 1000,
                    kv_bytes: 2000,
                    workspace_bytes: 500,
                    device: Some(DeviceMemoryView {
                        used_bytes: 7000,
                        total_bytes: 9000,
                    }),
                },
                ..EngineStats::default()
            },
            occupancy: Occupancy {
                total_blocks: 100,
                used_blocks: 40,
                reserved_blocks: 10,
                free_blocks: 50,
                cached_blocks: 0,
                block_size: 16,
                bytes_per_block: 1024,
            },
            queues: Some(vec![TenantQueueSnapshot {
                tenant: "acme".into(),
                queued_requests: 5,
                queued_tokens: 900,
                in_flight: 2,
            }]),
            resident_bytes: Some(1 << 20),
        }
    }

    fn render(tracker: &StateTracker, snap: &Snapshot) -> Scrape {
        let mut out = Writer::default();
        let config = MetricsConfig {
            memory_budget_bytes: Some(8000),
            model: "smol".into(),
            ..MetricsConfig::default()
        };
        tracker.write(&mut out, snap, &config);
        match Scrape::parse(&out.finish()) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn writes_upstream_capacity_and_replicas_per_model_and_state() {
        let mut out = Writer::default();
        write_upstreams(&mut out, &[]);
        assert!(out.finish().is_empty(), "nothing without upstream models");
        let mut out = Writer::default();
        let row = |model: &str, capacity, healthy, ejected, half_open| UpstreamCapacitySnapshot {
            model: model.into(),
            capacity_tokens: capacity,
            healthy,
            ejected,
            half_open,
        };
        write_upstreams(&mut out, &[row("a", 300, 3, 0, 0), row("b", 100, 1, 1, 1)]);
        let scrape = match Scrape::parse(&out.finish()) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(
            scrape.types.get(UPSTREAM_REPLICAS).map(String::as_str),
            Some("gauge")
        );
        assert_eq!(
            scrape.value(UPSTREAM_CAPACITY_TOKENS, &[("model", "b")]),
            Some(100.0)
        );
        for (state, value) in [("healthy", 1.0), ("ejected", 1.0), ("half_open", 1.0)] {
            let labels = [("model", "b"), ("state", state)];
            assert_eq!(scrape.value(UPSTREAM_REPLICAS, &labels), Some(value));
        }
        let zero = [("model", "a"), ("state", "ejected")];
        assert_eq!(
            scrape.value(UPSTREAM_REPLICAS, &zero),
            Some(0.0),
            "zeros too"
        );
    }

    #[test]
    fn writes_every_state_family_from_the_snapshot() {
        let scrape = render(&StateTracker::default(), &snapshot());
        // The upstream families come from the upstream pools (`write_upstreams`, below).
        let upstream = [UPSTREAM_CAPACITY_TOKENS, UPSTREAM_REPLICAS];
        for f in names::STATE.iter().filter(|f| !upstream.contains(&f.name)) {
            assert!(
                scrape
                    .types
                    .get(f.name)
                    .is_some_and(|k| k == f.kind.as_str()),
                "missing {}",
                f.name
            );
        }
        assert_eq!(scrape.value(KV_BLOCKS, &[("state", "used")]), Some(40.0));
        assert_eq!(
            scrape.value(KV_BLOCKS, &[("state", "reserved")]),
            Some(10.0)
        );
        assert_eq!(scrape.value(KV_USAGE_RATIO, &[]), Some(0.4));
        assert_eq!(scrape.value(KV_COMMITTED_RATIO, &[]), Some(0.5));
        assert_eq!(scrape.value(KV_CAPACITY_BYTES, &[]), Some(102_400.0));
        assert_eq!(
            scrape.value(MEMORY_ALLOCATED_BYTES, &[("kind", "kv")]),
            Some(2000.0)
        );
        assert_eq!(scrape.value(MEMORY_RESERVED_BYTES, &[]), Some(3500.0));
        assert_eq!(scrape.value(MEMORY_BUDGET_BYTES, &[]), Some(8000.0));
        assert_eq!(scrape.value(DEVICE_MEMORY_USED_BYTES, &[]), Some(7000.0));
        assert_eq!(scrape.value(DEVICE_MEMORY_TOTAL_BYTES, &[]), Some(9000.0));
        assert_eq!(
            scrape.value(REQUESTS_QUEUED, &[("tenant", "acme")]),
            Some(5.0)
        );
        assert_eq!(
            scrape.value(REQUESTS_IN_FLIGHT, &[("tenant", "acme")]),
            Some(2.0)
        );
        assert_eq!(scrape.value(PREEMPTIONS_TOTAL, &[]), Some(4.0));
        assert_eq!(scrape.value(BUILD_INFO, &[("model", "smol")]), Some(1.0));
        assert_eq!(
            snapshot().waiting_requests(),
            7,
            "admission queue + engine waiting"
        );
    }

    #[test]
    fn the_device_memory_families_are_absent_without_a_device() {
        let mut snap = snapshot();
        snap.stats.memory.device = None;
        let scrape = render(&StateTracker::default(), &snap);
        for name in [DEVICE_MEMORY_USED_BYTES, DEVICE_MEMORY_TOTAL_BYTES] {
            assert!(!scrape.types.contains_key(name), "{name} on the CPU");
        }
        assert_eq!(scrape.value(MEMORY_RESERVED_BYTES, &[]), Some(3500.0));
    }

    #[test]
    fn batch_histograms_render_every_step_cumulatively() {
        let mut snap = snapshot();
        for seqs in [1, 3, 3, 2, 9] {
            snap.stats.batch_seqs.record(seqs);
        }
        snap.stats.batch_tokens.record(300);
        let scrape = render(&StateTracker::default(), &snap);
        assert_eq!(scrape.check_histograms(), Ok(()));
        assert_eq!(
            scrape.types.get(BATCH_SIZE).map(String::as_str),
            Some("histogram")
        );
        let bucket = |le| scrape.value("kvgate_batch_size_bucket", &[("le", le)]);
        assert_eq!(bucket("1"), Some(1.0));
        assert_eq!(bucket("2"), Some(2.0));
        assert_eq!(bucket("4"), Some(4.0));
        assert_eq!(bucket("8"), Some(4.0));
        assert_eq!(bucket("16"), Some(5.0));
        assert_eq!(bucket("+Inf"), Some(5.0));
        assert_eq!(scrape.value("kvgate_batch_size_sum", &[]), Some(18.0));
        assert_eq!(scrape.value("kvgate_batch_size_count", &[]), Some(5.0));
        let tokens = |le| scrape.value("kvgate_batch_tokens_bucket", &[("le", le)]);
        assert_eq!((tokens("256"), tokens("512")), (Some(0.0), Some(1.0)));
        assert_eq!(scrape.value("kvgate_batch_tokens_sum", &[]), Some(300.0));
        // Step times are kept in microseconds and exported in seconds.
        snap.stats.step_micros.record(40_000);
        snap.stats.step_micros.record(120_000);
        snap.stats.prefill_cap_tokens = 37;
        snap.stats.target_step_micros = Some(100_000);
        let scrape = render(&StateTracker::default(), &snap);
        assert_eq!(scrape.check_histograms(), Ok(()));
        let step = |le| scrape.value("kvgate_engine_step_duration_seconds_bucket", &[("le", le)]);
        assert_eq!(
            (step("0.025"), step("0.05"), step("0.15")),
            (Some(0.0), Some(1.0), Some(2.0))
        );
        let sum = scrape.value("kvgate_engine_step_duration_seconds_sum", &[]);
        assert!(sum.is_some_and(|s| (s - 0.16).abs() < 1e-9), "{sum:?}");
        assert_eq!(scrape.value(ENGINE_PREFILL_CAP_TOKENS, &[]), Some(37.0));
        assert_eq!(scrape.value(ENGINE_TARGET_ITL_SECONDS, &[]), Some(0.1));
    }

    #[test]
    fn peak_never_decreases_even_if_the_engine_reports_less() {
        let tracker = StateTracker::default();
        let mut snap = snapshot();
        assert_eq!(
            render(&tracker, &snap).value(MEMORY_PEAK_ALLOCATED_BYTES, &[]),
            Some(5000.0)
        );
        snap.stats.peak_memory_bytes = 100; // e.g. another engine's stats, or a reset
        snap.stats.memory = MemoryUsage::default();
        assert_eq!(
            render(&tracker, &snap).value(MEMORY_PEAK_ALLOCATED_BYTES, &[]),
            Some(5000.0)
        );
        snap.stats.memory.kv_bytes = 9000; // current total above the recorded peak
        assert_eq!(
            render(&tracker, &snap).value(MEMORY_PEAK_ALLOCATED_BYTES, &[]),
            Some(9000.0)
        );
    }

    #[test]
    fn without_admission_there_are_no_tenant_gauges() {
        let snap = Snapshot {
            queues: None,
            ..snapshot()
        };
        let scrape = render(&StateTracker::default(), &snap);
        assert!(!scrape.types.contains_key(REQUESTS_QUEUED));
        assert_eq!(snap.waiting_requests(), 2);
    }

    #[test]
    fn reads_vm_rss_in_kib() {
        let status = "Name:\tkvgate\nVmPeak:\t  900 kB\nVmRSS:\t   2048 kB\nThreads: 4\n";
        assert_eq!(parse_vm_rss(status), Some(2048 * 1024));
        assert_eq!(parse_vm_rss("VmRSS: lots"), None);
        assert_eq!(parse_vm_rss(""), None);
        if cfg!(target_os = "linux") {
            assert!(resident_memory_bytes().is_some_and(|b| b > 0));
        }
    }
}
