//! Proof that the CPU runs the SIMD kernels: [`Avx2Fma`] and [`Avx512Vnni`], zero-sized tokens
//! that only run-time detection can make.
//!
//! A `#[target_feature]` function executed on a CPU without the feature is undefined behaviour,
//! so every safe function that ends up in SIMD code takes a token as an argument: holding one
//! is the precondition, checked once by whoever chose the SIMD path, and the compiler makes sure
//! no path reaches the kernels without it. The fields are private to this module, so nothing
//! else in the crate can forge one.

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
        if crate::simd_level() != crate::SimdLevel::Scalar
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Some(Avx2Fma { _detected: () });
        }
        None
    }
}

/// Everything [`Avx2Fma`] proves, plus AVX512F, AVX512VL and AVX512-VNNI (`vpdpbusd`), and the
/// kernels may use them (level [`crate::SimdLevel::Avx512Vnni`]: not capped
/// by `KVGATE_KERNELS_AVX2` or `KVGATE_KERNELS_SCALAR`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx512Vnni {
    avx2: Avx2Fma,
}

impl Avx512Vnni {
    /// The token, if the dispatching entry points use the VNNI kernels on this CPU (features
    /// re-checked here, as in [`Avx2Fma::detect`]).
    #[inline]
    pub(crate) fn detect() -> Option<Avx512Vnni> {
        #[cfg(target_arch = "x86_64")]
        if crate::simd_level() == crate::SimdLevel::Avx512Vnni
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            return Avx2Fma::detect().map(|avx2| Avx512Vnni { avx2 });
        }
        None
    }

    /// The AVX2 token this one includes.
    #[inline]
    pub(crate) fn avx2(self) -> Avx2Fma {
        self.avx2
    }
}
