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
mod conn;
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvgate_runtime::block_pool::BlockPool;
use parking_lot::{Mutex, RwLock};

pub use breaker::{BASE_BACKOFF, BreakerState, FAILURE_THRESHOLD, MAX_BACKOFF};
pub use capacity::HealthyCapacity;
pub use conn::{MAX_IDLE, UpstreamBody};
pub use count::{FRAMING_TOKEN, REPLY_PRIMING, TOKENS_PER_MESSAGE, TiktokenCounter};
pub use health::{CALL_TIMEOUT, PROBE_EVERY, SCRAPE_EVERY};
pub use pool::{Replica, ReplicaLease, ReplicaPool};
pub(crate) use proxy::{forwarded_body, relay};
pub use rename::UsageCell;
pub use spec::{
    DEFAULT_CAPACITY_TOKENS, DEFAULT_TIMEOUT, KvMetric, SYNTAX, UPSTREAM_BLOCK_SIZE, UpstreamKey,
    UpstreamSpec, UpstreamSpecError,
};

use crate::admission::{Admission, PoolId, PoolLimit};
use crate::metrics::{UpstreamCapacitySnapshot, UpstreamSource};

/// Longest time to open a TCP connection to an upstream before answering 502.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection to an upstream is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most replicas one request is sent to (the first try and the retries before its first byte).
pub const MAX_ATTEMPTS: usize = 3;

/// A set of upstreams that cannot be served together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("--upstream {0} is given twice for the same replica URL")]
    Duplicate(String),
    /// (From an upstreams file, the reload names its line and column instead.)
    #[error(
        "--upstream {0} has the embedded model's name; give the upstream another NAME (and \
         model={0} if the upstream serves it under that id)"
    )]
    ShadowsLocalModel(String),
    #[error("--upstream {0}: its capacity pool is not registered with admission")]
    NotAdmitted(String),
    #[error(
        "the upstreams would add models ({0}), which needs the server's admission (these \
         upstreams are not serving)"
    )]
    ModelsChanged(String),
}

/// Every configured upstream model. Cheap to clone (clones share the set); empty by default.
///
/// The set can change while serving: an upstreams-file reload ([`Upstreams::reload`]) adds,
/// changes and removes models. A model added by a reload gets its own admission pool
/// ([`crate::admission::Admission::add_pool`], once the set is attached to admission with
/// [`Upstreams::attach`]); a removed one leaves the set, so new requests naming it get 404
/// `model_not_found`, while the requests already queued or running keep their `Arc` of it and
/// finish. Removed models are kept aside, idle (no scrapes, no probes), with their admission
/// pool: a reload that names one again brings it back as it was, so the admission pools of a
/// process are bounded by the model names it was ever configured with.
#[derive(Clone, Default)]
pub struct Upstreams {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// The models served now, in configuration order.
    list: RwLock<Arc<[Arc<Upstream>]>>,
    /// Models a reload took out of service.
    retired: Mutex<Vec<Arc<Upstream>>>,
    /// What adding a model needs: the admission that gates the pools, and the embedded
    /// model's name (an upstream may not shadow it).
    attached: OnceLock<Attached>,
    /// Whether the upkeep tasks run (a model added later starts its own).
    upkeep: AtomicBool,
    /// Reloads one at a time.
    reloading: Mutex<()>,
}

struct Attached {
    local_model: String,
    admission: Admission,
}

/// One upstream model: its name, its capacity pool, its token counter and its replicas.
pub struct Upstream {
    name: String,
    pool: Arc<BlockPool>,
    counter: Arc<TiktokenCounter>,
    replicas: ReplicaPool,
    upkeep: OnceLock<()>,
    /// Its admission pool's id, once attached.
    pool_id: OnceLock<PoolId>,
    /// False while a reload has taken it out of service (its upkeep task then idles).
    active: AtomicBool,
}

