use std::sync::Arc;

use kvgate_runtime::engine::SeqId;

use super::*;

fn seq(id: u64, tenant: &str, state: SeqStatus, blocks: usize, reserved: usize) -> SeqSnapshot {
    SeqSnapshot {
        id: SeqId(id),
        label: Arc::from(tenant),
        state,
        prompt_tokens: blocks * 10,
        output_tokens: 3,
        computed_tokens: blocks * 10,
        scheduled_tokens: 0,
        blocks,
        reserved_blocks: reserved,
        preemptions: 0,
    }
}

fn occupancy(used: usize, reserved: usize) -> Occupancy {
    Occupancy {
        total_blocks: 100,
        used_blocks: used,
        reserved_blocks: reserved,
        free_blocks: 100 - used - reserved,
        cached_blocks: 0,
        block_size: 16,
        bytes_per_block: 1000,
    }
}

fn queue(tenant: &str, queued: usize, in_flight: usize) -> TenantQueueSnapshot {
    TenantQueueSnapshot {
        tenant: tenant.into(),
        queued_requests: queued,
        queued_tokens: queued as u64 * 100,
        in_flight,
    }
}

#[test]
fn tenants_add_up_their_sequences_and_queues() {
    let seqs = vec![
        seq(1, "acme", SeqStatus::Running, 5, 1),
        seq(2, "acme", SeqStatus::Waiting, 0, 4),
        seq(3, "beta", SeqStatus::Running, 8, 0),
    ];
    let queues = [queue("acme", 2, 2), queue("idle", 1, 0)];
    let report = KvReport::build(occupancy(13, 5), seqs, &queues);

    let names: Vec<_> = report.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["acme", "beta", "idle"]);
    let acme = &report.tenants[0];
    assert_eq!(
        (
            acme.sequences,
            acme.running,
            acme.blocks,
            acme.reserved_blocks
        ),
        (2, 1, 5, 5)
    );
    assert_eq!(acme.bytes, 5000);
    assert_eq!(acme.tokens, 50 + 3 + 3);
    assert_eq!(
        (acme.queued_requests, acme.queued_tokens, acme.in_flight),
        (2, 200, 2)
    );
    let idle = &report.tenants[2];
    assert_eq!(
        (idle.sequences, idle.blocks, idle.queued_requests),
        (0, 0, 1)
    );

    assert_eq!(report.pool.unattributed_used_blocks, 0);
    assert_eq!(report.pool.unattributed_reserved_blocks, 0);
    assert_eq!(report.pool.used_bytes, 13_000);
}

#[test]
fn largest_holders_are_the_top_ten_by_blocks_with_stable_ties() {
    let seqs: Vec<_> = (0..15)
        .map(|i| seq(i, "t", SeqStatus::Running, (i % 5) as usize, 0))
        .collect();
    let held: usize = seqs.iter().map(|s| s.blocks).sum();
    let report = KvReport::build(occupancy(held, 0), seqs, &[]);
    assert_eq!(report.sequences.len(), 15);
    assert_eq!(report.largest.len(), LARGEST_HOLDERS);
    let top: Vec<_> = report
        .largest
        .iter()
        .map(|s| (s.seq.blocks, s.seq.id.0))
        .collect();
    assert_eq!(top[..4], [(4, 4), (4, 9), (4, 14), (3, 3)]);
    assert!(
        report
            .largest
            .windows(2)
            .all(|w| w[0].seq.blocks >= w[1].seq.blocks)
    );
    assert_eq!(report.largest[0].bytes, 4000);
}

#[test]
fn blocks_nobody_holds_are_reported_as_unattributed() {
    // 3 used blocks and 6 reserved ones that no sequence accounts for.
    let report = KvReport::build(
        occupancy(10, 8),
        vec![seq(1, "a", SeqStatus::Running, 7, 2)],
        &[],
    );
    assert_eq!(report.pool.unattributed_used_blocks, 3);
    assert_eq!(report.pool.unattributed_reserved_blocks, 6);
}

#[test]
fn json_shape_is_flat_and_complete() {
    let report = KvReport::build(
        occupancy(5, 0),
        vec![seq(7, "acme", SeqStatus::Running, 5, 0)],
        &[],
    );
    let json = match serde_json::to_value(&report) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(json["pool"]["total_blocks"], 100);
    assert_eq!(json["pool"]["free_bytes"], 95_000);
    assert_eq!(json["pool"]["usage_ratio"], 0.05);
    assert_eq!(json["largest"][0]["id"], 7);
    assert_eq!(json["largest"][0]["label"], "acme");
    assert_eq!(json["largest"][0]["state"], "Running");
    assert_eq!(json["largest"][0]["bytes"], 5000);
    assert_eq!(json["tenants"][0]["blocks"], 5);
}

#[test]
fn prefix_cache_report_gives_the_hit_ratio_of_tokens() {
    let stats = kvgate_runtime::engine::EngineStats {
        prefix_cache_queries_total: 400,
        prefix_cache_hits_total: 300,
        prefix_caching: true,
        ..Default::default()
    };
    let report = PrefixCacheReport::of(&stats);
    assert_eq!((report.queried_tokens, report.hit_tokens), (400, 300));
    assert!((report.hit_ratio - 0.75).abs() < 1e-12);
    assert!(report.enabled);
    let idle = PrefixCacheReport::of(&Default::default());
    assert_eq!(idle.hit_ratio, 0.0, "no query, no ratio");
}
