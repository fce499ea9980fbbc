//! [`AppState`]: what every handler and extractor shares (engine, policy, admission, intake,
//! metrics, the shutdown phase). Its own module so that `handlers` and `extract` both depend on
//! it and not on each other.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use kvgate_runtime::engine::Engine;
use tokio::sync::watch;

use crate::admission::Admission;
use crate::intake::Intake;
use crate::metrics::Metrics;
use crate::reload::PolicyStore;
use crate::shutdown::GraceOver;
use crate::upstream::{UpstreamRoute, Upstreams};
use crate::validate::PromptCodec;

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<StateInner>,
}

pub(crate) struct StateInner {
    pub(crate) engine: Engine,
    pub(crate) codec: Arc<dyn PromptCodec>,
    pub(crate) store: PolicyStore,
    pub(crate) admission: Admission,
    pub(crate) metrics: Metrics,
    pub(crate) model_name: String,
    /// Models served by other engines, proxied (see `upstream.rs`); the set a reload changes.
    pub(crate) upstreams: Upstreams,
    pub(crate) created: u64,
    body: BodyLimits,
    /// Per-tenant limits before the body, and the fair validation workers.
    pub(crate) intake: Intake,
    /// A [`Phase`], as its `u8`.
    phase: AtomicU8,
    /// True once shutdown's grace period is over ([`AppState::end_grace`]).
    grace_over: watch::Sender<bool>,
}

/// Where the server is in its life. Shutdown has two steps so that load balancers can stop
/// routing here before anything is refused: first readiness fails while requests are still
/// served as usual (the pre-drain delay), then the listener closes and the drain begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Serving = 0,
    /// Shutdown was asked for: `/readyz` fails, requests are still served.
    PreDrain = 1,
    /// The listener is closed; in-flight requests finish, new generations are refused.
    Draining = 2,
}

/// How request bodies are read.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// Longest gap between two body frames before 408.
    pub idle_timeout: Duration,
}

/// What [`AppState::new`] needs.
pub struct StateParts {
    pub engine: Engine,
    pub codec: Arc<dyn PromptCodec>,
    pub store: PolicyStore,
    pub admission: Admission,
    pub metrics: Metrics,
    pub model_name: String,
    /// The upstream models, attached to admission ([`Upstreams::attach`]); empty when this
    /// server fronts no other engine.
    pub upstreams: Upstreams,
    pub body: BodyLimits,
    pub validation_workers: usize,
}

impl AppState {
    pub fn new(parts: StateParts) -> AppState {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        AppState {
            inner: Arc::new(StateInner {
                engine: parts.engine,
                codec: parts.codec,
                store: parts.store,
                admission: parts.admission,
                metrics: parts.metrics,
                model_name: parts.model_name,
                upstreams: parts.upstreams,
                created,
                body: parts.body,
                intake: Intake::new(parts.validation_workers),
                phase: AtomicU8::new(Phase::Serving as u8),
                grace_over: watch::Sender::new(false),
            }),
        }
    }

    pub fn policy_store(&self) -> &PolicyStore {
        &self.inner.store
    }

    pub fn body_limits(&self) -> BodyLimits {
        self.inner.body
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    pub fn admission(&self) -> &Admission {
        &self.inner.admission
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Where a request for model `name` goes now, if an upstream serves it (never the
    /// embedded model's name). Read per request: an upstreams reload adds and removes names.
    pub fn upstream(&self, name: &str) -> Option<UpstreamRoute> {
        self.inner.upstreams.route(name)
    }

    /// The upstream models served now.
    pub fn upstreams(&self) -> &Upstreams {
        &self.inner.upstreams
    }

    /// Per-tenant intake (see `intake.rs`).
    pub fn intake(&self) -> &Intake {
        &self.inner.intake
    }

    /// Shutdown was asked for: readiness fails from now on; requests are still served.
    pub fn begin_shutdown(&self) {
        self.advance(Phase::PreDrain);
    }

    /// Marks the server as draining (the listener has closed): new generations are refused.
    pub fn start_draining(&self) {
        self.advance(Phase::Draining);
    }

    /// Shutdown's grace period is over: admission refuses every queued request (503
    /// `unavailable`) and starts nothing more, then every [`GraceOver`] fires, so running
    /// streams send an error event and end, and unfinished non-streamed requests answer 503.
    /// The connections get a short flush window to write those answers before they are
    /// aborted (see `shutdown::serve_until`).
    pub fn end_grace(&self) {
        self.advance(Phase::Draining);
        self.inner.admission.close();
        self.inner.grace_over.send_replace(true);
    }

    /// A signal that fires when shutdown's grace period is over (at once if it already is).
    pub fn grace_over(&self) -> GraceOver {
        GraceOver::new(self.inner.grace_over.subscribe())
    }

    pub fn phase(&self) -> Phase {
        match self.inner.phase.load(Ordering::Acquire) {
            0 => Phase::Serving,
            1 => Phase::PreDrain,
            _ => Phase::Draining,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.phase() == Phase::Draining
    }

    /// Phases only move forward.
    fn advance(&self, to: Phase) {
        self.inner.phase.fetch_max(to as u8, Ordering::AcqRel);
    }
}
