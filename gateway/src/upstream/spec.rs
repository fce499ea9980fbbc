//! `--upstream NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION][,metrics=URL]
//! [,kv_metric=vllm|kvgate|none][,api_key_env=VAR]`: one upstream engine replica, parsed and
//! checked here so a typo fails at startup with a message naming the option. Several values
//! with the same `NAME` make a replica pool (`upstream/pool.rs`); the upstreams file
//! (`upstream/file.rs`) fills the same struct.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::Uri;

use crate::policy::parse_duration;

/// Capacity (tokens of KV) assumed for an upstream that declares none.
pub const DEFAULT_CAPACITY_TOKENS: usize = 65_536;
/// Tokens per block of an upstream's capacity pool (capacity is rounded down to whole blocks).
pub const UPSTREAM_BLOCK_SIZE: usize = 16;
/// Longest wait for an upstream's response headers unless `timeout=` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The syntax, for error messages and `--help`.
pub const SYNTAX: &str = "NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION][,metrics=URL]\
                          [,kv_metric=vllm|kvgate|none][,api_key_env=VAR]";

/// Which series of a replica's `/metrics` say how full its KV cache is and how many requests
/// wait. `None`: no scrape; its load is estimated from what this gateway has in flight there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvMetric {
    /// vLLM (and kvgate with `--metrics-compat vllm`): `vllm:kv_cache_usage_perc` (0-1) and
    /// `vllm:num_requests_waiting`.
    #[default]
    Vllm,
    /// A kvgate node: `kvgate_kv_usage_ratio` and `kvgate_requests_queued`.
    Kvgate,
    /// Nothing to scrape.
    None,
}

impl KvMetric {
    /// `(KV usage series, waiting-requests series)`, or `None` when nothing is scraped.
    pub fn series(self) -> Option<(&'static str, &'static str)> {
        match self {
            KvMetric::Vllm => Some(("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting")),
            KvMetric::Kvgate => Some(("kvgate_kv_usage_ratio", "kvgate_requests_queued")),
            KvMetric::None => None,
        }
    }

    pub fn parse(text: &str) -> Result<KvMetric, String> {
        match text {
            "vllm" => Ok(KvMetric::Vllm),
            "kvgate" => Ok(KvMetric::Kvgate),
            "none" => Ok(KvMetric::None),
            other => Err(format!(
                "kv_metric: `{other}` is not one of vllm, kvgate, none"
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            KvMetric::Vllm => "vllm",
            KvMetric::Kvgate => "kvgate",
            KvMetric::None => "none",
        }
    }
}

/// The key sent upstream as `Authorization: Bearer` (never the client's own key). Its `Debug`
/// is redacted so specs can be logged.
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamKey(pub String);

impl fmt::Debug for UpstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UpstreamKey(<redacted>)")
    }
}

/// One upstream engine that requests for model `name` are proxied to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// The model id clients send (`model`) and `/v1/models` lists.
    pub name: String,
    /// `http://host:port` plus an optional path prefix, without a trailing `/`; the OpenAI
    /// path (`/v1/chat/completions`) is appended.
    pub base_url: String,
    /// The model id sent upstream (`model=`; default: `name`). Also what tiktoken looks up.
    pub model: String,
    /// KV capacity the upstream declares, in tokens (`capacity=`): admission reserves
    /// prompt + max_tokens of it per running request.
    pub capacity_tokens: usize,
    /// Longest wait for the upstream's response headers (`timeout=`); a non-streamed
    /// completion sends its headers only when it is done, so this bounds it too. The server's
    /// own request timeout (until response headers, 504) still applies on top of it.
    pub timeout: Duration,
    /// Where the replica's Prometheus metrics are scraped (`metrics=`), if anywhere.
    pub metrics_url: Option<String>,
    /// Which series of `metrics_url` to read (`kv_metric=`; `None` when there is no URL).
    pub kv_metric: KvMetric,
    /// The key sent upstream (`api_key_env=VAR` reads it from the environment at startup).
    pub api_key: Option<UpstreamKey>,
}

/// Why an `--upstream` value was refused. Each message names the value and the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}`: {problem}")]
pub struct UpstreamSpecError {
    pub value: String,
    pub problem: String,
}

