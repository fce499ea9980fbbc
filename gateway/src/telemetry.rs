//! Per-request metric hooks for one generation: time to first token, inter-token gaps, and the
//! end-of-request record, which must be written exactly once however the request ends
//! (finished, failed, or dropped because the client left). The names and buckets live in
//! `metrics.rs`; this file only decides *when* each is recorded.

use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::{
    record_inter_token_latency, record_request_finished, record_time_to_first_token,
};

/// Travels with a generation (inside the response body for streams); records on drop.
#[derive(Debug)]
pub struct GenerationTelemetry {
    tenant: String,
    /// The configured name the request was served under (embedded model or upstream).
    model: String,
    arrived: Instant,
    prompt_tokens: usize,
    generated: usize,
    /// Prompt tokens the prefix cache served, once the engine has said (finished requests).
    cached_tokens: Option<usize>,
    last_token: Option<Instant>,
}

impl GenerationTelemetry {
    /// `arrived` is when the request reached the handler, so TTFT includes queueing. `model`
    /// must be a configured name (the embedded model's or an upstream's), never one a client
    /// made up: it is a metrics label.
    pub fn new(
        tenant: &str,
        model: &str,
        arrived: Instant,
        prompt_tokens: usize,
    ) -> GenerationTelemetry {
        GenerationTelemetry {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            arrived,
            prompt_tokens,
            generated: 0,
            cached_tokens: None,
            last_token: None,
        }
    }

    /// One generated token left (or was collected by) the server.
    pub fn on_token(&mut self) {
        let now = Instant::now();
        match self.last_token {
            None => record_time_to_first_token(
                &self.tenant,
                &self.model,
                now.duration_since(self.arrived),
            ),
            Some(previous) => {
                record_inter_token_latency(&self.tenant, &self.model, now.duration_since(previous))
            }
        }
        self.last_token = Some(now);
        self.generated += 1;
    }

    /// Generation ended normally with the engine's own counts.
    pub fn on_finished(&mut self, completion_tokens: usize, cached_tokens: usize) {
        self.generated = completion_tokens;
        self.cached_tokens = Some(cached_tokens);
    }

    /// A relayed answer ended: the counts the upstream reported (`usage`), when it did; the
    /// prompt count stays the gateway's own otherwise, and the completion count the number
    /// of tokens seen. Nothing is counted as cached (the upstream's cache is not known here).
    pub fn on_relayed_end(
        &mut self,
        prompt_tokens: Option<usize>,
        completion_tokens: Option<usize>,
    ) {
        if let Some(prompt) = prompt_tokens {
            self.prompt_tokens = prompt;
        }
        if let Some(completion) = completion_tokens {
            self.generated = completion;
        }
    }

    fn elapsed(&self) -> Duration {
        self.arrived.elapsed()
    }
}

impl Drop for GenerationTelemetry {
    fn drop(&mut self) {
        record_request_finished(
            &self.tenant,
            &self.model,
            self.elapsed(),
            self.prompt_tokens,
            self.generated,
            self.cached_tokens,
        );
    }
}
