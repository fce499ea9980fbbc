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
    /// The most completion tokens the request may count: its budget. A relayed answer's
    /// reported `usage` is the upstream's word and is clipped to it, as its debit is.
    completion_cap: usize,
    /// The most prompt tokens a relayed answer's `usage` may count ([`Self::capping_prompt_at`]).
    prompt_cap: usize,
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
            completion_cap: usize::MAX,
            prompt_cap: usize::MAX,
        }
    }

    /// Counts at most `cap` prompt tokens for this request, whatever a relayed answer
    /// reports. An upstream's count may differ from the gateway's (its own tokenizer and
    /// template), but not beyond the most the tenant may send: a broken or lying upstream
    /// would otherwise inflate `kvgate_prompt_tokens_total` without bound.
    pub fn capping_prompt_at(mut self, cap: usize) -> GenerationTelemetry {
        self.prompt_cap = cap;
        self
    }

    /// Counts at most `max_tokens` completion tokens for this request, whatever a relayed
    /// answer reports (an upstream's `usage` is not trusted beyond the budget it was sent).
    pub fn capping_completion_at(mut self, max_tokens: usize) -> GenerationTelemetry {
        self.completion_cap = max_tokens;
        self
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
    /// of tokens seen, either one at most the request's budget ([`Self::capping_completion_at`]).
    /// Nothing is counted as cached (the upstream's cache is not known here).
    pub fn on_relayed_end(
        &mut self,
        prompt_tokens: Option<usize>,
        completion_tokens: Option<usize>,
    ) {
        if let Some(prompt) = prompt_tokens {
            self.prompt_tokens = prompt.min(self.prompt_cap);
        }
        if let Some(completion) = completion_tokens {
            self.generated = completion.min(self.completion_cap);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relayed_completion_count_is_capped_at_the_budget() {
        let relayed = |reported: usize| {
            let mut telemetry =
                GenerationTelemetry::new("t", "m", Instant::now(), 3).capping_completion_at(5);
            telemetry.on_relayed_end(Some(4), Some(reported));
            let counted = (telemetry.prompt_tokens, telemetry.generated);
            // Recording on drop is harmless here: no recorder is installed in unit tests.
            drop(telemetry);
            counted
        };
        assert_eq!(relayed(1_000_000_000_000), (4, 5));
        assert_eq!(relayed(5), (4, 5));
        assert_eq!(relayed(2), (4, 2));
        // Without a cap (the embedded engine's own counts), nothing is clipped.
        let mut telemetry = GenerationTelemetry::new("t", "m", Instant::now(), 3);
        telemetry.on_relayed_end(None, Some(7));
        assert_eq!((telemetry.prompt_tokens, telemetry.generated), (3, 7));
    }

    #[test]
    fn a_relayed_prompt_count_is_capped_at_the_tenants_budget() {
        let relayed = |reported: usize| {
            let mut telemetry =
                GenerationTelemetry::new("t", "m", Instant::now(), 30).capping_prompt_at(100);
            telemetry.on_relayed_end(Some(reported), None);
            telemetry.prompt_tokens
        };
        assert_eq!(relayed(1_000_000_000_000), 100);
        assert_eq!(
            relayed(42),
            42,
            "the upstream's own count, where it is plausible"
        );
    }
}
