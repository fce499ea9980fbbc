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
//! Blocks carry refcounts from the start ([`BlockPool::fork`]) so prefix sharing can be added
//! later without changing the API. The free list is a plain stack of ids: O(1) push and pop and
//! no allocation after construction. (Prefix caching will need an index-linked list so a cached
//! block can be pulled from the middle.)

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// Index of a block in the pool (and in the backend's KV cache).
pub type BlockId = u32;

/// A consistent view of the pool at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Occupancy {
    pub total_blocks: usize,
    pub used_blocks: usize,
    pub reserved_blocks: usize,
    pub free_blocks: usize,
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
    /// Refcount per block; 0 means the block is on the free list.
    ref_counts: Vec<u32>,
    /// Ids of blocks with refcount 0. `reserved` of them are spoken for.
    free_list: Vec<BlockId>,
    used: usize,
    reserved: usize,
}

impl PoolState {
    fn available(&self) -> usize {
        self.free_list.len() - self.reserved
    }

    /// Moves `count` blocks from the free list to `table` with refcount 1. The caller has
    /// checked `count <= free_list.len()` under the same lock.
    fn take_blocks(&mut self, count: usize, table: &mut Vec<BlockId>) {
        let start = self.free_list.len().saturating_sub(count);
        let PoolState {
            ref_counts,
            free_list,
            used,
            ..
        } = self;
        for id in free_list.drain(start..).rev() {
            ref_counts[id as usize] = 1;
            *used += 1;
            table.push(id);
        }
    }
}

/// Fixed-size pool of KV blocks with reservations, see the module docs.
#[derive(Debug)]
pub struct BlockPool {
    state: Mutex<PoolState>,
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
                used: 0,
                reserved: 0,
            }),
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
            block_size: self.block_size,
            bytes_per_block: self.bytes_per_block,
        }
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
        })
    }

    /// A reservation of zero blocks, for sequences submitted without one.
    pub fn empty_reservation(self: &Arc<Self>) -> Reservation {
        Reservation {
            pool: Arc::clone(self),
            reserved: 0,
            drawn: 0,
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
        let id = state.free_list.pop()?;
        state.ref_counts[id as usize] = 1;
        state.used += 1;
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
                state.free_list.push(id);
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

    /// True when this reservation was made on `pool`.
    pub fn belongs_to(&self, pool: &BlockPool) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.pool), pool)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.reserved == 0 {
            return;
        }
        let mut state = self.pool.state.lock();
        state.reserved -= self.reserved;
        drop(state);
        self.reserved = 0;
        self.pool.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests;
