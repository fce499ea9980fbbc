//! How much of a block pool admission may fill now.
//!
//! The embedded engine's pool is always whole. An upstream model's pool stands for the
//! declared capacity of its replicas, and part of it can be gone for a while: a replica its
//! circuit breaker ejected serves nothing, so admitting requests into its share would only hand
//! them a 502 (no replica to send them to). Its owner (`upstream/capacity.rs`) lowers the
//! [`PoolLimit`] while replicas are ejected and raises it when they are readmitted; requests
//! meanwhile wait in the fair queue and get the queue's answers (429 forecast, 503
//! `queue_timeout`), and start as soon as capacity comes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvgate_runtime::block_pool::BlockPool;

/// A pool and the part of it admission may fill now (before the high watermark).
#[derive(Debug)]
pub struct PoolLimit {
    pool: Arc<BlockPool>,
    usable: AtomicUsize,
}

impl PoolLimit {
    /// The whole of `pool`.
    pub fn new(pool: Arc<BlockPool>) -> Arc<PoolLimit> {
        let usable = AtomicUsize::new(pool.total_blocks());
        Arc::new(PoolLimit { pool, usable })
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// Blocks admission may fill now; never more than the pool holds.
    pub fn usable_blocks(&self) -> usize {
        self.usable
            .load(Ordering::SeqCst)
            .min(self.pool.total_blocks())
    }

    /// Sets the usable blocks. When they grow, the admission dispatcher is woken as when
    /// blocks are returned: it waits on the pool's `freed` notification, registered before it
    /// reads this limit, so a raise that races with a dispatch step is never missed.
    pub fn set_usable_blocks(&self, blocks: usize) {
        let before = self.usable.swap(blocks, Ordering::SeqCst);
        if blocks > before {
            self.pool.freed().notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_starts_whole_and_never_exceeds_the_pool() {
        let limit = PoolLimit::new(BlockPool::new(10, 16, 0));
        assert_eq!(limit.usable_blocks(), 10);
        limit.set_usable_blocks(4);
        assert_eq!(limit.usable_blocks(), 4);
        limit.set_usable_blocks(0);
        assert_eq!(limit.usable_blocks(), 0);
        limit.set_usable_blocks(25);
        assert_eq!(limit.usable_blocks(), 10, "capped at the pool's size");
    }

    #[tokio::test]
    async fn raising_the_limit_wakes_whoever_waits_for_freed_blocks() {
        let limit = PoolLimit::new(BlockPool::new(10, 16, 0));
        limit.set_usable_blocks(0);
        let woken = limit.pool().freed().notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        limit.set_usable_blocks(0);
        assert!(
            futures::poll!(woken.as_mut()).is_pending(),
            "no change, no wake"
        );
        limit.set_usable_blocks(6);
        assert!(futures::poll!(woken.as_mut()).is_ready());
    }
}
