//! Prefix affinity: an approximate, bounded index of which replica recently received which
//! prompt prefix, after the Gateway API Inference Extension's prefix scorer.
//!
//! A prompt's token ids are cut into [`BLOCK_TOKENS`]-token blocks; block `i`'s hash chains
//! block `i-1`'s, so one hash stands for the whole prefix up to the end of its block (a
//! trailing partial block is ignored: engines cache whole blocks). The chain is seeded with the
//! model and the tenant, so two tenants never look like they share a prefix (engines that salt
//! their caches per tenant would not share it either). Nothing comes back from the engines: the
//! index records what this gateway sent where, which is an estimate of what each replica still
//! has cached. Each replica keeps at most `capacity` hashes, least recently sent evicted first,
//! so the index stays bounded however many distinct prompts go through. A collision only
//! gives a worse route, never a wrong answer, so a fast non-cryptographic hash is enough.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// Tokens per hashed block (vLLM's default KV block size; smaller blocks cost more entries).
pub const BLOCK_TOKENS: usize = 16;
/// Longest prefix looked at, in blocks: longer prompts are truncated (4,096 tokens).
pub const MAX_BLOCKS: usize = 256;

/// Identifies a replica in the index (stable across upstreams-file reloads).
pub type ReplicaId = u64;

/// The chained hashes of `ids`' whole blocks, at most [`MAX_BLOCKS`], seeded by `seed`.
pub fn block_hashes(seed: &str, ids: &[u32]) -> Vec<u64> {
    let mut parent = {
        let mut hasher = DefaultHasher::new();
        seed.hash(&mut hasher);
        hasher.finish()
    };
    ids.chunks_exact(BLOCK_TOKENS)
        .take(MAX_BLOCKS)
        .map(|block| {
            let mut hasher = DefaultHasher::new();
            parent.hash(&mut hasher);
            block.hash(&mut hasher);
            parent = hasher.finish();
            parent
        })
        .collect()
}

/// hash → replicas that recently received it, with one LRU per replica bounding it.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    owners: HashMap<u64, Vec<ReplicaId>>,
    recency: HashMap<ReplicaId, Lru>,
}

impl PrefixIndex {
    /// How many of `hashes`, from the first, `replica` received: the matched prefix in blocks.
    pub fn matched(&self, hashes: &[u64], replica: ReplicaId) -> usize {
        hashes
            .iter()
            .take_while(|hash| {
                self.owners
                    .get(hash)
                    .is_some_and(|owners| owners.contains(&replica))
            })
            .count()
    }

    /// Records that `hashes` were sent to `replica`, which keeps at most `capacity` of them.
    pub fn record(&mut self, hashes: &[u64], replica: ReplicaId, capacity: usize) {
        let capacity = capacity.max(1);
        let lru = self.recency.entry(replica).or_default();
        let mut evicted = Vec::new();
        for &hash in hashes {
            if lru.touch(hash) {
                self.owners.entry(hash).or_default().push(replica);
            }
            while lru.len() > capacity {
                match lru.pop_oldest() {
                    Some(old) => evicted.push(old),
                    None => break,
                }
            }
        }
        for hash in evicted {
            self.disown(hash, replica);
        }
    }

    /// Drops everything `replica` received (it was ejected, restarted or removed: its cache
    /// is gone or unknown).
    pub fn forget(&mut self, replica: ReplicaId) {
        if let Some(lru) = self.recency.remove(&replica) {
            for hash in lru.stamps.into_keys() {
                self.disown(hash, replica);
            }
        }
    }

    /// Hashes `replica` holds now.
    pub fn len_of(&self, replica: ReplicaId) -> usize {
        self.recency.get(&replica).map_or(0, Lru::len)
    }

    fn disown(&mut self, hash: u64, replica: ReplicaId) {
        if let Some(owners) = self.owners.get_mut(&hash) {
            owners.retain(|owner| *owner != replica);
            if owners.is_empty() {
                self.owners.remove(&hash);
            }
        }
    }
}

