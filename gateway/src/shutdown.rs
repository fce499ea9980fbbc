//! Connections and their end: the accept loop, per-connection timeouts, and the drain.
//!
//! Shutdown follows linkerd's shape: once the shutdown future resolves the listener is closed
//! (no new connections), every connection is asked to finish gracefully (hyper stops
//! keep-alive and completes the request in flight, streams included), and the drain is awaited
//! up to a grace period. When the grace is over, whatever is still open gets an answer rather
//! than a cut connection: queued requests and unfinished non-streamed ones a 503, running
//! streams an SSE error event ([`GraceOver`]); those answers get [`GRACE_FLUSH`] to be written,
//! and only what is still open after that is aborted. Shutdown never takes longer than
//! grace + flush.
//!
//! Slow clients are bounded three ways. hyper's header-read timeout covers slow headers and
//! idle keep-alive connections (hyper 1.x starts it whenever it waits for a request head).
//! The body extractor times out a stalled upload. And [`StallGuard`] closes a connection whose
//! writes have been blocked for the idle timeout: a client that stopped reading its stream
//! would otherwise hold its concurrency slot and KV reservation forever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::stack::GatewayService;

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    /// Longest a write to the client may stay blocked before the connection is closed.
    pub idle_timeout: Duration,
    /// Open connections at most; the accept loop waits for a slot beyond it.
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

/// How long connections get, once the grace period is over, to write the answers that the
/// grace's end produced (503s for queued and unfinished requests, an error event for running
/// streams) before whatever is still open is aborted.
pub const GRACE_FLUSH: Duration = Duration::from_millis(500);

/// Fires when shutdown's grace period is over ([`crate::state::AppState::end_grace`]): what
/// streaming bodies and handlers select on to give their client an answer (an SSE error event,
/// a 503) instead of a cut connection. Cheap to clone.
#[derive(Debug, Clone)]
pub struct GraceOver {
    over: Option<watch::Receiver<bool>>,
}

impl GraceOver {
    pub(crate) fn new(over: watch::Receiver<bool>) -> GraceOver {
        GraceOver { over: Some(over) }
    }

    /// A signal that never fires (tests, bodies outside a server).
    pub fn never() -> GraceOver {
        GraceOver { over: None }
    }

    /// Whether the grace period is over now.
    pub fn is_over(&self) -> bool {
        self.over.as_ref().is_some_and(|over| *over.borrow())
    }

    /// Resolves once the grace period is over (at once if it already is). Cancel-safe.
    pub async fn wait(&mut self) {
        match self.over.as_mut() {
            Some(over) => {
                if over.wait_for(|over| *over).await.is_err() {
                    // The server state is gone: no grace period ends any more.
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }
}

/// Waits for SIGTERM or SIGINT (Ctrl-C).
pub async fn signal() {
    Signals::listen().first().await;
}

/// SIGTERM and SIGINT, counted from when [`Signals::listen`] was called: the first starts the
/// shutdown, a second one (an operator who does not want to wait, or an orchestrator's
/// repeated TERM) cuts its pre-drain delay short, as servers stopped with Ctrl-C twice do.
/// The drain of in-flight requests is not cut: it has its own grace period.
#[derive(Clone)]
pub struct Signals {
    received: watch::Receiver<usize>,
}

impl Signals {
    /// Starts listening (a task that lives as long as the runtime). Call it inside a tokio
    /// runtime, before the first signal may come.
    pub fn listen() -> Signals {
        let (count, received) = watch::channel(0usize);
        let mut terminate = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(stream) => Some(stream),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the server");
                None
            }
        };
        tokio::spawn(async move {
            loop {
                let sigterm = async {
                    match terminate.as_mut() {
                        Some(stream) => stream.recv().await,
                        None => std::future::pending().await,
                    }
                };
                let name = tokio::select! {
                    Some(()) = sigterm => "SIGTERM",
                    Ok(()) = tokio::signal::ctrl_c() => "SIGINT",
                    else => return,
                };
                let mut seen = 0;
                count.send_modify(|n| {
                    *n += 1;
                    seen = *n;
                });
                match seen {
                    1 => tracing::info!("{name} received: draining"),
                    _ => tracing::info!("{name} received again: ending the pre-drain now"),
                }
            }
        });
        Signals { received }
    }

    /// Resolves at the first signal.
    pub async fn first(&self) {
        self.nth(1).await;
    }

    /// Resolves at the second signal.
    pub async fn second(&self) {
        self.nth(2).await;
    }

    async fn nth(&self, n: usize) {
        let mut received = self.received.clone();
        if received.wait_for(|count| *count >= n).await.is_err() {
            // The listener task is gone (the runtime is shutting down): no more signals.
            std::future::pending::<()>().await;
        }
    }
}

/// Accepts connections until `shutdown` resolves, then drains them within the grace period.
/// `on_drain` runs once, right when the listener closes. If connections are still open when
/// the grace period is over, `on_grace_over` runs once (it ends queued requests and running
/// streams with an answer: [`crate::state::AppState::end_grace`]) and the connections get
/// [`GRACE_FLUSH`] to write those answers; whatever is still open then is aborted.
pub async fn serve_until(
    listener: TcpListener,
    service: GatewayService,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
    on_drain: impl FnOnce(),
    on_grace_over: impl FnOnce(),
) {
    let (drain_tx, drain_rx) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // Reap finished connections so the set only holds live ones.
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            slot = Arc::clone(&slots).acquire_owned() => slot,
        };
        let Ok(slot) = slot else { break };
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let service = service.clone();
                let drain = drain_rx.clone();
                connections.spawn(async move {
                    serve_connection(stream, service, limits, drain).await;
                    tracing::trace!(%peer, "connection closed");
                    drop(slot);
                });
            }
            // Accept errors (EMFILE, ECONNABORTED) are per-connection: log and keep serving.
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(listener);
    on_drain();
    let open = connections.len();
    tracing::info!(open, grace = ?limits.shutdown_grace, "stopped accepting; draining connections");
    let _ = drain_tx.send(true);
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = connections.len(),
            flush = ?GRACE_FLUSH,
            "grace period over; answering what is left"
        );
        on_grace_over();
        let flushed = tokio::time::timeout(GRACE_FLUSH, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if flushed.is_err() {
            tracing::warn!(
                left = connections.len(),
                "flush window over; aborting connections"
            );
            connections.shutdown().await;
        }
    }
}

