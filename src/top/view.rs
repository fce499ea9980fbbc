//! What `kvgate top` shows: a [`TopView`] built from one scrape (gauges) and the previous one
//! (counter rates), rendered as plain text.
//!
//! Rates follow Prometheus' `rate()` semantics for two samples: the increase divided by the
//! elapsed time, where a counter that went down was reset (server restart) and its whole new
//! value counts as the increase. With no previous scrape there is no rate ("-"), never a guess.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvgate_gateway::metrics::exposition::Scrape;
use kvgate_gateway::metrics::{
    BUILD_INFO, ENGINE_STEPS_TOTAL, GENERATION_TOKENS_TOTAL, KV_BLOCK_SIZE_TOKENS, KV_BLOCKS,
    KV_CAPACITY_BYTES, MEMORY_ALLOCATED_BYTES, MEMORY_BUDGET_BYTES, MEMORY_PEAK_ALLOCATED_BYTES,
    PREEMPTIONS_TOTAL, PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_QUERIES_TOTAL,
    PROCESS_RESIDENT_MEMORY_BYTES, QUEUED_TOKENS, REQUESTS_IN_FLIGHT, REQUESTS_QUEUED,
    REQUESTS_REJECTED_TOTAL, REQUESTS_TOTAL, SEQUENCES,
};
use kvgate_runtime::kv_math::HumanSize;

const BAR_WIDTH: usize = 40;

/// A scrape and when it was taken.
pub struct Frame {
    pub scrape: Scrape,
    pub at: Instant,
}

/// Per-second increase of the counters `name{labels…}` (summed) between two frames.
pub fn rate(
    current: &Frame,
    previous: Option<&Frame>,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    let previous = previous?;
    let seconds = current
        .at
        .checked_duration_since(previous.at)?
        .as_secs_f64();
    if seconds <= 0.0 {
        return None;
    }
    Some(
        increase(
            previous.scrape.sum(name, labels),
            current.scrape.sum(name, labels),
        ) / seconds,
    )
}

/// Counter increase from `before` to `after`; a decrease means the counter restarted from 0.
pub fn increase(before: f64, after: f64) -> f64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TenantRow {
    pub tenant: String,
    pub in_flight: f64,
    pub queued: f64,
    pub queued_tokens: f64,
    pub requests_per_sec: Option<f64>,
    pub rejected_per_sec: Option<f64>,
    /// Reason with the most rejections in this interval.
    pub top_reason: Option<String>,
}

impl TenantRow {
    /// Fraction of this interval's requests that were rejected.
    pub fn rejected_fraction(&self) -> Option<f64> {
        match (self.rejected_per_sec, self.requests_per_sec) {
            (Some(rejected), Some(total)) if total > 0.0 => Some((rejected / total).min(1.0)),
            _ => None,
        }
    }
}

/// Everything on one screen.
#[derive(Debug, Clone, PartialEq)]
pub struct TopView {
    pub build: String,
    pub blocks_total: f64,
    pub blocks_used: f64,
    pub blocks_reserved: f64,
    /// Unreferenced blocks still holding a cached prefix (part of the free ones).
    pub blocks_cached: f64,
    /// Cached ÷ looked-up prompt tokens over the interval, all tenants; `None` without a
    /// previous scrape or without a finished request in between.
    pub prefix_hit_rate: Option<f64>,
    pub block_size: f64,
    pub kv_bytes: f64,
    pub memory_allocated: f64,
    pub memory_peak: f64,
    pub memory_budget: f64,
    pub resident: Option<f64>,
    pub running: f64,
    pub waiting: f64,
    pub steps_per_sec: Option<f64>,
    pub preemptions_per_sec: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    pub tenants: Vec<TenantRow>,
}

