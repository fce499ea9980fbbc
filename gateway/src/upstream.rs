//! Upstream mode: when one machine is not enough, the same gateway fronts other engines (other
//! kvgate nodes, vLLM, llama.cpp's server, anything that speaks OpenAI's HTTP API).
//!
//! `kvgate serve --upstream NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION]` (see
//! [`UpstreamSpec`]) adds model `NAME` next to the embedded one. A request whose `model` is
//! `NAME` takes the same path as an embedded one, with two substitutions:
//!
//! * **validation** counts prompt tokens with tiktoken ([`TiktokenCounter`]; the upstream's own
//!   tokenizer is unknown), and applies the tenant's length limits to that count;
//! * **admission**'s capacity gate is the upstream's own [`BlockPool`], sized from its declared
//!   capacity in 16-token blocks, instead of the local KV pool. Rate limits, tenant
//!   concurrency, the fair queue and every 429/503 are the embedded path's, unchanged.
//!
//! The admitted request is then forwarded (`proxy.rs`): the client's JSON with `model` set to
//! the upstream's id and `max_tokens` made explicit, POSTed over a pooled plain-http connection
//! to the same OpenAI path under `URL`; the answer (JSON or SSE) is relayed frame by frame with
//! its `model` renamed to `NAME` (`rename.rs`), and the admission guard lives in the relayed
//! body until it ends.

//!
//! **Replica pools** (`pool.rs`): `--upstream` repeated with the same `NAME`, or an upstreams
//! file (`--upstreams FILE`, `file.rs`, hot-reloaded), gives one model several engine
//! replicas. Admission gates the model on one capacity pool, the sum of its replicas'
//! declared capacities; each admitted request then goes to the replica with the best score of
//! KV usage, queue length and prefix affinity (`route.rs`, `prefix.rs`), kept fresh by a
//! scrape-and-probe task (`health.rs`). A circuit breaker per replica (`breaker.rs`) ejects a
//! failing one; a request whose replica fails before its first byte reached the client is
//! retried on another. Admission's usable capacity for the model follows its healthy replicas
//! (`capacity.rs`): an ejected replica's share is withdrawn until it is readmitted, so when
//! every replica is ejected requests wait in the fair queue (429/503 as for the embedded
//! engine) rather than failing with 502, and start when one comes back.

mod breaker;
mod capacity;
mod count;
pub mod file;
mod health;
mod pool;
pub mod prefix;
mod proxy;
mod rename;
pub mod route;
mod spec;

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kvgate_runtime::block_pool::BlockPool;

pub use breaker::{BASE_BACKOFF, BreakerState, FAILURE_THRESHOLD, MAX_BACKOFF};
pub use capacity::HealthyCapacity;
pub use count::{FRAMING_TOKEN, REPLY_PRIMING, TOKENS_PER_MESSAGE, TiktokenCounter};
pub use health::{CALL_TIMEOUT, PROBE_EVERY, SCRAPE_EVERY};
pub use pool::{Replica, ReplicaLease, ReplicaPool};
pub(crate) use proxy::{forwarded_body, relay};
pub use rename::UsageCell;
pub use spec::{
    DEFAULT_CAPACITY_TOKENS, DEFAULT_TIMEOUT, KvMetric, SYNTAX, UPSTREAM_BLOCK_SIZE, UpstreamKey,
    UpstreamSpec, UpstreamSpecError,
};

use crate::admission::{PoolId, PoolLimit};
use crate::metrics::{UpstreamCapacitySnapshot, UpstreamSource};

/// Longest time to open a TCP connection to an upstream before answering 502.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection to an upstream is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most replicas one request is sent to (the first try and the retries before its first byte).
pub const MAX_ATTEMPTS: usize = 3;

/// The client every upstream shares (one connection pool, keyed by host).
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A set of upstreams that cannot be served together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("--upstream {0} is given twice for the same replica URL")]
    Duplicate(String),
    #[error(
        "--upstream {0} has the embedded model's name; give the upstream another NAME (and \
         model={0} if the upstream serves it under that id)"
    )]
    ShadowsLocalModel(String),
    #[error("--upstream {0}: its capacity pool is not registered with admission")]
    NotAdmitted(String),
    #[error(
        "the upstreams would change the set of models ({0}); adding or removing a model \
         needs a restart (replicas of existing models can be added and removed)"
    )]
    ModelsChanged(String),
}

/// Every configured upstream model. Cheap to clone; empty by default.
#[derive(Clone, Default)]
pub struct Upstreams {
    list: Arc<[Arc<Upstream>]>,
    client: Option<HttpClient>,
}

/// One upstream model: its name, its capacity pool, its token counter and its replicas.
pub struct Upstream {
    name: String,
    pool: Arc<BlockPool>,
    counter: Arc<TiktokenCounter>,
    replicas: ReplicaPool,
    upkeep: OnceLock<()>,
}

