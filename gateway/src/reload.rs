//! Hot reload of the policy file: on SIGHUP and when the file changes on disk.
//!
//! [`PolicyStore`] holds the current `Arc<Policy>` in a `tokio::sync::watch` channel. A reload
//! validates the whole new file first and swaps only if it is good; a bad file keeps the old
//! policy, is logged with its `file:line:column` error and counted. Requests already admitted
//! are untouched because each holds its own `Arc<TenantPolicy>`.
//!
//! The file watcher watches the *directory*, because editors and config-management tools
//! replace files by rename, which a watch on the file itself would lose. Events are debounced:
//! one save often produces several events, and the file may be half-written at the first one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use notify::{Event, EventKind, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::policy::{Policy, PolicyError, load_policy};

/// Quiet time after the last file event before reloading.
const DEBOUNCE: Duration = Duration::from_millis(250);

/// The current policy, shared by every handler. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PolicyStore {
    inner: Arc<StoreInner>,
}

#[derive(Debug)]
struct StoreInner {
    path: PathBuf,
    current: watch::Sender<Arc<Policy>>,
    successes: AtomicU64,
    failures: AtomicU64,
}

/// How many reloads succeeded and failed since start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReloadCounts {
    pub success: u64,
    pub failure: u64,
}

/// Why reload triggers could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot install the SIGHUP handler: {0}")]
    Signal(#[source] std::io::Error),
    #[error("cannot watch {}: {source}", path.display())]
    Files {
        path: PathBuf,
        source: notify::Error,
    },
}

impl PolicyStore {
    /// Loads `path`; later reloads read the same path.
    pub fn load(path: impl AsRef<Path>) -> Result<PolicyStore, PolicyError> {
        let policy = load_policy(path.as_ref())?;
        Ok(PolicyStore::from_policy(policy))
    }

    /// Wraps an already-loaded policy; reloads read `policy.source()`.
    pub fn from_policy(policy: Policy) -> PolicyStore {
        let path = policy.source().to_path_buf();
        let (current, _) = watch::channel(Arc::new(policy));
        PolicyStore {
            inner: Arc::new(StoreInner {
                path,
                current,
                successes: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }),
        }
    }

    /// The policy in force now.
    pub fn current(&self) -> Arc<Policy> {
        Arc::clone(&self.inner.current.borrow())
    }

    /// A receiver that sees every successful reload.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Policy>> {
        self.inner.current.subscribe()
    }

    /// The file reloads read.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Re-reads the file; on error the current policy stays. Logged and counted either way.
    pub fn reload(&self) -> Result<(), PolicyError> {
        match load_policy(&self.inner.path) {
            Ok(policy) => {
                let tenants = policy.tenants().count();
                self.inner.current.send_replace(Arc::new(policy));
                self.inner.successes.fetch_add(1, Ordering::Relaxed);
                crate::metrics::record_policy_reload(true);
                tracing::info!(path = %self.inner.path.display(), tenants, "policy reloaded");
                Ok(())
            }
            Err(error) => {
                self.inner.failures.fetch_add(1, Ordering::Relaxed);
                crate::metrics::record_policy_reload(false);
                tracing::warn!(%error, "policy reload failed; keeping the previous policy");
                Err(error)
            }
        }
    }

    pub fn reload_counts(&self) -> ReloadCounts {
        ReloadCounts {
            success: self.inner.successes.load(Ordering::Relaxed),
            failure: self.inner.failures.load(Ordering::Relaxed),
        }
    }

    /// Reloads on SIGHUP and on changes to the file, until the returned guard is dropped.
    /// Must be called inside a tokio runtime.
    pub fn watch(&self) -> Result<ReloadWatcher, WatchError> {
        let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(WatchError::Signal)?;
        let store = self.clone();
        let on_signal = tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading policy");
                let _ = store.reload();
            }
        });

        // Capacity 1: while a reload is pending, further events add nothing.
        let (changed_tx, mut changed_rx) = mpsc::channel::<()>(1);
        let file_name = self.inner.path.file_name().map(ToOwned::to_owned);
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<Event>| {
            let Ok(event) = event else { return };
            let touches_file = event
                .paths
                .iter()
                .any(|p| p.file_name() == file_name.as_deref());
            if touches_file && !matches!(event.kind, EventKind::Access(_)) {
                let _ = changed_tx.try_send(());
            }
        })
        .map_err(|source| WatchError::Files {
            path: self.inner.path.clone(),
            source,
        })?;
        let directory = match self.inner.path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        watcher
            .watch(&directory, RecursiveMode::NonRecursive)
            .map_err(|source| WatchError::Files {
                path: directory,
                source,
            })?;
        let store = self.clone();
        let on_change = tokio::spawn(async move {
            while changed_rx.recv().await.is_some() {
                // Debounce: wait until events stop arriving for a moment.
                loop {
                    tokio::time::sleep(DEBOUNCE).await;
                    if changed_rx.try_recv().is_err() {
                        break;
                    }
                }
                let _ = store.reload();
            }
        });
        Ok(ReloadWatcher {
            _watcher: watcher,
            tasks: vec![on_signal, on_change],
        })
    }
}

