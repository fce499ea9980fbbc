use std::path::PathBuf;

use super::*;

fn shipped(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../policies")
        .join(name)
}

/// The error for `text`, as (line, column, field, message).
fn error_of(text: &str) -> (usize, usize, String, String) {
    match parse_policy("p.toml", text) {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(PolicyError::Invalid {
            path,
            line,
            column,
            field,
            message,
        }) => {
            assert_eq!(path, PathBuf::from("p.toml"));
            (line, column, field, message)
        }
        Err(other) => panic!("unexpected error {other}"),
    }
}

#[test]
fn shipped_default_policy_admits_anonymous_callers() {
    let policy = load_policy(shipped("default.toml")).unwrap();
    let anonymous = policy.anonymous_tenant().unwrap();
    assert_eq!(anonymous.name, "local");
    assert_eq!(anonymous.max_input_tokens, 2048);
    assert_eq!(anonymous.max_output_tokens, 512);
    assert!(anonymous.max_input_tokens + anonymous.max_output_tokens <= 8192);
    assert_eq!(policy.kv.high_watermark, 0.9);
}

#[test]
fn shipped_multi_tenant_policy_has_three_weighted_tenants_and_an_admin() {
    let summary = check_policy_file(shipped("multi-tenant.toml")).unwrap();
    let names: Vec<&str> = summary
        .tenants
        .iter()
        .map(|t| t.policy.name.as_str())
        .collect();
    assert_eq!(names, ["alpha", "beta", "gamma"]);
    let weights: Vec<u32> = summary
        .tenants
        .iter()
        .map(|t| t.policy.weight.get())
        .collect();
    assert_eq!(weights, [3, 2, 1]);
    assert!(summary.tenants.iter().all(|t| t.keys == 1));
    assert_eq!(summary.anonymous_tenant, None);
    assert_eq!(summary.admin_keys, 1);
    let gamma = &summary.tenants[2].policy;
    assert_eq!(gamma.overflow, Overflow::TruncateOldest);
    assert_eq!(gamma.max_queue_wait, Duration::from_secs(10));
    assert_eq!(gamma.max_input_tokens, 2048, "inherited from [defaults]");
    assert!(
        summary
            .to_string()
            .contains("tenant gamma: keys 1, weight 1")
    );
}

#[test]
fn tenants_inherit_defaults_then_builtins() {
    let policy = parse_policy(
        "p.toml",
        "[defaults]\nmax_concurrency = 3\nrequests_per_minute = 60\n[tenants.a]\nweight = 5\n[tenants.b]\nrequests_per_minute = 10\n",
    )
    .unwrap();
    let a = policy.tenant("a").unwrap();
    assert_eq!(
        (
            a.weight.get(),
            a.max_concurrency,
            a.requests_per_minute.map(|n| n.get())
        ),
        (5, 3, Some(60))
    );
    assert_eq!(a.tokens_per_minute, None, "no built-in token limit");
    assert_eq!(a.max_queue_wait, Duration::from_secs(30));
    assert_eq!(
        policy
            .tenant("b")
            .unwrap()
            .requests_per_minute
            .map(|n| n.get()),
        Some(10)
    );
    assert!(policy.tenant("c").is_none());
}

#[test]
fn syntax_errors_name_line_column_and_field() {
    let (line, column, field, _) = error_of("[tenants.a]\nweight = = 3\n");
    assert_eq!((line, column, field.as_str()), (2, 10, "tenants.a.weight"));
}

#[test]
fn unknown_fields_are_errors_with_their_location() {
    let (line, column, field, message) = error_of("[tenants.a]\nmax_concurency = 3\n");
    assert_eq!((line, column), (2, 1));
    assert_eq!(field, "tenants.a.max_concurency");
    assert!(message.contains("unknown field"), "{message}");

    let (line, _, field, _) = error_of("[tenants.a]\n[kvv]\nhigh_watermark = 0.5\n");
    assert_eq!((line, field.as_str()), (2, "kvv"));
}

#[test]
fn type_errors_point_at_the_value() {
    let (line, column, field, _) = error_of("[tenants.a]\n\nweight = \"heavy\"\n");
    assert_eq!((line, column, field.as_str()), (3, 10, "tenants.a.weight"));
}

