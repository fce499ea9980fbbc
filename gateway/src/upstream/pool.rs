//! A model's replica pool: the engines serving one model name, each with its load counters,
//! last scrape and circuit breaker, and the prefix index the router consults.
//!
//! [`ReplicaPool::choose`] scores every replica whose breaker lets a request through
//! (`route.rs`), takes the best, records the prompt's prefix hashes for it and returns a
//! [`ReplicaLease`] that counts the request in that replica's in-flight load until it is
//! dropped (when the relayed body ends). The replica set can be replaced while requests run
//! ([`ReplicaPool::replace`], for upstreams-file reloads): replicas whose spec did not change
//! keep their state; requests hold an `Arc` of the replica they were sent to. Breaker
//! ejections and readmissions move the model's admission capacity ([`HealthyCapacity`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use super::UpstreamSpec;
use super::breaker::{Breaker, BreakerState};
use super::capacity::HealthyCapacity;
use super::conn::ConnPool;
use super::prefix::{BLOCK_TOKENS, PrefixIndex, ReplicaId};
use super::route::{Candidate, LoadSample, Scraped, Weights, pick};
use crate::metrics::UpstreamCapacitySnapshot;

/// One engine replica.
pub struct Replica {
    id: ReplicaId,
    spec: UpstreamSpec,
    /// Its keep-alive connections (`conn.rs`).
    conns: ConnPool,
    in_flight_requests: AtomicUsize,
    in_flight_tokens: AtomicUsize,
    /// Prompt + max_tokens of every request ever sent here (for scrape corrections).
    tokens_sent: AtomicU64,
    /// Requests ever sent here.
    requests_sent: AtomicU64,
    scraped: Mutex<Option<Scraped>>,
    breaker: Mutex<Breaker>,
    /// When the last active probe went (the upkeep task probes each replica now and then).
    last_probe: Mutex<Option<Instant>>,
    /// The model's admission capacity, told of this replica's ejections and readmissions.
    capacity: Arc<HealthyCapacity>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("id", &self.id)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

/// Process-wide replica ids (prefix-index keys; never reused).
static NEXT_REPLICA_ID: AtomicU64 = AtomicU64::new(1);

impl Replica {
    fn new(spec: UpstreamSpec, capacity: Arc<HealthyCapacity>) -> Replica {
        Replica {
            id: NEXT_REPLICA_ID.fetch_add(1, Ordering::Relaxed),
            conns: ConnPool::new(&spec.base_url),
            spec,
            in_flight_requests: AtomicUsize::new(0),
            in_flight_tokens: AtomicUsize::new(0),
            tokens_sent: AtomicU64::new(0),
            requests_sent: AtomicU64::new(0),
            scraped: Mutex::new(None),
            breaker: Mutex::new(Breaker::default()),
            last_probe: Mutex::new(None),
            capacity,
        }
    }

    pub fn spec(&self) -> &UpstreamSpec {
        &self.spec
    }

    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// `http://host:port[/prefix]`, also this replica's label in logs and metrics.
    pub fn base_url(&self) -> &str {
        &self.spec.base_url
    }

    pub(crate) fn conns(&self) -> &ConnPool {
        &self.conns
    }

    /// Requests sent here since the gateway started (tries that failed included).
    pub fn requests_sent(&self) -> u64 {
        self.requests_sent.load(Ordering::Relaxed)
    }

    pub fn in_flight_requests(&self) -> usize {
        self.in_flight_requests.load(Ordering::Relaxed)
    }

    /// Whether the breaker has ejected this replica.
    pub fn is_ejected(&self) -> bool {
        self.breaker.lock().is_ejected()
    }

    /// Where its breaker stands now.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.lock().state()
    }

    /// The load signals the router reads.
    pub fn load(&self) -> LoadSample {
        LoadSample {
            scraped: *self.scraped.lock(),
            in_flight_requests: self.in_flight_requests.load(Ordering::Relaxed),
            in_flight_tokens: self.in_flight_tokens.load(Ordering::Relaxed),
            tokens_sent: self.tokens_sent.load(Ordering::Relaxed),
            capacity_tokens: self.spec.capacity_tokens,
        }
    }

    /// Stores a scrape taken at `at` (`kv_usage` 0-1, `waiting` requests).
    pub(crate) fn set_scrape(&self, at: Instant, kv_usage: f64, waiting: f64) {
        *self.scraped.lock() = Some(Scraped {
            at,
            kv_usage,
            waiting,
            tokens_sent_then: self.tokens_sent.load(Ordering::Relaxed),
        });
    }

