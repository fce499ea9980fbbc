//! Phase two of policy loading: raw file → typed [`Policy`]. Tenant limits are resolved in
//! `limits.rs`; this file checks what spans tenants: names, key digests (unique across
//! tenants), the anonymous tenant and what unknown keys get, admin keys, `[kv]` and `[lanes]`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;

use super::limits::{Limits, int_field};
use super::raw::{
    RawKv, RawLanes, RawOnStoreError, RawPolicy, RawReservation, RawShared, RawUnknownKeys,
};
use super::source::Source;
use super::{
    DefaultRates, KeyDigest, KvPolicy, LanePolicy, OnStoreError, Policy, PolicyError,
    ReservationMode, SharedPolicy, TenantPolicy, UnknownKeys, UnknownKeysPolicy,
};

// Built-in pool and lane settings (tenant limits are in `limits.rs`).
const BUILTIN_HIGH_WATERMARK: f64 = 0.9;
const BUILTIN_PROMPT_HEADROOM_BLOCKS: u64 = 4;
const BUILTIN_LONG_PROMPT_TOKENS: u64 = 1024;
const BUILTIN_LONG_MAX_CONCURRENCY: u64 = 2;
/// A Redis round trip on a LAN takes well under a millisecond; 50 ms is a slow store, and
/// admission must not wait longer than that before falling back (`on_store_error`).
const BUILTIN_SHARED_TIMEOUT: Duration = Duration::from_millis(50);
/// Longest `[shared] timeout`: every request waits up to this long when Redis hangs.
const LONGEST_SHARED_TIMEOUT: Duration = Duration::from_secs(5);
const MOST_SHARED_REPLICAS: u64 = 1024;

/// Builds a [`Policy`] from file text.
pub(super) fn build(path: &Path, text: &str) -> Result<Policy, PolicyError> {
    let source = Source { path, text };
    let raw: RawPolicy = toml::from_str(text).map_err(|err| source.toml_error(&err))?;

    if let Some(keys) = &raw.defaults.key_sha256 {
        return Err(source.error(
            keys.span(),
            "defaults.key_sha256",
            "keys belong to one tenant; move them to a [tenants.NAME] table",
        ));
    }
    let defaults = Limits::builtin().inherit(&source, "defaults", &raw.defaults)?;

    let mut tenants = BTreeMap::new();
    let mut tenant_keys: Vec<(KeyDigest, Arc<TenantPolicy>)> = Vec::new();
    let mut key_owner: HashMap<KeyDigest, String> = HashMap::new();
    for (name, own) in &raw.tenants {
        let table = format!("tenants.{}", name.get_ref());
        check_tenant_name(&source, name, &table)?;
        let limits = defaults.inherit(&source, &table, own)?;
        let tenant = Arc::new(limits.into_tenant(&source, &table, name.get_ref())?);
        for key in own.key_sha256.iter().flat_map(|keys| keys.get_ref()) {
            let field = format!("{table}.key_sha256");
            let digest = parse_digest(&source, key, &field)?;
            if let Some(owner) = key_owner.insert(digest, tenant.name.clone()) {
                let message = format!("this key digest is already mapped to tenant `{owner}`");
                return Err(source.error(key.span(), &field, message));
            }
            tenant_keys.push((digest, Arc::clone(&tenant)));
        }
        tenants.insert(tenant.name.clone(), tenant);
    }
    if tenants.is_empty() {
        return Err(source.error(0..0, "tenants", "declare at least one [tenants.NAME] table"));
    }

    let anonymous_tenant = match &raw.anonymous_tenant {
        None => None,
        Some(name) => Some(tenants.get(name.get_ref()).cloned().ok_or_else(|| {
            let message = format!("no [tenants.{}] table declares this tenant", name.get_ref());
            source.error(name.span(), "anonymous_tenant", message)
        })?),
    };

    let unknown_keys = build_unknown_keys(
        &source,
        &raw,
        anonymous_tenant.is_some(),
        !tenant_keys.is_empty(),
    )?;

    let mut admin_keys = Vec::new();
    for key in &raw.admin_key_sha256 {
        let digest = parse_digest(&source, key, "admin_key_sha256")?;
        if admin_keys.contains(&digest) {
            return Err(source.error(key.span(), "admin_key_sha256", "duplicate admin key digest"));
        }
        admin_keys.push(digest);
    }

    let (requests_per_minute, tokens_per_minute) = defaults.rates();
    Ok(Policy {
        source: path.to_path_buf(),
        default_rates: DefaultRates {
            requests_per_minute,
            tokens_per_minute,
        },
        tenants,
        anonymous_tenant,
        unknown_keys,
        tenant_keys,
        admin_keys,
        kv: build_kv(&source, &raw.kv)?,
        lanes: build_lanes(&source, &raw.lanes)?,
        shared: match &raw.shared {
            Some(shared) => Some(build_shared(&source, shared.get_ref())?),
            None => None,
        },
    })
}

