//! The paged KV block pool: which blocks are in use, which are promised, which are free.
//!
//! One `Arc<BlockPool>` is shared by the gateway (tokio tasks that *reserve* capacity before a
//! request is admitted) and the engine thread (which *allocates* concrete block ids as sequences
//! grow). Only integers live here; the KV tensors belong to the backend.
//!
//! Accounting: `total = used + reserved + free`, where `used` counts blocks with a non-zero
//! refcount, `reserved` counts capacity promised by live [`Reservation`]s but not yet turned into
//! blocks, and `free` is what anyone may still take. All checks and updates happen under one
//! short-held lock, so a reservation can never be granted on stale numbers.
//!
//! A [`Reservation`] is an RAII credit: its `Drop` returns whatever it still holds and wakes the
//! gateway's queue through [`BlockPool::freed`]. The engine moves it into a sequence and
//! allocates from it first; blocks taken from a credit go back into that credit when the sequence
//! is preempted, so a request the gateway fully reserved for cannot lose its capacity to others.
//!
//! **Prefix caching.** A sequence registers each of its blocks once the block is full and
//! computed ([`BlockPool::register_full_blocks`]); the block then stays findable under the hash
//! of its content (see [`prefix`]) for as long as it holds it, also after its last reference is
//! gone. Free blocks therefore come in two kinds: plain ones on a stack, and ones still holding
//! a cached prefix on an LRU list. A fresh block comes from the stack first and only then
//! evicts the least recently freed cached block, so the cache costs no capacity: cached-and-free
//! blocks count as free everywhere (as in vLLM). A new sequence pins its longest cached prefix
//! with [`BlockPool::acquire_cached_prefix`]: blocks still in use just gain a reference, free
//! cached ones are taken like a fresh allocation (credit first), all under the same lock, so a
//! hit cannot be evicted between lookup and use. Only full blocks are shared and a block is
//! never written again once full, so there is no copy-on-write.

pub mod prefix;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

pub use self::prefix::BlockHash;
use self::prefix::{CachedBlock, LruList, PrefixHasher};

/// Index of a block in the pool (and in the backend's KV cache).
pub type BlockId = u32;

/// A consistent view of the pool at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Occupancy {
    pub total_blocks: usize,
    pub used_blocks: usize,
    pub reserved_blocks: usize,
    pub free_blocks: usize,
    /// Blocks with no reference that still hold a cached prefix. They are part of the free
    /// capacity (`free_blocks`, or `reserved_blocks` when promised): a fresh allocation evicts
    /// them, least recently freed first, once no plain free block is left.
    pub cached_blocks: usize,
    pub block_size: usize,
    pub bytes_per_block: usize,
}

impl Occupancy {
    pub fn total_bytes(&self) -> usize {
        self.total_blocks * self.bytes_per_block
    }
    pub fn used_bytes(&self) -> usize {
        self.used_blocks * self.bytes_per_block
    }
    pub fn reserved_bytes(&self) -> usize {
        self.reserved_blocks * self.bytes_per_block
    }
    pub fn free_bytes(&self) -> usize {
        self.free_blocks * self.bytes_per_block
    }
    /// Tokens the whole pool can hold.
    pub fn total_tokens(&self) -> usize {
        self.total_blocks * self.block_size
    }
    /// Fraction of blocks holding KV (vLLM's `kv_cache_usage_perc`), 0 for an empty pool.
    pub fn usage_ratio(&self) -> f64 {
        ratio(self.used_blocks, self.total_blocks)
    }
    /// Fraction of blocks used or promised: what admission compares with its watermark.
    pub fn committed_ratio(&self) -> f64 {
        ratio(self.used_blocks + self.reserved_blocks, self.total_blocks)
    }
}

fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// The integer state guarded by the pool's lock.
#[derive(Debug)]
struct PoolState {
    /// Refcount per block; 0 means the block is free (on `free_list` or `cached_free`).
    ref_counts: Vec<u32>,
    /// Free blocks holding nothing cached, as a stack.
    free_list: Vec<BlockId>,
    /// Free blocks still holding a cached prefix, least recently freed first.
    cached_free: LruList,
    /// The cache entry of each block registered under its hash (used or free).
    entries: Vec<Option<CachedBlock>>,
    by_hash: HashMap<BlockHash, BlockId>,
    /// Blocks with refcount > 0.
    used: usize,
    /// Free capacity promised to reservations; `reserved ≤ free_count()` always.
    reserved: usize,
    /// Bumped whenever a block is registered in or evicted from the prefix cache, so that a
    /// caller holding estimates of cached prefixes knows when they may have gone stale.
    cache_generation: u64,
}

impl PoolState {
    fn free_count(&self) -> usize {
        self.free_list.len() + self.cached_free.len()
    }

    fn available(&self) -> usize {
        self.free_count() - self.reserved
    }

    /// A free block with refcount 1: a plain one if any, else the least recently freed cached
    /// one, whose cache entry is dropped. The caller has checked capacity under the same lock.
    fn take_fresh(&mut self) -> Option<BlockId> {
        let id = match self.free_list.pop() {
            Some(id) => id,
            None => {
                let id = self.cached_free.pop_front()?;
                if let Some(entry) = self.entries[id as usize].take() {
                    self.by_hash.remove(&entry.hash);
                    self.cache_generation += 1;
                }
                id
            }
        };
        self.ref_counts[id as usize] = 1;
        self.used += 1;
        Some(id)
    }

    /// Moves `count` fresh blocks to `table`. The caller has checked `count <= free_count()`.
    fn take_blocks(&mut self, count: usize, table: &mut Vec<BlockId>) {
        for _ in 0..count {
            match self.take_fresh() {
                Some(id) => table.push(id),
                None => break,
            }
        }
    }

    /// The block cached under `hash` if it really holds (`parent`, `tokens`, `salt`).
    fn confirmed_hit(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        salt: &str,
    ) -> Option<BlockId> {
        let &id = self.by_hash.get(&hash)?;
        let entry = self.entries.get(id as usize)?.as_ref()?;
        entry.confirms(hash, parent, tokens, salt).then_some(id)
    }
}