    /// Records a request that ended well (may readmit an ejected replica, giving its capacity
    /// back to admission).
    pub(crate) fn succeeded(&self) {
        self.record_success(Breaker::success);
    }

    /// Records an answered health probe (see [`Breaker::probe_success`]).
    pub(crate) fn probe_succeeded(&self) {
        self.record_success(Breaker::probe_success);
    }

    fn record_success(&self, success: fn(&mut Breaker) -> bool) {
        let mut breaker = self.breaker.lock();
        if success(&mut breaker) {
            // Under the breaker's lock: a concurrent ejection reaches the capacity after this.
            self.capacity.readmitted(self.id);
            drop(breaker);
            crate::metrics::record_breaker_transition(&self.spec.name, &self.spec.base_url, false);
            tracing::info!(replica = %self.spec.base_url, model = %self.spec.name,
                           "upstream replica readmitted");
        }
    }

    /// Records a failed request or probe (may eject the replica, withdrawing its capacity from
    /// admission). True when it was ejected.
    pub(crate) fn failed(&self, why: &str) -> bool {
        let mut breaker = self.breaker.lock();
        let ejected = breaker.failure(Instant::now());
        if ejected {
            self.capacity.ejected(self.id);
        }
        drop(breaker);
        if ejected {
            crate::metrics::record_breaker_transition(&self.spec.name, &self.spec.base_url, true);
            tracing::warn!(replica = %self.spec.base_url, model = %self.spec.name, why,
                           "upstream replica ejected by its circuit breaker");
        }
        ejected
    }

    /// Whether an active probe is due: an ejected replica whose backoff is over (its
    /// half-open trial), or, when it has `siblings` to take its work, a healthy one not
    /// probed for `every` (a lone replica gets no work elsewhere, so probing it while healthy
    /// would only add connections; its requests feed the breaker).
    pub(crate) fn probe_due(
        &self,
        now: Instant,
        every: std::time::Duration,
        siblings: bool,
    ) -> bool {
        let mut breaker = self.breaker.lock();
        if breaker.is_ejected() {
            return breaker.try_acquire(now);
        }
        drop(breaker);
        if !siblings {
            return false;
        }
        let mut last = self.last_probe.lock();
        let due = last.is_none_or(|at| now.saturating_duration_since(at) >= every);
        if due {
            *last = Some(now);
        }
        due
    }
}

/// A request counted in a replica's load; dropping it (the relayed body ended) uncounts it.
pub struct ReplicaLease {
    replica: Arc<Replica>,
    tokens: usize,
}

