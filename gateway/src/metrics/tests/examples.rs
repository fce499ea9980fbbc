//! The shipped Grafana dashboard and Prometheus alerts against the metric table: every metric
//! they query exists (histogram series through their `_bucket`/`_sum`/`_count` suffixes), every
//! label they match on is one the family has (or `job`/`instance`, added by Prometheus), every
//! `reason` they name is a rejection reason, and the dashboard has what Grafana's import needs.
//! A renamed metric or label breaks this test instead of silently emptying a panel or an alert.

use std::collections::HashSet;

use serde_json::Value;

use crate::metrics::RejectReason;
use crate::metrics::names::{Family, Kind, family_of};

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/grafana/kvgate-dashboard.json"
);
const ALERTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/prometheus/alerts.yml"
);
const ALERTS_TEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/prometheus/alerts_test.yml"
);

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// A kvgate series name resolved to its family: the family itself, or a histogram's
/// `_bucket`/`_sum`/`_count` series (`bucket` is true for `_bucket`, which also has `le`).
fn resolve(name: &str) -> Option<(&'static Family, bool)> {
    if let Some(family) = family_of(name) {
        return Some((family, false));
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let family = family_of(name.strip_suffix(suffix)?)?;
        (family.kind == Kind::Histogram).then_some((family, *suffix == "_bucket"))
    })
}

/// One kvgate series selector of a PromQL expression: its name and `label op "value"` matchers.
#[derive(Debug)]
struct Selector {
    name: String,
    matchers: Vec<(String, String)>,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    is_ident_start(c) || c.is_ascii_digit()
}

/// Reads a PromQL string literal starting at `chars[*i]` (a quote) and returns its content.
fn read_string(chars: &[char], i: &mut usize) -> String {
    let quote = chars[*i];
    let mut out = String::new();
    *i += 1;
    while *i < chars.len() && chars[*i] != quote {
        if chars[*i] == '\\' && quote != '`' && *i + 1 < chars.len() {
            *i += 1;
        }
        out.push(chars[*i]);
        *i += 1;
    }
    *i += 1;
    out
}

/// Every selector of a `kvgate_` metric in a PromQL expression, with its label matchers.
/// Strings are skipped, so label values and Grafana variables are never taken for metrics.
fn selectors(expr: &str) -> Result<Vec<Selector>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let skip_space = |i: &mut usize| {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            read_string(&chars, &mut i);
        } else if c.is_ascii_digit() {
            // Numbers and durations (5m, 0.99): never a metric.
            while i < chars.len() && (is_ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            let name: String = chars[start..i].iter().collect();
            if !name.starts_with("kvgate_") {
                continue;
            }
            let mut matchers = Vec::new();
            skip_space(&mut i);
            if chars.get(i) == Some(&'{') {
                i += 1;
                loop {
                    skip_space(&mut i);
                    match chars.get(i) {
                        Some('}') => {
                            i += 1;
                            break;
                        }
                        Some(',') => i += 1,
                        Some(&c) if is_ident_start(c) => {
                            let start = i;
                            while i < chars.len() && is_ident(chars[i]) {
                                i += 1;
                            }
                            let label: String = chars[start..i].iter().collect();
                            skip_space(&mut i);
                            while matches!(chars.get(i), Some('=' | '!' | '~')) {
                                i += 1;
                            }
                            skip_space(&mut i);
                            if !matches!(chars.get(i), Some('"' | '\'' | '`')) {
                                return Err(format!("{name}: matcher {label} has no string value"));
                            }
                            matchers.push((label, read_string(&chars, &mut i)));
                        }
                        other => return Err(format!("{name}: unexpected {other:?} in matchers")),
                    }
                }
            }
            found.push(Selector { name, matchers });
        } else {
            i += 1;
        }
    }
    Ok(found)
}

/// Checks one PromQL expression; returns how many kvgate selectors it has.
fn check_expr(expr: &str, context: &str) -> usize {
    let found = selectors(expr).unwrap_or_else(|e| panic!("{context}: {e} in {expr:?}"));
    let reasons: HashSet<&str> = RejectReason::ALL.iter().map(|r| r.as_str()).collect();
    for selector in &found {
        let Some((family, bucket)) = resolve(&selector.name) else {
            panic!(
                "{context}: {} is not a kvgate metric (names.rs) in {expr:?}",
                selector.name
            );
        };
        for (label, value) in &selector.matchers {
            let known = family.labels.contains(&label.as_str())
                || matches!(label.as_str(), "job" | "instance")
                || (bucket && label == "le");
            assert!(
                known,
                "{context}: {} has no label {label:?} (it has {:?}) in {expr:?}",
                selector.name, family.labels
            );
            if label == "reason" && !value.contains('$') {
                for alternative in value.split('|') {
                    assert!(
                        reasons.contains(alternative),
                        "{context}: {alternative:?} is not a rejection reason in {expr:?}"
                    );
                }
            }
        }
    }
    found.len()
}