/// Fixed-size pool of KV blocks with reservations, see the module docs.
#[derive(Debug)]
pub struct BlockPool {
    state: Mutex<PoolState>,
    hasher: PrefixHasher,
    block_size: usize,
    bytes_per_block: usize,
    freed: Notify,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, each `bytes_per_block` bytes in the
    /// backend's cache (used only for reporting).
    pub fn new(num_blocks: usize, block_size: usize, bytes_per_block: usize) -> Arc<BlockPool> {
        let num_blocks = num_blocks.min(BlockId::MAX as usize);
        // Reverse so the first blocks handed out are 0, 1, 2… (easier to read in tests and logs).
        let free_list: Vec<BlockId> = (0..num_blocks as BlockId).rev().collect();
        Arc::new(BlockPool {
            state: Mutex::new(PoolState {
                ref_counts: vec![0; num_blocks],
                free_list,
                cached_free: LruList::new(num_blocks),
                entries: vec![None; num_blocks],
                by_hash: HashMap::new(),
                used: 0,
                reserved: 0,
                cache_generation: 0,
            }),
            hasher: PrefixHasher::new(),
            block_size,
            bytes_per_block,
            freed: Notify::new(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total_blocks(&self) -> usize {
        self.state.lock().ref_counts.len()
    }

    pub fn snapshot(&self) -> Occupancy {
        let state = self.state.lock();
        Occupancy {
            total_blocks: state.ref_counts.len(),
            used_blocks: state.used,
            reserved_blocks: state.reserved,
            free_blocks: state.available(),
            cached_blocks: state.cached_free.len(),
            block_size: self.block_size,
            bytes_per_block: self.bytes_per_block,
        }
    }

    /// Changes whenever the prefix cache gains or loses a block: estimates made with
    /// [`BlockPool::cached_prefix_blocks`] under another generation may be stale.
    pub fn cache_generation(&self) -> u64 {
        self.state.lock().cache_generation
    }

    /// Reserves `blocks` blocks of capacity if that many are free right now.
    pub fn try_reserve(self: &Arc<Self>, blocks: usize) -> Option<Reservation> {
        self.try_reserve_within(blocks, usize::MAX)
    }

    /// Reserves `blocks` only if afterwards `used + reserved ≤ limit_blocks` (the gateway's
    /// high watermark) and the blocks are free. Check and update are one atomic step.
    pub fn try_reserve_within(
        self: &Arc<Self>,
        blocks: usize,
        limit_blocks: usize,
    ) -> Option<Reservation> {
        let mut state = self.state.lock();
        let committed = state.used + state.reserved;
        if blocks > state.available() || committed.saturating_add(blocks) > limit_blocks {
            return None;
        }
        state.reserved += blocks;
        drop(state);
        Some(Reservation {
            pool: Arc::clone(self),
            reserved: blocks,
            drawn: 0,
            pinned: Vec::new(),
            pinned_hashes: Vec::new(),
        })
    }

    /// [`BlockPool::try_reserve_within`] for a request of `blocks` blocks whose first blocks
    /// may already be cached: in one critical section it looks up the longest cached prefix of
    /// `tokens` under `salt` (at most [`BlockPool::cacheable_prefix_blocks`]), pins it and
    /// reserves only the rest. A hit still in use by another sequence costs nothing; a hit
    /// that is cached but free is taken off the LRU list like an allocation, so it counts
    /// against the free blocks and the limit as a new block would. The pinned prefix travels
    /// in the [`Reservation`] and is held until the reservation drops, so nothing can evict it
    /// between admission and scheduling (nor while the sequence is preempted);
    /// [`BlockPool::acquire_cached_prefix`] hands it to the sequence. `None` (nothing pinned,
    /// nothing reserved) when even the reduced cost does not fit.
    pub fn try_reserve_prefix_within(
        self: &Arc<Self>,
        blocks: usize,
        limit_blocks: usize,
        salt: &str,
        tokens: &[u32],
    ) -> Option<Reservation> {
        if self.block_size == 0 {
            return self.try_reserve_within(blocks, limit_blocks);
        }
        let wanted = self.prefix_hashes(salt, tokens, self.cacheable_prefix_blocks(tokens.len()));
        let mut state = self.state.lock();
        // The hits, and how many of them are free (those cost capacity when pinned).
        let mut hits: Vec<BlockId> = Vec::new();
        let mut free_hits = 0;
        for (i, (&hash, chunk)) in wanted
            .iter()
            .zip(tokens.chunks_exact(self.block_size))
            .enumerate()
        {
            let parent = i.checked_sub(1).map(|p| wanted[p]);
            if hits.len() >= blocks {
                break;
            }
            let Some(id) = state.confirmed_hit(hash, parent, chunk, salt) else {
                break;
            };
            if state.ref_counts[id as usize] == 0 {
                free_hits += 1;
            }
            hits.push(id);
        }
        let reserve = blocks - hits.len();
        let cost = reserve + free_hits;
        let committed = state.used + state.reserved;
        if cost > state.available() || committed.saturating_add(cost) > limit_blocks {
            return None;
        }
        for &id in &hits {
            let count = state.ref_counts[id as usize];
            if count == 0 {
                state.cached_free.remove(id);
                state.used += 1;
            }
            state.ref_counts[id as usize] = count + 1;
        }
        state.reserved += reserve;
        drop(state);
        let pinned_hashes = wanted[..hits.len()].to_vec();
        Some(Reservation {
            pool: Arc::clone(self),
            reserved: reserve,
            drawn: 0,
            pinned: hits,
            pinned_hashes,
        })
    }

    /// How many leading blocks of a `len`-token sequence may come from the cache: never the
    /// block holding the last token, which must be computed for its logits.
    pub fn cacheable_prefix_blocks(&self, len: usize) -> usize {
        if self.block_size == 0 {
            return 0;
        }
        len.saturating_sub(1) / self.block_size
    }

    /// A reservation of zero blocks, for sequences submitted without one.
    pub fn empty_reservation(self: &Arc<Self>) -> Reservation {
        Reservation {
            pool: Arc::clone(self),
            reserved: 0,
            drawn: 0,
            pinned: Vec::new(),
            pinned_hashes: Vec::new(),
        }
    }

    /// Allocates one block for the holder of `credit`: from the credit first, else from the free
    /// blocks. `None` when neither has one.
    pub fn allocate(&self, credit: &mut Reservation) -> Option<BlockId> {
        let from_credit = credit.belongs_to(self) && credit.reserved > 0;
        let mut state = self.state.lock();
        if !from_credit && state.available() == 0 {
            return None;
        }
        let id = state.take_fresh()?;
        if from_credit {
            state.reserved -= 1;
            credit.reserved -= 1;
            credit.drawn += 1;
        }
        Some(id)
    }

    /// All-or-nothing: appends `count` new blocks to `table`, drawing on `credit` first, or
    /// changes nothing and returns false. A credit from another pool is ignored (not drawn on).
    pub fn allocate_n(
        &self,
        count: usize,
        credit: &mut Reservation,
        table: &mut Vec<BlockId>,
    ) -> bool {
        if count == 0 {
            return true;
        }
        let own_credit = credit.belongs_to(self);
        let from_credit = if own_credit {
            count.min(credit.reserved)
        } else {
            0
        };
        let mut state = self.state.lock();
        if count - from_credit > state.available() {
            return false;
        }
        state.reserved -= from_credit;
        credit.reserved -= from_credit;
        credit.drawn += from_credit;
        state.take_blocks(count, table);
        true
    }

    /// Adds a reference to blocks already in use (prefix sharing: a forked sequence points at
    /// the same blocks). Ids that are out of range or currently free are skipped.
    pub fn fork(&self, blocks: &[BlockId]) {
        let mut state = self.state.lock();
        for &id in blocks {
            if let Some(count) = state.ref_counts.get_mut(id as usize)
                && *count > 0
            {
                *count += 1;
            }
        }
    }

    /// Drops one reference to each block; a block whose count reaches zero goes back to the
    /// free list. Equivalent to [`BlockPool::free_into`] with no credit.
    pub fn free(&self, blocks: &[BlockId]) {
        self.release(blocks, None);
    }

    /// Like [`BlockPool::free`], but blocks that were drawn from `credit` and become free are
    /// reserved again for it (a preempted sequence keeps the capacity it was promised).
    pub fn free_into(&self, blocks: &[BlockId], credit: &mut Reservation) {
        if credit.belongs_to(self) {
            self.release(blocks, Some(credit));
        } else {
            self.release(blocks, None);
        }
    }

    fn release(&self, blocks: &[BlockId], mut credit: Option<&mut Reservation>) {
        if blocks.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        // Reverse order: the tail of a sequence is the least likely to be shared, so it is the
        // best block to hand out again first.
        for &id in blocks.iter().rev() {
            let Some(count) = state.ref_counts.get_mut(id as usize) else {
                continue;
            };
            if *count == 0 {
                continue; // double free: ignore rather than corrupt the free list
            }
            *count -= 1;
            let now_free = *count == 0;
            if now_free {
                state.used -= 1;
                if state.entries[id as usize].is_some() {
                    state.cached_free.push_back(id);
                } else {
                    state.free_list.push(id);
                }
            }
            if let Some(credit) = credit.as_deref_mut()
                && credit.drawn > 0
            {
                credit.drawn -= 1;
                if now_free {
                    credit.reserved += 1;
                    state.reserved += 1;
                }
            }
        }
        drop(state);
        self.freed.notify_waiters();
    }

    /// Hashes of the first `max_blocks` full blocks of `tokens` under `salt`, chained.
    fn prefix_hashes(&self, salt: &str, tokens: &[u32], max_blocks: usize) -> Vec<BlockHash> {
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.extend_block_hashes(salt, tokens, max_blocks, &mut hashes);
        hashes
    }

    /// Extends `hashes`, the chained hashes of the leading full blocks of `tokens` under
    /// `salt` (computed earlier by this pool), to cover the first `max_blocks` full blocks.
    /// A block's hash depends only on the tokens up to its end, so a list computed for a
    /// shorter token list stays valid as tokens are appended: callers compute it once.
    pub fn extend_block_hashes(
        &self,
        salt: &str,
        tokens: &[u32],
        max_blocks: usize,
        hashes: &mut Vec<BlockHash>,
    ) {
        if self.block_size == 0 {
            return;
        }
        let full = (tokens.len() / self.block_size).min(max_blocks);
        for b in hashes.len()..full {
            let chunk = &tokens[b * self.block_size..(b + 1) * self.block_size];
            let parent = hashes.last().copied();
            hashes.push(self.hasher.hash(parent, chunk, salt));
        }
    }

    /// How many leading full blocks of `tokens` (at most `max_blocks`) are cached under `salt`
    /// right now. Pins nothing: the answer may be stale by the time it is used, so it serves
    /// estimates (sizing a reservation) and never decides which blocks a sequence reads.
    pub fn cached_prefix_blocks(&self, salt: &str, tokens: &[u32], max_blocks: usize) -> usize {
        if self.block_size == 0 {
            return 0;
        }
        let hashes = self.prefix_hashes(salt, tokens, max_blocks);
        let state = self.state.lock();
        let mut parent = None;
        for (i, (&hash, chunk)) in hashes
            .iter()
            .zip(tokens.chunks_exact(self.block_size))
            .enumerate()
        {
            if state.confirmed_hit(hash, parent, chunk, salt).is_none() {
                return i;
            }
            parent = Some(hash);
        }
        hashes.len()
    }

    /// Pins the longest cached prefix of `tokens` under `salt`, at most `max_blocks` blocks,
    /// appending the blocks to `table` and their hashes to `hashes` (both empty: a sequence
    /// that holds no blocks). A hit on a block in use adds a reference; a hit on a free cached
    /// block takes it off the LRU list, drawing on `credit` first, else on unreserved free
    /// capacity, and the prefix stops at the first block neither can pay for. Lookup and
    /// pinning happen under one lock, so nothing can evict a hit in between. Returns the
    /// number of blocks pinned.
    ///
    /// Credit accounting stays approximate in one direction, as for [`BlockPool::fork`]:
    /// [`BlockPool::free_into`] counts released blocks against the credit's `drawn` from the
    /// tail, so when a block drawn from the credit is still shared by another sequence at
    /// release, the credit gets back one block less. The pool's books stay exact; the sequence
    /// finds that block again as a hit in use when it is re-admitted.
    pub fn acquire_cached_prefix(
        &self,
        salt: &str,
        tokens: &[u32],
        max_blocks: usize,
        credit: &mut Reservation,
        table: &mut Vec<BlockId>,
        hashes: &mut Vec<BlockHash>,
    ) -> usize {
        if self.block_size == 0 || !table.is_empty() || !hashes.is_empty() {
            return 0;
        }
        let wanted = self.prefix_hashes(salt, tokens, max_blocks);
        let own_credit = credit.belongs_to(self);
        let mut state = self.state.lock();
        // A prefix the gateway pinned with the reservation comes first: the sequence takes
        // its own reference to each block (the credit keeps its pin until it drops, so a
        // preempted sequence finds the prefix again). Used only if it is this sequence's.
        let pinned = credit.pinned.len();
        if own_credit && pinned > 0 && wanted.get(..pinned) == Some(&credit.pinned_hashes[..]) {
            for &id in &credit.pinned {
                state.ref_counts[id as usize] += 1;
            }
            table.extend_from_slice(&credit.pinned);
            hashes.extend_from_slice(&credit.pinned_hashes);
        }
        let skip = table.len();
        for (&hash, chunk) in wanted
            .iter()
            .zip(tokens.chunks_exact(self.block_size))
            .skip(skip)
        {
            let Some(id) = state.confirmed_hit(hash, hashes.last().copied(), chunk, salt) else {
                break;
            };
            let count = state.ref_counts[id as usize];
            if count > 0 {
                state.ref_counts[id as usize] = count + 1;
            } else {
                if own_credit && credit.reserved > 0 {
                    state.reserved -= 1;
                    credit.reserved -= 1;
                    credit.drawn += 1;
                } else if state.available() == 0 {
                    break;
                }
                state.cached_free.remove(id);
                state.ref_counts[id as usize] = 1;
                state.used += 1;
            }
            table.push(id);
            hashes.push(hash);
        }
        table.len()
    }

    /// Registers the full blocks of a sequence that are not registered yet: block `b` of
    /// `table` holds `computed[b * block_size..(b + 1) * block_size]`, and `hashes` holds the
    /// hashes of the blocks before it (the chain grows here). Call it only with tokens whose
    /// K/V the backend has written. A block whose content is already cached in another block
    /// is not registered twice (the first copy keeps serving hits), but its hash still extends
    /// the chain.
    pub fn register_full_blocks(
        &self,
        salt: &str,
        table: &[BlockId],
        computed: &[u32],
        hashes: &mut Vec<BlockHash>,
    ) {
        if self.block_size == 0 {
            return;
        }
        let first = hashes.len();
        let full = (computed.len() / self.block_size).min(table.len());
        if full <= first {
            return;
        }
        for b in first..full {
            let chunk = &computed[b * self.block_size..(b + 1) * self.block_size];
            let parent = hashes.last().copied();
            hashes.push(self.hasher.hash(parent, chunk, salt));
        }
        let salt: Arc<str> = salt.into();
        let mut state = self.state.lock();
        for b in first..full {
            let id = table[b];
            let hash = hashes[b];
            let i = id as usize;
            let usable = state.ref_counts.get(i).is_some_and(|&c| c > 0)
                && state.entries[i].is_none()
                && !state.by_hash.contains_key(&hash);
            if !usable {
                continue;
            }
            state.entries[i] = Some(CachedBlock {
                hash,
                parent: b.checked_sub(1).map(|p| hashes[p]),
                salt: Arc::clone(&salt),
                tokens: computed[b * self.block_size..(b + 1) * self.block_size].into(),
            });
            state.by_hash.insert(hash, id);
            state.cache_generation += 1;
        }
    }

    /// Fires (to every current waiter) whenever blocks or reservations are returned. To wait
    /// without missing a wake-up: create and `enable()` the `Notified` future, retry the
    /// reservation, and only then await it.
    pub fn freed(&self) -> &Notify {
        &self.freed
    }

    /// Shorthand for `self.freed().notified()`.
    pub fn wait_for_free(&self) -> Notified<'_> {
        self.freed.notified()
    }
}

/// Capacity promised to one request: `reserved` blocks not yet allocated, plus a count of the
/// blocks it has already turned into allocations (`drawn`). Not `Clone`: two copies would
/// release the same capacity twice. Dropping it returns the unallocated part to the pool.
#[derive(Debug)]
pub struct Reservation {
    pool: Arc<BlockPool>,
    reserved: usize,
    drawn: usize,
    /// A cached prefix pinned at admission ([`BlockPool::try_reserve_prefix_within`]): one
    /// reference to each block, released when the reservation drops.
    pinned: Vec<BlockId>,
    /// The chain hashes of `pinned`, to check that a sequence's prompt really starts with it.
    pinned_hashes: Vec<BlockHash>,
}

impl Reservation {
    /// Blocks still promised and not yet allocated.
    pub fn blocks(&self) -> usize {
        self.reserved
    }

    /// Blocks allocated from this reservation and still held by its owner.
    pub fn drawn(&self) -> usize {
        self.drawn
    }

    /// Blocks of a cached prefix pinned with this reservation (they are not in `blocks()`).
    pub fn pinned_blocks(&self) -> usize {
        self.pinned.len()
    }

    /// True when this reservation was made on `pool`.
    pub fn belongs_to(&self, pool: &BlockPool) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.pool), pool)
    }

    /// Gives every reserved block beyond `keep` back to the pool (and wakes its waiters);
    /// returns how many went back.
    pub fn release_beyond(&mut self, keep: usize) -> usize {
        let surplus = self.reserved.saturating_sub(keep);
        if surplus > 0 {
            self.pool.state.lock().reserved -= surplus;
            self.reserved -= surplus;
            self.pool.freed.notify_waiters();
        }
        surplus
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release_beyond(0);
        if !self.pinned.is_empty() {
            // The pinned prefix stays cached: its blocks go back to the LRU list once no
            // sequence reads them (`release` notifies the waiters).
            let pinned = std::mem::take(&mut self.pinned);
            self.pool.release(&pinned, None);
        }
    }
}

#[cfg(test)]
mod tests;
