//! Proof that the CPU runs the AVX2 kernels: [`Avx2Fma`], a zero-sized token that only run-time
//! detection can make.
//!
//! A `#[target_feature]` function executed on a CPU without the feature is undefined behaviour,
//! so every safe function that ends up in AVX2 code takes the token as an argument: holding one
//! is the precondition, checked once by whoever chose the SIMD path, and the compiler makes sure
//! no path reaches the kernels without it. The field is private to this module, so nothing else
//! in the crate can forge one. An AVX-512 path gets a sibling token the same way.

/// AVX2, FMA and F16C are available on this CPU, and the kernels may use them (not forced off
/// by `KVGATE_KERNELS_SCALAR`). `Copy`, so it can travel with a call down to its tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx2Fma {
    _detected: (),
}

impl Avx2Fma {
    /// The token, if the dispatching entry points use AVX2 on this CPU. The features are
    /// re-checked here (std caches them: a few relaxed loads) rather than trusted from
    /// [`crate::simd_level`], so the token's soundness rests on this function alone.
    #[inline]
    pub(crate) fn detect() -> Option<Avx2Fma> {
        #[cfg(target_arch = "x86_64")]
        if crate::simd_level() == crate::SimdLevel::Avx2
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Some(Avx2Fma { _detected: () });
        }
        None
    }
}
