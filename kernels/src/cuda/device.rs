//! The "device ops" seam: the few things the CUDA backend's launch sequence needs from a device
//! — allocate once, copy in and out, launch a kernel of `kernels/cuda/*.cu` by name with its
//! parameters — behind one trait with two implementations:
//!
//! * [`cudarc`](super::cudarc_device) drives a real NVIDIA GPU (CUBINs compiled by NVRTC);
//! * [`emu`](super::emu_device) runs the same `.cu` sources on the CPU through the C++
//!   emulation layer, so CI executes the backend's whole forward step without a GPU.
//!
//! Buffers are handles into allocations the device owns for its whole life, never raw
//! addresses: the launch code (in `kvgate-runtime`, which forbids `unsafe`) can only name
//! memory that exists, and each implementation turns a handle plus offset into its own
//! pointer after checking the offset. What a kernel does inside a buffer is bounded by the
//! geometry the launch code computes; the emulator tests check those sizes on the CPU.

use std::fmt;

/// One allocation of device memory: an id into the device's table and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevBuf {
    id: usize,
    bytes: usize,
}

impl DevBuf {
    /// For [`DeviceOps`] implementations: the handle of their allocation number `id`.
    pub fn new(id: usize, bytes: usize) -> DevBuf {
        DevBuf { id, bytes }
    }

    pub fn id(self) -> usize {
        self.id
    }

    pub fn bytes(self) -> usize {
        self.bytes
    }

    /// A kernel argument pointing `offset` bytes into this buffer.
    pub fn at(self, offset: usize) -> KernelArg {
        KernelArg::Buf { buf: self, offset }
    }

    /// A kernel argument pointing at the start of this buffer.
    pub fn arg(self) -> KernelArg {
        self.at(0)
    }

    /// Checks that `len` bytes from `offset` lie inside the buffer.
    pub fn check_range(self, offset: usize, len: usize) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(DeviceError::OutOfBounds {
                offset,
                len,
                bytes: self.bytes,
            }),
        }
    }
}

/// One kernel parameter, in the kernel's parameter order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A pointer `offset` bytes into a buffer.
    Buf {
        buf: DevBuf,
        offset: usize,
    },
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Dynamic shared memory one block may opt in to on the smallest architecture kvgate compiles
/// for (sm_80: 163 KiB; sm_90 allows 227 KiB).
pub const MAX_DYNAMIC_SHARED_BYTES: u32 = 163 * 1024;

/// Grid and block of one launch (blocks are one-dimensional in every kvgate kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub threads: u32,
    pub shared_bytes: u32,
}

impl LaunchDims {
    pub fn new(grid: [u32; 3], threads: u32, shared_bytes: usize) -> LaunchDims {
        LaunchDims {
            grid,
            threads,
            // Kernel shared memory is at most a few hundred KiB; saturate rather than wrap so
            // an absurd request fails at launch instead of running with a tiny buffer.
            shared_bytes: u32::try_from(shared_bytes).unwrap_or(u32::MAX),
        }
    }

    /// What the hardware refuses at launch, checked by both devices so the emulator refuses it
    /// too: blocks of 32..=1024 threads (a multiple of 32: every kvgate kernel works in whole
    /// warps), grid x up to 2³¹ − 1 and y, z up to 65 535 blocks, and dynamic shared memory up
    /// to [`MAX_DYNAMIC_SHARED_BYTES`].
    /// A refusal is [`DeviceError::Launch`] for `kernel`, naming the limit.
    pub fn check_limits(&self, kernel: &str) -> Result<(), DeviceError> {
        self.limit_exceeded().map_or(Ok(()), |detail| {
            Err(DeviceError::Launch {
                kernel: kernel.to_string(),
                detail,
            })
        })
    }

    /// The first limit [`LaunchDims::check_limits`] finds exceeded, described.
    fn limit_exceeded(&self) -> Option<String> {
        let [x, y, z] = self.grid;
        if self.threads == 0 || !self.threads.is_multiple_of(32) || self.threads > 1024 {
            return Some(format!(
                "{self}: blocks must be 32..=1024 threads, a multiple of 32"
            ));
        }
        if x == 0 || y == 0 || z == 0 {
            return Some(format!("{self}: empty grid"));
        }
        if x > i32::MAX as u32 || y > 65_535 || z > 65_535 {
            return Some(format!(
                "{self}: over CUDA's grid limits (x ≤ 2147483647, y and z ≤ 65535)"
            ));
        }
        if self.shared_bytes > MAX_DYNAMIC_SHARED_BYTES {
            return Some(format!(
                "{self}: over the {MAX_DYNAMIC_SHARED_BYTES} B of shared memory a block may have"
            ));
        }
        None
    }

    /// A one-dimensional grid of `blocks` blocks.
    pub fn linear(blocks: usize, threads: u32) -> LaunchDims {
        LaunchDims::new(
            [u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1],
            threads,
            0,
        )
    }
}

/// Memory as a device reports it, for the backend's memory metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of every live allocation made through [`DeviceOps::alloc`].
    pub allocated: u64,
    /// The most `allocated` has been.
    pub peak: u64,
    /// The driver's own view (`cuMemGetInfo`: free, total), where there is a driver.
    pub driver_free_total: Option<(u64, u64)>,
}

/// Why a device operation failed; the backend reports it as the step's error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("device out of memory allocating {bytes} bytes: {detail}")]
    OutOfMemory { bytes: usize, detail: String },
    #[error("{len} bytes at offset {offset} overrun a device buffer of {bytes} bytes")]
    OutOfBounds {
        offset: usize,
        len: usize,
        bytes: usize,
    },
    #[error("no buffer {0} on this device")]
    UnknownBuffer(usize),
    #[error("no kernel named `{0}`")]
    UnknownKernel(String),
    #[error("kernel `{kernel}`: {detail}")]
    Launch { kernel: String, detail: String },
    #[error("{0}")]
    Driver(String),
}

