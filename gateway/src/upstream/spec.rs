//! `--upstream NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION]`: one upstream engine,
//! parsed and checked here so a typo fails at startup with a message naming the option.

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
pub const SYNTAX: &str = "NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION]";

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
        )
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
        };
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
                other => {
                    return Err(fail(format!(
                        "unknown option `{other}` (known: model, capacity, timeout)"
                    )));
                }
            }
        }
        Ok(spec)
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("the model name is empty (expected {SYNTAX})"));
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("the model name `{name}` contains whitespace"));
    }
    Ok(())
}

/// `http://host[:port][/prefix]` → the same without a trailing `/`.
fn parse_base_url(url: &str) -> Result<String, String> {
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

fn parse_capacity(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(tokens) if tokens >= UPSTREAM_BLOCK_SIZE => Ok(tokens),
        _ => Err(format!(
            "capacity: `{text}` must be a whole number of tokens, at least {UPSTREAM_BLOCK_SIZE}"
        )),
    }
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    match parse_duration(text) {
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
        assert_eq!(spec.model, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(spec.capacity_tokens, 100_000);
        assert_eq!(spec.capacity_blocks(), 6250);
        assert_eq!(spec.timeout, Duration::from_secs(90));
        // Display writes a value that parses back to the same spec.
        assert_eq!(parse(&spec.to_string()), spec);
        assert_eq!(parse("a=http://h:1/,timeout=500ms").base_url, "http://h:1");
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
            ("a=http://h:1,model=", "model: the model name is empty"),
            (
                "a=http://h:1,capacity=64,capacity=32",
                "`capacity` is given twice",
            ),
            ("a=http://h:1,weight=2", "unknown option `weight`"),
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
