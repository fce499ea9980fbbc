//! The relayed answer names the model the client asked for.
//!
//! A client asks for `NAME`; the upstream is sent its own id (`model=ID`) and answers with
//! whatever it calls itself (llama.cpp's server: the path of its GGUF file). OpenAI's API, and
//! vLLM's `--served-model-name`, answer with the name that was requested, and clients match
//! on it, so [`RenameModel`] rewrites the top-level `model` field of the relayed JSON body, or
//! of each SSE `data:` event, to `NAME`.
//!
//! An SSE stream is still relayed as it arrives: every complete line goes out as soon as its
//! newline does; only a line split across frames waits for its end. A JSON body is held until
//! it is complete (it is one non-streamed answer) and rewritten once. Anything that is not an
//! object with a string `model` (an error body, `data: [DONE]`, a comment) passes unchanged,
//! as does a body or line larger than [`MAX_HELD_BYTES`], so memory per response stays bounded.
//! Rewritten JSON is re-serialized, so its keys may come back in another order.
//!
//! On the way it reads the answer's `usage.completion_tokens` (a JSON answer's, or the SSE
//! usage chunk's when the client asked for one) into a [`UsageCell`], so the request's token
//! debit can be settled on what the upstream really generated.
//!
//! With a [`GenerationTelemetry`] it also times the answer as the embedded engine's answers are
//! timed: each SSE event that carries generated text counts as a token (time to first token,
//! then inter-token gaps; an engine that sends several tokens per event is timed per event),
//! and when the body ends or is dropped the request's prompt and completion tokens are
//! recorded under its tenant, from the answer's `usage` when it reported one. A non-streamed
//! answer arrives whole, so it adds no first-token or inter-token sample (it has no such
//! moments to measure), only its duration and token counts.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use serde_json::Value;

use crate::telemetry::GenerationTelemetry;

/// Most bytes held back to rewrite (one JSON answer, or one SSE line); beyond that the rest is
/// relayed unchanged.
pub(crate) const MAX_HELD_BYTES: usize = 4 << 20;

/// How the body is framed, which decides what is held back and rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// One JSON document: held to its end, then rewritten.
    Json,
    /// Server-sent events: rewritten line by line.
    Sse,
    /// Relayed as is (unknown content, or too large to hold).
    Verbatim,
}

/// The `usage` token counts a relayed answer reported, if it did. Cheap to clone.
#[derive(Debug, Clone)]
pub struct UsageCell(Arc<[AtomicU64; 2]>);

/// Where each count is kept in a [`UsageCell`].
const COMPLETION: usize = 0;
const PROMPT: usize = 1;

impl Default for UsageCell {
    fn default() -> UsageCell {
        UsageCell(Arc::new([
            AtomicU64::new(u64::MAX),
            AtomicU64::new(u64::MAX),
        ]))
    }
}

impl UsageCell {
    /// The reported completion tokens; `None` until an answer reported them.
    pub fn completion_tokens(&self) -> Option<usize> {
        self.get(COMPLETION)
    }

    /// The reported prompt tokens; `None` until an answer reported them.
    pub fn prompt_tokens(&self) -> Option<usize> {
        self.get(PROMPT)
    }

    fn get(&self, which: usize) -> Option<usize> {
        match self.0[which].load(Ordering::Relaxed) {
            u64::MAX => None,
            tokens => usize::try_from(tokens).ok(),
        }
    }

    fn set(&self, which: usize, tokens: u64) {
        self.0[which].store(tokens.min(u64::MAX - 1), Ordering::Relaxed);
    }
}

/// A body whose `model` values are rewritten to the name the client asked for.
pub(crate) struct RenameModel<B> {
    inner: B,
    name: String,
    usage: UsageCell,
    framing: Framing,
    held: BytesMut,
    /// The inner body has ended (its trailers, if any, wait in `trailers`).
    ended: bool,
    trailers: Option<Frame<Bytes>>,
    /// SSE events seen so far that carried generated text.
    text_events: usize,
    /// Times the answer under its tenant (see the module docs); records when dropped.
    telemetry: Option<GenerationTelemetry>,
}

impl<B> RenameModel<B> {
    pub(crate) fn new(inner: B, name: String, framing: Framing) -> RenameModel<B> {
        RenameModel {
            inner,
            name,
            usage: UsageCell::default(),
            framing,
            held: BytesMut::new(),
            ended: false,
            trailers: None,
            text_events: 0,
            telemetry: None,
        }
    }

    /// Times the answer and counts its tokens into `telemetry` (see the module docs).
    pub(crate) fn recording(mut self, telemetry: GenerationTelemetry) -> RenameModel<B> {
        self.telemetry = Some(telemetry);
        self
    }

