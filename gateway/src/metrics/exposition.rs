//! The Prometheus text exposition format (version 0.0.4): a small writer for the families
//! kvgate renders itself, and a parser for reading a scrape back (`kvgate top`, tests).
//!
//! The parser accepts what Prometheus accepts for this format: `# HELP`/`# TYPE` and other
//! comments, `name{label="value",...} value [timestamp]`, label escapes `\\`, `\"`, `\n`, and the
//! special values `NaN`, `+Inf`, `-Inf`. It keeps samples in order and never panics on input.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

/// Builds exposition text family by family.
#[derive(Debug, Default)]
pub struct Writer {
    out: String,
}

impl Writer {
    /// Starts a family: its `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// One sample line of the current family.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape_label_value(val));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_value(value));
    }

    /// One series of the current histogram family: a cumulative `_bucket` sample per
    /// `(upper bound, observations ≤ bound)` of `buckets` (increasing, without `+Inf`), then the
    /// `+Inf` bucket, `_sum` and `_count`. `le` is appended to `labels`.
    pub fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        buckets: impl IntoIterator<Item = (f64, u64)>,
        sum: f64,
        count: u64,
    ) {
        let bucket = format!("{name}_bucket");
        let mut le_sample = |le: &str, observations: u64| {
            let mut with_le = labels.to_vec();
            with_le.push(("le", le));
            self.sample(&bucket, &with_le, observations as f64);
        };
        for (bound, observations) in buckets {
            le_sample(&format_value(bound), observations);
        }
        le_sample("+Inf", count);
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, count as f64);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Prometheus spelling of a sample value: integers without a fraction, `NaN`, `+Inf`, `-Inf`.
pub fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{value}")
    }
}

/// One sample of a scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// True when every `(key, value)` of `wanted` is among this sample's labels.
    pub fn has_labels(&self, wanted: &[(&str, &str)]) -> bool {
        wanted.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// A parsed scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    pub samples: Vec<Sample>,
    /// Family name → declared type ("counter", "gauge", ...).
    pub types: HashMap<String, String>,
}

/// A series' labels, sorted, without `le`.
type Labels = Vec<(String, String)>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metrics line {line}: {reason}")]
pub struct ParseError {
    pub line: usize,
    pub reason: String,
}