/// Groups specs by model name, in first-seen order; a replica URL twice under one name is an
/// error (it would double-count its capacity).
fn group(specs: Vec<UpstreamSpec>) -> Result<Vec<(String, Vec<UpstreamSpec>)>, UpstreamError> {
    let mut groups: Vec<(String, Vec<UpstreamSpec>)> = Vec::new();
    let mut seen = HashSet::new();
    for spec in specs {
        if !seen.insert((spec.name.clone(), spec.base_url.clone())) {
            return Err(UpstreamError::Duplicate(format!(
                "{}={}",
                spec.name, spec.base_url
            )));
        }
        match groups.iter_mut().find(|(name, _)| *name == spec.name) {
            Some((_, group)) => group.push(spec),
            None => groups.push((spec.name.clone(), vec![spec])),
        }
    }
    Ok(groups)
}

impl Upstreams {
    /// Builds each model's capacity pool (the sum of its replicas' capacities), token counter
    /// (tiktoken's encodings are built here, once, not per request, for the first replica's
    /// model id) and replica pool, sharing one pooled HTTP client. Specs with the same name
    /// are replicas of one model.
    pub fn new(specs: Vec<UpstreamSpec>) -> Result<Upstreams, UpstreamError> {
        let client = http_client();
        let list = group(specs)?
            .into_iter()
            .map(|(name, specs)| {
                let counter = Arc::new(TiktokenCounter::for_model(&specs[0].model));
                let blocks = specs.iter().map(UpstreamSpec::capacity_blocks).sum();
                let pool = BlockPool::new(blocks, UPSTREAM_BLOCK_SIZE, 0);
                let capacity = HealthyCapacity::new(PoolLimit::new(Arc::clone(&pool)));
                for spec in &specs {
                    tracing::info!(
                        upstream = %name,
                        url = %spec.base_url,
                        model = %spec.model,
                        capacity_tokens = spec.capacity_blocks() * UPSTREAM_BLOCK_SIZE,
                        metrics = spec.metrics_url.as_deref().unwrap_or("none"),
                        encoding = counter.encoding(),
                        "upstream replica configured"
                    );
                }
                Arc::new(Upstream {
                    name,
                    pool,
                    counter,
                    replicas: ReplicaPool::new(specs, &client, capacity),
                    upkeep: OnceLock::new(),
                })
            })
            .collect();
        Ok(Upstreams {
            list,
            client: Some(client),
        })
    }

    /// Replaces each model's replicas with `specs` (an upstreams-file reload). The models
    /// must stay the same (their admission pools exist since startup); each model's
    /// admission capacity becomes its healthy replicas' declared capacity, never more than
    /// the pool sized at startup. Nothing changes on error.
    pub fn reload(&self, specs: Vec<UpstreamSpec>) -> Result<(), UpstreamError> {
        let groups = group(specs)?;
        let old: HashSet<&str> = self.list.iter().map(|u| u.name.as_str()).collect();
        let new: HashSet<&str> = groups.iter().map(|(name, _)| name.as_str()).collect();
        if old != new {
            let mut changes: Vec<String> = new
                .difference(&old)
                .map(|name| format!("+{name}"))
                .chain(old.difference(&new).map(|name| format!("-{name}")))
                .collect();
            changes.sort();
            return Err(UpstreamError::ModelsChanged(changes.join(", ")));
        }
        let client = self.client.clone().unwrap_or_else(http_client);
        for (name, specs) in groups {
            if let Some(upstream) = self.get(&name) {
                let declared: usize = specs.iter().map(UpstreamSpec::capacity_blocks).sum();
                if declared > upstream.pool.total_blocks() {
                    tracing::warn!(upstream = %name, declared_blocks = declared,
                                   admission_blocks = upstream.pool.total_blocks(),
                                   "the replicas' capacity grew; admission keeps its \
                                    startup capacity until a restart");
                }
                upstream.replicas.replace(specs, &client);
            }
        }
        Ok(())
    }

    /// Starts each model's scrape-and-probe task, once (inside a tokio runtime).
    pub fn start_upkeep(&self) {
        for upstream in self.list.iter() {
            if upstream.upkeep.set(()).is_ok() {
                health::spawn_upkeep(upstream);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        self.list.iter()
    }

    /// The upstream serving model `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.list.iter().find(|upstream| upstream.name == name)
    }

    /// The capacity pools in order, each with the limit its healthy replicas set, for
    /// [`crate::admission::Admission::with_pools`].
    pub fn pools(&self) -> Vec<Arc<PoolLimit>> {
        self.list
            .iter()
            .map(|upstream| Arc::clone(upstream.replicas.capacity().limit()))
            .collect()
    }

    /// Pairs each upstream with the admission pool id of its capacity pool (`pool_id`, e.g.
    /// [`crate::admission::Admission::pool_id`]), refusing an upstream named like the
    /// embedded model (it could never be reached).
    pub fn routes(
        &self,
        local_model: &str,
        pool_id: impl Fn(&Arc<BlockPool>) -> Option<PoolId>,
    ) -> Result<Vec<UpstreamRoute>, UpstreamError> {
        self.list
            .iter()
            .map(|upstream| {
                if upstream.name == local_model {
                    return Err(UpstreamError::ShadowsLocalModel(upstream.name.clone()));
                }
                let pool = pool_id(&upstream.pool)
                    .ok_or_else(|| UpstreamError::NotAdmitted(upstream.name.clone()))?;
                Ok(UpstreamRoute {
                    upstream: Arc::clone(upstream),
                    pool,
                })
            })
            .collect()
    }
}

impl UpstreamSource for Upstreams {
    /// Every configured model's replicas as their breakers stand now: read at scrape time, so
    /// the gauges follow every breaker transition and every reload.
    fn upstream_capacity(&self) -> Vec<UpstreamCapacitySnapshot> {
        self.iter()
            .map(|upstream| upstream.replicas.capacity_snapshot(&upstream.name))
            .collect()
    }
}

impl std::fmt::Debug for Upstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.list
                    .iter()
                    .flat_map(|upstream| upstream.replicas.replicas().to_vec()),
            )
            .finish()
    }
}