    /// Bytes about to go out: each SSE event in them that carried text is a token now.
    fn emit(&mut self, out: Bytes, text_events_before: usize) -> Bytes {
        if let Some(telemetry) = self.telemetry.as_mut()
            && self.framing == Framing::Sse
        {
            for _ in text_events_before..self.text_events {
                telemetry.on_token();
            }
        }
        out
    }

    /// Reports the answer's `usage.completion_tokens` into `usage`.
    pub(crate) fn reporting_usage(mut self, usage: UsageCell) -> RenameModel<B> {
        self.usage = usage;
        self
    }

    /// The held bytes that can go out now, rewritten; `None` while more must be read first.
    fn ready_bytes(&mut self) -> Option<Bytes> {
        match self.framing {
            Framing::Sse => {
                if let Some(end) = self.held.iter().rposition(|&b| b == b'\n') {
                    let lines = self.held.split_to(end + 1);
                    let before = self.text_events;
                    let out =
                        rename_in_lines(&lines, &self.name, &self.usage, &mut self.text_events);
                    return Some(self.emit(out, before));
                }
                if self.held.len() > MAX_HELD_BYTES {
                    self.framing = Framing::Verbatim;
                    return Some(self.held.split().freeze());
                }
                None
            }
            Framing::Json if self.held.len() > MAX_HELD_BYTES => {
                self.framing = Framing::Verbatim;
                Some(self.held.split().freeze())
            }
            Framing::Json => None,
            Framing::Verbatim => Some(self.held.split().freeze()),
        }
    }

    /// Everything still held, at the end of the body.
    fn rest(&mut self) -> Bytes {
        let rest = self.held.split();
        match self.framing {
            Framing::Sse => {
                let before = self.text_events;
                let out = rename_in_lines(&rest, &self.name, &self.usage, &mut self.text_events);
                self.emit(out, before)
            }
            Framing::Json => rename_in_json(&rest, &self.name, &self.usage, &mut 0)
                .map_or(rest.freeze(), Bytes::from),
            Framing::Verbatim => rest.freeze(),
        }
    }
}

impl<B> Drop for RenameModel<B> {
    /// The answer ended or its client left: its token counts go with the telemetry's record.
    fn drop(&mut self) {
        if let Some(telemetry) = self.telemetry.as_mut() {
            let seen = (self.framing == Framing::Sse).then_some(self.text_events);
            telemetry.on_relayed_end(
                self.usage.prompt_tokens(),
                self.usage.completion_tokens().or(seen),
            );
        }
    }
}

impl<B> http_body::Body for RenameModel<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        loop {
            if this.ended {
                if !this.held.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(this.rest()))));
                }
                return Poll::Ready(this.trailers.take().map(Ok));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => this.ended = true,
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        this.held.extend_from_slice(&data);
                        if let Some(out) = this.ready_bytes() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    // Trailers end a body: send what is held first.
                    Err(trailers) => {
                        this.trailers = Some(trailers);
                        this.ended = true;
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.held.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // A rewritten body's length differs from the upstream's.
        SizeHint::default()
    }
}

/// Rewrites the `data:` lines among `lines` (each ending in `\n`, except perhaps the last),
/// counting those that carry generated text into `text_events`.
fn rename_in_lines(lines: &[u8], name: &str, usage: &UsageCell, text_events: &mut usize) -> Bytes {
    let mut out = Vec::with_capacity(lines.len());
    for line in lines.split_inclusive(|&b| b == b'\n') {
        match rename_in_event_line(line, name, usage, text_events) {
            Some(renamed) => out.extend_from_slice(&renamed),
            None => out.extend_from_slice(line),
        }
    }
    Bytes::from(out)
}

/// `data: {...,"model":"x",...}` with `model` set to `name`, keeping the line ending; `None`
/// for any other line.
fn rename_in_event_line(
    line: &[u8],
    name: &str,
    usage: &UsageCell,
    text_events: &mut usize,
) -> Option<Vec<u8>> {
    let content_end = line
        .iter()
        .rposition(|&b| b != b'\n' && b != b'\r')
        .map_or(0, |i| i + 1);
    let (content, ending) = line.split_at(content_end);
    let payload = content.strip_prefix(b"data:")?;
    let payload = payload.strip_prefix(b" ").unwrap_or(payload);
    let renamed = rename_in_json(payload, name, usage, text_events)?;
    let mut out = Vec::with_capacity(renamed.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&renamed);
    out.extend_from_slice(ending);
    Some(out)
}