impl Scrape {
    pub fn parse(text: &str) -> Result<Scrape, ParseError> {
        let mut scrape = Scrape::default();
        for (index, raw) in text.lines().enumerate() {
            let line = raw.trim();
            let error = |reason: String| ParseError {
                line: index + 1,
                reason,
            };
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut words = comment.split_whitespace();
                if words.next() == Some("TYPE")
                    && let (Some(name), Some(kind)) = (words.next(), words.next())
                {
                    scrape.types.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            scrape.samples.push(parse_sample(line).map_err(error)?);
        }
        Ok(scrape)
    }

    /// Samples of one name, in scrape order.
    pub fn series<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The first sample of `name` carrying all of `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.series(name)
            .find(|s| s.has_labels(labels))
            .map(|s| s.value)
    }

    /// Sum over every sample of `name` carrying all of `labels` (0 when there is none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.series(name)
            .filter(|s| s.has_labels(labels))
            .map(|s| s.value)
            .sum()
    }

    /// Checks every family typed `histogram`: per series (its labels other than `le`) the bucket
    /// counts never decrease as `le` grows, there is a `+Inf` bucket equal to the series'
    /// `_count`, and a `_sum`. Returns the first problem found.
    pub fn check_histograms(&self) -> Result<(), String> {
        let without_le = |s: &Sample| -> Labels {
            let mut labels: Labels = s
                .labels
                .iter()
                .filter(|(k, _)| k != "le")
                .cloned()
                .collect();
            labels.sort();
            labels
        };
        let histograms = self.types.iter().filter(|(_, kind)| *kind == "histogram");
        for (family, _) in histograms {
            let mut series: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
            for sample in self.series(&format!("{family}_bucket")) {
                let le = sample
                    .label("le")
                    .ok_or_else(|| format!("{family}_bucket without le"))?;
                let bound = parse_value(le).ok_or_else(|| format!("{family}_bucket le={le:?}"))?;
                series
                    .entry(without_le(sample))
                    .or_default()
                    .push((bound, sample.value));
            }
            for (labels, mut buckets) in series {
                buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                if let Some(w) = buckets.windows(2).find(|w| w[1].1 < w[0].1) {
                    return Err(format!(
                        "{family}{labels:?}: bucket le={} holds {} < {} of le={}",
                        w[1].0, w[1].1, w[0].1, w[0].0
                    ));
                }
                let inf = match buckets.last() {
                    Some(&(bound, count)) if bound == f64::INFINITY => count,
                    _ => return Err(format!("{family}{labels:?}: no +Inf bucket")),
                };
                let exact = |name: String| {
                    self.samples
                        .iter()
                        .find(|s| s.name == name && without_le(s) == labels)
                        .map(|s| s.value)
                };
                match exact(format!("{family}_count")) {
                    Some(count) if count == inf => {}
                    other => {
                        return Err(format!(
                            "{family}{labels:?}: _count {other:?} differs from +Inf bucket {inf}"
                        ));
                    }
                }
                if exact(format!("{family}_sum")).is_none() {
                    return Err(format!("{family}{labels:?}: no _sum"));
                }
            }
        }
        Ok(())
    }

    /// Distinct values of `label` among the samples of `name`.
    pub fn label_values(&self, name: &str, label: &str) -> BTreeSet<String> {
        self.series(name)
            .filter_map(|s| s.label(label))
            .map(str::to_string)
            .collect()
    }
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    is_name_start(c) || c.is_ascii_digit()
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..name_end];
    if !name.starts_with(is_name_start) {
        return Err(format!("invalid metric name in {line:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels)?;
    }
    if rest.trim().is_empty() {
        return Err(format!("missing value for {name}"));
    }
    if !rest.starts_with([' ', '\t']) {
        return Err(format!("expected a space before the value of {name}"));
    }
    let mut fields = rest.split_whitespace();
    let value_text = fields
        .next()
        .ok_or_else(|| format!("missing value for {name}"))?;
    let value = parse_value(value_text)
        .ok_or_else(|| format!("invalid value {value_text:?} for {name}"))?;
    if let Some(timestamp) = fields.next()
        && timestamp.parse::<i64>().is_err()
    {
        return Err(format!("invalid timestamp {timestamp:?} for {name}"));
    }
    if fields.next().is_some() {
        return Err(format!("unexpected text after the value of {name}"));
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `key="value",...}` and returns the text after the closing brace.
fn parse_labels<'a>(
    mut text: &'a str,
    labels: &mut Vec<(String, String)>,
) -> Result<&'a str, String> {
    loop {
        text = text.trim_start();
        if let Some(after) = text.strip_prefix('}') {
            return Ok(after);
        }
        let key_end = text
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        let key = &text[..key_end];
        if key.is_empty() || key.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!("invalid label name at {text:?}"));
        }
        text = text[key_end..].trim_start();
        text = text
            .strip_prefix("=\"")
            .ok_or_else(|| format!("expected =\" after label {key}"))?;
        let mut value = String::new();
        let mut chars = text.char_indices();
        let close = loop {
            match chars.next() {
                None => return Err(format!("unterminated value of label {key}")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err(format!("invalid escape in label {key}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        text = text[close + 1..].trim_start();
        if let Some(after) = text.strip_prefix(',') {
            text = after;
        } else if !text.starts_with('}') {
            return Err(format!("expected , or }} after label {key}"));
        }
    }
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &str = r#"# HELP kvgate_requests_total Requests.
# TYPE kvgate_requests_total counter
kvgate_requests_total{tenant="a",route="chat",outcome="admitted"} 3
kvgate_requests_total{tenant="b",route="chat",outcome="rejected"} 2
# TYPE kvgate_queue_wait_seconds histogram
kvgate_queue_wait_seconds_bucket{tenant="a",le="0.5"} 1
kvgate_queue_wait_seconds_bucket{tenant="a",le="+Inf"} 3
kvgate_queue_wait_seconds_sum{tenant="a"} 1.25
kvgate_queue_wait_seconds_count{tenant="a"} 3

vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.25 1700000000000
weird{msg="say \"hi\"\\n\nbye",} NaN
"#;

    fn parse(text: &str) -> Scrape {
        match Scrape::parse(text) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn parses_counters_histograms_colons_timestamps_and_escapes() {
        let scrape = parse(REAL);
        assert_eq!(scrape.samples.len(), 8);
        assert_eq!(scrape.types["kvgate_requests_total"], "counter");
        assert_eq!(
            scrape.value("kvgate_requests_total", &[("tenant", "b")]),
            Some(2.0)
        );
        assert_eq!(
            scrape.sum("kvgate_requests_total", &[("route", "chat")]),
            5.0
        );
        assert_eq!(
            scrape.sum("kvgate_requests_total", &[("tenant", "nobody")]),
            0.0
        );
        assert_eq!(
            scrape.value("kvgate_queue_wait_seconds_bucket", &[("le", "+Inf")]),
            Some(3.0)
        );
        assert_eq!(scrape.value("vllm:kv_cache_usage_perc", &[]), Some(0.25));
        let weird = scrape
            .series("weird")
            .next()
            .map(|s| (s.label("msg").map(str::to_string), s.value));
        assert!(matches!(weird, Some((Some(ref m), v)) if m == "say \"hi\"\\n\nbye" && v.is_nan()));
        let tenants: Vec<_> = scrape
            .label_values("kvgate_requests_total", "tenant")
            .into_iter()
            .collect();
        assert_eq!(tenants, ["a", "b"]);
    }

    #[test]
    fn writer_output_parses_back_exactly() {
        let mut w = Writer::default();
        w.family("kvgate_kv_blocks", "gauge", "KV blocks.\nby state");
        w.sample("kvgate_kv_blocks", &[("state", "used")], 12.0);
        w.sample("kvgate_kv_blocks", &[("state", "tricky \"q\" \\ \n")], 0.5);
        w.sample("kvgate_up", &[], f64::INFINITY);
        let text = w.finish();
        assert!(text.starts_with(
            "# HELP kvgate_kv_blocks KV blocks.\\nby state\n# TYPE kvgate_kv_blocks gauge\n"
        ));
        assert!(
            text.contains("kvgate_kv_blocks{state=\"used\"} 12\n"),
            "{text}"
        );
        let scrape = parse(&text);
        assert_eq!(
            scrape.value("kvgate_kv_blocks", &[("state", "tricky \"q\" \\ \n")]),
            Some(0.5)
        );
        assert_eq!(scrape.value("kvgate_up", &[]), Some(f64::INFINITY));
    }

    #[test]
    fn written_histograms_parse_back_cumulative_and_are_checked() {
        let mut w = Writer::default();
        w.family("kvgate_batch_size", "histogram", "Sequences per step.");
        w.histogram(
            "kvgate_batch_size",
            &[("engine", "0")],
            [(0.5, 1), (1.0, 2), (2.0, 5)],
            9.0,
            6,
        );
        let text = w.finish();
        assert!(
            text.contains("kvgate_batch_size_bucket{engine=\"0\",le=\"2\"} 5\n"),
            "{text}"
        );
        let scrape = parse(&text);
        let bucket = |le| scrape.value("kvgate_batch_size_bucket", &[("le", le)]);
        assert_eq!(bucket("+Inf"), Some(6.0));
        assert_eq!(scrape.value("kvgate_batch_size_sum", &[]), Some(9.0));
        assert_eq!(scrape.value("kvgate_batch_size_count", &[]), Some(6.0));
        assert_eq!(scrape.check_histograms(), Ok(()), "1, 2, 5, then +Inf 6");
        assert_eq!(parse(REAL).check_histograms(), Ok(()));

        let broken = |text: &str| parse(text).check_histograms().unwrap_err();
        let head = "# TYPE h histogram\n";
        let shrinking = format!(
            "{head}h_bucket{{le=\"1\"}} 3\nh_bucket{{le=\"2\"}} 2\nh_bucket{{le=\"+Inf\"}} 3\nh_sum 1\nh_count 3\n"
        );
        assert!(broken(&shrinking).contains("< 3"), "{}", broken(&shrinking));
        let no_inf = format!("{head}h_bucket{{le=\"1\"}} 3\nh_sum 1\nh_count 3\n");
        assert!(broken(&no_inf).contains("+Inf"));
        let count_differs = format!("{head}h_bucket{{le=\"+Inf\"}} 3\nh_sum 1\nh_count 4\n");
        assert!(broken(&count_differs).contains("_count"));
        let no_sum = format!("{head}h_bucket{{le=\"+Inf\"}} 3\nh_count 3\n");
        assert!(broken(&no_sum).contains("_sum"));
    }

    #[test]
    fn malformed_lines_are_errors_with_line_numbers() {
        let cases = [
            ("ok 1\n9bad 1", 2, "invalid metric name"),
            ("m{a=\"x\" 1", 1, "expected , or }"),
            ("m{a=x} 1", 1, "expected =\""),
            ("m{a=\"x} 1", 1, "unterminated"),
            ("m{a=\"\\q\"} 1", 1, "invalid escape"),
            ("m", 1, "missing value"),
            ("m one", 1, "invalid value"),
            ("m 1 soon", 1, "invalid timestamp"),
            ("m 1 2 3", 1, "unexpected text"),
            ("m{=\"x\"} 1", 1, "invalid label name"),
            ("m-1 2", 1, "expected a space"),
        ];
        for (text, line, reason) in cases {
            match Scrape::parse(text) {
                Ok(s) => panic!("{text:?} parsed as {s:?}"),
                Err(e) => {
                    assert_eq!(e.line, line, "{text:?}: {e}");
                    assert!(e.reason.contains(reason), "{text:?}: {e}");
                }
            }
        }
    }

    #[test]
    fn values_use_prometheus_spelling() {
        assert_eq!(format_value(3.0), "3");
        assert_eq!(format_value(0.125), "0.125");
        assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(1e21), "1000000000000000000000");
    }
}
