//! API-key authentication: `Authorization: Bearer KEY` → tenant, and admin checks for `/admin/*`.
//!
//! Policy files store only SHA-256 digests of keys. A presented key is hashed and compared with
//! *every* stored digest in constant time (`subtle`), and the match is selected without an early
//! exit, so response timing says nothing about how close a guess was or which tenant matched.

use std::sync::Arc;

use http::HeaderMap;
use http::header::AUTHORIZATION;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

use crate::policy::{KeyDigest, Policy, TenantPolicy, UnknownKeys};

/// Why a request could not be authenticated. All are HTTP 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("You didn't provide an API key. Send it as `Authorization: Bearer KEY`.")]
    MissingKey,
    #[error("The Authorization header must be `Bearer KEY`.")]
    MalformedHeader,
    #[error("Incorrect API key provided.")]
    InvalidKey,
    #[error("This endpoint needs an admin API key.")]
    NotAdmin,
}

impl AuthError {
    /// Every authentication failure is 401, as OpenAI answers.
    pub fn status(&self) -> u16 {
        401
    }

    /// OpenAI's error code for a bad or missing key.
    pub fn code(&self) -> &'static str {
        "invalid_api_key"
    }

    /// OpenAI's error type for authentication failures.
    pub fn error_type(&self) -> &'static str {
        "invalid_request_error"
    }
}

/// Lowercase hex SHA-256 of a key, the form stored in policy files (`kvgate policy hash-key`).
pub fn hash_key(key: &str) -> String {
    hex::encode(digest_key(key))
}

/// SHA-256 of a key.
pub fn digest_key(key: &str) -> KeyDigest {
    Sha256::digest(key.as_bytes()).into()
}

/// What keys from [`new_key`] start with, so a leaked one is recognisable in logs and scanners.
pub const NEW_KEY_PREFIX: &str = "sk-kvg-";

/// Random bytes in a key from [`new_key`]: 256 bits. Keys are stored as *unsalted* SHA-256
/// digests, so a key must be unguessable for its digest to be safe to keep in a policy file.
pub const NEW_KEY_BYTES: usize = 32;

/// A new API key: [`NEW_KEY_PREFIX`] and [`NEW_KEY_BYTES`] bytes from the operating system's
/// random source (not a user-space generator), in hex.
pub fn new_key() -> Result<String, rand::rand_core::OsError> {
    use rand::TryRngCore;
    let mut bytes = [0u8; NEW_KEY_BYTES];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes)?;
    Ok(format!("{NEW_KEY_PREFIX}{}", hex::encode(bytes)))
}

/// How a request identified itself, kept with it while it waits so a policy reload can check
/// it again ([`tenant_for`]): no key, or the digest of the key it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    NoKey,
    Key(KeyDigest),
}

/// The request's [`Credential`] (401 for a malformed `Authorization` header).
pub fn credential(headers: &HeaderMap) -> Result<Credential, AuthError> {
    Ok(match bearer_key(headers)? {
        Some(key) => Credential::Key(digest_key(key)),
        None => Credential::NoKey,
    })
}

/// Maps a request's key to its tenant. No key: the anonymous tenant if the policy names one,
/// else 401. A key that matches no tenant follows the policy's `unknown_keys`: the anonymous
/// tenant (a keyless policy, where SDKs send a placeholder key), or 401, so that on a policy
/// with keys a typo never silently downgrades a caller to anonymous limits.
pub fn authenticate(policy: &Policy, headers: &HeaderMap) -> Result<Arc<TenantPolicy>, AuthError> {
    tenant_for(policy, &credential(headers)?)
}

/// [`authenticate`] for a credential taken earlier: the tenant it maps to under `policy`.
pub fn tenant_for(
    policy: &Policy,
    credential: &Credential,
) -> Result<Arc<TenantPolicy>, AuthError> {
    let Credential::Key(digest) = credential else {
        return policy
            .anonymous_tenant()
            .cloned()
            .ok_or(AuthError::MissingKey);
    };
    let digests = policy.tenant_key_digests();
    let known = find_digest(digest, digests.iter().map(|(digest, _)| digest))
        .and_then(|index| digests.get(index))
        .map(|(_, tenant)| Arc::clone(tenant));
    match (known, policy.unknown_keys(), policy.anonymous_tenant()) {
        (Some(tenant), _, _) => Ok(tenant),
        (None, UnknownKeys::Anonymous, Some(anonymous)) => Ok(Arc::clone(anonymous)),
        (None, _, _) => Err(AuthError::InvalidKey),
    }
}

