//! The two types a matrix product hands to its kernels: [`QMatrix`], a validated view of a
//! weight matrix, and [`OutPtr`], the output slice shared by the threads of one product.
//!
//! They live apart from `matmul.rs` so that the dispatcher (`matmul`) and the SIMD tiles
//! (`avx2`) both depend on this module and not on each other: `matmul → avx2 → matrix`.

use std::marker::PhantomData;

use crate::KernelError;
use crate::quant::WeightType;

/// A weight matrix in GGML layout: `rows` rows of `cols` elements, each row `ty.row_bytes(cols)`
/// bytes, rows back to back. Borrowed from the (possibly unaligned) memory-mapped file.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub ty: WeightType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> QMatrix<'a> {
    /// Validates that `data` holds exactly `rows` rows of `cols` elements of `ty`.
    pub fn new(
        ty: WeightType,
        data: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        ty.check_cols(cols)?;
        let expected = ty
            .row_bytes(cols)
            .checked_mul(rows)
            .ok_or(KernelError::Overflow { rows, cols })?;
        if data.len() != expected {
            return Err(KernelError::DataSize {
                ty,
                rows,
                cols,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self {
            ty,
            data,
            rows,
            cols,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    pub(crate) fn assert_valid(&self) {
        assert!(
            self.ty.check_cols(self.cols).is_ok(),
            "QMatrix cols not a block multiple"
        );
        let needed = self.rows.checked_mul(self.row_bytes());
        assert!(
            needed.is_some_and(|n| self.data.len() >= n),
            "QMatrix data shorter than rows × row_bytes"
        );
    }
}

/// The output slice of one matmul, shared by its threads; each thread writes a disjoint set of
/// columns `r` of `out[a * rows + r]`. A raw pointer because the threads' writes interleave in
/// memory (row-major output, column ranges per thread), which `split_at_mut` cannot express.
///
/// The lifetime `'out` is the mutable borrow of the slice it was made from: while any copy of
/// the `OutPtr` exists the slice cannot be read, written or freed by anyone else, so a write
/// through it can never dangle or race with the owner.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr<'out> {
    ptr: *mut f32,
    len: usize,
    _out: PhantomData<&'out mut [f32]>,
}

// SAFETY: threads only write disjoint elements (distinct weight-row ranges; `write`'s
// contract), and the borrow `'out` keeps the slice alive and unaliased for as long as any copy
// of the pointer exists.
unsafe impl Send for OutPtr<'_> {}
unsafe impl Sync for OutPtr<'_> {}

impl<'out> OutPtr<'out> {
    pub(crate) fn new(out: &'out mut [f32]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _out: PhantomData,
        }
    }

    /// Writes `value` at `index`.
    ///
    /// # Safety
    /// No other thread may access `index` while any copy of this `OutPtr` is alive.
    #[inline(always)]
    pub(crate) unsafe fn write(self, index: usize, value: f32) {
        assert!(index < self.len, "matmul output index out of bounds");
        // SAFETY: bounds checked above; the slice is borrowed for `'out` (alive, no other
        // access); exclusivity among the sharing threads is the caller's contract.
        unsafe { *self.ptr.add(index) = value };
    }
}