impl Upstream {
    /// The model id clients send.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pool admission reserves this model's capacity from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The prompt token counter validation uses for this upstream.
    pub fn counter(&self) -> &Arc<TiktokenCounter> {
        &self.counter
    }

    /// The replicas serving this model.
    pub fn replicas(&self) -> &ReplicaPool {
        &self.replicas
    }
}

/// An upstream as the handlers see it: where to send, and which admission pool gates it.
#[derive(Clone)]
pub struct UpstreamRoute {
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) pool: PoolId,
}

impl UpstreamRoute {
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }

    pub fn pool(&self) -> PoolId {
        self.pool
    }
}

pub(crate) fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> UpstreamSpec {
        text.parse().unwrap()
    }

    #[test]
    fn upstreams_get_pools_sized_from_their_capacity_and_replicas_by_name() {
        let upstreams = Upstreams::new(vec![
            spec("a=http://127.0.0.1:1,capacity=100"),
            spec("b=http://127.0.0.1:2,model=gpt-4o"),
        ])
        .unwrap();
        let a = upstreams.get("a").unwrap();
        assert_eq!(
            a.pool().total_blocks(),
            6,
            "100 tokens = 6 whole 16-token blocks"
        );
        assert_eq!(a.pool().block_size(), UPSTREAM_BLOCK_SIZE);
        assert_eq!(a.counter().encoding(), "cl100k_base");
        assert_eq!(a.replicas().replicas().len(), 1);
        let b = upstreams.get("b").unwrap();
        assert_eq!(b.pool().total_blocks(), DEFAULT_CAPACITY_TOKENS / 16);
        assert_eq!(
            b.counter().encoding(),
            "o200k_base",
            "counted as model=gpt-4o"
        );
        assert!(upstreams.get("gpt-4o").is_none(), "clients send the NAME");
        assert_eq!(upstreams.pools().len(), 2);

        // The same name twice: two replicas of one model, capacities summed.
        let pooled = Upstreams::new(vec![
            spec("a=http://127.0.0.1:1,capacity=160"),
            spec("b=http://127.0.0.1:3"),
            spec("a=http://127.0.0.1:2,capacity=320"),
        ])
        .unwrap();
        let a = pooled.get("a").unwrap();
        assert_eq!(a.replicas().replicas().len(), 2);
        assert_eq!(a.pool().total_blocks(), 30);
        assert_eq!(pooled.pools().len(), 2, "one admission pool per model");

        let twice = Upstreams::new(vec![
            spec("a=http://127.0.0.1:1"),
            spec("a=http://127.0.0.1:1/"),
        ]);
        assert_eq!(
            twice.err(),
            Some(UpstreamError::Duplicate("a=http://127.0.0.1:1".into()))
        );
    }

    #[test]
    fn reload_changes_replicas_but_not_the_set_of_models() {
        let upstreams = Upstreams::new(vec![spec("a=http://127.0.0.1:1")]).unwrap();
        upstreams
            .reload(vec![
                spec("a=http://127.0.0.1:1"),
                spec("a=http://127.0.0.1:2"),
            ])
            .unwrap();
        assert_eq!(upstreams.get("a").unwrap().replicas().replicas().len(), 2);
        let error = upstreams
            .reload(vec![
                spec("a=http://127.0.0.1:1"),
                spec("b=http://127.0.0.1:2"),
            ])
            .unwrap_err();
        assert_eq!(error, UpstreamError::ModelsChanged("+b".into()));
        assert_eq!(
            upstreams.get("a").unwrap().replicas().replicas().len(),
            2,
            "a refused reload changes nothing"
        );
    }

    #[test]
    fn routes_refuse_the_local_models_name_and_unadmitted_pools() {
        let upstreams = Upstreams::new(vec![spec("local=http://127.0.0.1:1")]).unwrap();
        let shadow = upstreams.routes("local", |_| Some(PoolId(1)));
        assert_eq!(
            shadow.err(),
            Some(UpstreamError::ShadowsLocalModel("local".into()))
        );
        let unknown = upstreams.routes("embedded", |_| None);
        assert_eq!(
            unknown.err(),
            Some(UpstreamError::NotAdmitted("local".into()))
        );
        let routes = upstreams.routes("embedded", |_| Some(PoolId(1))).unwrap();
        assert_eq!(routes[0].pool, PoolId(1));
        assert_eq!(routes[0].upstream.name(), "local");
    }
}