impl UpstreamSpec {
    /// The capacity pool's size: `capacity_tokens` in whole blocks.
    /// The path under which the replica serves (`/engines/a` in `http://h:1/engines/a`; empty
    /// for a server root).
    pub fn path_prefix(&self) -> &str {
        let rest = self
            .base_url
            .strip_prefix("http://")
            .unwrap_or(&self.base_url);
        rest.find('/').map_or("", |at| &rest[at..])
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity_tokens / UPSTREAM_BLOCK_SIZE
    }
}

impl fmt::Display for UpstreamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={},model={},capacity={},timeout={}ms",
            self.name,
            self.base_url,
            self.model,
            self.capacity_tokens,
            self.timeout.as_millis()
        )?;
        // The key itself is never written (Display is logged); its presence is.
        if let Some(url) = &self.metrics_url {
            write!(f, ",metrics={url},kv_metric={}", self.kv_metric.name())?;
        }
        if self.api_key.is_some() {
            f.write_str(",api_key=<redacted>")?;
        }
        Ok(())
    }
}

impl FromStr for UpstreamSpec {
    type Err = UpstreamSpecError;

    fn from_str(value: &str) -> Result<UpstreamSpec, UpstreamSpecError> {
        let fail = |problem: String| UpstreamSpecError {
            value: value.to_owned(),
            problem,
        };
        let Some((name, rest)) = value.split_once('=') else {
            return Err(fail(format!("expected {SYNTAX}")));
        };
        check_name(name).map_err(&fail)?;
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or_default();
        let base_url = parse_base_url(url).map_err(&fail)?;
        let mut spec = UpstreamSpec {
            name: name.to_owned(),
            base_url,
            model: name.to_owned(),
            capacity_tokens: DEFAULT_CAPACITY_TOKENS,
            timeout: DEFAULT_TIMEOUT,
            metrics_url: None,
            kv_metric: KvMetric::None,
            api_key: None,
        };
        let mut kv_metric = None;
        let mut seen: Vec<&str> = Vec::new();
        for option in parts {
            let Some((key, text)) = option.split_once('=') else {
                return Err(fail(format!(
                    "option `{option}` must be KEY=VALUE (expected {SYNTAX})"
                )));
            };
            if seen.contains(&key) {
                return Err(fail(format!("`{key}` is given twice")));
            }
            seen.push(key);
            match key {
                "model" => {
                    check_name(text).map_err(|problem| fail(format!("model: {problem}")))?;
                    spec.model = text.to_owned();
                }
                "capacity" => spec.capacity_tokens = parse_capacity(text).map_err(&fail)?,
                "timeout" => spec.timeout = parse_timeout(text).map_err(&fail)?,
                "metrics" => spec.metrics_url = Some(parse_metrics_url(text).map_err(&fail)?),
                "kv_metric" => kv_metric = Some(KvMetric::parse(text).map_err(&fail)?),
                "api_key_env" => spec.api_key = Some(key_from_env(text).map_err(&fail)?),
                other => {
                    return Err(fail(format!(
                        "unknown option `{other}` (known: model, capacity, timeout, metrics, \
                         kv_metric, api_key_env)"
                    )));
                }
            }
        }
        spec.kv_metric = settle_kv_metric(spec.metrics_url.is_some(), kv_metric).map_err(&fail)?;
        Ok(spec)
    }
}

pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("the model name is empty (expected {SYNTAX})"));
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("the model name `{name}` contains whitespace"));
    }
    Ok(())
}

/// `http://host[:port][/prefix]` → the same without a trailing `/`.
pub(crate) fn parse_base_url(url: &str) -> Result<String, String> {
    let uri: Uri = url
        .parse()
        .map_err(|error| format!("`{url}` is not a URL: {error}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(
                "https upstreams are not supported; kvgate speaks plain http to \
                        upstreams (keep them on a private network, or put a TLS proxy on \
                        localhost)"
                    .to_owned(),
            );
        }
        _ => return Err(format!("the URL `{url}` must start with http://")),
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("the URL `{url}` has no host"));
    };
    // `Uri` takes any digits as a port, and reports one past u16 as none: it would be
    // dialled as 80. (The text after the last `:`, unless that colon is inside `[IPv6]`.)
    let port = authority
        .as_str()
        .rsplit_once(':')
        .map(|(_, port)| port)
        .filter(|port| !port.contains(']'));
    if let Some(port) = port
        && !port.parse::<u16>().is_ok_and(|port| port != 0)
    {
        return Err(format!(
            "the URL `{url}` has port {port}, not one of 1..65535"
        ));
    }
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".to_owned());
    }
    if uri.query().is_some() {
        return Err("the URL must not have a query string".to_owned());
    }
    let prefix = uri.path().trim_end_matches('/');
    if prefix == "/v1" || prefix.ends_with("/v1") {
        return Err("give the server's root URL, without `/v1` (kvgate appends \
                    /v1/chat/completions and /v1/completions)"
            .to_owned());
    }
    Ok(format!("http://{authority}{prefix}"))
}

