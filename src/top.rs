//! `kvgate top`: a refreshing terminal view of a running server, read from its `/metrics`.
//!
//! Every interval it scrapes `/metrics` over plain HTTP, parses the text format with the
//! gateway's parser, turns counters into per-second rates against the previous scrape (see
//! [`view`]) and redraws the screen with ANSI clear codes. A failed scrape is shown on screen and
//! retried on the next tick, so `top` survives a server restart; with `--once` it is an error.

mod view;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvgate_gateway::metrics::exposition::Scrape;

use view::{Frame, TopView};

/// Largest `/metrics` body accepted: far above any real scrape, low enough to bound memory.
const MAX_BODY_BYTES: usize = 16 << 20;
/// One scrape may take this long before it counts as failed.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// ANSI: cursor home, clear screen.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// Shows `url`'s metrics every `interval` until Ctrl-C; with `once`, prints one frame (no
/// screen clearing, no rates) and returns, failing if the scrape fails.
pub async fn run(url: String, interval: Duration, once: bool) -> anyhow::Result<()> {
    let base = url.trim_end_matches('/');
    let uri: hyper::Uri = format!("{base}/metrics")
        .parse()
        .with_context(|| format!("invalid --url {url:?}: expected e.g. http://127.0.0.1:8080"))?;
    if uri.scheme_str() != Some("http") {
        bail!("--url must be a plain http:// URL (kvgate serves HTTP), got {url:?}");
    }
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let interval = interval.max(Duration::from_millis(100));

    if once {
        let scrape = fetch(&client, &uri).await?;
        let frame = Frame {
            scrape,
            at: Instant::now(),
        };
        let mut out = std::io::stdout().lock();
        write!(
            out,
            "{}",
            TopView::build(&frame, None).render(base, interval)
        )?;
        out.flush()?;
        return Ok(());
    }

    let mut previous: Option<Frame> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let screen = match fetch(&client, &uri).await {
            Ok(scrape) => {
                let frame = Frame {
                    scrape,
                    at: Instant::now(),
                };
                let screen = TopView::build(&frame, previous.as_ref()).render(base, interval);
                previous = Some(frame);
                screen
            }
            Err(error) => format!(
                "kvgate top — {base}\n\nscrape failed: {error:#}\nretrying every {interval:?}…\n"
            ),
        };
        // A closed terminal or pipe ends `top` with an error instead of a panic.
        let mut out = std::io::stdout().lock();
        write!(out, "{CLEAR}{screen}")?;
        out.flush()?;
    }
}

/// GETs and parses one scrape.
async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    uri: &hyper::Uri,
) -> anyhow::Result<Scrape> {
    let response = tokio::time::timeout(SCRAPE_TIMEOUT, client.get(uri.clone()))
        .await
        .with_context(|| format!("no answer from {uri} within {SCRAPE_TIMEOUT:?}"))?
        .with_context(|| format!("cannot reach {uri}"))?;
    let status = response.status();
    if !status.is_success() {
        bail!("{uri} answered {status}");
    }
    let body = tokio::time::timeout(
        SCRAPE_TIMEOUT,
        Limited::new(response.into_body(), MAX_BODY_BYTES).collect(),
    )
    .await
    .with_context(|| format!("{uri} did not finish its body within {SCRAPE_TIMEOUT:?}"))?
    .map_err(|e| anyhow::anyhow!("reading {uri}: {e}"))?
    .to_bytes();
    let text = std::str::from_utf8(&body).with_context(|| format!("{uri} is not UTF-8 text"))?;
    Scrape::parse(text).with_context(|| format!("{uri} is not Prometheus text format"))
}
