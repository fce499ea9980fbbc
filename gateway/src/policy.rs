//! Tenant policy: who may call the gateway and under which limits.
//!
//! A policy file is TOML (`policies/*.toml`): `[defaults]`, `[tenants.NAME]` overrides, optional
//! `anonymous_tenant`, `unknown_keys`, `admin_key_sha256`, `[kv]` and `[lanes]`. Loading is two-phase, like
//! ripgrep's lowargs/hiargs: `raw` records what was written (with spans), then `build` (with
//! `limits` for per-tenant inheritance) checks meaning into a typed [`Policy`]. Every error
//! names the file, line, column and field (`source`), because a bad policy reload must be
//! fixable from the log line alone.

mod build;
mod limits;
mod raw;
pub(crate) mod source;
#[cfg(test)]
mod tests;

/// Durations as the policy file writes them (`"30s"`, `"500ms"`, `"1m30s"`); also used by
/// `--upstream ...,timeout=` and the duration flags of `kvgate serve`.
pub use raw::parse_duration;

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A SHA-256 digest of an API key; the plain key is never stored.
pub type KeyDigest = [u8; 32];

/// The validated policy. Immutable: a reload builds a new one (see `reload.rs`).
#[derive(Debug)]
pub struct Policy {
    source: PathBuf,
    tenants: BTreeMap<String, Arc<TenantPolicy>>,
    anonymous_tenant: Option<Arc<TenantPolicy>>,
    /// What a bearer key that matches no tenant gets.
    unknown_keys: UnknownKeysPolicy,
    tenant_keys: Vec<(KeyDigest, Arc<TenantPolicy>)>,
    admin_keys: Vec<KeyDigest>,
    /// The `[defaults]` rate limits: what a newly added tenant would get.
    default_rates: DefaultRates,
    /// How admission reserves KV blocks.
    pub kv: KvPolicy,
    /// The long-prompt lane.
    pub lanes: LanePolicy,
    /// `[shared]`: tenant limits kept in Redis across gateway replicas (`None`: local only).
    pub shared: Option<SharedPolicy>,
}

/// `[shared]`: where the tenant limits shared by every gateway replica live, and what to do
/// when that store fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPolicy {
    /// `redis://HOST:PORT/DB` (checked to parse; not dialled at load).
    pub redis_url: String,
    /// Longest one store call may take before `on_store_error` decides.
    pub timeout: Duration,
    pub on_store_error: OnStoreError,
    /// Gateway replicas sharing the limits: the `local` fallback admits limit ÷ this each.
    pub replicas: u32,
}

/// `on_store_error`: what admission does when the shared store errs or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStoreError {
    /// Each replica enforces its share (limit ÷ `replicas`) with its own local limiter.
    Local,
    /// Admit without a rate limit (fail open, as Envoy's global limiter does by default).
    Allow,
    /// Refuse with 503 (fail closed).
    Deny,
}

impl OnStoreError {
    /// The `behaviour` label of `kvgate_shared_store_errors_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::Allow => "allow",
            OnStoreError::Deny => "deny",
        }
    }
}

/// One tenant's effective limits (its overrides on top of `[defaults]` on top of built-ins).
/// Requests hold an `Arc` of this, so a reload never changes limits under a running request.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantPolicy {
    pub name: String,
    pub max_input_tokens: usize,
    pub max_output_tokens: usize,
    /// Cap on prompt + max_tokens.
    pub max_total_tokens: usize,
    pub max_messages: usize,
    /// What to do with a conversation longer than `max_input_tokens`.
    pub overflow: Overflow,
    /// Requests running at once; the excess waits in the queue.
    pub max_concurrency: usize,
    /// Requests being read or validated at once (body upload, template, tokenization); the
    /// excess is refused with 429 before its body is read.
    pub max_validating: usize,
    /// `None`: no request-rate limit.
    pub requests_per_minute: Option<NonZeroU32>,
    /// `None`: no token-rate limit. Also the token bucket's size (its burst).
    pub tokens_per_minute: Option<NonZeroU32>,
    /// Most requests waiting in this tenant's queue.
    pub queue_depth: usize,
    /// Most tokens (prompt + max_tokens) waiting in this tenant's queue.
    pub queue_tokens: usize,
    /// Longest a request may wait in the queue before a 503.
    pub max_queue_wait: Duration,
    /// Fair-share weight: under contention a tenant gets tokens in proportion to it.
    pub weight: NonZeroU32,
    /// Whose cached prompt prefixes this tenant's requests may reuse.
    pub prefix_cache: PrefixCacheScope,
}