/// `kv_metric` with `metrics`: as given (default vllm); without: only `none` makes sense.
pub(crate) fn settle_kv_metric(
    has_url: bool,
    kv_metric: Option<KvMetric>,
) -> Result<KvMetric, String> {
    match (has_url, kv_metric) {
        (true, Some(metric)) => Ok(metric),
        (true, None) => Ok(KvMetric::Vllm),
        (false, None | Some(KvMetric::None)) => Ok(KvMetric::None),
        (false, Some(_)) => Err("kv_metric needs metrics=URL (where to scrape it)".to_owned()),
    }
}

/// A full `http://host:port/path` URL to scrape.
pub(crate) fn parse_metrics_url(url: &str) -> Result<String, String> {
    let uri: Uri = url
        .parse()
        .map_err(|error| format!("metrics: `{url}` is not a URL: {error}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!(
            "metrics: `{url}` must be an http:// URL with a host, e.g. http://10.0.0.5:8000/metrics"
        ));
    }
    Ok(url.to_owned())
}

/// The upstream key from environment variable `var` (so it is not on the command line).
pub(crate) fn key_from_env(var: &str) -> Result<UpstreamKey, String> {
    match std::env::var(var) {
        Ok(key) if !key.trim().is_empty() => Ok(UpstreamKey(key.trim().to_owned())),
        Ok(_) => Err(format!("api_key_env: environment variable {var} is empty")),
        Err(_) => Err(format!(
            "api_key_env: environment variable {var} is not set"
        )),
    }
}

pub(crate) fn parse_capacity(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(tokens) if tokens >= UPSTREAM_BLOCK_SIZE => Ok(tokens),
        _ => Err(format!(
            "capacity: `{text}` must be a whole number of tokens, at least {UPSTREAM_BLOCK_SIZE}"
        )),
    }
}

/// Longest `timeout=` accepted: a day is far beyond any answer's wait for its first byte,
/// and keeps every deadline computed from it within the clock's range.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