/// Keeps the reload triggers alive; dropping it stops them.
pub struct ReloadWatcher {
    _watcher: notify::RecommendedWatcher,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ReloadWatcher {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "[tenants.a]\nmax_concurrency = 2\n";
    const BETTER: &str = "[tenants.a]\nmax_concurrency = 7\n";
    const BAD: &str = "[tenants.a]\nmax_concurrency = 0\n";

    fn concurrency(store: &PolicyStore) -> Option<usize> {
        store.current().tenant("a").map(|t| t.max_concurrency)
    }

    #[test]
    fn a_bad_file_keeps_the_old_policy_and_in_flight_arcs_are_untouched() {
        let dir = tempdir();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, GOOD).unwrap();
        let store = PolicyStore::load(&path).unwrap();
        let held_by_a_request = store.current().tenant("a").unwrap();

        std::fs::write(&path, BAD).unwrap();
        assert!(matches!(
            store.reload(),
            Err(PolicyError::Invalid { line: 2, .. })
        ));
        assert_eq!(concurrency(&store), Some(2));

        std::fs::write(&path, BETTER).unwrap();
        assert!(store.reload().is_ok());
        assert_eq!(concurrency(&store), Some(7));
        assert_eq!(held_by_a_request.max_concurrency, 2);
        assert_eq!(
            store.reload_counts(),
            ReloadCounts {
                success: 1,
                failure: 1
            }
        );
    }

    #[tokio::test]
    async fn file_changes_trigger_a_reload() {
        let dir = tempdir();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, GOOD).unwrap();
        let store = PolicyStore::load(&path).unwrap();
        let mut updates = store.subscribe();
        let _watcher = store.watch().unwrap();

        // Replace by rename, as editors do.
        let staged = dir.path().join("policy.toml.new");
        std::fs::write(&staged, BETTER).unwrap();
        std::fs::rename(&staged, &path).unwrap();
        // Generous bound so a broken watcher fails the test instead of hanging it.
        tokio::time::timeout(Duration::from_secs(60), updates.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(concurrency(&store), Some(7));
    }

    #[tokio::test]
    async fn sighup_triggers_a_reload() {
        let dir = tempdir();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, GOOD).unwrap();
        let store = PolicyStore::load(&path).unwrap();
        let mut updates = store.subscribe();
        // Changed before the watcher starts, so only the signal can trigger the reload.
        std::fs::write(&path, BETTER).unwrap();
        // Installs the SIGHUP handler before returning, so the signal below cannot kill us.
        let _watcher = store.watch().unwrap();
        let status = std::process::Command::new("kill")
            .args(["-HUP", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(60), updates.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(concurrency(&store), Some(7));
    }

    /// A fresh empty dir, removed with all in it when the guard drops (on a panic too).
    fn tempdir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("kvgate-reload-")
            .tempdir()
            .unwrap()
    }
}
