//! The upstreams file (`kvgate serve --upstreams FILE`): the operator's list of engine
//! replicas, one `[[replica]]` table each, validated like the policy file (every error names
//! the file, line, column and field) and hot-reloaded: on SIGHUP and when the file changes,
//! models and their replicas are added, removed or changed without a restart; a file
//! that does not validate keeps the running set (logged, and counted in
//! `kvgate_upstream_reloads_total{result}`).
//!
//! ```toml
//! [[replica]]
//! name = "llama"                    # the model name clients send (several replicas share it)
//! url = "http://10.0.0.5:8000"      # root URL, plain http, without /v1
//! model = "meta-llama/Llama-3.1-8B" # id sent upstream (default: name)
//! capacity = 200000                 # KV capacity in tokens (default 65536)
//! timeout = "60s"                   # longest wait for response headers (default 120s)
//! metrics = "http://10.0.0.5:8000/metrics"  # scraped for KV usage and waiting requests
//! kv_metric = "vllm"                # vllm | kvgate | none (default vllm with metrics)
//! api_key_env = "LLAMA_KEY"         # key sent upstream, read from this variable
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use toml::Spanned;

use super::spec::{
    DEFAULT_CAPACITY_TOKENS, DEFAULT_TIMEOUT, KvMetric, UpstreamSpec, check_name, key_from_env,
    parse_base_url, parse_capacity, parse_metrics_url, parse_timeout, settle_kv_metric,
};
use super::{UpstreamError, Upstreams};
use crate::policy::PolicyError;
use crate::policy::source::Source;

/// How often the file's modification time and size are checked for a change.
pub const POLL_EVERY: Duration = Duration::from_millis(500);

/// An upstreams file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamsFileError {
    #[error("cannot read upstreams file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `file:line:column: field: message`.
    #[error(transparent)]
    Invalid(#[from] PolicyError),
    #[error("{}: {source}", path.display())]
    Upstreams {
        path: PathBuf,
        source: UpstreamError,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    replica: Vec<Spanned<RawReplica>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplica {
    name: Spanned<String>,
    url: Spanned<String>,
    model: Option<Spanned<String>>,
    capacity: Option<Spanned<i64>>,
    timeout: Option<Spanned<String>>,
    metrics: Option<Spanned<String>>,
    kv_metric: Option<Spanned<String>>,
    api_key_env: Option<Spanned<String>>,
}

/// Reads and validates an upstreams file.
pub fn load_upstreams_file(path: &Path) -> Result<Vec<UpstreamSpec>, UpstreamsFileError> {
    let text = read(path)?;
    Ok(parse_upstreams_file(path, &text)?)
}

fn read(path: &Path) -> Result<String, UpstreamsFileError> {
    std::fs::read_to_string(path).map_err(|source| UpstreamsFileError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// `error` (from applying the file's specs) located in the file where it names one model:
/// `file:line:column: replica.name: ...` at the first replica of that name, as every other
/// error about the file. Errors about the `--upstream` values, or a model the file does not
/// name, keep their own text.
fn locate(path: &Path, text: &str, error: UpstreamError) -> UpstreamsFileError {
    let name = match &error {
        UpstreamError::ShadowsLocalModel(name) => name,
        _ => {
            return UpstreamsFileError::Upstreams {
                path: path.to_path_buf(),
                source: error,
            };
        }
    };
    let named = toml::from_str::<RawFile>(text).ok().and_then(|raw| {
        raw.replica
            .into_iter()
            .map(|entry| entry.into_inner().name)
            .find(|raw_name| raw_name.get_ref() == name)
    });
    match named {
        Some(raw_name) => UpstreamsFileError::Invalid(Source { path, text }.error(
            raw_name.span(),
            "replica.name",
            format!(
                "`{name}` is the embedded model's name; give the upstream another name (and \
                 model = \"{name}\" if the upstream serves it under that id)"
            ),
        )),
        None => UpstreamsFileError::Upstreams {
            path: path.to_path_buf(),
            source: error,
        },
    }
}

/// Validates upstreams-file text; `path` only names the file in errors.
pub fn parse_upstreams_file(path: &Path, text: &str) -> Result<Vec<UpstreamSpec>, PolicyError> {
    let source = Source { path, text };
    let raw: RawFile = toml::from_str(text).map_err(|error| source.toml_error(&error))?;
    let mut specs: Vec<UpstreamSpec> = Vec::new();
    for entry in raw.replica {
        let entry_span = entry.span();
        let raw = entry.into_inner();
        let at = |field: &Spanned<String>, name: &str, problem: String| {
            source.error(field.span(), &format!("replica.{name}"), problem)
        };
        check_name(raw.name.get_ref()).map_err(|p| at(&raw.name, "name", p))?;
        let base_url = parse_base_url(raw.url.get_ref()).map_err(|p| at(&raw.url, "url", p))?;
        let model = match &raw.model {
            Some(model) => {
                check_name(model.get_ref()).map_err(|p| at(model, "model", p))?;
                model.get_ref().clone()
            }
            None => raw.name.get_ref().clone(),
        };
        let capacity_tokens = match &raw.capacity {
            Some(capacity) => parse_capacity(&capacity.get_ref().to_string())
                .map_err(|p| source.error(capacity.span(), "replica.capacity", p))?,
            None => DEFAULT_CAPACITY_TOKENS,
        };
        let timeout = match &raw.timeout {
            Some(timeout) => {
                parse_timeout(timeout.get_ref()).map_err(|p| at(timeout, "timeout", p))?
            }
            None => DEFAULT_TIMEOUT,
        };
        let metrics_url = match &raw.metrics {
            Some(url) => Some(parse_metrics_url(url.get_ref()).map_err(|p| at(url, "metrics", p))?),
            None => None,
        };
        let kv_metric = match &raw.kv_metric {
            Some(text) => {
                Some(KvMetric::parse(text.get_ref()).map_err(|p| at(text, "kv_metric", p))?)
            }
            None => None,
        };
        let kv_metric = settle_kv_metric(metrics_url.is_some(), kv_metric).map_err(|p| {
            let span = raw
                .kv_metric
                .as_ref()
                .map_or(entry_span.clone(), Spanned::span);
            source.error(span, "replica.kv_metric", p)
        })?;
        let api_key = match &raw.api_key_env {
            Some(var) => Some(key_from_env(var.get_ref()).map_err(|p| at(var, "api_key_env", p))?),
            None => None,
        };
        let spec = UpstreamSpec {
            name: raw.name.get_ref().clone(),
            base_url,
            model,
            capacity_tokens,
            timeout,
            metrics_url,
            kv_metric,
            api_key,
        };
        if specs
            .iter()
            .any(|other| other.name == spec.name && other.base_url == spec.base_url)
        {
            return Err(at(
                &raw.url,
                "url",
                format!(
                    "model `{}` already has a replica at {}",
                    spec.name, spec.base_url
                ),
            ));
        }
        specs.push(spec);
    }
    Ok(specs)
}

/// Keeps `upstreams` in step with `path` (plus the `--upstream` values `fixed`, which always
/// stay): reloads on SIGHUP and when the file's modification time or size changes. Polling
/// rather than a file watcher: an edit by rename, a config-management tool or a mounted
/// ConfigMap all change the metadata, and one poll every [`POLL_EVERY`] costs nothing. Must be
/// called inside a tokio runtime; the task ends when the returned handle is aborted.
pub fn watch_upstreams_file(
    upstreams: Upstreams,
    path: PathBuf,
    fixed: Vec<UpstreamSpec>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    // Taken before the task runs: an edit right after this call is still seen as one.
    let mut seen = stamp(&path);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = stamp(&path);
                    if now == seen {
                        continue;
                    }
                    seen = now;
                }
                signal = hangups.recv() => {
                    if signal.is_none() {
                        return;
                    }
                }
            }
            // Logged and counted inside; the running set stays on error.
            let _ = reload(&upstreams, &path, &fixed);
        }
    }))
}