#[test]
fn semantic_errors_point_at_the_offending_field() {
    let (line, column, field, message) = error_of("[tenants.a]\nweight = 0\n");
    assert_eq!((line, column, field.as_str()), (2, 10, "tenants.a.weight"));
    assert!(message.contains("at least 1"), "{message}");

    let (line, column, field, _) = error_of("[tenants.a]\n[kv]\nhigh_watermark = 1.5\n");
    assert_eq!((line, column, field.as_str()), (3, 18, "kv.high_watermark"));
    let (_, _, field, _) = error_of("[tenants.a]\n[kv]\nhigh_watermark = 0.0\n");
    assert_eq!(field, "kv.high_watermark");

    let (line, _, field, message) = error_of("[tenants.a]\nmax_queue_wait = \"30 seconds\"\n");
    assert_eq!((line, field.as_str()), (2, "tenants.a.max_queue_wait"));
    assert!(message.contains("not a duration"), "{message}");

    let (line, _, field, message) =
        error_of("[defaults]\nmax_total_tokens = 1000\n[tenants.a]\nmax_input_tokens = 1500\n");
    assert_eq!((line, field.as_str()), (4, "tenants.a.max_input_tokens"));
    assert!(
        message.contains("exceeds max_total_tokens (1000)"),
        "{message}"
    );
}

#[test]
fn duplicate_key_digests_across_tenants_are_rejected() {
    let digest = "ab".repeat(32);
    let text = format!(
        "[tenants.a]\nkey_sha256 = [\"{digest}\"]\n[tenants.b]\nkey_sha256 = [\n  \"{}\",\n  \"{digest}\",\n]\n",
        "cd".repeat(32)
    );
    let (line, column, field, message) = error_of(&text);
    assert_eq!(
        (line, column, field.as_str()),
        (6, 3, "tenants.b.key_sha256")
    );
    assert!(message.contains("tenant `a`"), "{message}");
}

#[test]
fn keys_must_be_digests_and_belong_to_tenants() {
    let (_, _, field, message) = error_of("[tenants.a]\nkey_sha256 = [\"sk-plain-key\"]\n");
    assert_eq!(field, "tenants.a.key_sha256");
    assert!(message.contains("hash-key"), "{message}");
    let (_, _, field, _) = error_of(&format!(
        "[defaults]\nkey_sha256 = [\"{}\"]\n[tenants.a]\n",
        "ab".repeat(32)
    ));
    assert_eq!(field, "defaults.key_sha256");
}

#[test]
fn anonymous_tenant_must_exist_and_a_policy_needs_tenants() {
    let (line, column, field, _) = error_of("anonymous_tenant = \"guest\"\n[tenants.a]\n");
    assert_eq!((line, column, field.as_str()), (1, 20, "anonymous_tenant"));
    let (_, _, field, _) = error_of("[defaults]\nweight = 2\n");
    assert_eq!(field, "tenants");
    let (_, _, field, _) = error_of("[tenants.\"bad name\"]\n");
    assert_eq!(field, "tenants.bad name");
}

#[test]
fn read_errors_name_the_file() {
    let error = load_policy("/nonexistent/kvgate.toml").unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/kvgate.toml"),
        "{error}"
    );
}

#[test]
fn unknown_keys_default_to_anonymous_only_on_a_keyless_policy_with_an_anonymous_tenant() {
    let default = load_policy(shipped("default.toml")).unwrap();
    assert_eq!(default.unknown_keys(), UnknownKeys::Anonymous);
    let multi = load_policy(shipped("multi-tenant.toml")).unwrap();
    assert_eq!(multi.unknown_keys(), UnknownKeys::Reject);
    let keyed_with_anonymous = format!(
        "anonymous_tenant = \"a\"\n[tenants.a]\n[tenants.b]\nkey_sha256 = [\"{}\"]\n",
        "ab".repeat(32)
    );
    let policy = parse_policy("p.toml", &keyed_with_anonymous).unwrap();
    assert_eq!(policy.unknown_keys(), UnknownKeys::Reject);
    let no_anonymous = parse_policy("p.toml", "[tenants.a]\n").unwrap();
    assert_eq!(no_anonymous.unknown_keys(), UnknownKeys::Reject);
    let written = format!("unknown_keys = \"anonymous\"\n{keyed_with_anonymous}");
    let policy = parse_policy("p.toml", &written).unwrap();
    assert_eq!(policy.unknown_keys(), UnknownKeys::Anonymous);
}