impl TopView {
    pub fn build(current: &Frame, previous: Option<&Frame>) -> TopView {
        let s = &current.scrape;
        let gauge = |name: &str, labels: &[(&str, &str)]| s.value(name, labels).unwrap_or(0.0);
        let build = s
            .series(BUILD_INFO)
            .next()
            .map(|b| {
                [
                    ("model", "model"),
                    ("backend", "backend"),
                    ("version", "kvgate"),
                ]
                .iter()
                .filter_map(|(key, shown)| {
                    b.label(key)
                        .filter(|v| !v.is_empty())
                        .map(|v| format!("{shown} {v}"))
                })
                .collect::<Vec<_>>()
                .join(", ")
            })
            .unwrap_or_default();
        TopView {
            build,
            blocks_total: gauge(KV_BLOCKS, &[("state", "total")]),
            blocks_used: gauge(KV_BLOCKS, &[("state", "used")]),
            blocks_reserved: gauge(KV_BLOCKS, &[("state", "reserved")]),
            blocks_cached: gauge(KV_BLOCKS, &[("state", "cached")]),
            prefix_hit_rate: match (
                rate(current, previous, PREFIX_CACHE_HITS_TOTAL, &[]),
                rate(current, previous, PREFIX_CACHE_QUERIES_TOTAL, &[]),
            ) {
                (Some(hits), Some(queries)) if queries > 0.0 => Some((hits / queries).min(1.0)),
                _ => None,
            },
            block_size: gauge(KV_BLOCK_SIZE_TOKENS, &[]),
            kv_bytes: gauge(KV_CAPACITY_BYTES, &[]),
            memory_allocated: s.sum(MEMORY_ALLOCATED_BYTES, &[]),
            memory_peak: gauge(MEMORY_PEAK_ALLOCATED_BYTES, &[]),
            memory_budget: gauge(MEMORY_BUDGET_BYTES, &[]),
            resident: s.value(PROCESS_RESIDENT_MEMORY_BYTES, &[]),
            running: gauge(SEQUENCES, &[("state", "running")]),
            waiting: gauge(SEQUENCES, &[("state", "waiting")]),
            steps_per_sec: rate(current, previous, ENGINE_STEPS_TOTAL, &[]),
            preemptions_per_sec: rate(current, previous, PREEMPTIONS_TOTAL, &[]),
            tokens_per_sec: rate(current, previous, GENERATION_TOKENS_TOTAL, &[]),
            tenants: tenant_rows(current, previous),
        }
    }

    pub fn render(&self, url: &str, interval: Duration) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "kvgate top — {url} — every {:.1}s — {}\n",
            interval.as_secs_f64(),
            self.build
        );
        let total = self.blocks_total.max(1.0);
        let (used, reserved) = (self.blocks_used / total, self.blocks_reserved / total);
        let _ = writeln!(
            out,
            "KV   {}  {:.1}% used, {:.1}% reserved ({}/{} blocks of {} tokens, {})",
            bar(&[(used, '#'), (reserved, '+')]),
            used * 100.0,
            reserved * 100.0,
            self.blocks_used,
            self.blocks_total,
            self.block_size,
            bytes(self.kv_bytes)
        );
        let _ = writeln!(
            out,
            "PFX  {} cached blocks, prefix hit rate {}",
            self.blocks_cached,
            self.prefix_hit_rate
                .map_or("-".into(), |r| format!("{:.1}%", r * 100.0))
        );
        // The bar is a fraction of the budget; without one there is nothing to fill it against
        // (scaling to the peak would draw a full bar whenever allocation is at its peak).
        let memory_bar = if self.memory_budget > 0.0 {
            bar(&[
                (self.memory_allocated / self.memory_budget, '#'),
                (
                    (self.memory_peak - self.memory_allocated) / self.memory_budget,
                    '^',
                ),
            ])
        } else {
            no_bar("no --memory-budget")
        };
        let _ = writeln!(
            out,
            "MEM  {}  allocated {}, peak {}, budget {}, rss {}",
            memory_bar,
            bytes(self.memory_allocated),
            bytes(self.memory_peak),
            if self.memory_budget > 0.0 {
                bytes(self.memory_budget)
            } else {
                "none".into()
            },
            self.resident.map_or("-".into(), bytes),
        );
        let _ = writeln!(
            out,
            "SEQ  running {}, waiting {}, {} steps/s, {} preemptions/s, {} tokens/s\n",
            self.running,
            self.waiting,
            per_sec(self.steps_per_sec),
            per_sec(self.preemptions_per_sec),
            per_sec(self.tokens_per_sec)
        );
        let _ = writeln!(
            out,
            "{:<20} {:>9} {:>7} {:>11} {:>8} {:>8} {:>6}  TOP REASON",
            "TENANT", "IN-FLIGHT", "QUEUED", "QUEUED-TOK", "REQ/S", "REJ/S", "REJ%"
        );
        for t in &self.tenants {
            let _ = writeln!(
                out,
                "{:<20} {:>9} {:>7} {:>11} {:>8} {:>8} {:>6}  {}",
                t.tenant,
                t.in_flight,
                t.queued,
                t.queued_tokens,
                per_sec(t.requests_per_sec),
                per_sec(t.rejected_per_sec),
                t.rejected_fraction()
                    .map_or("-".into(), |f| format!("{:.0}%", f * 100.0)),
                t.top_reason.as_deref().unwrap_or("-")
            );
        }
        out
    }
}

