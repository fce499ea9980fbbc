//! Cost of one admission command with N requests already queued (issue 16, item 8).
//!
//! The pool is full, so N requests of tenant `flood` stay queued; each measured command is an
//! `admit` of tenant `probe`, whose queue (depth 1) is already full: the dispatcher receives
//! the command, runs a whole step (expire, re-forecast, dispatch, publish) and refuses it with
//! 429 `queue_full`. A dispatcher whose per-command work grew with the queue would show it
//! here: the time per command should not depend on N.
//!
//! Run: `cargo bench -p kvgate-gateway --bench dispatch`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvgate_gateway::admission::{Admission, AdmissionTicket, PoolId};
use kvgate_gateway::auth::Credential;
use kvgate_gateway::policy::parse_policy;
use kvgate_gateway::reload::PolicyStore;
use kvgate_runtime::block_pool::BlockPool;

const POLICY: &str = "[defaults]\nqueue_depth = 20000\nqueue_tokens = 100000000\n\
                      max_queue_wait = \"3600s\"\n\
                      [tenants.flood]\n[tenants.probe]\nqueue_depth = 1\n";

fn ticket(store: &PolicyStore, tenant: &str) -> AdmissionTicket {
    AdmissionTicket {
        tenant: store
            .current()
            .tenant(tenant)
            .expect("tenant in the policy"),
        // Checked again only by a policy reload, which the benchmark never does.
        credential: Credential::NoKey,
        prompt_tokens: 16,
        max_output_tokens: 16,
        prompt_param: "messages",
        request_id: String::new(),
        pool: PoolId::LOCAL,
        prefix: None,
    }
}

fn queued(admission: &Admission) -> usize {
    let rows = admission.queue_snapshot();
    rows.iter().map(|row| row.queued_requests).sum()
}

fn dispatch_cost(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission_command");
    group.measurement_time(Duration::from_secs(5));
    for queued_requests in [10usize, 1_000, 10_000] {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("tokio runtime");
        let store = PolicyStore::from_policy(parse_policy("bench.toml", POLICY).expect("policy"));
        let pool = BlockPool::new(16, 16, 1024);
        let _full = pool.try_reserve(16).expect("empty pool");
        let admission =
            runtime.block_on(async { Admission::new(store.clone(), Arc::clone(&pool)) });
        // N flood requests and the one probe request that fills the probe's queue.
        runtime.block_on(async {
            for _ in 0..queued_requests {
                let (admission, ticket) = (admission.clone(), ticket(&store, "flood"));
                tokio::spawn(async move { admission.admit(ticket).await });
            }
            let (admission_probe, ticket) = (admission.clone(), ticket(&store, "probe"));
            tokio::spawn(async move { admission_probe.admit(ticket).await });
            while queued(&admission) < queued_requests + 1 {
                tokio::task::yield_now().await;
            }
        });
        group.bench_with_input(
            BenchmarkId::from_parameter(queued_requests),
            &queued_requests,
            |b, _| {
                b.iter_custom(|iterations| {
                    runtime.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iterations {
                            let refused = admission.admit(ticket(&store, "probe")).await;
                            assert!(refused.is_err(), "the probe's queue is full");
                            black_box(refused.err());
                        }
                        start.elapsed()
                    })
                })
            },
        );
        assert_eq!(
            queued(&admission),
            queued_requests + 1,
            "nothing left the queue"
        );
    }
    group.finish();
}

criterion_group!(benches, dispatch_cost);
criterion_main!(benches);