/// A device the CUDA backend's launch sequence runs on. Calls are in stream order: a copy
/// out sees every launch before it.
pub trait DeviceOps: Send {
    /// For logs: "NVIDIA H200 (sm_90)" or "CUDA emulator (CPU)".
    fn describe(&self) -> String;
    /// Allocates `bytes` of device memory, zeroed, held until the device is dropped.
    fn alloc(&mut self, bytes: usize) -> Result<DevBuf, DeviceError>;
    /// Copies `src` to `offset` bytes into `dst`.
    fn upload(&mut self, dst: DevBuf, offset: usize, src: &[u8]) -> Result<(), DeviceError>;
    /// Copies `dst.len()` bytes from `offset` bytes into `src`, after all earlier launches.
    fn download(&mut self, src: DevBuf, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Launches kernel `name` (one of [`super::PROGRAMS`]) with `args` in parameter order.
    fn launch(
        &mut self,
        name: &str,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), DeviceError>;
    /// Allocated, peak and (where there is a driver) free/total bytes.
    fn memory(&self) -> DeviceMemory;
}

/// A boxed device is a device: callers that choose the device at run time (the GPU tests, which
/// can also run on the emulator) hold `Box<dyn DeviceOps>`.
impl<D: DeviceOps + ?Sized> DeviceOps for Box<D> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn alloc(&mut self, bytes: usize) -> Result<DevBuf, DeviceError> {
        (**self).alloc(bytes)
    }
    fn upload(&mut self, dst: DevBuf, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        (**self).upload(dst, offset, src)
    }
    fn download(&mut self, src: DevBuf, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        (**self).download(src, offset, dst)
    }
    fn launch(
        &mut self,
        name: &str,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        (**self).launch(name, dims, args)
    }
    fn memory(&self) -> DeviceMemory {
        (**self).memory()
    }
}

impl fmt::Display for LaunchDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [x, y, z] = self.grid;
        write!(
            f,
            "grid ({x}, {y}, {z}) × {} threads, {} B shared",
            self.threads, self.shared_bytes
        )
    }
}

/// Bookkeeping both implementations share: sizes of the live allocations and the peak.
#[derive(Debug, Default)]
pub struct AllocTable {
    sizes: Vec<usize>,
    allocated: u64,
    peak: u64,
}

impl AllocTable {
    /// Records a new allocation of `bytes`; returns its handle.
    pub fn record(&mut self, bytes: usize) -> DevBuf {
        self.sizes.push(bytes);
        self.allocated += bytes as u64;
        self.peak = self.peak.max(self.allocated);
        DevBuf::new(self.sizes.len() - 1, bytes)
    }

    /// Checks that `buf` is one of this device's allocations and the range is inside it.
    pub fn check(&self, buf: DevBuf, offset: usize, len: usize) -> Result<(), DeviceError> {
        match self.sizes.get(buf.id) {
            Some(&bytes) if bytes == buf.bytes => buf.check_range(offset, len),
            _ => Err(DeviceError::UnknownBuffer(buf.id)),
        }
    }

    pub fn memory(&self) -> DeviceMemory {
        DeviceMemory {
            allocated: self.allocated,
            peak: self.peak,
            driver_free_total: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_over_cudas_limits_are_refused_naming_the_limit() {
        assert!(
            LaunchDims::new([2_000_000, 65_535, 3], 128, 48 * 1024)
                .check_limits("k")
                .is_ok()
        );
        let refused = |dims: LaunchDims, what: &str| {
            let error = dims.check_limits("k").expect_err(what).to_string();
            assert!(error.contains(what), "{error}");
        };
        refused(LaunchDims::new([1, 65_536, 1], 128, 0), "grid limits");
        refused(LaunchDims::new([1, 1, 65_536], 128, 0), "grid limits");
        refused(LaunchDims::new([1 << 31, 1, 1], 128, 0), "grid limits");
        refused(LaunchDims::new([0, 1, 1], 128, 0), "empty grid");
        refused(LaunchDims::new([1, 1, 1], 96 + 1, 0), "multiple of 32");
        refused(LaunchDims::new([1, 1, 1], 2048, 0), "multiple of 32");
        refused(LaunchDims::new([1, 1, 1], 128, 164 * 1024), "shared memory");
    }

    #[test]
    fn alloc_table_tracks_peak_and_rejects_foreign_or_overrunning_ranges() {
        let mut t = AllocTable::default();
        let a = t.record(100);
        let b = t.record(28);
        assert_eq!(t.memory().allocated, 128);
        assert_eq!(t.memory().peak, 128);
        assert!(t.check(a, 0, 100).is_ok());
        assert!(t.check(b, 20, 8).is_ok());
        assert_eq!(
            t.check(b, 20, 9),
            Err(DeviceError::OutOfBounds {
                offset: 20,
                len: 9,
                bytes: 28
            })
        );
        assert!(t.check(a, usize::MAX, 2).is_err(), "offset overflow");
        assert_eq!(
            t.check(DevBuf::new(7, 4), 0, 1),
            Err(DeviceError::UnknownBuffer(7))
        );
        assert_eq!(
            t.check(DevBuf::new(0, 4096), 0, 1),
            Err(DeviceError::UnknownBuffer(0)),
            "a handle must match its allocation's size"
        );
    }
}