fn tenant_rows(current: &Frame, previous: Option<&Frame>) -> Vec<TenantRow> {
    let s = &current.scrape;
    let names: BTreeSet<String> = [
        REQUESTS_IN_FLIGHT,
        REQUESTS_QUEUED,
        REQUESTS_TOTAL,
        REQUESTS_REJECTED_TOTAL,
    ]
    .iter()
    .flat_map(|metric| s.label_values(metric, "tenant"))
    .collect();
    names
        .into_iter()
        .map(|tenant| {
            let t = [("tenant", tenant.as_str())];
            let reasons = s.label_values(REQUESTS_REJECTED_TOTAL, "reason");
            let top_reason = reasons
                .iter()
                .filter_map(|r| {
                    let per_sec = rate(
                        current,
                        previous,
                        REQUESTS_REJECTED_TOTAL,
                        &[t[0], ("reason", r)],
                    )?;
                    (per_sec > 0.0).then_some((per_sec, r))
                })
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, r)| r.clone());
            TenantRow {
                in_flight: s.value(REQUESTS_IN_FLIGHT, &t).unwrap_or(0.0),
                queued: s.value(REQUESTS_QUEUED, &t).unwrap_or(0.0),
                queued_tokens: s.value(QUEUED_TOKENS, &t).unwrap_or(0.0),
                requests_per_sec: rate(current, previous, REQUESTS_TOTAL, &t),
                rejected_per_sec: rate(current, previous, REQUESTS_REJECTED_TOTAL, &t),
                top_reason,
                tenant,
            }
        })
        .collect()
}

/// `[###++....]`: each segment a fraction of the width, clamped so the bar never overflows.
pub fn bar(segments: &[(f64, char)]) -> String {
    let mut cells = String::with_capacity(BAR_WIDTH + 2);
    cells.push('[');
    let mut filled = 0usize;
    for &(fraction, symbol) in segments {
        let fraction = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let n = ((fraction * BAR_WIDTH as f64).round() as usize).min(BAR_WIDTH - filled);
        cells.extend(std::iter::repeat_n(symbol, n));
        filled += n;
    }
    cells.extend(std::iter::repeat_n('.', BAR_WIDTH - filled));
    cells.push(']');
    cells
}

/// A bar-sized box holding `text` instead of a level, so the columns after it stay aligned.
pub fn no_bar(text: &str) -> String {
    let text: String = text.chars().take(BAR_WIDTH).collect();
    format!("[{text:^width$}]", width = BAR_WIDTH)
}

fn bytes(value: f64) -> String {
    if value.is_finite() && value >= 0.0 {
        HumanSize(value as usize).to_string()
    } else {
        "-".into()
    }
}

fn per_sec(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.2}"))
}

#[cfg(test)]
mod tests;
