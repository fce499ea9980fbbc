//! The pool's prefix cache: block hashes, the hash → block map's entries, and the LRU of free
//! blocks that still hold a cached prefix.
//!
//! A full block's identity is a keyed hash of (parent block's hash, its token ids, the cache
//! salt). The key is drawn at random per pool (two independent SipHash-1-3 keys from
//! [`RandomState`], 128 bits together), so nobody outside the process can build colliding
//! prompts; and a hit is confirmed against the block's stored tokens, parent hash and salt
//! anyway, so even a chance collision cannot serve one prompt the KV of another.

use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::Arc;

use super::BlockId;

/// Content identity of one full block (and, through its parent, of the whole prefix before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(u128);

/// Hashes full blocks with this pool's secret keys.
#[derive(Debug, Clone)]
pub(super) struct PrefixHasher {
    high: RandomState,
    low: RandomState,
}

impl PrefixHasher {
    pub(super) fn new() -> PrefixHasher {
        PrefixHasher {
            high: RandomState::new(),
            low: RandomState::new(),
        }
    }

    /// The hash of a block holding `tokens` after the block hashed `parent` (None: the first
    /// block), under `salt`. The salt goes into every block, not just the first: it costs a
    /// few bytes and keeps each block's identity self-contained.
    pub(super) fn hash(&self, parent: Option<BlockHash>, tokens: &[u32], salt: &str) -> BlockHash {
        let half = |state: &RandomState| {
            let mut h = state.build_hasher();
            parent.map(|p| p.0).hash(&mut h);
            salt.hash(&mut h);
            tokens.hash(&mut h);
            h.finish()
        };
        BlockHash((u128::from(half(&self.high)) << 64) | u128::from(half(&self.low)))
    }
}

/// What a block registered in the cache holds, kept to confirm hits.
#[derive(Debug, Clone)]
pub(super) struct CachedBlock {
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    pub(super) salt: Arc<str>,
    pub(super) tokens: Box<[u32]>,
}

impl CachedBlock {
    /// True when this block is exactly the block `hash` stands for: same parent, salt and
    /// token ids, not just the same hash.
    pub(super) fn confirms(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        salt: &str,
    ) -> bool {
        self.hash == hash && self.parent == parent && &*self.salt == salt && &*self.tokens == tokens
    }
}

const NIL: BlockId = BlockId::MAX;

/// Doubly linked list over block ids, linked through two index arrays: O(1) push at the back,
/// pop at the front and removal from the middle (a cached block revived by a hit), and no
/// allocation after construction. Front = least recently freed = first to evict.
#[derive(Debug)]
pub(super) struct LruList {
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    /// Whether each block is on the list (so `remove` of an absent id is a no-op).
    linked: Vec<bool>,
    head: BlockId,
    tail: BlockId,
    len: usize,
}

impl LruList {
    pub(super) fn new(num_blocks: usize) -> LruList {
        LruList {
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            linked: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn contains(&self, id: BlockId) -> bool {
        self.linked.get(id as usize).copied().unwrap_or(false)
    }

    pub(super) fn push_back(&mut self, id: BlockId) {
        let i = id as usize;
        if self.linked[i] {
            return;
        }
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
    }

    pub(super) fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    pub(super) fn remove(&mut self, id: BlockId) {
        let i = id as usize;
        if !self.contains(id) {
            return;
        }
        let (prev, next) = (self.prev[i], self.next[i]);
        if prev == NIL {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), |&id| {
            let next = self.next[id as usize];
            (next != NIL).then_some(next)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_removes_from_the_middle_and_pops_oldest_first() {
        let mut lru = LruList::new(5);
        for id in [3, 1, 4, 0] {
            lru.push_back(id);
        }
        lru.push_back(1); // already linked: no change
        lru.remove(4);
        lru.remove(2); // not linked: no change
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![3, 1, 0]);
        assert_eq!(lru.len(), 3);
        assert_eq!(lru.pop_front(), Some(3));
        lru.remove(0);
        assert_eq!(lru.pop_front(), Some(1));
        assert_eq!(lru.pop_front(), None);
        assert_eq!(lru.len(), 0);
    }

    #[test]
    fn hash_depends_on_parent_tokens_and_salt() {
        let h = PrefixHasher::new();
        let a = h.hash(None, &[1, 2, 3], "t");
        assert_eq!(a, h.hash(None, &[1, 2, 3], "t"));
        assert_ne!(a, h.hash(None, &[1, 2, 4], "t"));
        assert_ne!(a, h.hash(None, &[1, 2, 3], "u"));
        assert_ne!(a, h.hash(Some(a), &[1, 2, 3], "t"));
        // Another pool draws other keys: hashes are not predictable across processes.
        assert_ne!(a, PrefixHasher::new().hash(None, &[1, 2, 3], "t"));
    }
}