/// `prefix_cache`: which requests share cached prompt blocks with this tenant's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixCacheScope {
    /// Only the tenant's own requests (the default): another tenant can neither hit nor time
    /// its prompts, the side channel vLLM's `cache_salt` closes.
    Tenant,
    /// Every tenant whose policy also says `shared`.
    Shared,
    /// Neither reads nor fills the cache.
    Off,
}

impl PrefixCacheScope {
    /// The engine's cache salt for a request of `tenant` (`None`: no caching). A shared salt
    /// cannot collide with a tenant's own, because it is not a tenant name.
    pub fn salt(self, tenant: &str) -> Option<String> {
        match self {
            PrefixCacheScope::Tenant => Some(format!("tenant:{tenant}")),
            PrefixCacheScope::Shared => Some("shared".to_owned()),
            PrefixCacheScope::Off => None,
        }
    }
}

/// The request and token rates of `[defaults]` (`None`: unlimited). Reported in the
/// `x-ratelimit-*` headers of responses that belong to no tenant (a refused key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DefaultRates {
    pub requests_per_minute: Option<NonZeroU32>,
    pub tokens_per_minute: Option<NonZeroU32>,
}

/// What a request whose bearer key matches no tenant gets (`unknown_keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownKeys {
    /// Served as the anonymous tenant, as if it had sent no key. Clients such as the official
    /// OpenAI SDK always send a key, so on a policy without keys a placeholder must not be a 401.
    Anonymous,
    /// 401 `invalid_api_key`, so a mistyped key is never served at anonymous limits.
    Reject,
}

/// The `unknown_keys` mode in force and whether the file wrote it (else the default applied:
/// `anonymous` for a policy with an anonymous tenant and no tenant keys, `reject` otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownKeysPolicy {
    pub mode: UnknownKeys,
    pub written: bool,
}

/// What validation does with a prompt that is too long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// 400 `context_length_exceeded`.
    Reject,
    /// Drop the oldest non-system messages until the prompt fits.
    TruncateOldest,
}

/// `[kv]`: admission reserves KV blocks under `high_watermark × total_blocks`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvPolicy {
    /// Fraction of the pool admission may fill, in (0, 1].
    pub high_watermark: f64,
    pub reservation: ReservationMode,
    /// Extra blocks reserved beyond the prompt in `Prompt` mode.
    pub prompt_headroom_blocks: usize,
}

/// How many blocks a request reserves before it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationMode {
    /// prompt + max_tokens: the request can never run out of KV.
    Full,
    /// prompt + headroom: more concurrency; the engine may preempt when decode outgrows it.
    Prompt,
}

/// `[lanes]`: prompts of at least `long_prompt_tokens` go to a lane capped at
/// `long_max_concurrency`, so short prompts never queue behind a wall of long prefills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanePolicy {
    pub long_prompt_tokens: usize,
    pub long_max_concurrency: usize,
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read policy file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}:{column}: `{field}`: {message}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        column: usize,
        field: String,
        message: String,
    },
}

/// Reads and validates a policy file.
pub fn load_policy(path: impl AsRef<Path>) -> Result<Policy, PolicyError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_policy(path, &text)
}

/// Validates policy text; `path` is only used to name the file in errors.
pub fn parse_policy(path: impl AsRef<Path>, text: &str) -> Result<Policy, PolicyError> {
    build::build(path.as_ref(), text)
}

/// Loads a file and summarises it, for `kvgate policy check FILE`.
pub fn check_policy_file(path: impl AsRef<Path>) -> Result<PolicySummary, PolicyError> {
    load_policy(path).map(|policy| policy.summary())
}

impl Policy {
    /// The tenant called `name`, if declared.
    pub fn tenant(&self, name: &str) -> Option<Arc<TenantPolicy>> {
        self.tenants.get(name).cloned()
    }

    /// All declared tenants, by name.
    pub fn tenants(&self) -> impl Iterator<Item = &Arc<TenantPolicy>> {
        self.tenants.values()
    }

    /// The tenant that requests without an API key belong to, if any.
    pub fn anonymous_tenant(&self) -> Option<&Arc<TenantPolicy>> {
        self.anonymous_tenant.as_ref()
    }

    /// What a bearer key that matches no tenant gets. `Anonymous` implies
    /// [`Policy::anonymous_tenant`] is set.
    pub fn unknown_keys(&self) -> UnknownKeys {
        self.unknown_keys.mode
    }

    /// Every (key digest, tenant) pair; auth compares against all of them.
    pub fn tenant_key_digests(&self) -> &[(KeyDigest, Arc<TenantPolicy>)] {
        &self.tenant_keys
    }

    /// Digests of keys that may call `/admin/*`.
    pub fn admin_key_digests(&self) -> &[KeyDigest] {
        &self.admin_keys
    }