/// Serves one HTTP/1.1 connection until it closes, stalls, or finishes draining.
async fn serve_connection(
    stream: TcpStream,
    service: GatewayService,
    limits: ConnectionLimits,
    mut drain: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let guard = StallGuard::new(stream);
    let stall = guard.clock();
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(guard), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let mut draining = *drain.borrow();
    if draining {
        connection.as_mut().graceful_shutdown();
    }
    let check_every = (limits.idle_timeout / 4).max(Duration::from_millis(10));
    let mut stall_check = tokio::time::interval(check_every);
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection ended with an error");
                }
                return;
            }
            changed = drain.changed(), if !draining => {
                draining = true;
                if changed.is_ok() {
                    connection.as_mut().graceful_shutdown();
                }
            }
            _ = stall_check.tick() => {
                if stall.blocked_for() >= limits.idle_timeout {
                    tracing::info!(idle = ?limits.idle_timeout, "client stopped reading; closing");
                    return;
                }
            }
        }
    }
}

// === impl StallGuard ===

/// An IO wrapper that remembers since when its writes have been blocked.
#[derive(Debug)]
pub struct StallGuard<IO> {
    io: IO,
    clock: Arc<StallClock>,
}

/// Shared between the IO and the connection's watchdog.
#[derive(Debug)]
pub struct StallClock {
    epoch: Instant,
    /// Milliseconds after `epoch` + 1 at which the current write blocked; 0 = not blocked.
    blocked_since: AtomicU64,
}

impl StallClock {
    /// How long the current write has been blocked (zero if it is not).
    pub fn blocked_for(&self) -> Duration {
        match self.blocked_since.load(Ordering::Acquire) {
            0 => Duration::ZERO,
            since => {
                let now = self.now_ms();
                Duration::from_millis(now.saturating_sub(since - 1))
            }
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn record<T>(&self, poll: &Poll<T>) {
        match poll {
            Poll::Pending => {
                let now = self.now_ms() + 1;
                let _ = self.blocked_since.compare_exchange(
                    0,
                    now,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            Poll::Ready(_) => self.blocked_since.store(0, Ordering::Release),
        }
    }
}

impl<IO> StallGuard<IO> {
    pub fn new(io: IO) -> StallGuard<IO> {
        StallGuard {
            io,
            clock: Arc::new(StallClock {
                epoch: Instant::now(),
                blocked_since: AtomicU64::new(0),
            }),
        }
    }

    pub fn clock(&self) -> Arc<StallClock> {
        Arc::clone(&self.clock)
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for StallGuard<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for StallGuard<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.clock.record(&poll);
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.clock.record(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.clock.record(&poll);
        poll
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_blocked_write_is_timed_and_progress_resets_it() {
        let (client, server) = tokio::io::duplex(16);
        let mut guard = StallGuard::new(server);
        let clock = guard.clock();
        assert_eq!(clock.blocked_for(), Duration::ZERO);
        // Nobody reads `client`: after 16 bytes the write blocks.
        let writer = tokio::spawn(async move {
            guard.write_all(&[7u8; 64]).await.unwrap();
            guard
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            clock.blocked_for() >= Duration::from_secs(5),
            "{:?}",
            clock.blocked_for()
        );
        // The client reads everything: the write completes and the clock resets.
        let mut client = client;
        let mut sink = vec![0u8; 64];
        client.read_exact(&mut sink).await.unwrap();
        let _guard = writer.await.unwrap();
        assert_eq!(clock.blocked_for(), Duration::ZERO);
    }
}