/// Every `kvgate_…` word of a free text (descriptions, comments) names a metric.
fn check_mentions(text: &str, context: &str) {
    let mut rest = text;
    while let Some(at) = rest.find("kvgate_") {
        let word: String = rest[at..].chars().take_while(|&c| is_ident(c)).collect();
        assert!(
            resolve(&word).is_some(),
            "{context}: mentions {word}, which is not a kvgate metric"
        );
        rest = &rest[at + word.len()..];
    }
}

fn string_field<'a>(value: &'a Value, key: &str, context: &str) -> &'a str {
    match value.get(key).and_then(Value::as_str) {
        Some(text) if !text.trim().is_empty() => text,
        _ => panic!("{context}: needs a non-empty string {key:?}"),
    }
}

/// Checks the Grafana variables (`$job`, `${datasource}`) an expression uses are defined.
fn check_variables(expr: &str, variables: &HashSet<String>, context: &str) {
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let name: String = rest
            .trim_start_matches('{')
            .chars()
            .take_while(|&c| c.is_ascii_alphanumeric() || c == '_')
            .collect();
        assert!(
            name.starts_with("__") || variables.contains(&name),
            "{context}: ${name} is not a dashboard variable in {expr:?}"
        );
    }
}

/// Walks panels (and the panels of rows) checking what Grafana needs to import and place them;
/// returns the number of kvgate selectors their targets use.
fn check_panels(
    panels: &[Value],
    ids: &mut HashSet<u64>,
    variables: &HashSet<String>,
    titles: &mut Vec<String>,
) -> usize {
    let mut selectors = 0;
    for panel in panels {
        let id = panel.get("id").and_then(Value::as_u64);
        let context = format!("panel {id:?}");
        let id = id.unwrap_or_else(|| panic!("{context}: needs an integer id"));
        assert!(ids.insert(id), "{context}: duplicate panel id");
        let kind = string_field(panel, "type", &context);
        titles.push(string_field(panel, "title", &context).to_string());
        let grid = panel
            .get("gridPos")
            .unwrap_or_else(|| panic!("{context}: needs gridPos"));
        let cell = |key: &str| {
            grid.get(key)
                .and_then(Value::as_u64)
                .unwrap_or_else(|| panic!("{context}: gridPos.{key} must be a whole number"))
        };
        let (h, w, x) = (cell("h"), cell("w"), cell("x"));
        cell("y");
        assert!(
            h > 0 && w > 0 && x + w <= 24,
            "{context}: gridPos outside the 24-column grid"
        );
        if let Some(description) = panel.get("description").and_then(Value::as_str) {
            check_mentions(description, &context);
        }
        if kind == "row" {
            let nested = panel.get("panels").and_then(Value::as_array);
            let nested = nested.unwrap_or_else(|| panic!("{context}: a row needs panels"));
            selectors += check_panels(nested, ids, variables, titles);
            continue;
        }
        let targets = panel.get("targets").and_then(Value::as_array);
        let targets = match targets {
            Some(targets) if !targets.is_empty() => targets,
            _ => panic!("{context}: needs targets"),
        };
        let mut ref_ids = HashSet::new();
        for target in targets {
            let ref_id = string_field(target, "refId", &context);
            assert!(
                ref_ids.insert(ref_id),
                "{context}: duplicate refId {ref_id}"
            );
            let expr = string_field(target, "expr", &context);
            let found = check_expr(expr, &context);
            assert!(found > 0, "{context}: {expr:?} queries no kvgate metric");
            check_variables(expr, variables, &context);
            selectors += found;
        }
        let datasource = panel.get("datasource").and_then(|d| d.get("uid"));
        if let Some(uid) = datasource.and_then(Value::as_str) {
            check_variables(uid, variables, &context);
        }
    }
    selectors
}

