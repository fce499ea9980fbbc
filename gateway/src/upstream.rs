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

mod count;
mod proxy;
mod rename;
mod spec;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kvgate_runtime::block_pool::BlockPool;

pub use count::{FRAMING_TOKEN, REPLY_PRIMING, TOKENS_PER_MESSAGE, TiktokenCounter};
pub(crate) use proxy::{forwarded_body, relay};
pub use spec::{
    DEFAULT_CAPACITY_TOKENS, DEFAULT_TIMEOUT, SYNTAX, UPSTREAM_BLOCK_SIZE, UpstreamSpec,
    UpstreamSpecError,
};

use crate::admission::PoolId;

/// Longest time to open a TCP connection to an upstream before answering 502.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection to an upstream is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The client every upstream shares (one connection pool, keyed by host).
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A set of upstreams that cannot be served together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("--upstream {0} is given twice")]
    Duplicate(String),
    #[error(
        "--upstream {0} has the embedded model's name; give the upstream another NAME (and \
         model={0} if the upstream serves it under that id)"
    )]
    ShadowsLocalModel(String),
    #[error("--upstream {0}: its capacity pool is not registered with admission")]
    NotAdmitted(String),
}

/// Every configured upstream. Cheap to clone; empty by default.
#[derive(Clone, Default)]
pub struct Upstreams {
    list: Arc<[Arc<Upstream>]>,
}

/// One upstream: its spec, its capacity pool, its token counter and the shared client.
pub struct Upstream {
    spec: UpstreamSpec,
    pool: Arc<BlockPool>,
    counter: Arc<TiktokenCounter>,
    client: HttpClient,
}

impl Upstreams {
    /// Builds each upstream's capacity pool and token counter (tiktoken's encodings are built
    /// here, once, not per request) and the pooled HTTP client. Names must be distinct.
    pub fn new(specs: Vec<UpstreamSpec>) -> Result<Upstreams, UpstreamError> {
        let mut names = HashSet::new();
        for spec in &specs {
            if !names.insert(spec.name.as_str()) {
                return Err(UpstreamError::Duplicate(spec.name.clone()));
            }
        }
        let client = http_client();
        let list = specs
            .into_iter()
            .map(|spec| {
                let counter = Arc::new(TiktokenCounter::for_model(&spec.model));
                let pool = BlockPool::new(spec.capacity_blocks(), UPSTREAM_BLOCK_SIZE, 0);
                tracing::info!(
                    upstream = %spec.name,
                    url = %spec.base_url,
                    model = %spec.model,
                    capacity_tokens = spec.capacity_blocks() * UPSTREAM_BLOCK_SIZE,
                    encoding = counter.encoding(),
                    "upstream configured"
                );
                Arc::new(Upstream {
                    spec,
                    pool,
                    counter,
                    client: client.clone(),
                })
            })
            .collect();
        Ok(Upstreams { list })
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        self.list.iter()
    }

    /// The upstream serving model `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.list.iter().find(|upstream| upstream.spec.name == name)
    }

    /// The capacity pools in order, for [`crate::admission::Admission::with_pools`].
    pub fn pools(&self) -> Vec<Arc<BlockPool>> {
        self.list
            .iter()
            .map(|upstream| Arc::clone(&upstream.pool))
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
                if upstream.spec.name == local_model {
                    return Err(UpstreamError::ShadowsLocalModel(upstream.spec.name.clone()));
                }
                let pool = pool_id(&upstream.pool)
                    .ok_or_else(|| UpstreamError::NotAdmitted(upstream.spec.name.clone()))?;
                Ok(UpstreamRoute {
                    upstream: Arc::clone(upstream),
                    pool,
                })
            })
            .collect()
    }
}

impl std::fmt::Debug for Upstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.list.iter().map(|upstream| &upstream.spec))
            .finish()
    }
}

impl Upstream {
    /// The model id clients send.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn spec(&self) -> &UpstreamSpec {
        &self.spec
    }

    /// The pool admission reserves this upstream's capacity from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The prompt token counter validation uses for this upstream.
    pub fn counter(&self) -> &Arc<TiktokenCounter> {
        &self.counter
    }

    pub(crate) fn client(&self) -> &HttpClient {
        &self.client
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

fn http_client() -> HttpClient {
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
    fn upstreams_get_pools_sized_from_their_capacity_and_distinct_names() {
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
        let b = upstreams.get("b").unwrap();
        assert_eq!(b.pool().total_blocks(), DEFAULT_CAPACITY_TOKENS / 16);
        assert_eq!(
            b.counter().encoding(),
            "o200k_base",
            "counted as model=gpt-4o"
        );
        assert!(upstreams.get("gpt-4o").is_none(), "clients send the NAME");
        assert_eq!(upstreams.pools().len(), 2);

        let twice = Upstreams::new(vec![
            spec("a=http://127.0.0.1:1"),
            spec("a=http://127.0.0.1:2"),
        ]);
        assert_eq!(twice.err(), Some(UpstreamError::Duplicate("a".into())));
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