impl ReplicaLease {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for ReplicaLease {
    fn drop(&mut self) {
        self.replica
            .in_flight_requests
            .fetch_sub(1, Ordering::Relaxed);
        self.replica
            .in_flight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// The replicas of one model and the router's state over them.
pub struct ReplicaPool {
    replicas: RwLock<Arc<[Arc<Replica>]>>,
    capacity: Arc<HealthyCapacity>,
    index: Mutex<PrefixIndex>,
    rotation: AtomicUsize,
    weights: Weights,
}

impl ReplicaPool {
    /// One replica per spec, each with its own connections, reporting to `capacity` (which starts out
    /// counting them all healthy).
    pub(crate) fn new(specs: Vec<UpstreamSpec>, capacity: Arc<HealthyCapacity>) -> ReplicaPool {
        let replicas: Vec<Arc<Replica>> = specs
            .into_iter()
            .map(|spec| Arc::new(Replica::new(spec, Arc::clone(&capacity))))
            .collect();
        capacity.set_replicas(replicas.iter().map(|r| (r.id, r.spec.capacity_blocks())));
        ReplicaPool {
            replicas: RwLock::new(replicas.into()),
            capacity,
            index: Mutex::new(PrefixIndex::default()),
            rotation: AtomicUsize::new(0),
            weights: Weights::default(),
        }
    }

    /// The model's admission capacity, as its healthy replicas make it.
    pub fn capacity(&self) -> &Arc<HealthyCapacity> {
        &self.capacity
    }

    /// The current replicas (a snapshot).
    pub fn replicas(&self) -> Arc<[Arc<Replica>]> {
        Arc::clone(&self.replicas.read())
    }

    /// The best replica for a prompt with prefix hashes `hashes` and a reservation of
    /// `tokens` (prompt + max_tokens), skipping `tried` (replicas that failed this request)
    /// and those whose breaker is open. `None` when no replica can take it now.
    pub fn choose(
        &self,
        hashes: &[u64],
        tokens: usize,
        tried: &[ReplicaId],
    ) -> Option<ReplicaLease> {
        let now = Instant::now();
        let replicas = self.replicas();
        let open: Vec<&Arc<Replica>> = replicas
            .iter()
            .filter(|replica| !tried.contains(&replica.id))
            .filter(|replica| replica.breaker.lock().is_available(now))
            .collect();
        let chosen = {
            let index = self.index.lock();
            let candidates: Vec<Candidate> = open
                .iter()
                .map(|replica| {
                    let (kv_usage, queue) = replica.load().estimate(now);
                    let prefix = if hashes.is_empty() {
                        0.0
                    } else {
                        index.matched(hashes, replica.id) as f64 / hashes.len() as f64
                    };
                    Candidate {
                        kv_usage,
                        queue,
                        prefix,
                    }
                })
                .collect();
            let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
            pick(&candidates, self.weights, rotation)
        };
        let replica = Arc::clone(open.get(chosen?)?);
        // The half-open trial may have been taken by a probe since: then nothing goes there.
        if !replica.breaker.lock().try_acquire(now) {
            let mut tried = tried.to_vec();
            tried.push(replica.id);
            return self.choose(hashes, tokens, &tried);
        }
        self.index.lock().record(
            hashes,
            replica.id,
            replica.spec.capacity_tokens / BLOCK_TOKENS,
        );
        replica.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        replica
            .in_flight_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        replica
            .tokens_sent
            .fetch_add(tokens as u64, Ordering::Relaxed);
        replica.requests_sent.fetch_add(1, Ordering::Relaxed);
        Some(ReplicaLease { replica, tokens })
    }

    /// The replicas of model `model` as the capacity gauges report them: how many stand in
    /// each breaker state, and the declared capacity of the healthy ones (what a model can
    /// take while the others are out; admission's share is the same, capped by its pool).
    pub fn capacity_snapshot(&self, model: &str) -> UpstreamCapacitySnapshot {
        let mut snapshot = UpstreamCapacitySnapshot {
            model: model.to_owned(),
            ..UpstreamCapacitySnapshot::default()
        };
        for replica in self.replicas().iter() {
            match replica.breaker_state() {
                BreakerState::Healthy => {
                    snapshot.healthy += 1;
                    snapshot.capacity_tokens += replica.spec.capacity_tokens as u64;
                }
                BreakerState::Ejected => snapshot.ejected += 1,
                BreakerState::HalfOpen => snapshot.half_open += 1,
            }
        }
        snapshot
    }

    /// Forgets what `replica` was sent (it was ejected: its cache is unknown after a restart).
    pub(crate) fn forget(&self, replica: ReplicaId) {
        self.index.lock().forget(replica);
    }

    /// Replaces the replica set with `specs`: a replica whose spec is unchanged keeps its
    /// state (load, breaker, prefix entries); the others start fresh, and removed ones leave
    /// the index (requests already sent to them finish there).
    pub(crate) fn replace(&self, specs: Vec<UpstreamSpec>) {
        let old = self.replicas();
        let next: Vec<Arc<Replica>> = specs
            .into_iter()
            .map(
                |spec| match old.iter().find(|replica| replica.spec == spec) {
                    Some(kept) => Arc::clone(kept),
                    None => Arc::new(Replica::new(spec, Arc::clone(&self.capacity))),
                },
            )
            .collect();
        for gone in old.iter().filter(|r| !next.iter().any(|n| n.id == r.id)) {
            self.forget(gone.id);
        }
        self.capacity
            .set_replicas(next.iter().map(|r| (r.id, r.spec.capacity_blocks())));
        *self.replicas.write() = next.into();
    }
}

/// A pool of replicas `m=http://127.0.0.1:9000+i` with the given capacities (tokens), for
/// tests here and in the relay's.
#[cfg(test)]
pub(crate) fn test_pool(capacities: &[usize]) -> ReplicaPool {
    let specs: Vec<UpstreamSpec> = capacities
        .iter()
        .enumerate()
        .map(|(i, capacity)| {
            let spec = format!("m=http://127.0.0.1:{},capacity={capacity}", 9000 + i);
            spec.parse().expect("a valid spec")
        })
        .collect();
    let blocks = specs.iter().map(UpstreamSpec::capacity_blocks).sum();
    let limit = crate::admission::PoolLimit::new(kvgate_runtime::block_pool::BlockPool::new(
        blocks,
        crate::upstream::UPSTREAM_BLOCK_SIZE,
        0,
    ));
    ReplicaPool::new(specs, HealthyCapacity::new(limit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::prefix::block_hashes;

    fn pool(capacities: &[usize]) -> ReplicaPool {
        test_pool(capacities)
    }

    fn port(lease: &ReplicaLease) -> &str {
        lease.replica().base_url().rsplit(':').next().unwrap()
    }

    #[tokio::test]
    async fn leases_count_load_and_spread_equal_replicas() {
        let pool = pool(&[1000, 1000]);
        let a = pool.choose(&[], 100, &[]).unwrap();
        let b = pool.choose(&[], 100, &[]).unwrap();
        assert_ne!(a.replica().id(), b.replica().id(), "the less loaded one");
        assert_eq!(a.replica().in_flight_requests(), 1);
        let held = Arc::clone(a.replica());
        drop(a);
        assert_eq!(held.in_flight_requests(), 0);
        assert_eq!(held.load().in_flight_tokens, 0);
        assert_eq!(held.load().tokens_sent, 100, "sent stays counted");
    }

    #[tokio::test]
    async fn a_shared_prefix_sticks_to_one_replica_until_it_fills_up() {
        let pool = pool(&[1000, 1000]);
        let system: Vec<u32> = (0..160).collect();
        let hashes = block_hashes("m/t", &system);
        let first = pool.choose(&hashes, 10, &[]).unwrap();
        let home = port(&first).to_owned();
        let mut held = vec![first];
        for _ in 0..3 {
            let lease = pool.choose(&hashes, 10, &[]).unwrap();
            assert_eq!(port(&lease), home, "affinity");
            held.push(lease);
        }
        // The home replica saturates (a scrape says 95% full): new work goes elsewhere.
        held[0].replica().set_scrape(Instant::now(), 0.95, 0.0);
        let spilled = pool.choose(&hashes, 10, &[]).unwrap();
        assert_ne!(port(&spilled), home);
    }

    #[tokio::test]
    async fn ejected_and_tried_replicas_are_skipped_and_reload_keeps_unchanged_ones() {
        let pool = pool(&[1000, 1000]);
        let replicas = pool.replicas();
        for _ in 0..super::super::breaker::FAILURE_THRESHOLD {
            replicas[0].failed("test");
        }
        for _ in 0..4 {
            let lease = pool.choose(&[], 1, &[]).unwrap();
            assert_eq!(lease.replica().id(), replicas[1].id());
        }
        let snapshot = pool.capacity_snapshot("m");
        assert_eq!(
            (snapshot.healthy, snapshot.ejected, snapshot.half_open),
            (1, 1, 0)
        );
        assert_eq!(
            snapshot.capacity_tokens, 1000,
            "the healthy replica's capacity"
        );
        assert!(
            pool.choose(&[], 1, &[replicas[1].id()]).is_none(),
            "none left"
        );

        let kept = replicas[1].spec().clone();
        let usable = || pool.capacity().limit().usable_blocks();
        assert_eq!(
            usable(),
            1000 / 16,
            "only the healthy replica's capacity (62 blocks)"
        );
        replicas[0].succeeded();
        assert_eq!(
            usable(),
            2 * (1000 / 16),
            "readmitted: its capacity is back"
        );
        for _ in 0..super::super::breaker::FAILURE_THRESHOLD {
            replicas[1].failed("test");
        }
        assert_eq!(usable(), 1000 / 16);
        replicas[1].succeeded();
        let added: UpstreamSpec = "m=http://127.0.0.1:9100".parse().unwrap();
        pool.replace(vec![kept, added]);
        let now = pool.replicas();
        assert_eq!(now.len(), 2);
        assert_eq!(
            now[0].id(),
            replicas[1].id(),
            "unchanged spec: same replica"
        );
        assert_ne!(now[1].id(), replicas[0].id());
        assert_eq!(
            usable(),
            2 * (1000 / 16),
            "the added replica's default capacity is capped by the pool's startup size"
        );
    }
}
