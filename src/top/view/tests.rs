use super::*;

fn frame(text: &str, at: Instant) -> Frame {
    match Scrape::parse(text) {
        Ok(scrape) => Frame { scrape, at },
        Err(e) => panic!("{e}"),
    }
}

const BEFORE: &str = r#"
kvgate_requests_total{tenant="acme",route="chat",outcome="admitted"} 100
kvgate_requests_total{tenant="acme",route="chat",outcome="rejected"} 10
kvgate_requests_rejected_total{tenant="acme",reason="rate"} 6
kvgate_requests_rejected_total{tenant="acme",reason="queue_full"} 4
kvgate_engine_steps_total 1000
kvgate_preemptions_total 5
kvgate_prefix_cache_queries_total{tenant="acme"} 1000
kvgate_prefix_cache_hits_total{tenant="acme"} 100
"#;

const AFTER: &str = r#"
# TYPE kvgate_kv_blocks gauge
kvgate_kv_blocks{state="total"} 200
kvgate_kv_blocks{state="used"} 50
kvgate_kv_blocks{state="reserved"} 20
kvgate_kv_blocks{state="free"} 130
kvgate_kv_blocks{state="cached"} 12
kvgate_prefix_cache_queries_total{tenant="acme"} 1800
kvgate_prefix_cache_queries_total{tenant="other"} 200
kvgate_prefix_cache_hits_total{tenant="acme"} 700
kvgate_prefix_cache_hits_total{tenant="other"} 150
kvgate_kv_block_size_tokens 16
kvgate_kv_capacity_bytes 2097152
kvgate_memory_allocated_bytes{kind="weights"} 1048576
kvgate_memory_allocated_bytes{kind="kv"} 2097152
kvgate_memory_allocated_bytes{kind="workspace"} 0
kvgate_memory_peak_allocated_bytes 4194304
kvgate_memory_budget_bytes 8388608
kvgate_sequences{state="running"} 3
kvgate_sequences{state="waiting"} 1
kvgate_requests_in_flight{tenant="acme"} 2
kvgate_requests_queued{tenant="acme"} 5
kvgate_queued_tokens{tenant="acme"} 900
kvgate_requests_queued{tenant="idle"} 0
kvgate_requests_total{tenant="acme",route="chat",outcome="admitted"} 116
kvgate_requests_total{tenant="acme",route="chat",outcome="rejected"} 14
kvgate_requests_rejected_total{tenant="acme",reason="rate"} 7
kvgate_requests_rejected_total{tenant="acme",reason="queue_full"} 7
kvgate_engine_steps_total 1400
kvgate_preemptions_total 2
kvgate_build_info{version="0.1.0",backend="cpu",model="smol"} 1
"#;

fn two_frames() -> (Frame, Frame) {
    let start = Instant::now();
    (
        frame(BEFORE, start),
        frame(AFTER, start + Duration::from_secs(2)),
    )
}

#[test]
fn rates_are_increase_over_elapsed_time() {
    let (before, after) = two_frames();
    assert_eq!(
        rate(&after, Some(&before), ENGINE_STEPS_TOTAL, &[]),
        Some(200.0)
    );
    // 20 new requests (16 admitted + 4 rejected) in 2 s, summed over outcomes.
    assert_eq!(
        rate(&after, Some(&before), REQUESTS_TOTAL, &[("tenant", "acme")]),
        Some(10.0)
    );
    assert_eq!(
        rate(&after, None, ENGINE_STEPS_TOTAL, &[]),
        None,
        "no previous scrape, no rate"
    );
    assert_eq!(
        rate(&after, Some(&after), ENGINE_STEPS_TOTAL, &[]),
        None,
        "no elapsed time, no rate"
    );
    assert_eq!(
        rate(&before, Some(&after), ENGINE_STEPS_TOTAL, &[]),
        None,
        "frames out of order"
    );
}

#[test]
fn a_counter_that_went_down_restarted_from_zero() {
    assert_eq!(increase(10.0, 25.0), 15.0);
    assert_eq!(increase(10.0, 10.0), 0.0);
    assert_eq!(increase(1000.0, 3.0), 3.0);
    let (before, after) = two_frames();
    // preemptions 5 → 2: a restart, so the increase is 2 over 2 s.
    assert_eq!(
        rate(&after, Some(&before), PREEMPTIONS_TOTAL, &[]),
        Some(1.0)
    );
}

