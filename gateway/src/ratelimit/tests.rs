use std::num::NonZeroU32;
use std::time::Duration;

use super::*;
use crate::policy::parse_policy;

fn tenant(rpm: Option<u32>, tpm: Option<u32>) -> TenantPolicy {
    let policy = parse_policy("t.toml", "[tenants.t]\n").unwrap();
    let mut tenant = TenantPolicy::clone(&policy.tenant("t").unwrap());
    tenant.requests_per_minute = rpm.and_then(NonZeroU32::new);
    tenant.tokens_per_minute = tpm.and_then(NonZeroU32::new);
    tenant
}

fn wait_of(result: Result<Debit, RateLimitError>) -> (LimitKind, Duration) {
    match result {
        Err(RateLimitError::Limited { kind, wait, .. }) => (kind, wait),
        other => panic!("expected Limited, got {other:?}"),
    }
}

fn remaining_tokens(limits: &RateLimits, tenant: &TenantPolicy) -> u32 {
    limits
        .headers(tenant)
        .tokens
        .map_or(0, |status| status.remaining)
}

#[tokio::test(start_paused = true)]
async fn request_limit_reports_governors_exact_wait() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(3), None);
    let held: Vec<Debit> = (0..3)
        .map(|_| limits.try_debit(&tenant, 10).unwrap())
        .collect();
    // 3 per minute: one cell every 20 s, so the fourth fits 20 s after the burst.
    assert_eq!(
        wait_of(limits.try_debit(&tenant, 10)),
        (LimitKind::Requests, Duration::from_secs(20))
    );
    tokio::time::advance(Duration::from_secs(19)).await;
    assert_eq!(
        wait_of(limits.try_debit(&tenant, 10)).1,
        Duration::from_secs(1)
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(limits.try_debit(&tenant, 10).is_ok());
    for debit in held {
        debit.settle(10);
    }
}

#[tokio::test(start_paused = true)]
async fn token_limit_waits_until_enough_tokens_replenish() {
    let limits = RateLimits::new();
    let tenant = tenant(None, Some(1000));
    let first = limits.try_debit(&tenant, 600).unwrap();
    // 400 left; 200 more replenish in 12 s at 1000/min.
    assert_eq!(
        wait_of(limits.try_debit(&tenant, 600)),
        (LimitKind::Tokens, Duration::from_secs(12))
    );
    tokio::time::advance(Duration::from_secs(12)).await;
    let second = limits.try_debit(&tenant, 600).unwrap();
    first.settle(600);
    second.settle(600);
}

#[tokio::test(start_paused = true)]
async fn a_request_bigger_than_the_bucket_is_insufficient_quota() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(100), Some(1000));
    match limits.try_debit(&tenant, 1001) {
        Err(RateLimitError::ExceedsBucket {
            kind: LimitKind::Tokens,
            limit: 1000,
            requested: 1001,
            ..
        }) => {}
        other => panic!("expected ExceedsBucket, got {other:?}"),
    }
    assert_eq!(
        limits.headers(&tenant).requests.map(|s| s.remaining),
        Some(100),
        "nothing was charged"
    );
}

#[tokio::test(start_paused = true)]
async fn unused_tokens_are_refunded_as_credit_that_later_debits_spend() {
    let limits = RateLimits::new();
    let tenant = tenant(None, Some(1000));
    limits.try_debit(&tenant, 1000).unwrap().settle(400);
    assert_eq!(remaining_tokens(&limits, &tenant), 600);
    let spent_credit = limits.try_debit(&tenant, 600).unwrap();
    assert!(matches!(
        limits.try_debit(&tenant, 1),
        Err(RateLimitError::Limited { .. })
    ));
    spent_credit.settle(600);
}

#[tokio::test(start_paused = true)]
async fn refunds_never_grow_the_bucket_beyond_its_size() {
    let limits = RateLimits::new();
    let tenant = tenant(None, Some(1000));
    limits.try_debit(&tenant, 500).unwrap().settle(0);
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(remaining_tokens(&limits, &tenant), 1000);
    let all = limits.try_debit(&tenant, 1000).unwrap();
    assert!(matches!(
        limits.try_debit(&tenant, 1),
        Err(RateLimitError::Limited { .. })
    ));
    all.settle(1000);
}

#[tokio::test(start_paused = true)]
async fn a_request_limit_refusal_gives_the_tokens_back() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(1), Some(1000));
    let first = limits.try_debit(&tenant, 100).unwrap();
    assert_eq!(
        wait_of(limits.try_debit(&tenant, 100)).0,
        LimitKind::Requests
    );
    assert_eq!(remaining_tokens(&limits, &tenant), 900);
    first.settle(100);
}

#[tokio::test(start_paused = true)]
async fn dropping_an_unsettled_debit_refunds_everything() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(2), Some(1000));
    drop(limits.try_debit(&tenant, 700).unwrap());
    let headers = limits.headers(&tenant);
    assert_eq!(headers.requests.map(|s| s.remaining), Some(2));
    assert_eq!(headers.tokens.map(|s| s.remaining), Some(1000));
}