/// The JSON object `json` with its string `model` set to `name`; `None` when there is nothing
/// to change (not an object, no string `model`, or already `name`). Its `usage` token
/// counts, if any, go into `usage`; `text_events` counts it if it carries generated text.
///
/// This runs on every relayed answer and on every SSE event of a stream, so it reads only the
/// three fields it needs ([`Peek`]) and splices the new name in place of the old value: the
/// rest of the text is relayed byte for byte, never built into a tree and written again. An
/// object the peek cannot read (a duplicate key, a field of an unexpected type) takes the
/// general path, [`rename_in_value`].
fn rename_in_json(
    json: &[u8],
    name: &str,
    usage: &UsageCell,
    text_events: &mut usize,
) -> Option<Vec<u8>> {
    // A struct also deserializes from an array: only an object takes the fast path.
    let is_object = json.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let Some(peek) = is_object
        .then(|| serde_json::from_slice::<Peek>(json).ok())
        .flatten()
    else {
        return rename_in_value(json, name, usage, text_events);
    };
    if let Some(reported) = &peek.usage {
        for (which, tokens) in [
            (COMPLETION, reported.completion_tokens),
            (PROMPT, reported.prompt_tokens),
        ] {
            if let Some(tokens) = tokens {
                usage.set(which, tokens);
            }
        }
    }
    if peek.choices.iter().flatten().any(ChoicePeek::carries_text) {
        *text_events += 1;
    }
    let raw = peek.model?;
    let Ok(model) = serde_json::from_str::<std::borrow::Cow<str>>(raw.get()) else {
        return None; // not a string
    };
    if model == name {
        return None;
    }
    // `raw` borrows from `json`: its position there is the old value's.
    let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
    let end = start + raw.get().len();
    let quoted = serde_json::to_vec(name).ok()?;
    let mut out = Vec::with_capacity(json.len() - (end - start) + quoted.len());
    out.extend_from_slice(json.get(..start)?);
    out.extend_from_slice(&quoted);
    out.extend_from_slice(json.get(end..)?);
    Some(out)
}

/// What [`rename_in_json`] reads of an answer or event; every other field is skipped unread.
#[derive(serde::Deserialize)]
struct Peek<'a> {
    #[serde(borrow, default)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    usage: Option<UsagePeek>,
    #[serde(borrow, default)]
    choices: Option<Vec<ChoicePeek<'a>>>,
}

#[derive(serde::Deserialize)]
struct UsagePeek {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
}

#[derive(serde::Deserialize)]
struct ChoicePeek<'a> {
    #[serde(borrow, default)]
    delta: Option<DeltaPeek<'a>>,
    #[serde(borrow, default)]
    text: Option<std::borrow::Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct DeltaPeek<'a> {
    /// `Some(None)` for `"content": null`, which (as in [`carries_text`]) is no text and does
    /// not fall back to the choice's `text`.
    #[serde(borrow, default, deserialize_with = "present")]
    content: Option<Option<std::borrow::Cow<'a, str>>>,
}

/// A field that is there, null or not.
fn present<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<std::borrow::Cow<'a, str>>>, D::Error> {
    use serde::Deserialize;
    Option::<std::borrow::Cow<'a, str>>::deserialize(deserializer).map(Some)
}

impl ChoicePeek<'_> {
    /// As [`carries_text`]: a chat delta's `content`, else a completion's `text`, not empty.
    fn carries_text(&self) -> bool {
        let text = match self.delta.as_ref().and_then(|delta| delta.content.as_ref()) {
            Some(content) => content.as_deref(),
            None => self.text.as_deref(),
        };
        text.is_some_and(|text| !text.is_empty())
    }
}

/// [`rename_in_json`] for any JSON: parsed into a tree, renamed, written again.
fn rename_in_value(
    json: &[u8],
    name: &str,
    usage: &UsageCell,
    text_events: &mut usize,
) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(json).ok()?;
    let object = value.as_object_mut()?;
    if let Some(reported) = object.get("usage") {
        for (which, field) in [(COMPLETION, "completion_tokens"), (PROMPT, "prompt_tokens")] {
            if let Some(tokens) = reported.get(field).and_then(Value::as_u64) {
                usage.set(which, tokens);
            }
        }
    }
    if carries_text(object) {
        *text_events += 1;
    }
    match object.get("model") {
        Some(Value::String(model)) if model != name => {}
        _ => return None,
    }
    object.insert("model".to_owned(), Value::from(name));
    serde_json::to_vec(&value).ok()
}

