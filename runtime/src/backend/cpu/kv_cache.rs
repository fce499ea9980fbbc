//! The paged f16 KV cache: one K and one V array per layer, each
//! `[num_blocks][block_size][kv_heads][head_dim]`, allocated once at startup.
//!
//! Blocks are owned by the engine's block pool; the cache only stores values at the slots the
//! batch's slot mapping names and serves them to paged attention through block tables. Nothing
//! here knows which sequence owns which block.

use half::f16;
use kvgate_kernels::KvLayout;

/// K and V storage of one layer.
pub struct LayerKv {
    pub k: Vec<f16>,
    pub v: Vec<f16>,
}

/// All layers' K/V blocks.
pub struct PagedKvCache {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub layers: Vec<LayerKv>,
}

impl PagedKvCache {
    /// Allocates `layers × 2 × num_blocks × block_size × kv_heads × head_dim` f16 values.
    /// `None` if the size overflows or the allocation fails.
    pub fn new(layers: usize, num_blocks: usize, layout: KvLayout) -> Option<PagedKvCache> {
        let per_layer = num_blocks.checked_mul(layout.block_elems())?;
        per_layer.checked_mul(layers)?.checked_mul(4)?;
        let mut all = Vec::new();
        all.try_reserve_exact(layers).ok()?;
        for _ in 0..layers {
            all.push(LayerKv {
                k: zeroed(per_layer)?,
                v: zeroed(per_layer)?,
            });
        }
        Some(PagedKvCache {
            layout,
            num_blocks,
            layers: all,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| ((l.k.len() + l.v.len()) * std::mem::size_of::<f16>()) as u64)
            .sum()
    }
}

/// A zeroed f16 vector, failing instead of aborting when memory is short. Every page is written
/// here, so the whole cache is resident from startup and later steps cannot run out of memory.
fn zeroed(len: usize) -> Option<Vec<f16>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, f16::ZERO);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_layout() {
        let layout = KvLayout {
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        let cache = PagedKvCache::new(30, 4, layout).expect("small cache allocates");
        assert_eq!(cache.layers[0].k.len(), 4 * 16 * 192);
        // 30 layers × K,V × 64 slots × 192 values × 2 bytes.
        assert_eq!(cache.bytes(), 30 * 2 * 64 * 192 * 2);
        assert!(PagedKvCache::new(usize::MAX / 2, usize::MAX / 2, layout).is_none());
    }
}