/// Checks that the request carries one of the policy's admin keys.
pub fn authenticate_admin(policy: &Policy, headers: &HeaderMap) -> Result<(), AuthError> {
    let key = bearer_key(headers)?.ok_or(AuthError::MissingKey)?;
    match find_digest(&digest_key(key), policy.admin_key_digests().iter()) {
        Some(_) => Ok(()),
        None => Err(AuthError::NotAdmin),
    }
}

/// The key in `Authorization: Bearer KEY`, `None` when the header is absent.
fn bearer_key(headers: &HeaderMap) -> Result<Option<&str>, AuthError> {
    let Some(value) = headers.get(AUTHORIZATION) else {
        return Ok(None);
    };
    let value = value.to_str().map_err(|_| AuthError::MalformedHeader)?;
    let (scheme, key) = value
        .trim()
        .split_once(' ')
        .ok_or(AuthError::MalformedHeader)?;
    let key = key.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || key.is_empty() {
        return Err(AuthError::MalformedHeader);
    }
    Ok(Some(key))
}

/// Index of the digest equal to `presented`. Visits every candidate and selects the match with
/// constant-time operations; only the number of candidates is visible in the timing.
fn find_digest<'a>(
    presented: &KeyDigest,
    candidates: impl Iterator<Item = &'a KeyDigest>,
) -> Option<usize> {
    let mut found = Choice::from(0);
    let mut found_index = 0u64;
    for (index, candidate) in candidates.enumerate() {
        let equal = presented.ct_eq(candidate);
        found_index = u64::conditional_select(&found_index, &(index as u64), equal);
        found |= equal;
    }
    bool::from(found).then_some(found_index as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_policy;
    use http::HeaderValue;

    fn policy(anonymous: bool) -> Policy {
        let anonymous = if anonymous {
            "anonymous_tenant = \"guest\"\n"
        } else {
            ""
        };
        policy_with(anonymous)
    }

    /// The test policy (three tenants, two with keys, and an admin key) under `header`.
    fn policy_with(header: &str) -> Policy {
        let text = format!(
            "{header}admin_key_sha256 = [\"{admin}\"]\n\
             [tenants.guest]\n\
             [tenants.alpha]\nkey_sha256 = [\"{alpha}\"]\n\
             [tenants.beta]\nkey_sha256 = [\"{beta_old}\", \"{beta_new}\"]\n",
            admin = hash_key("sk-admin"),
            alpha = hash_key("sk-alpha"),
            beta_old = hash_key("sk-beta-old"),
            beta_new = hash_key("sk-beta-new"),
        );
        match parse_policy("test.toml", &text) {
            Ok(policy) => policy,
            Err(err) => panic!("test policy must load: {err}"),
        }
    }

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn tenant_of(policy: &Policy, authorization: Option<&str>) -> Result<String, AuthError> {
        authenticate(policy, &headers(authorization)).map(|tenant| tenant.name.clone())
    }

    #[test]
    fn hash_key_is_lowercase_sha256_hex() {
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn new_keys_are_long_random_and_authenticate_by_their_digest() {
        let keys: Vec<String> = (0..64).map(|_| new_key().expect("OS randomness")).collect();
        for key in &keys {
            let random = key.strip_prefix(NEW_KEY_PREFIX).expect("prefixed");
            assert_eq!(random.len(), 2 * NEW_KEY_BYTES);
            assert!(random.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
        }
        let mut distinct = keys.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), keys.len(), "64 keys, no repeat");
        // Every hex digit shows up across 64 × 64 random digits (a stuck source would not).
        let digits: std::collections::BTreeSet<u8> = keys
            .iter()
            .flat_map(|k| k.bytes().skip(NEW_KEY_PREFIX.len()))
            .collect();
        assert_eq!(digits.len(), 16);
        // The printed digest is the one that authenticates the key.
        let text = format!("[tenants.t]\nkey_sha256 = [\"{}\"]\n", hash_key(&keys[0]));
        let policy = parse_policy("new.toml", &text).unwrap();
        let bearer = format!("Bearer {}", keys[0]);
        assert_eq!(tenant_of(&policy, Some(&bearer)), Ok("t".into()));
    }

    #[test]
    fn valid_keys_map_to_their_tenant_including_second_keys() {
        let policy = policy(false);
        assert_eq!(
            tenant_of(&policy, Some("Bearer sk-alpha")),
            Ok("alpha".into())
        );
        assert_eq!(
            tenant_of(&policy, Some("Bearer sk-beta-old")),
            Ok("beta".into())
        );
        assert_eq!(
            tenant_of(&policy, Some("bearer  sk-beta-new ")),
            Ok("beta".into())
        );
    }

    #[test]
    fn unknown_key_is_rejected_on_a_policy_with_keys_even_with_anonymous_access() {
        for anonymous in [false, true] {
            let policy = policy(anonymous);
            assert_eq!(
                tenant_of(&policy, Some("Bearer sk-wrong")),
                Err(AuthError::InvalidKey)
            );
            assert_eq!(
                tenant_of(&policy, Some("Bearer sk-admin")),
                Err(AuthError::InvalidKey)
            );
        }
    }

    #[test]
    fn unknown_keys_can_be_served_as_the_anonymous_tenant_when_written() {
        let policy = policy_with("anonymous_tenant = \"guest\"\nunknown_keys = \"anonymous\"\n");
        assert_eq!(
            tenant_of(&policy, Some("Bearer sk-typo")),
            Ok("guest".into())
        );
        assert_eq!(
            tenant_of(&policy, Some("Bearer sk-alpha")),
            Ok("alpha".into()),
            "a known key still selects its tenant"
        );
        assert_eq!(
            tenant_of(&policy, Some("Basic sk-typo")),
            Err(AuthError::MalformedHeader)
        );
    }

    #[test]
    fn a_keyless_policy_serves_placeholder_keys_anonymously_unless_it_rejects_them() {
        let keyless = |extra: &str| {
            let text = format!("anonymous_tenant = \"local\"\n{extra}[tenants.local]\n");
            parse_policy("keyless.toml", &text).unwrap()
        };
        let default = keyless("");
        assert_eq!(default.unknown_keys(), UnknownKeys::Anonymous);
        for presented in [
            None,
            Some("Bearer unused-for-anonymous"),
            Some("Bearer sk-x"),
        ] {
            assert_eq!(tenant_of(&default, presented), Ok("local".into()));
        }
        let strict = keyless("unknown_keys = \"reject\"\n");
        assert_eq!(strict.unknown_keys(), UnknownKeys::Reject);
        assert_eq!(tenant_of(&strict, None), Ok("local".into()));
        assert_eq!(
            tenant_of(&strict, Some("Bearer sk-x")),
            Err(AuthError::InvalidKey)
        );
    }

    #[test]
    fn missing_key_is_anonymous_only_when_the_policy_names_a_tenant() {
        assert_eq!(tenant_of(&policy(false), None), Err(AuthError::MissingKey));
        assert_eq!(tenant_of(&policy(true), None), Ok("guest".into()));
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let policy = policy(true);
        for value in ["sk-alpha", "Basic sk-alpha", "Bearer ", "Bearer"] {
            assert_eq!(
                tenant_of(&policy, Some(value)),
                Err(AuthError::MalformedHeader),
                "{value:?}"
            );
        }
    }

    #[test]
    fn admin_endpoints_need_an_admin_key() {
        let policy = policy(true);
        assert_eq!(
            authenticate_admin(&policy, &headers(Some("Bearer sk-admin"))),
            Ok(())
        );
        assert_eq!(
            authenticate_admin(&policy, &headers(Some("Bearer sk-alpha"))),
            Err(AuthError::NotAdmin)
        );
        assert_eq!(
            authenticate_admin(&policy, &headers(None)),
            Err(AuthError::MissingKey)
        );
    }

    #[test]
    fn find_digest_returns_the_matching_index_wherever_it_is() {
        let digests: Vec<KeyDigest> = (0..5).map(|i| digest_key(&format!("k{i}"))).collect();
        for (index, digest) in digests.iter().enumerate() {
            assert_eq!(find_digest(digest, digests.iter()), Some(index));
        }
        assert_eq!(find_digest(&digest_key("other"), digests.iter()), None);
    }
}
