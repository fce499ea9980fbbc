//! An upstream model's admission capacity follows its healthy replicas: the declared capacity
//! of every replica its circuit breaker has not ejected, never more than the admission pool
//! built at startup (a reload that adds replicas cannot grow a pool admission already sized).
//!
//! When every replica is ejected the usable capacity is zero, so requests wait in the fair
//! queue (and get its 429 forecast or 503 `queue_timeout`) instead of an immediate 502; the
//! breaker's half-open probe readmits a replica once it answers again (`health.rs`), which
//! gives its share back and wakes the queue ([`PoolLimit::set_usable_blocks`]).
//!
//! Breakers report their transitions here while holding their own lock, so the order of an
//! ejection and a readmission of the same replica is the breaker's order. This never takes a
//! breaker's lock itself.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use super::prefix::ReplicaId;
use crate::admission::PoolLimit;

/// The replicas of one model as admission's capacity sees them.
#[derive(Debug)]
pub struct HealthyCapacity {
    limit: Arc<PoolLimit>,
    state: Mutex<Tracked>,
}

#[derive(Debug, Default)]
struct Tracked {
    /// Declared capacity of each current replica, in admission blocks.
    declared: HashMap<ReplicaId, usize>,
    /// Current replicas whose breaker is open or half-open.
    ejected: HashSet<ReplicaId>,
}

impl Tracked {
    fn healthy_blocks(&self) -> usize {
        self.declared
            .iter()
            .filter(|(id, _)| !self.ejected.contains(id))
            .map(|(_, blocks)| blocks)
            .sum()
    }
}

impl HealthyCapacity {
    /// Tracks the replicas behind `limit`'s pool; none until [`HealthyCapacity::set_replicas`].
    pub(crate) fn new(limit: Arc<PoolLimit>) -> Arc<HealthyCapacity> {
        Arc::new(HealthyCapacity {
            limit,
            state: Mutex::new(Tracked::default()),
        })
    }

    /// The limit admission reads.
    pub fn limit(&self) -> &Arc<PoolLimit> {
        &self.limit
    }

    /// The current replica set, each with its declared blocks. Replicas kept from the last
    /// set keep their ejection; new ones start healthy (their breaker starts closed).
    pub(crate) fn set_replicas(&self, replicas: impl IntoIterator<Item = (ReplicaId, usize)>) {
        let mut state = self.state.lock();
        state.declared = replicas.into_iter().collect();
        let Tracked { declared, ejected } = &mut *state;
        ejected.retain(|id| declared.contains_key(id));
        self.publish(&state);
    }

    /// `replica`'s breaker ejected it: its share is withdrawn. A replica no longer in the set
    /// (removed by a reload while a request still ran there) changes nothing.
    pub(crate) fn ejected(&self, replica: ReplicaId) {
        let mut state = self.state.lock();
        if state.declared.contains_key(&replica) && state.ejected.insert(replica) {
            self.publish(&state);
        }
    }

    /// `replica`'s breaker readmitted it: its share comes back.
    pub(crate) fn readmitted(&self, replica: ReplicaId) {
        let mut state = self.state.lock();
        if state.ejected.remove(&replica) {
            self.publish(&state);
        }
    }

    /// Declared blocks of the replicas not ejected now (before the pool's cap).
    pub fn healthy_blocks(&self) -> usize {
        self.state.lock().healthy_blocks()
    }

    /// Under the state lock, so concurrent changes reach the limit in their order.
    fn publish(&self, state: &Tracked) {
        self.limit.set_usable_blocks(state.healthy_blocks());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_runtime::block_pool::BlockPool;

    fn tracker(pool_blocks: usize) -> Arc<HealthyCapacity> {
        HealthyCapacity::new(PoolLimit::new(BlockPool::new(pool_blocks, 16, 0)))
    }

    #[test]
    fn ejected_replicas_withdraw_their_share_until_readmitted() {
        let capacity = tracker(30);
        capacity.set_replicas([(1, 10), (2, 20)]);
        assert_eq!(capacity.limit().usable_blocks(), 30);
        capacity.ejected(2);
        assert_eq!(capacity.limit().usable_blocks(), 10);
        capacity.ejected(2);
        assert_eq!(
            capacity.limit().usable_blocks(),
            10,
            "an ejection counts once"
        );
        capacity.ejected(1);
        assert_eq!(capacity.limit().usable_blocks(), 0, "every replica ejected");
        capacity.readmitted(1);
        assert_eq!(capacity.limit().usable_blocks(), 10);
        capacity.readmitted(1);
        assert_eq!(capacity.limit().usable_blocks(), 10);
        capacity.readmitted(2);
        assert_eq!(capacity.limit().usable_blocks(), 30);
    }

    #[test]
    fn a_new_replica_set_keeps_known_ejections_and_never_exceeds_the_pool() {
        let capacity = tracker(30);
        capacity.set_replicas([(1, 10), (2, 20)]);
        capacity.ejected(1);
        // Replica 2 removed, 3 added: 1 stays ejected, 3 starts healthy.
        capacity.set_replicas([(1, 10), (3, 15)]);
        assert_eq!(capacity.healthy_blocks(), 15);
        assert_eq!(capacity.limit().usable_blocks(), 15);
        // A removed replica's late transitions change nothing.
        capacity.ejected(2);
        assert_eq!(capacity.limit().usable_blocks(), 15);
        // More declared than the pool admission sized at startup: capped.
        capacity.readmitted(1);
        capacity.set_replicas([(1, 10), (3, 15), (4, 40)]);
        assert_eq!(capacity.healthy_blocks(), 65);
        assert_eq!(capacity.limit().usable_blocks(), 30);
        // Removing replica 1 while ejected forgets its ejection: re-adding it is healthy.
        capacity.ejected(1);
        capacity.set_replicas([(3, 15)]);
        capacity.set_replicas([(1, 10), (3, 15)]);
        assert_eq!(capacity.limit().usable_blocks(), 25);
    }
}