pub(crate) fn parse_timeout(text: &str) -> Result<Duration, String> {
    match parse_duration(text) {
        Ok(timeout) if timeout > MAX_TIMEOUT => Err(format!(
            "timeout: `{text}` is longer than the most allowed, {}h",
            MAX_TIMEOUT.as_secs() / 3600
        )),
        Ok(timeout) if !timeout.is_zero() => Ok(timeout),
        Ok(_) => Err("timeout: must be longer than 0".to_owned()),
        Err(problem) => Err(format!("timeout: {problem}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> UpstreamSpec {
        text.parse()
            .unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
    }

    fn problem(text: &str) -> String {
        match text.parse::<UpstreamSpec>() {
            Ok(spec) => panic!("{text:?} should be refused, parsed as {spec:?}"),
            Err(error) => {
                assert_eq!(error.value, text);
                error.problem
            }
        }
    }

    #[test]
    fn a_bare_name_and_url_gets_the_defaults() {
        let spec = parse("llama=http://127.0.0.1:9000");
        assert_eq!(
            spec,
            UpstreamSpec {
                name: "llama".into(),
                base_url: "http://127.0.0.1:9000".into(),
                model: "llama".into(),
                capacity_tokens: DEFAULT_CAPACITY_TOKENS,
                timeout: DEFAULT_TIMEOUT,
                metrics_url: None,
                kv_metric: KvMetric::None,
                api_key: None,
            }
        );
        assert_eq!(spec.capacity_blocks(), DEFAULT_CAPACITY_TOKENS / 16);
    }

    #[test]
    fn options_set_the_upstream_model_capacity_and_timeout() {
        let spec = parse(
            "big=http://10.0.0.5:8000/engines/a/,model=meta-llama/Llama-3.1-8B-Instruct,\
             capacity=100000,timeout=1m30s",
        );
        assert_eq!(spec.name, "big");
        assert_eq!(spec.base_url, "http://10.0.0.5:8000/engines/a");
        assert_eq!(spec.path_prefix(), "/engines/a");
        assert_eq!(parse("a=http://h:1/").path_prefix(), "");
        assert_eq!(spec.model, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(spec.capacity_tokens, 100_000);
        assert_eq!(spec.capacity_blocks(), 6250);
        assert_eq!(spec.timeout, Duration::from_secs(90));
        // Display writes a value that parses back to the same spec.
        assert_eq!(parse(&spec.to_string()), spec);
        assert_eq!(parse("a=http://h:1/,timeout=500ms").base_url, "http://h:1");
        assert_eq!(parse("a=http://[::1]:8080").base_url, "http://[::1]:8080");
        assert_eq!(parse("a=http://[::1]").base_url, "http://[::1]");
        assert_eq!(parse("a=http://h:65535").base_url, "http://h:65535");
    }

    #[test]
    fn metrics_and_keys_configure_scraping_and_the_upstream_key() {
        let spec = parse("a=http://h:1,metrics=http://h:1/metrics,kv_metric=kvgate");
        assert_eq!(spec.metrics_url.as_deref(), Some("http://h:1/metrics"));
        assert_eq!(spec.kv_metric, KvMetric::Kvgate);
        assert_eq!(parse(&spec.to_string()), spec, "round trip");
        let vllm = parse("a=http://h:1,metrics=http://h:1/metrics");
        assert_eq!(vllm.kv_metric, KvMetric::Vllm, "the default series");
        assert_eq!(parse("a=http://h:1").kv_metric, KvMetric::None);

        // PATH is set in every test environment (setting a variable would race other tests).
        let path = std::env::var("PATH").unwrap();
        let keyed = parse("a=http://h:1,api_key_env=PATH");
        assert_eq!(keyed.api_key, Some(UpstreamKey(path.trim().to_owned())));
        let logged = format!("{keyed:?} {keyed}");
        assert!(!logged.contains(path.trim()), "never logged: {logged}");
    }

    #[test]
    fn malformed_values_name_the_problem() {
        let cases = [
            ("llama", "expected NAME=URL"),
            ("=http://h:1", "model name is empty"),
            ("my model=http://h:1", "whitespace"),
            ("a=", "is not a URL"),
            ("a=127.0.0.1:9000", "must start with http://"),
            ("a=https://h:1", "https upstreams are not supported"),
            ("a=http://h:1/v1", "without `/v1`"),
            ("a=http://h:1/x/v1/", "without `/v1`"),
            ("a=http://h:1/?x=1", "query string"),
            ("a=http://user:pw@h:1", "credentials"),
            ("a=http://h:1,capacity", "must be KEY=VALUE"),
            ("a=http://h:1,capacity=lots", "capacity: `lots`"),
            ("a=http://h:1,capacity=15", "at least 16"),
            ("a=http://h:1,capacity=-5", "capacity"),
            ("a=http://h:1,timeout=30", "timeout: `30` is not a duration"),
            ("a=http://h:1,timeout=0s", "longer than 0"),
            (
                "a=http://h:1,timeout=6000000000000000h",
                "longer than the most allowed, 24h",
            ),
            ("a=http://h:1,timeout=25h", "longer than the most allowed"),
            (
                "a=http://127.0.0.1:99999",
                "port 99999, not one of 1..65535",
            ),
            ("a=http://127.0.0.1:0", "port 0, not one of 1..65535"),
            ("a=http://h:", "port , not one of"),
            ("a=http://h:1,model=", "model: the model name is empty"),
            (
                "a=http://h:1,capacity=64,capacity=32",
                "`capacity` is given twice",
            ),
            ("a=http://h:1,weight=2", "unknown option `weight`"),
            ("a=http://h:1,kv_metric=kvgate", "needs metrics=URL"),
            (
                "a=http://h:1,metrics=ftp://h:1/metrics",
                "must be an http:// URL",
            ),
            (
                "a=http://h:1,metrics=http://h:1/m,kv_metric=sglang",
                "`sglang` is not one of",
            ),
            (
                "a=http://h:1,api_key_env=KVGATE_NO_SUCH_VAR_X",
                "is not set",
            ),
        ];
        for (text, expected) in cases {
            let problem = problem(text);
            assert!(problem.contains(expected), "{text:?}: {problem}");
        }
        let error = "a=https://h:1".parse::<UpstreamSpec>().unwrap_err();
        assert!(
            error.to_string().starts_with("`a=https://h:1`: "),
            "{error}"
        );
    }
}