#[test]
fn unknown_keys_errors_name_the_setting() {
    let (line, column, field, message) = error_of("unknown_keys = \"anonymous\"\n[tenants.a]\n");
    assert_eq!((line, column, field.as_str()), (1, 16, "unknown_keys"));
    assert!(message.contains("anonymous_tenant"), "{message}");
    let (line, _, field, _) = error_of("unknown_keys = \"allow\"\n[tenants.a]\n");
    assert_eq!((line, field.as_str()), (1, "unknown_keys"));
}

#[test]
fn the_summary_says_which_unknown_keys_mode_is_in_force_and_why() {
    let default = check_policy_file(shipped("default.toml"))
        .unwrap()
        .to_string();
    assert!(
        default.contains(
            "unknown keys: anonymous (any other bearer key is served as tenant local; \
             default for a policy without tenant keys)"
        ),
        "{default}"
    );
    let multi = check_policy_file(shipped("multi-tenant.toml"))
        .unwrap()
        .to_string();
    assert!(
        multi.contains("unknown keys: reject (401 invalid_api_key; default for a policy"),
        "{multi}"
    );
    assert!(
        !multi.to_lowercase().contains(": ok"),
        "no second OK line: {multi}"
    );
    let written = parse_policy(
        "p.toml",
        "anonymous_tenant = \"a\"\nunknown_keys = \"reject\"\n[tenants.a]\n",
    )
    .unwrap()
    .summary()
    .to_string();
    assert!(
        written.contains("unknown keys: reject (401 invalid_api_key; as written)"),
        "{written}"
    );
}

#[test]
fn the_summary_shows_the_shared_store_without_its_password() {
    let summary = |text: &str| parse_policy("p.toml", text).unwrap().summary().to_string();
    let shared = summary(
        "[shared]\nredis = \"redis://app:s3cret@10.0.0.9:6379/2\"\nreplicas = 3\n\
         on_store_error = \"deny\"\n[tenants.a]\n",
    );
    assert!(
        shared.contains(
            "shared limits: redis://app:***@10.0.0.9:6379/2 (timeout 50ms, on store error deny, \
             3 replica(s))"
        ),
        "{shared}"
    );
    assert!(!shared.contains("s3cret"), "{shared}");
    let local = summary("[tenants.a]\n");
    assert!(local.contains("shared limits: none"), "{local}");
}

#[test]
fn the_summary_warns_of_a_tenant_no_request_can_reach() {
    let summary = |text: &str| parse_policy("p.toml", text).unwrap().summary().to_string();
    // c's key is sk-c (its SHA-256 below).
    let unreachable = summary(
        "anonymous_tenant = \"a\"\n[tenants.a]\n[tenants.b]\n[tenants.c]\n\
         key_sha256 = [\"923e700d172fdfb7e2d3d189270520d3f716e86cd133bd546c6eae20e158ed47\"]\n",
    );
    assert!(
        unreachable.contains("warning: tenant b has no keys and is not the anonymous tenant"),
        "{unreachable}"
    );
    assert_eq!(
        unreachable.matches("warning:").count(),
        1,
        "a and c are reachable"
    );
    for shipped_file in ["default.toml", "multi-tenant.toml"] {
        let text = check_policy_file(shipped(shipped_file))
            .unwrap()
            .to_string();
        assert!(!text.contains("warning:"), "{shipped_file}: {text}");
    }
}

#[test]
fn max_validating_inherits_and_must_be_positive() {
    let policy = parse_policy(
        "p.toml",
        "[defaults]\nmax_validating = 5\n[tenants.a]\n[tenants.b]\nmax_validating = 2\n",
    )
    .unwrap();
    assert_eq!(policy.tenant("a").unwrap().max_validating, 5);
    assert_eq!(policy.tenant("b").unwrap().max_validating, 2);
    let builtin = parse_policy("p.toml", "[tenants.c]\n").unwrap();
    assert_eq!(builtin.tenant("c").unwrap().max_validating, 64);
    let (line, column, field, message) = error_of("[tenants.a]\nmax_validating = 0\n");
    assert_eq!((line, column), (2, 18));
    assert_eq!(field, "tenants.a.max_validating");
    assert!(message.contains("at least 1"), "{message}");
}