#[test]
fn tenant_rows_show_queue_and_rejection_rate_with_its_main_reason() {
    let (before, after) = two_frames();
    let view = TopView::build(&after, Some(&before));
    let names: Vec<_> = view.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["acme", "idle"]);
    let acme = &view.tenants[0];
    assert_eq!(
        (acme.in_flight, acme.queued, acme.queued_tokens),
        (2.0, 5.0, 900.0)
    );
    assert_eq!(acme.requests_per_sec, Some(10.0));
    assert_eq!(acme.rejected_per_sec, Some(2.0));
    assert_eq!(acme.rejected_fraction(), Some(0.2));
    assert_eq!(
        acme.top_reason.as_deref(),
        Some("queue_full"),
        "3 queue_full vs 1 rate this interval"
    );
    let idle = &view.tenants[1];
    assert_eq!(
        (
            idle.requests_per_sec,
            idle.rejected_fraction(),
            idle.top_reason.clone()
        ),
        (Some(0.0), None, None)
    );
}

#[test]
fn gauges_and_first_frame_render_without_rates() {
    let (_, after) = two_frames();
    let view = TopView::build(&after, None);
    assert_eq!(
        (view.blocks_used, view.blocks_reserved, view.blocks_total),
        (50.0, 20.0, 200.0)
    );
    assert_eq!(view.memory_allocated, 3_145_728.0);
    let screen = view.render("http://127.0.0.1:8080", Duration::from_secs(1));
    assert!(
        screen.contains("model smol, backend cpu, kvgate 0.1.0"),
        "{screen}"
    );
    assert!(
        screen.contains(&format!(
            "KV   [{}{}{}]  25.0% used, 10.0% reserved",
            "#".repeat(10),
            "+".repeat(4),
            ".".repeat(26)
        )),
        "{screen}"
    );
    assert!(
        screen.contains("allocated 3MiB, peak 4MiB, budget 8MiB, rss -"),
        "{screen}"
    );
    assert!(
        screen.contains("running 3, waiting 1, - steps/s"),
        "{screen}"
    );
    assert!(
        screen
            .lines()
            .any(|l| l.starts_with("acme") && l.ends_with("  -")),
        "{screen}"
    );
}

#[test]
fn bars_never_overflow_and_ignore_nonsense() {
    assert_eq!(
        bar(&[(0.5, '#')]),
        format!("[{}{}]", "#".repeat(20), ".".repeat(20))
    );
    assert_eq!(
        bar(&[(0.9, '#'), (0.5, '+')]),
        format!("[{}{}]", "#".repeat(36), "+".repeat(4))
    );
    assert_eq!(
        bar(&[(f64::NAN, '#'), (-1.0, '+')]),
        format!("[{}]", ".".repeat(40))
    );
    assert_eq!(bar(&[(7.0, '#')]).chars().count(), 42);
}

#[test]
fn without_a_budget_the_memory_line_has_no_level_bar() {
    let (_, after) = two_frames();
    let no_budget = AFTER.replace(
        "kvgate_memory_budget_bytes 8388608",
        "kvgate_memory_budget_bytes 0",
    );
    let mut view = TopView::build(&frame(&no_budget, after.at), None);
    // Allocation at its peak: a bar scaled to the peak would be full.
    view.memory_peak = view.memory_allocated;
    let screen = view.render("http://127.0.0.1:8080", Duration::from_secs(1));
    let mem = screen.lines().find(|l| l.starts_with("MEM")).unwrap();
    assert!(!mem.contains('#'), "{mem}");
    assert!(mem.contains("no --memory-budget"), "{mem}");
    assert!(mem.contains("budget none"), "{mem}");
    assert_eq!(
        mem.find("  allocated"),
        Some("MEM  ".len() + BAR_WIDTH + 2),
        "aligned like a bar: {mem}"
    );

    let with_budget = TopView::build(&after, None).render("u", Duration::from_secs(1));
    let mem = with_budget.lines().find(|l| l.starts_with("MEM")).unwrap();
    assert!(
        mem.starts_with(&format!("MEM  [{}{}", "#".repeat(15), "^".repeat(5))),
        "{mem}"
    );
}

#[test]
fn the_prefix_line_shows_cached_blocks_and_the_interval_hit_rate() {
    let (before, after) = two_frames();
    let view = TopView::build(&after, Some(&before));
    assert_eq!(view.blocks_cached, 12.0);
    // (700 − 100 + 150) hits of (1800 − 1000 + 200) queried tokens in the interval.
    let rate = view.prefix_hit_rate.expect("two frames");
    assert!((rate - 0.75).abs() < 1e-9, "{rate}");
    let screen = view.render("http://127.0.0.1:8080", Duration::from_secs(1));
    assert!(
        screen.contains("PFX  12 cached blocks, prefix hit rate 75.0%"),
        "{screen}"
    );
    let first = TopView::build(&after, None);
    assert_eq!(
        first.prefix_hit_rate, None,
        "no rate without a previous scrape"
    );
}