#[tokio::test(start_paused = true)]
async fn headers_report_limit_remaining_and_time_to_full() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(60), Some(6000));
    let debit = limits.try_debit(&tenant, 100).unwrap();
    let headers = debit.headers();
    let requests = headers.requests.unwrap();
    assert_eq!(
        (requests.limit, requests.remaining, requests.reset),
        (60, 59, Duration::from_secs(1))
    );
    let tokens = headers.tokens.unwrap();
    assert_eq!(
        (tokens.limit, tokens.remaining, tokens.reset),
        (6000, 5900, Duration::from_secs(1))
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        limits.headers(&tenant).requests.map(|s| s.remaining),
        Some(60)
    );
    assert_eq!(
        limits.headers(&tenant_without_limits()),
        RateLimitHeaders::default()
    );
    debit.settle(100);
}

#[tokio::test(start_paused = true)]
async fn a_quota_change_on_reload_rebuilds_the_buckets() {
    let limits = RateLimits::new();
    let before = tenant(Some(1), None);
    limits.try_debit(&before, 1).unwrap().settle(1);
    assert!(limits.try_debit(&before, 1).is_err());
    let after = tenant(Some(5), None);
    assert!(limits.try_debit(&after, 1).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_quota_change_on_reload_keeps_what_was_spent_and_refunds_reach_the_new_bucket() {
    let limits = RateLimits::new();
    let before = tenant(None, Some(1000));
    let held = limits.try_debit(&before, 600).unwrap();
    let after = tenant(None, Some(2000));
    // The 600 tokens spent stay spent: a reload does not refill the bucket.
    assert_eq!(remaining_tokens(&limits, &after), 1400);
    // The request admitted before the reload used 100: its refund goes to the bucket in force.
    held.settle(100);
    assert_eq!(remaining_tokens(&limits, &after), 1900);
    // Lowering the quota below what was spent leaves the bucket empty, not negative.
    let spent = limits.try_debit(&after, 1500).unwrap();
    let lower = tenant(None, Some(500));
    assert_eq!(remaining_tokens(&limits, &lower), 0);
    drop(spent);
}

fn tenant_without_limits() -> TenantPolicy {
    tenant(None, None)
}

fn remaining_requests(limits: &RateLimits, tenant: &TenantPolicy) -> Option<u32> {
    limits.headers(tenant).requests.map(|s| s.remaining)
}

#[tokio::test(start_paused = true)]
async fn a_reserved_request_cell_is_spent_so_a_burst_cannot_pass_it() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(2), Some(100));
    // A burst of three before any body is read: the third is refused with governor's wait.
    let first = limits.reserve_request(&tenant).expect("room for one");
    let second = limits.reserve_request(&tenant).expect("room for two");
    let (kind, wait) = match limits.reserve_request(&tenant) {
        Err(RateLimitError::Limited { kind, wait, .. }) => (kind, wait),
        other => panic!("expected Limited, got {other:?}"),
    };
    assert_eq!(kind, LimitKind::Requests);
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_secs(30),
        "{wait:?}"
    );
    assert_eq!(remaining_requests(&limits, &tenant), Some(0));
    // The first is refused before admission (say its body was invalid): its cell comes back.
    drop(first);
    assert_eq!(remaining_requests(&limits, &tenant), Some(1));
    // The second's debit takes its cell over: no second request is charged.
    let debit = limits
        .try_debit_prepaid(&tenant, 10, Some(second))
        .expect("the tokens fit");
    assert_eq!(remaining_requests(&limits, &tenant), Some(1));
    assert_eq!(remaining_tokens(&limits, &tenant), 90);
    // The request ran: the cell stays spent, the unused tokens come back.
    debit.settle(4);
    assert_eq!(remaining_requests(&limits, &tenant), Some(1));
    assert_eq!(remaining_tokens(&limits, &tenant), 96);
}

#[tokio::test(start_paused = true)]
async fn a_prepaid_request_refused_for_tokens_gets_its_cell_back() {
    let limits = RateLimits::new();
    let tenant = tenant(Some(2), Some(100));
    let cell = limits.reserve_request(&tenant).unwrap();
    assert!(matches!(
        limits.try_debit_prepaid(&tenant, 500, Some(cell)),
        Err(RateLimitError::ExceedsBucket { .. })
    ));
    assert_eq!(
        remaining_requests(&limits, &tenant),
        Some(2),
        "all or nothing"
    );
    // A refused debit after a reserve: the debit is dropped unsettled, everything returns.
    let cell = limits.reserve_request(&tenant).unwrap();
    drop(limits.try_debit_prepaid(&tenant, 50, Some(cell)).unwrap());
    assert_eq!(remaining_requests(&limits, &tenant), Some(2));
    assert_eq!(remaining_tokens(&limits, &tenant), 100);
    // A tenant without a request limit: the cell is empty and returns nothing.
    let free = tenant_without_limits();
    let cell = limits.reserve_request(&free).expect("no limit");
    limits
        .try_debit_prepaid(&free, 1, Some(cell))
        .unwrap()
        .settle(1);
    assert_eq!(remaining_requests(&limits, &free), None);
}