#[test]
fn prefix_cache_defaults_to_the_tenant_inherits_and_rejects_unknown_scopes() {
    let policy = parse_policy(
        "p.toml",
        "[defaults]\nprefix_cache = \"shared\"\n[tenants.a]\n[tenants.b]\nprefix_cache = \"off\"\n",
    )
    .unwrap();
    let scope = |name: &str| policy.tenant(name).unwrap().prefix_cache;
    assert_eq!(scope("a"), PrefixCacheScope::Shared);
    assert_eq!(scope("b"), PrefixCacheScope::Off);
    let builtin = parse_policy("p.toml", "[tenants.a]\n").unwrap();
    let a = builtin.tenant("a").unwrap();
    assert_eq!(a.prefix_cache, PrefixCacheScope::Tenant);
    // Salts: per tenant by default, one for every sharing tenant, none when off.
    assert_eq!(a.prefix_cache.salt("a"), Some("tenant:a".to_owned()));
    assert_ne!(a.prefix_cache.salt("a"), a.prefix_cache.salt("b"));
    assert_eq!(
        PrefixCacheScope::Shared.salt("a"),
        PrefixCacheScope::Shared.salt("b")
    );
    assert_eq!(PrefixCacheScope::Off.salt("a"), None);

    let (line, column, field, message) = error_of("[tenants.a]\nprefix_cache = \"global\"\n");
    assert_eq!(
        (line, column, field.as_str()),
        (2, 16, "tenants.a.prefix_cache")
    );
    assert!(message.contains("unknown variant"), "{message}");
}

#[test]
fn shared_section_parses_with_defaults_and_is_absent_by_default() {
    let policy = parse_policy("p.toml", "[tenants.a]\n").unwrap();
    assert_eq!(
        policy.shared, None,
        "without [shared] the local limiter decides"
    );
    let policy = parse_policy(
        "p.toml",
        "[shared]\nredis = \"redis://127.0.0.1:6379/2\"\n[tenants.a]\n",
    )
    .unwrap();
    assert_eq!(
        policy.shared,
        Some(SharedPolicy {
            redis_url: "redis://127.0.0.1:6379/2".into(),
            timeout: Duration::from_millis(50),
            on_store_error: OnStoreError::Local,
            replicas: 1,
        })
    );
    let policy = parse_policy(
        "p.toml",
        "[shared]\nredis = \"redis://h:1\"\ntimeout = \"20ms\"\non_store_error = \"deny\"\nreplicas = 3\n[tenants.a]\n",
    )
    .unwrap();
    let shared = policy.shared.unwrap();
    assert_eq!(shared.timeout, Duration::from_millis(20));
    assert_eq!(shared.on_store_error, OnStoreError::Deny);
    assert_eq!(shared.replicas, 3);
}

#[test]
fn shared_section_errors_name_line_column_and_field() {
    let (line, column, field, message) = error_of("[tenants.a]\n[shared]\nredis = \"http://x\"\n");
    assert_eq!((line, column, field.as_str()), (3, 9, "shared.redis"));
    assert!(message.contains("not a Redis URL"), "{message}");

    let (line, column, field, message) =
        error_of("[shared]\nredis = \"redis://h:1\"\ntimeout = \"10s\"\n[tenants.a]\n");
    assert_eq!((line, column, field.as_str()), (3, 11, "shared.timeout"));
    assert!(message.contains("at most 5s"), "{message}");

    let (line, column, field, _) =
        error_of("[shared]\nredis = \"redis://h:1\"\nreplicas = 0\n[tenants.a]\n");
    assert_eq!((line, column, field.as_str()), (3, 12, "shared.replicas"));

    let (line, _, _, message) =
        error_of("[shared]\nredis = \"redis://h:1\"\non_store_error = \"open\"\n[tenants.a]\n");
    assert_eq!(line, 3);
    assert!(message.contains("local"), "{message}");

    let (_, _, _, message) = error_of("[shared]\ntimeout = \"20ms\"\n[tenants.a]\n");
    assert!(message.contains("redis"), "{message}");
}