/// `[shared]`: the Redis URL must parse (it is not dialled here: a store that is down at load
/// time is `on_store_error`'s case, not a bad file), the timeout is bounded so a hung store
/// cannot hold requests for long, and `replicas` divides the limits of the `local` fallback.
fn build_shared(source: &Source, raw: &RawShared) -> Result<SharedPolicy, PolicyError> {
    let url = raw.redis.get_ref().trim().to_owned();
    if let Err(err) = redis::Client::open(url.as_str()) {
        let message = format!("not a Redis URL ({err}); write e.g. \"redis://127.0.0.1:6379/0\"");
        return Err(source.error(raw.redis.span(), "shared.redis", message));
    }
    let timeout = match &raw.timeout {
        Some(text) => {
            let timeout = super::parse_duration(text.get_ref())
                .map_err(|m| source.error(text.span(), "shared.timeout", m))?;
            if timeout.is_zero() || timeout > LONGEST_SHARED_TIMEOUT {
                let message = "must be more than 0 and at most 5s";
                return Err(source.error(text.span(), "shared.timeout", message));
            }
            timeout
        }
        None => BUILTIN_SHARED_TIMEOUT,
    };
    let on_store_error = match raw.on_store_error.as_ref().map(|m| *m.get_ref()) {
        None | Some(RawOnStoreError::Local) => OnStoreError::Local,
        Some(RawOnStoreError::Allow) => OnStoreError::Allow,
        Some(RawOnStoreError::Deny) => OnStoreError::Deny,
    };
    let replicas = int_field(
        source,
        "shared",
        "replicas",
        &raw.replicas,
        1,
        MOST_SHARED_REPLICAS,
    )?
    .map_or(1, |f| f.value);
    Ok(SharedPolicy {
        redis_url: url,
        timeout,
        on_store_error,
        replicas: u32::try_from(replicas).unwrap_or(1),
    })
}

/// `unknown_keys`: as written, or by default `anonymous` when the policy has an anonymous
/// tenant and no tenant keys (a single-user setup, where clients such as the official OpenAI
/// SDK send a placeholder key they cannot leave out), `reject` otherwise (a typo of a real key
/// must not be served at anonymous limits).
fn build_unknown_keys(
    source: &Source,
    raw: &RawPolicy,
    has_anonymous: bool,
    has_tenant_keys: bool,
) -> Result<UnknownKeysPolicy, PolicyError> {
    let Some(written) = &raw.unknown_keys else {
        let mode = if has_anonymous && !has_tenant_keys {
            UnknownKeys::Anonymous
        } else {
            UnknownKeys::Reject
        };
        return Ok(UnknownKeysPolicy {
            mode,
            written: false,
        });
    };
    let mode = match written.get_ref() {
        RawUnknownKeys::Reject => UnknownKeys::Reject,
        RawUnknownKeys::Anonymous if has_anonymous => UnknownKeys::Anonymous,
        RawUnknownKeys::Anonymous => {
            let message = "\"anonymous\" serves unknown keys as the anonymous tenant; \
                           set `anonymous_tenant` too";
            return Err(source.error(written.span(), "unknown_keys", message));
        }
    };
    Ok(UnknownKeysPolicy {
        mode,
        written: true,
    })
}

fn check_tenant_name(
    source: &Source,
    name: &Spanned<String>,
    table: &str,
) -> Result<(), PolicyError> {
    let text = name.get_ref();
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if text.is_empty() || text.len() > 64 || !text.chars().all(allowed) {
        let message = "tenant names are 1-64 characters of A-Z, a-z, 0-9, '_', '-', '.'";
        return Err(source.error(name.span(), table, message));
    }
    Ok(())
}

/// A 64-hex-digit SHA-256 digest, as printed by `kvgate policy hash-key`.
fn parse_digest(
    source: &Source,
    text: &Spanned<String>,
    field: &str,
) -> Result<KeyDigest, PolicyError> {
    let mut digest = [0u8; 32];
    hex::decode_to_slice(text.get_ref().trim(), &mut digest).map_err(|_| {
        let message = "not a SHA-256 digest (64 hex digits); run `kvgate policy hash-key KEY`";
        source.error(text.span(), field, message)
    })?;
    Ok(digest)
}

fn build_kv(source: &Source, raw: &RawKv) -> Result<KvPolicy, PolicyError> {
    let high_watermark = match &raw.high_watermark {
        Some(value) => {
            let w = *value.get_ref();
            if !(w > 0.0 && w <= 1.0) {
                let message = format!("must be in (0, 1], got {w}");
                return Err(source.error(value.span(), "kv.high_watermark", message));
            }
            w
        }
        None => BUILTIN_HIGH_WATERMARK,
    };
    let reservation = match raw.reservation.as_ref().map(|r| *r.get_ref()) {
        None | Some(RawReservation::Full) => ReservationMode::Full,
        Some(RawReservation::Prompt) => ReservationMode::Prompt,
    };
    let headroom = int_field(
        source,
        "kv",
        "prompt_headroom_blocks",
        &raw.prompt_headroom_blocks,
        0,
        u64::MAX,
    )?
    .map_or(BUILTIN_PROMPT_HEADROOM_BLOCKS, |f| f.value);
    Ok(KvPolicy {
        high_watermark,
        reservation,
        prompt_headroom_blocks: usize::try_from(headroom).unwrap_or(usize::MAX),
    })
}

fn build_lanes(source: &Source, raw: &RawLanes) -> Result<LanePolicy, PolicyError> {
    let get = |raw: &Option<Spanned<i64>>, name: &str, builtin: u64| {
        int_field(source, "lanes", name, raw, 1, u64::MAX)
            .map(|f| f.map_or(builtin, |f| f.value))
            .map(|v| usize::try_from(v).unwrap_or(usize::MAX))
    };
    Ok(LanePolicy {
        long_prompt_tokens: get(
            &raw.long_prompt_tokens,
            "long_prompt_tokens",
            BUILTIN_LONG_PROMPT_TOKENS,
        )?,
        long_max_concurrency: get(
            &raw.long_max_concurrency,
            "long_max_concurrency",
            BUILTIN_LONG_MAX_CONCURRENCY,
        )?,
    })
}
