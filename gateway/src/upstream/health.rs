//! The upkeep task of each upstream model: every [`SCRAPE_EVERY`] it scrapes the KV usage and
//! waiting requests of replicas that publish metrics, and it probes replicas with a cheap
//! `GET /health` (never a generation: a busy engine's generation probe can take seconds and
//! eject a healthy replica) — each healthy one every [`PROBE_EVERY`] when it has siblings, an
//! ejected one as soon as its backoff is over (its half-open trial). Probe results feed the same circuit breaker
//! as requests. Every call has a timeout, so a hung replica never stalls the loop, and the
//! replicas of one round are contacted concurrently. The task holds only a weak reference
//! and ends when its upstream is dropped; it idles while a reload has taken the model out of
//! service.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::pool::Replica;
use super::{CONNECT_TIMEOUT, KvMetric, POOL_IDLE_TIMEOUT, Upstream};
use crate::metrics::exposition::Scrape;

/// How often metrics are scraped (routing signals are this fresh).
pub const SCRAPE_EVERY: Duration = Duration::from_millis(250);
/// Longest wait for one scrape or probe.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(1000);
/// How often a healthy replica is probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// Largest metrics page read (a vLLM page is tens of KiB).
const MAX_SCRAPE_BYTES: usize = 4 << 20;

/// Starts `upstream`'s upkeep task (inside a tokio runtime).
pub(crate) fn spawn_upkeep(upstream: &Arc<Upstream>) {
    let weak: Weak<Upstream> = Arc::downgrade(upstream);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SCRAPE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(upstream) = weak.upgrade() else {
                return;
            };
            if !upstream.is_active() {
                // Taken out of service by a reload: nothing to route, so nothing to learn.
                continue;
            }
            let replicas = upstream.replicas().replicas();
            let now = Instant::now();
            let siblings = replicas.len() > 1;
            let rounds = replicas.iter().map(|replica| {
                let probe = replica.probe_due(now, PROBE_EVERY, siblings);
                let upstream = Arc::clone(&upstream);
                async move {
                    if probe {
                        probe_once(&upstream, replica).await;
                    }
                    if replica.spec().metrics_url.is_some() {
                        scrape_once(replica).await;
                    }
                }
            });
            futures::future::join_all(rounds).await;
        }
    });
}

/// `GET {base}/health`. Any answer below 500 means the server is up and answering HTTP (vLLM
/// and llama-server answer 200, llama-server 503 while it loads its model; a kvgate node,
/// whose probe is `/healthz`, answers 404, which still proves it is serving). A 5xx or no
/// answer within [`CALL_TIMEOUT`] is a failure.
async fn probe_once(upstream: &Upstream, replica: &Arc<Replica>) {
    let url = format!("{}/health", replica.base_url());
    match get(replica, &url).await {
        Ok((status, _)) if !status.is_server_error() => replica.probe_succeeded(),
        Ok((status, _)) => {
            if replica.failed(&format!("probe answered {status}")) {
                upstream.replicas().forget(replica.id());
            }
        }
        Err(why) => {
            if replica.failed(&format!("probe: {why}")) {
                upstream.replicas().forget(replica.id());
            }
        }
    }
}

/// Reads the replica's KV usage and waiting requests from its metrics page. A failed scrape
/// leaves the last one, which goes stale on its own (`route::STALE_AFTER`).
async fn scrape_once(replica: &Replica) {
    let (Some(url), Some((kv_series, waiting_series))) = (
        replica.spec().metrics_url.as_deref(),
        replica.spec().kv_metric.series(),
    ) else {
        return;
    };
    let text = match get(replica, url).await {
        Ok((status, body)) if status.is_success() => body,
        Ok((status, _)) => {
            tracing::debug!(replica = %replica.base_url(), %status, "metrics scrape refused");
            return;
        }
        Err(why) => {
            tracing::debug!(replica = %replica.base_url(), why, "metrics scrape failed");
            return;
        }
    };
    match parse_load(&text, kv_series, waiting_series) {
        Some((kv, waiting)) => replica.set_scrape(Instant::now(), kv, waiting),
        None => tracing::debug!(replica = %replica.base_url(), series = kv_series,
                                "metrics page has no KV usage series"),
    }
}

/// `(KV usage, waiting requests)` from a Prometheus page: the largest KV usage sample (one
/// per engine), and the waiting requests summed over samples.
pub(crate) fn parse_load(text: &str, kv_series: &str, waiting_series: &str) -> Option<(f64, f64)> {
    let scrape = Scrape::parse(text).ok()?;
    let kv = scrape
        .series(kv_series)
        .map(|sample| sample.value)
        .filter(|value| value.is_finite())
        .reduce(f64::max)?;
    let waiting = scrape.sum(waiting_series, &[]);
    Some((kv.clamp(0.0, 1.0), waiting.max(0.0)))
}

/// The client of probes and scrapes (a metrics URL may name another host than the replica's):
/// hyper-util's pooled client, which is fine at their rate; requests go on the replica's own
/// connections (`conn.rs`).
fn probe_client() -> &'static Client<HttpConnector, Full<Bytes>> {
    static CLIENT: OnceLock<Client<HttpConnector, Full<Bytes>>> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .build(connector)
    })
}

/// A GET with [`CALL_TIMEOUT`] and a body bound; `(status, body text)`.
async fn get(replica: &Replica, url: &str) -> Result<(http::StatusCode, String), String> {
    let mut request = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .map_err(|error| format!("bad URL {url}: {error}"))?;
    if let Some(key) = &replica.spec().api_key
        && let Ok(value) = http::HeaderValue::from_str(&format!("Bearer {}", key.0))
    {
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, value);
    }
    let call = async {
        let response = probe_client()
            .request(request)
            .await
            .map_err(|error| error.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_SCRAPE_BYTES)
            .collect()
            .await
            .map_err(|error| error.to_string())?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {}ms", CALL_TIMEOUT.as_millis()))?
}

impl KvMetric {
    /// Whether this replica is scraped at all.
    pub fn is_scraped(self) -> bool {
        self.series().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_comes_from_the_named_series() {
        let page = "# TYPE vllm:kv_cache_usage_perc gauge\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} 0.75\n\
                    vllm:num_requests_waiting{engine=\"0\"} 2\n\
                    vllm:num_requests_waiting{engine=\"1\"} 3\n\
                    kvgate_kv_usage_ratio 0.5\n";
        let (vllm_kv, vllm_q) = KvMetric::Vllm.series().unwrap();
        assert_eq!(parse_load(page, vllm_kv, vllm_q), Some((0.75, 5.0)));
        let (kv, q) = KvMetric::Kvgate.series().unwrap();
        assert_eq!(
            parse_load(page, kv, q),
            Some((0.5, 0.0)),
            "no waiting series: 0"
        );
        assert_eq!(parse_load("other_metric 1\n", kv, q), None);
        assert_eq!(
            parse_load("kvgate_kv_usage_ratio 7\n", kv, q),
            Some((1.0, 0.0))
        );
        assert!(!KvMetric::None.is_scraped());
    }
}