    /// The `[defaults]` rate limits.
    pub fn default_rates(&self) -> DefaultRates {
        self.default_rates
    }

    /// The file this policy was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// A printable overview (no key material beyond counts).
    pub fn summary(&self) -> PolicySummary {
        let tenants = self
            .tenants
            .values()
            .map(|tenant| TenantSummary {
                policy: TenantPolicy::clone(tenant),
                keys: self
                    .tenant_keys
                    .iter()
                    .filter(|(_, owner)| owner.name == tenant.name)
                    .count(),
            })
            .collect();
        PolicySummary {
            source: self.source.clone(),
            tenants,
            anonymous_tenant: self.anonymous_tenant.as_ref().map(|t| t.name.clone()),
            unknown_keys: self.unknown_keys,
            admin_keys: self.admin_keys.len(),
            kv: self.kv,
            lanes: self.lanes,
            shared: self.shared.clone(),
        }
    }
}

/// What `kvgate policy check` prints.
#[derive(Debug, Clone)]
pub struct PolicySummary {
    pub source: PathBuf,
    pub tenants: Vec<TenantSummary>,
    pub anonymous_tenant: Option<String>,
    pub unknown_keys: UnknownKeysPolicy,
    pub admin_keys: usize,
    pub kv: KvPolicy,
    pub lanes: LanePolicy,
    pub shared: Option<SharedPolicy>,
}

/// One tenant in a [`PolicySummary`].
#[derive(Debug, Clone)]
pub struct TenantSummary {
    pub policy: TenantPolicy,
    /// Number of API key digests mapped to this tenant.
    pub keys: usize,
}

/// `url` with any password replaced by `***`: a summary is printed and pasted around.
fn without_password(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{}{user}{hidden}{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

impl fmt::Display for PolicySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let anonymous = self
            .anonymous_tenant
            .as_deref()
            .unwrap_or("(none: a key is required)");
        writeln!(f, "anonymous tenant: {anonymous}")?;
        let origin = if self.unknown_keys.written {
            "as written"
        } else if self.unknown_keys.mode == UnknownKeys::Anonymous {
            "default for a policy without tenant keys"
        } else {
            "default for a policy with tenant keys or no anonymous tenant"
        };
        match (self.unknown_keys.mode, &self.anonymous_tenant) {
            (UnknownKeys::Anonymous, Some(tenant)) => writeln!(
                f,
                "unknown keys: anonymous (any other bearer key is served as tenant {tenant}; {origin})"
            )?,
            _ => writeln!(f, "unknown keys: reject (401 invalid_api_key; {origin})")?,
        }
        writeln!(f, "admin keys: {}", self.admin_keys)?;
        let mode = match self.kv.reservation {
            ReservationMode::Full => "full".to_string(),
            ReservationMode::Prompt => {
                format!("prompt + {} blocks", self.kv.prompt_headroom_blocks)
            }
        };
        writeln!(
            f,
            "kv: high watermark {}, reservation {mode}",
            self.kv.high_watermark
        )?;
        writeln!(
            f,
            "lanes: long prompts >= {} tokens, at most {} at once",
            self.lanes.long_prompt_tokens, self.lanes.long_max_concurrency
        )?;
        match &self.shared {
            Some(shared) => writeln!(
                f,
                "shared limits: {} (timeout {:?}, on store error {}, {} replica(s))",
                without_password(&shared.redis_url),
                shared.timeout,
                shared.on_store_error.as_str(),
                shared.replicas
            )?,
            None => writeln!(f, "shared limits: none (each gateway replica limits alone)")?,
        }
        for TenantSummary { policy: t, keys } in &self.tenants {
            let per_minute =
                |limit: Option<NonZeroU32>| limit.map_or("unlimited".into(), |n| n.to_string());
            writeln!(
                f,
                "tenant {}: keys {keys}, weight {}, concurrency {}, validating {}, rpm {}, tpm {}, input {}, output {}, total {}, queue {} req / {} tok / {:?}",
                t.name,
                t.weight,
                t.max_concurrency,
                t.max_validating,
                per_minute(t.requests_per_minute),
                per_minute(t.tokens_per_minute),
                t.max_input_tokens,
                t.max_output_tokens,
                t.max_total_tokens,
                t.queue_depth,
                t.queue_tokens,
                t.max_queue_wait,
            )?;
            if *keys == 0 && self.anonymous_tenant.as_deref() != Some(t.name.as_str()) {
                // Valid, but almost certainly a mistake: say so where the operator looks.
                writeln!(
                    f,
                    "warning: tenant {} has no keys and is not the anonymous tenant: no request \
                     can reach it",
                    t.name
                )?;
            }
        }
        Ok(())
    }
}