impl Upstream {
    /// A model's capacity pool (the sum of its replicas' capacities), token counter (tiktoken's
    /// encodings are built here, once, not per request, for the first replica's model id) and
    /// replica pool.
    fn build(name: String, specs: Vec<UpstreamSpec>) -> Arc<Upstream> {
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
            replicas: ReplicaPool::new(specs, capacity),
            upkeep: OnceLock::new(),
            pool_id: OnceLock::new(),
            active: AtomicBool::new(true),
        })
    }

    /// Replaces its replicas (a reload that keeps or brings back the model).
    fn replace_replicas(&self, specs: Vec<UpstreamSpec>) {
        let declared: usize = specs.iter().map(UpstreamSpec::capacity_blocks).sum();
        if declared > self.pool.total_blocks() {
            tracing::warn!(upstream = %self.name, declared_blocks = declared,
                           admission_blocks = self.pool.total_blocks(),
                           "the replicas' capacity grew; admission keeps the capacity this \
                            model's pool was created with until a restart");
        }
        self.replicas.replace(specs);
    }

    /// Whether it is in service (not taken out by a reload).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }
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
    /// One model per name (specs with the same name are replicas of one model), each replica
    /// with its own keep-alive connections; see [`Upstream::build`].
    pub fn new(specs: Vec<UpstreamSpec>) -> Result<Upstreams, UpstreamError> {
        let upstreams = Upstreams::default();
        let list: Vec<Arc<Upstream>> = group(specs)?
            .into_iter()
            .map(|(name, specs)| Upstream::build(name, specs))
            .collect();
        *upstreams.shared.list.write() = list.into();
        Ok(upstreams)
    }

    /// Ties the set to `admission`, which gates each model's capacity pool (the pools it was
    /// built with, [`Upstreams::pools`]), and refuses a model named like the embedded one (it
    /// could never be reached). From now on a reload may add models: each gets a pool of its
    /// own in `admission`.
    pub fn attach(&self, local_model: &str, admission: &Admission) -> Result<(), UpstreamError> {
        for upstream in self.list().iter() {
            if upstream.name == local_model {
                return Err(UpstreamError::ShadowsLocalModel(upstream.name.clone()));
            }
            let id = admission
                .pool_id(&upstream.pool)
                .ok_or_else(|| UpstreamError::NotAdmitted(upstream.name.clone()))?;
            let _ = upstream.pool_id.set(id);
        }
        let _ = self.shared.attached.set(Attached {
            local_model: local_model.to_owned(),
            admission: admission.clone(),
        });
        Ok(())
    }

    /// Applies `specs` (an upstreams-file reload): models kept get the new replica list
    /// (replicas whose spec is unchanged keep their state; a model's admission capacity
    /// becomes its healthy replicas' declared capacity, never more than its pool); models no
    /// longer named leave the set (new requests get 404; queued and running ones finish);
    /// new names become routable at once, each with an admission pool of its own — which
    /// needs the set to be attached to admission ([`Upstreams::attach`]). Nothing changes on
    /// error.
    pub fn reload(&self, specs: Vec<UpstreamSpec>) -> Result<(), UpstreamError> {
        let _one_at_a_time = self.shared.reloading.lock();
        let groups = group(specs)?;
        let current = self.list();
        let attached = self.shared.attached.get();
        if let Some(attached) = attached
            && let Some((name, _)) = groups.iter().find(|(n, _)| *n == attached.local_model)
        {
            return Err(UpstreamError::ShadowsLocalModel(name.clone()));
        }
        let added: Vec<&str> = groups
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| current.iter().all(|u| u.name != *name))
            .collect();
        if !added.is_empty() && attached.is_none() {
            let mut changes: Vec<String> = added.iter().map(|name| format!("+{name}")).collect();
            changes.sort();
            return Err(UpstreamError::ModelsChanged(changes.join(", ")));
        }
        // Checked: from here on nothing fails.
        let mut retired = self.shared.retired.lock();
        let mut next = Vec::with_capacity(groups.len());
        for (name, specs) in groups {
            let known = current.iter().find(|u| u.name == name).cloned();
            let back = || {
                let at = retired.iter().position(|u| u.name == name)?;
                Some(retired.swap_remove(at))
            };
            let upstream = match known.or_else(back) {
                Some(upstream) => {
                    upstream.replace_replicas(specs);
                    if !upstream.is_active() {
                        upstream.active.store(true, Ordering::SeqCst);
                        tracing::info!(upstream = %name, "upstream model back in service");
                    }
                    upstream
                }
                None => {
                    let upstream = Upstream::build(name, specs);
                    if let Some(attached) = attached {
                        let limit = Arc::clone(upstream.replicas.capacity().limit());
                        let _ = upstream.pool_id.set(attached.admission.add_pool(limit));
                    }
                    if self.shared.upkeep.load(Ordering::SeqCst) && upstream.upkeep.set(()).is_ok()
                    {
                        health::spawn_upkeep(&upstream);
                    }
                    tracing::info!(upstream = %upstream.name, "upstream model added");
                    upstream
                }
            };
            next.push(upstream);
        }
        for gone in current.iter() {
            if next.iter().all(|u| !Arc::ptr_eq(u, gone)) {
                gone.active.store(false, Ordering::SeqCst);
                retired.push(Arc::clone(gone));
                tracing::info!(upstream = %gone.name,
                               "upstream model removed: new requests for it get 404, \
                                queued and running ones finish");
            }
        }
        *self.shared.list.write() = next.into();
        Ok(())
    }

    /// Starts each model's scrape-and-probe task, once (inside a tokio runtime); models a
    /// reload adds later start theirs when added.
    pub fn start_upkeep(&self) {
        self.shared.upkeep.store(true, Ordering::SeqCst);
        for upstream in self.list().iter() {
            if upstream.upkeep.set(()).is_ok() {
                health::spawn_upkeep(upstream);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.shared.list.read().is_empty()
    }

    /// The models served now (a snapshot).
    pub fn list(&self) -> Arc<[Arc<Upstream>]> {
        Arc::clone(&self.shared.list.read())
    }

    /// The upstream serving model `name` now.
    pub fn get(&self, name: &str) -> Option<Arc<Upstream>> {
        self.shared
            .list
            .read()
            .iter()
            .find(|upstream| upstream.name == name)
            .cloned()
    }

    /// Where a request for model `name` goes now: the upstream and its admission pool; `None`
    /// when no upstream serves that name (or the set is not attached to admission).
    pub fn route(&self, name: &str) -> Option<UpstreamRoute> {
        let upstream = self.get(name)?;
        let pool = *upstream.pool_id.get()?;
        Some(UpstreamRoute { upstream, pool })
    }

    /// The capacity pools in order, each with the limit its healthy replicas set, for
    /// [`crate::admission::Admission::with_pools`].
    pub fn pools(&self) -> Vec<Arc<PoolLimit>> {
        self.list()
            .iter()
            .map(|upstream| Arc::clone(upstream.replicas.capacity().limit()))
            .collect()
    }
}

impl UpstreamSource for Upstreams {
    /// Every configured model's replicas as their breakers stand now: read at scrape time, so
    /// the gauges follow every breaker transition and every reload.
    fn upstream_capacity(&self) -> Vec<UpstreamCapacitySnapshot> {
        self.list()
            .iter()
            .map(|upstream| upstream.replicas.capacity_snapshot(&upstream.name))
            .collect()
    }
}

impl std::fmt::Debug for Upstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.list()
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
    fn without_admission_a_reload_changes_replicas_and_removes_but_cannot_add_models() {
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
        assert!(upstreams.get("b").is_none());
    }

    /// Admission over an empty local pool and `upstreams`' pools, the set attached to it.
    async fn attached(upstreams: &Upstreams) -> Admission {
        let store = crate::reload::PolicyStore::from_policy(
            crate::policy::parse_policy("t.toml", "[tenants.t]\n").unwrap(),
        );
        let admission = Admission::with_pools(store, BlockPool::new(4, 16, 0), upstreams.pools());
        upstreams.attach("embedded", &admission).unwrap();
        admission
    }

    #[tokio::test]
    async fn a_reload_adds_removes_and_brings_back_models_with_their_own_pools() {
        let upstreams = Upstreams::new(vec![spec("a=http://127.0.0.1:1,capacity=160")]).unwrap();
        let admission = attached(&upstreams).await;
        let a = upstreams.route("a").expect("routable");
        assert!(upstreams.route("b").is_none());

        // b is added: routable at once, on a pool of its own that admission gates.
        upstreams
            .reload(vec![
                spec("a=http://127.0.0.1:1,capacity=160"),
                spec("b=http://127.0.0.1:2,capacity=320"),
            ])
            .unwrap();
        let b = upstreams.route("b").expect("added");
        assert_ne!(b.pool(), a.pool());
        assert_eq!(admission.pool_id(b.upstream().pool()), Some(b.pool()));
        assert_eq!(b.upstream().pool().total_blocks(), 20);
        assert_eq!(upstreams.route("a").unwrap().pool(), a.pool(), "a is kept");
        let names: Vec<String> = upstreams
            .list()
            .iter()
            .map(|u| u.name().to_owned())
            .collect();
        assert_eq!(names, ["a", "b"]);

        // a is removed: no longer routable; a request that holds it still has it all.
        upstreams
            .reload(vec![spec("b=http://127.0.0.1:2,capacity=320")])
            .unwrap();
        assert!(upstreams.route("a").is_none());
        assert!(!a.upstream().is_active());
        assert_eq!(a.upstream().replicas().replicas().len(), 1);
        assert_eq!(upstreams.pools().len(), 1);

        // a comes back: the same model (and admission pool), with the new replica list.
        upstreams
            .reload(vec![
                spec("b=http://127.0.0.1:2,capacity=320"),
                spec("a=http://127.0.0.1:3,capacity=160"),
            ])
            .unwrap();
        let back = upstreams.route("a").expect("back");
        assert!(Arc::ptr_eq(back.upstream(), a.upstream()));
        assert_eq!(back.pool(), a.pool());
        assert!(back.upstream().is_active());
        assert!(
            back.upstream().replicas().replicas()[0]
                .base_url()
                .ends_with(":3")
        );
        drop(admission);
    }

    #[tokio::test]
    async fn attaching_and_reloading_refuse_the_embedded_models_name() {
        let upstreams = Upstreams::new(vec![spec("local=http://127.0.0.1:1")]).unwrap();
        let store = crate::reload::PolicyStore::from_policy(
            crate::policy::parse_policy("t.toml", "[tenants.t]\n").unwrap(),
        );
        let admission =
            Admission::with_pools(store.clone(), BlockPool::new(4, 16, 0), upstreams.pools());
        assert_eq!(
            upstreams.attach("local", &admission).err(),
            Some(UpstreamError::ShadowsLocalModel("local".into()))
        );
        let unadmitted = Admission::new(store, BlockPool::new(4, 16, 0));
        assert_eq!(
            upstreams.attach("embedded", &unadmitted).err(),
            Some(UpstreamError::NotAdmitted("local".into()))
        );

        let upstreams = Upstreams::new(vec![spec("a=http://127.0.0.1:1")]).unwrap();
        let _admission = attached(&upstreams).await;
        assert_eq!(
            upstreams
                .reload(vec![spec("embedded=http://127.0.0.1:2")])
                .err(),
            Some(UpstreamError::ShadowsLocalModel("embedded".into()))
        );
        assert!(upstreams.route("a").is_some(), "nothing changed");
    }
}