/// Whether a chunk carries generated text: a chat delta's `content` or a completion's `text`,
/// not empty, in any choice (role-only and usage-only chunks carry none).
fn carries_text(chunk: &serde_json::Map<String, Value>) -> bool {
    let Some(Value::Array(choices)) = chunk.get("choices") else {
        return false;
    };
    choices.iter().any(|choice| {
        let text = choice
            .get("delta")
            .and_then(|delta| delta.get("content"))
            .or_else(|| choice.get("text"));
        text.and_then(Value::as_str)
            .is_some_and(|text| !text.is_empty())
    })
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full, StreamBody};
    use serde_json::json;

    use super::*;

    /// The body `chunks` would become, split into frames exactly as given.
    async fn relayed(chunks: &[&[u8]], framing: Framing) -> Vec<Bytes> {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
            .iter()
            .map(|chunk| Ok(Frame::data(Bytes::copy_from_slice(chunk))))
            .collect();
        let mut body = RenameModel::new(
            StreamBody::new(futures::stream::iter(frames)),
            "remote".to_owned(),
            framing,
        );
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(frame.unwrap().into_data().unwrap());
        }
        out
    }

    /// The usage `chunks` report when relayed with `framing`.
    async fn reported_usage(chunks: &[&str], framing: Framing) -> Option<usize> {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
            .iter()
            .map(|chunk| Ok(Frame::data(Bytes::copy_from_slice(chunk.as_bytes()))))
            .collect();
        let usage = UsageCell::default();
        let body = RenameModel::new(
            StreamBody::new(futures::stream::iter(frames)),
            "remote".to_owned(),
            framing,
        )
        .reporting_usage(usage.clone());
        body.collect().await.unwrap();
        usage.completion_tokens()
    }

    #[test]
    fn events_with_generated_text_are_counted_and_both_token_counts_read() {
        let usage = UsageCell::default();
        let mut text_events = 0;
        let lines = concat!(
            "data: {\"model\":\"x\",\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"model\":\"x\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
            "data: {\"model\":\"x\",\"choices\":[{\"delta\":{\"content\":\"\"}}]}\n\n",
            // Already named as asked (not rewritten) but still a token; a completion's text.
            "data: {\"model\":\"remote\",\"choices\":[{\"text\":\" there\"}]}\n\n",
            ": a comment\n",
            "data: {\"model\":\"x\",\"choices\":[],",
            "\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n",
        );
        rename_in_lines(lines.as_bytes(), "remote", &usage, &mut text_events);
        assert_eq!(text_events, 2, "role, empty and usage chunks carry no text");
        assert_eq!(usage.prompt_tokens(), Some(5));
        assert_eq!(usage.completion_tokens(), Some(2));
    }

    #[test]
    fn the_peek_reads_and_renames_exactly_as_the_general_path() {
        let cases = [
            r#"{"id":"c","model":"/m.gguf","choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":8,"completion_tokens":1}}"#,
            r#" { "model" : "x\u00e9\"q" , "choices" : [ { "delta" : { "content" : "Hi" } } ] } "#,
            r#"{"model":"remote","choices":[{"text":" there"}]}"#,
            r#"{"model":"x","choices":[{"delta":{"content":null},"text":"t"}]}"#,
            r#"{"model":"x","choices":[{"delta":null,"text":"t"}]}"#,
            r#"{"model":"x","choices":[{"delta":{"content":[{"type":"text"}]}}]}"#,
            r#"{"model":"x","model":"y","choices":[]}"#,
            r#"{"model":"x","usage":{"completion_tokens":1.5,"prompt_tokens":3}}"#,
            r#"{"model":"x","usage":null,"choices":null}"#,
            r#"{"model":7,"usage":{"completion_tokens":4}}"#,
            r#"{"usage":{"completion_tokens":4}}"#,
            r#"["x",{"completion_tokens":9}]"#,
            r#"{"model":"x"} trailing"#,
            r#"{"model":"x","choices":[1]}"#,
        ];
        for case in cases {
            let (fast_usage, general_usage) = (UsageCell::default(), UsageCell::default());
            let (mut fast_text, mut general_text) = (0, 0);
            let fast = rename_in_json(case.as_bytes(), "remote", &fast_usage, &mut fast_text);
            let general =
                rename_in_value(case.as_bytes(), "remote", &general_usage, &mut general_text);
            let parse = |out: Option<Vec<u8>>| {
                out.map(|bytes| serde_json::from_slice::<Value>(&bytes).unwrap())
            };
            assert_eq!(parse(fast), parse(general), "{case}");
            assert_eq!(fast_text, general_text, "{case}");
            assert_eq!(
                fast_usage.completion_tokens(),
                general_usage.completion_tokens(),
                "{case}"
            );
            assert_eq!(
                fast_usage.prompt_tokens(),
                general_usage.prompt_tokens(),
                "{case}"
            );
        }
        // The rest of the text is relayed as it came: only the value of `model` changes.
        let text = br#"{ "id" : "c1", "model" : "/m.gguf", "z":1, "a":2 }"#;
        let out = rename_in_json(text, "remote", &UsageCell::default(), &mut 0).unwrap();
        assert_eq!(out, br#"{ "id" : "c1", "model" : "remote", "z":1, "a":2 }"#);
    }

    #[tokio::test]
    async fn the_answers_completion_tokens_are_reported() {
        let json = r#"{"model":"remote","usage":{"prompt_tokens":9,"completion_tokens":7}}"#;
        assert_eq!(reported_usage(&[json], Framing::Json).await, Some(7));
        let sse = [
            "data: {\"model\":\"x\",\"choices\":[]}\n\n",
            "data: {\"model\":\"x\",\"choices\":[],\"usage\":{\"completion_",
            "tokens\":12}}\n\ndata: [DONE]\n\n",
        ];
        assert_eq!(reported_usage(&sse, Framing::Sse).await, Some(12));
        let no_usage = ["data: {\"model\":\"x\"}\n\n", "data: [DONE]\n\n"];
        assert_eq!(reported_usage(&no_usage, Framing::Sse).await, None);
    }

    #[tokio::test]
    async fn a_json_answer_reports_the_requested_name() {
        let answer = json!({"id": "c1", "model": "/models/llama.gguf", "choices": []});
        let text = serde_json::to_vec(&answer).unwrap();
        let (head, tail) = text.split_at(10);
        let out = relayed(&[head, tail], Framing::Json).await;
        assert_eq!(out.len(), 1, "held to the end, sent once");
        let renamed: Value = serde_json::from_slice(&out[0]).unwrap();
        assert_eq!(renamed["model"], "remote");
        assert_eq!(renamed["id"], "c1");

        let error: &[u8] = br#"{"error":{"message":"model /m.gguf is busy","code":503}}"#;
        let out = relayed(&[error], Framing::Json).await;
        assert_eq!(
            out.concat(),
            error.to_vec(),
            "no top-level model: unchanged"
        );
    }

    #[tokio::test]
    async fn sse_events_are_renamed_line_by_line_as_they_arrive() {
        let first: &[u8] =
            b"data: {\"model\":\"/m.gguf\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n";
        let split: &[u8] = b"data: {\"model\":\"/m.gg";
        let rest: &[u8] = b"uf\",\"choices\":[]}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n";
        let out = relayed(&[first, split, rest], Framing::Sse).await;
        assert_eq!(out.len(), 2, "the split line waits for its end: {out:?}");
        let first_out = std::str::from_utf8(&out[0]).unwrap();
        assert!(first_out.starts_with("data: {"), "{first_out}");
        assert!(first_out.ends_with("}\n\n"), "{first_out}");
        let event: Value = serde_json::from_str(first_out["data: ".len()..].trim()).unwrap();
        assert_eq!(event["model"], "remote");
        assert_eq!(event["choices"][0]["delta"]["content"], "Hi");
        let second = std::str::from_utf8(&out[1]).unwrap();
        assert!(second.contains("\"model\":\"remote\""), "{second}");
        assert!(
            second.ends_with("}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n"),
            "{second}"
        );
    }

    #[tokio::test]
    async fn verbatim_bodies_and_oversized_lines_pass_unchanged() {
        let text: &[u8] = br#"{"model":"/m.gguf"}"#;
        assert_eq!(relayed(&[text], Framing::Verbatim).await.concat(), text);

        let mut long = b"data: {\"model\":\"/m.gguf\",\"pad\":\"".to_vec();
        long.extend(std::iter::repeat_n(b'x', MAX_HELD_BYTES));
        let out = relayed(&[&long[..], &b"\"}\n\n"[..]], Framing::Sse).await;
        let mut expected = long.clone();
        expected.extend_from_slice(b"\"}\n\n");
        assert_eq!(out.concat(), expected);
    }

    #[tokio::test]
    async fn an_answer_that_already_has_the_name_is_not_reserialized() {
        let text = br#"{"model":"remote",  "id":"x"}"#;
        let mut body = RenameModel::new(
            Full::new(Bytes::from_static(text)),
            "remote".to_owned(),
            Framing::Json,
        );
        let out = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&out[..], text);
        assert!(body.frame().await.is_none());
    }
}