#[test]
fn the_grafana_dashboard_imports_and_queries_only_existing_metrics() {
    let text = read(DASHBOARD);
    let dashboard: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"));
    let title = string_field(&dashboard, "title", "dashboard");
    assert!(!title.is_empty());
    let uid = string_field(&dashboard, "uid", "dashboard");
    assert!(
        uid.len() <= 40
            && uid
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
        "Grafana uids are at most 40 of [A-Za-z0-9_-]: {uid:?}"
    );
    let schema = dashboard.get("schemaVersion").and_then(Value::as_u64);
    assert!(
        schema.is_some_and(|v| v >= 30),
        "schemaVersion (Grafana 8+) needed, got {schema:?}"
    );

    let templating = dashboard
        .pointer("/templating/list")
        .and_then(Value::as_array)
        .expect("templating.list");
    let variables: HashSet<String> = templating
        .iter()
        .map(|v| string_field(v, "name", "variable").to_string())
        .collect();
    let mut selectors = 0;
    for variable in templating {
        let name = string_field(variable, "name", "variable");
        let query = match variable.get("query") {
            Some(Value::Object(query)) => query.get("query").and_then(Value::as_str),
            Some(Value::String(query)) if variable["type"] == "query" => Some(query.as_str()),
            _ => None,
        };
        if let Some(query) = query {
            let context = format!("variable {name}");
            selectors += check_expr(query, &context);
            check_variables(query, &variables, &context);
        }
    }

    let panels = dashboard
        .get("panels")
        .and_then(Value::as_array)
        .expect("panels");
    assert!(!panels.is_empty(), "a dashboard needs panels");
    let mut titles = Vec::new();
    selectors += check_panels(panels, &mut HashSet::new(), &variables, &mut titles);
    check_mentions(
        dashboard
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or(""),
        "dashboard",
    );
    // Not vacuous: the dashboard queries dozens of series, including the exact batch histogram.
    assert!(selectors >= 30, "only {selectors} kvgate selectors found");
    assert!(
        text.contains("kvgate_batch_size_bucket"),
        "batch size panel missing"
    );
    assert!(titles.len() >= 20, "{titles:?}");
}

/// The PromQL of every `expr:` in a Prometheus rules file: inline values and `|`/`>` blocks.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut exprs = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start().trim_start_matches("- ");
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        if value.starts_with('|') || value.starts_with('>') {
            let block: Vec<&str> = lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || indent(l) > indent(line))
                .map(|l| l.trim())
                .collect();
            exprs.push(block.join("\n"));
        } else if let Some(quoted) = value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
            exprs.push(quoted.replace("''", "'"));
        } else if let Some(quoted) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
            exprs.push(quoted.replace("\\\"", "\"").replace("\\\\", "\\"));
        } else {
            exprs.push(value.to_string());
        }
    }
    exprs
}

#[test]
fn the_prometheus_alerts_use_only_existing_metrics_labels_and_reasons() {
    let yaml = read(ALERTS);
    let exprs = rule_exprs(&yaml);
    let alerts = yaml
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(alerts >= 7, "alerts.yml defines {alerts} alerts");
    assert_eq!(exprs.len(), alerts, "one expr per alert: {exprs:#?}");
    let mut selectors = 0;
    for expr in &exprs {
        assert!(!expr.trim().is_empty(), "empty expr in {ALERTS}");
        selectors += check_expr(expr, ALERTS);
    }
    assert!(
        selectors >= 6,
        "only {selectors} kvgate selectors in {exprs:#?}"
    );
    // Annotations and comments name metrics too (e.g. "check kvgate_requests_rejected_total").
    check_mentions(&yaml, ALERTS);

    // The rule unit tests feed series by name: they must be the names the server exports.
    let tests = read(ALERTS_TEST);
    let mut series = 0;
    for line in tests.lines() {
        let Some(value) = line.trim_start().strip_prefix("- series:") else {
            continue;
        };
        let selector = value.trim().trim_matches('\'');
        if selector.starts_with("kvgate_") {
            series += check_expr(selector, ALERTS_TEST);
        }
    }
    assert!(series >= 10, "only {series} kvgate input series found");
    check_mentions(&tests, ALERTS_TEST);
}

#[test]
fn the_checker_catches_unknown_names_labels_and_reasons() {
    let panics = |expr: &str| std::panic::catch_unwind(|| check_expr(expr, "probe")).is_err();
    assert!(!panics(
        "sum(rate(kvgate_requests_rejected_total{job=\"k\", reason=~\"rate|kv_saturation\"}[5m]))"
    ));
    assert!(!panics(
        "histogram_quantile(0.9, rate(kvgate_batch_size_bucket{le=\"+Inf\"}[5m]))"
    ));
    assert!(!panics(
        "kvgate_batch_tokens_sum / kvgate_batch_tokens_count"
    ));
    assert!(panics("rate(kvgate_no_such_metric[5m])"), "unknown metric");
    assert!(panics("kvgate_kv_usage_ratio_bucket"), "_bucket of a gauge");
    assert!(panics("kvgate_kv_blocks{kind=\"used\"}"), "unknown label");
    assert!(
        panics("kvgate_requests_rejected_total{reason=\"kv_full\"}"),
        "unknown reason"
    );
    assert!(panics("kvgate_kv_usage_ratio{le=\"1\"}"), "le on a gauge");
    assert_eq!(
        rule_exprs(
            "- alert: A\n  expr: up == 0\n- alert: B\n  expr: |\n    a\n    > 1\n  for: 1m\n"
        ),
        ["up == 0", "a\n> 1"]
    );
}