/// Least-recently-used order over hashes, by stamp. A touched hash gets a new stamp and a new
/// queue entry; the old entry is left in the queue and skipped when popped (its stamp no
/// longer matches). The queue is compacted when stale entries outnumber live ones, so it
/// stays within twice the live count.
#[derive(Debug, Default)]
struct Lru {
    next_stamp: u64,
    stamps: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl Lru {
    /// Marks `hash` most recent; true when it was not held before.
    fn touch(&mut self, hash: u64) -> bool {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let new = self.stamps.insert(hash, stamp).is_none();
        self.order.push_back((hash, stamp));
        if self.order.len() > 2 * self.stamps.len() + 16 {
            let stamps = &self.stamps;
            self.order
                .retain(|(hash, stamp)| stamps.get(hash) == Some(stamp));
        }
        new
    }

    fn pop_oldest(&mut self) -> Option<u64> {
        while let Some((hash, stamp)) = self.order.pop_front() {
            if self.stamps.get(&hash) == Some(&stamp) {
                self.stamps.remove(&hash);
                return Some(hash);
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.stamps.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn hashes_chain_whole_blocks_and_depend_on_the_seed_and_the_prefix() {
        let ids = prompt(50, 0);
        let hashes = block_hashes("m/t", &ids);
        assert_eq!(
            hashes.len(),
            3,
            "50 tokens = 3 whole blocks, the tail ignored"
        );
        assert_eq!(block_hashes("m/t", &ids[..48]), hashes);
        assert_ne!(block_hashes("m/other-tenant", &ids), hashes);
        // Same second block after a different first block: a different chain from block 0.
        let mut changed = ids.clone();
        changed[0] += 1;
        let other = block_hashes("m/t", &changed);
        assert!(other.iter().zip(&hashes).all(|(a, b)| a != b));
        assert_eq!(block_hashes("m/t", &prompt(16 * 300, 0)).len(), MAX_BLOCKS);
        assert!(block_hashes("m/t", &ids[..15]).is_empty());
    }

    #[test]
    fn matches_count_consecutive_blocks_from_the_start_per_replica() {
        let mut index = PrefixIndex::default();
        let shared = block_hashes("s", &prompt(64, 0));
        index.record(&shared[..3], 1, 100);
        index.record(&shared, 2, 100);
        assert_eq!(index.matched(&shared, 1), 3);
        assert_eq!(index.matched(&shared, 2), 4);
        assert_eq!(index.matched(&shared, 3), 0);
        let unrelated = block_hashes("s", &prompt(64, 1));
        assert_eq!(index.matched(&unrelated, 2), 0);
        index.forget(2);
        assert_eq!(index.matched(&shared, 2), 0);
        assert_eq!(index.matched(&shared, 1), 3, "others keep theirs");
    }

    #[test]
    fn each_replica_keeps_its_most_recent_hashes_within_capacity() {
        let mut index = PrefixIndex::default();
        let old = block_hashes("s", &prompt(16 * 4, 0));
        let new = block_hashes("s", &prompt(16 * 4, 9));
        index.record(&old, 1, 6);
        index.record(&new, 1, 6);
        assert_eq!(index.len_of(1), 6);
        assert_eq!(index.matched(&new, 1), 4, "the newest stay");
        assert_eq!(
            index.matched(&old, 1),
            0,
            "the oldest two were evicted first"
        );
        // Re-sending refreshes: now `old`'s head is the most recent.
        index.record(&old[..2], 1, 6);
        assert_eq!(index.matched(&old, 1), 2);
        assert_eq!(index.len_of(1), 6);
        // Repeated touches of one hash never grow the queue without bound.
        for _ in 0..10_000 {
            index.record(&new[..1], 1, 6);
        }
        let lru = &index.recency[&1];
        assert!(
            lru.order.len() <= 2 * lru.stamps.len() + 17,
            "{}",
            lru.order.len()
        );
        assert!(index.owners.len() <= 6, "evicted hashes leave the index");
    }
}