/// Re-reads the file and applies it; on any error the running set stays. Logged and counted.
pub fn reload(
    upstreams: &Upstreams,
    path: &Path,
    fixed: &[UpstreamSpec],
) -> Result<(), UpstreamsFileError> {
    let applied = read(path).and_then(|text| {
        let specs = parse_upstreams_file(path, &text)?;
        let all = fixed.iter().cloned().chain(specs).collect::<Vec<_>>();
        let replicas = all.len();
        upstreams
            .reload(all)
            .map(|()| replicas)
            .map_err(|error| locate(path, &text, error))
    });
    match applied {
        Ok(replicas) => {
            crate::metrics::record_upstream_reload(true);
            tracing::info!(path = %path.display(), replicas, "upstreams reloaded");
            Ok(())
        }
        Err(error) => {
            crate::metrics::record_upstream_reload(false);
            tracing::warn!(%error, "upstreams reload failed; keeping the running replicas");
            Err(error)
        }
    }
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<UpstreamSpec>, String> {
        parse_upstreams_file(Path::new("up.toml"), text).map_err(|e| e.to_string())
    }

    #[test]
    fn replicas_with_all_fields_and_defaults() {
        let specs = parse(
            "[[replica]]\nname = \"llama\"\nurl = \"http://10.0.0.5:8000/\"\n\
             model = \"meta/llama\"\ncapacity = 32000\ntimeout = \"30s\"\n\
             metrics = \"http://10.0.0.5:8000/metrics\"\nkv_metric = \"kvgate\"\n\
             api_key_env = \"PATH\"\n\n\
             [[replica]]\nname = \"llama\"\nurl = \"http://10.0.0.6:8000\"\n",
        )
        .unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].base_url, "http://10.0.0.5:8000");
        assert_eq!(specs[0].model, "meta/llama");
        assert_eq!(specs[0].capacity_tokens, 32000);
        assert_eq!(specs[0].timeout, Duration::from_secs(30));
        assert_eq!(specs[0].kv_metric, KvMetric::Kvgate);
        assert!(specs[0].api_key.is_some());
        assert_eq!(specs[1].model, "llama");
        assert_eq!(specs[1].capacity_tokens, DEFAULT_CAPACITY_TOKENS);
        assert_eq!(specs[1].kv_metric, KvMetric::None);
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn errors_name_the_line_column_and_field() {
        let cases = [
            (
                "[[replica]]\nname = \"a\"\nurl = \"https://h:1\"\n",
                "up.toml:3:7: `replica.url`: https upstreams",
            ),
            (
                "[[replica]]\nname = \"a\"\nurl = \"http://h:1\"\ncapacity = 4\n",
                "up.toml:4:12: `replica.capacity`",
            ),
            (
                "[[replica]]\nname = \"a\"\nurl = \"http://h:1\"\nweight = 2\n",
                "up.toml:4:1",
            ),
            (
                "[[replica]]\nname = \"a\"\nurl = \"http://h:1\"\nkv_metric = \"vllm\"\n",
                "up.toml:4:13: `replica.kv_metric`: kv_metric needs metrics=URL",
            ),
            (
                "[[replica]]\nname = \"a\"\nurl = \"http://h:1\"\n\n\
                 [[replica]]\nname = \"a\"\nurl = \"http://h:1/\"\n",
                "up.toml:7:7: `replica.url`: model `a` already has a replica",
            ),
            ("[[replica]]\nname = \"a\"\n", "missing field `url`"),
            (
                "[[replica]]\nname = \"a\"\nurl = \"http://h:1\"\ntimeout = \"soon\"\n",
                "up.toml:4:11: `replica.timeout`",
            ),
        ];
        for (text, expected) in cases {
            let error = parse(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[tokio::test]
    async fn a_changed_file_is_reloaded_and_a_bad_one_keeps_the_running_set() {
        // Removed with the file when the test ends, failed or not.
        let dir = tempfile::Builder::new()
            .prefix("kvgate-upfile-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("upstreams.toml");
        let one = "[[replica]]\nname = \"m\"\nurl = \"http://127.0.0.1:1\"\n";
        std::fs::write(&path, one).unwrap();
        let upstreams = Upstreams::new(load_upstreams_file(&path).unwrap()).unwrap();
        let count = || upstreams.get("m").unwrap().replicas().replicas().len();
        let watcher = watch_upstreams_file(upstreams.clone(), path.clone(), Vec::new()).unwrap();

        let two = format!("{one}\n[[replica]]\nname = \"m\"\nurl = \"http://127.0.0.1:2\"\n");
        std::fs::write(&path, two).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while count() != 2 {
            assert!(tokio::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        std::fs::write(&path, "[[replica]]\nname = \"m\"\n").unwrap();
        assert!(reload(&upstreams, &path, &[]).is_err());
        assert_eq!(count(), 2, "a bad file keeps the running replicas");
        std::fs::write(
            &path,
            "[[replica]]\nname = \"other\"\nurl = \"http://h:1\"\n",
        )
        .unwrap();
        // Not attached to a server's admission: a new model has no pool to go to.
        let error = reload(&upstreams, &path, &[]).unwrap_err().to_string();
        assert!(error.contains("+other"), "{error}");
        assert_eq!(count(), 2);
        watcher.abort();
    }

    #[tokio::test]
    async fn a_reload_that_names_the_embedded_model_points_at_the_line() {
        // Removed with the file when the test ends, failed or not.
        let dir = tempfile::Builder::new()
            .prefix("kvgate-upfile-local-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("upstreams.toml");
        let one = "[[replica]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n";
        std::fs::write(&path, one).unwrap();
        let upstreams = Upstreams::new(load_upstreams_file(&path).unwrap()).unwrap();
        let store = crate::reload::PolicyStore::from_policy(
            crate::policy::parse_policy("t.toml", "[tenants.t]\n").unwrap(),
        );
        let admission = crate::admission::Admission::with_pools(
            store,
            kvgate_runtime::block_pool::BlockPool::new(4, 16, 0),
            upstreams.pools(),
        );
        upstreams.attach("embedded", &admission).unwrap();
        let two = format!("{one}\n[[replica]]\nname = \"embedded\"\nurl = \"http://h:2\"\n");
        std::fs::write(&path, two).unwrap();
        let error = reload(&upstreams, &path, &[]).unwrap_err().to_string();
        assert_eq!(
            error,
            format!(
                "{}:6:8: `replica.name`: `embedded` is the embedded model's name; give the \
                 upstream another name (and model = \"embedded\" if the upstream serves it \
                 under that id)",
                path.display()
            )
        );
        assert!(upstreams.get("embedded").is_none(), "the running set stays");
    }
}
