//! [`DeviceOps`] on a real NVIDIA GPU through cudarc (driver API, loaded at run time: the
//! build needs no CUDA toolkit). The kernels are compiled by NVRTC for the device's exact
//! architecture (a CUBIN, cached on disk, see [`super::nvrtc::CubinCache`]), loaded once;
//! memory is allocated once by the backend and addressed through [`DevBuf`] handles; all work
//! goes to one stream with cudarc's event tracking off (a single-stream engine needs none).
//!
//! cudarc panics when the driver library is missing, so [`CudarcDevice::open`] runs kvgate's
//! own probe first and returns the probe's one-line reason instead. (cudarc opens the driver by
//! its standard names, `libcuda.so`/`libcuda.so.1`; a driver found only through
//! `KVGATE_CUDA_DRIVER_LIB` at another path must also be on the loader's path.)

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
    result, sys,
};
use cudarc::nvrtc::Ptx;

use super::device::{
    AllocTable, DevBuf, DeviceError, DeviceMemory, DeviceOps, KernelArg, LaunchDims,
};
use super::nvrtc::{CubinCache, Nvrtc};
use super::probe::DeviceProbe;
use super::{PROGRAMS, nvrtc_options};

/// Dynamic shared memory a kernel may use without opting in (`cudaFuncSetAttribute`).
const DEFAULT_MAX_SHARED: u32 = 48 * 1024;

/// One GPU, its stream, the loaded kernels and every allocation.
pub struct CudarcDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    /// Held for the device's life; dropping one frees it.
    slices: Vec<CudaSlice<u8>>,
    /// Base address of each slice (fixed for its life).
    addresses: Vec<u64>,
    table: AllocTable,
    description: String,
}

fn driver(what: &str) -> impl Fn(result::DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Driver(format!("{what}: {e}"))
}

impl CudarcDevice {
    /// Opens GPU `ordinal` after checking the driver, the GPU and NVRTC are usable, and
    /// compiles (or reads from `cubin_cache`) every kernel program for its architecture.
    pub fn open(ordinal: usize, cubin_cache: &Path) -> Result<CudarcDevice, DeviceError> {
        let probe = DeviceProbe::run();
        let gpu = probe
            .usable_gpu(ordinal)
            .map_err(|e| DeviceError::Driver(e.to_string()))?
            .clone();
        let ctx = CudaContext::new(ordinal).map_err(driver("cuCtxRetain"))?;
        // SAFETY: kvgate uses one stream per device; nothing relies on cross-stream events.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let nvrtc = Nvrtc::open().map_err(|e| DeviceError::Driver(e.to_string()))?;
        let cache = CubinCache::new(cubin_cache);
        let options = nvrtc_options(&arch);
        let mut functions = HashMap::new();
        for program in PROGRAMS {
            let (cubin, _) = cache
                .get_or_compile(&nvrtc, program, &options)
                .map_err(|e| DeviceError::Driver(format!("{}: {e}", program.name)))?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(driver(program.name))?;
            for &name in program.kernels {
                let f = module.load_function(name).map_err(driver(name))?;
                functions.insert(name, f);
            }
        }
        Ok(CudarcDevice {
            ctx,
            stream,
            functions,
            slices: Vec::new(),
            addresses: Vec::new(),
            table: AllocTable::default(),
            description: gpu.to_string(),
        })
    }

    fn address(&self, buf: DevBuf, offset: usize, len: usize) -> Result<u64, DeviceError> {
        self.table.check(buf, offset, len)?;
        Ok(self.addresses[buf.id()] + offset as u64)
    }

    /// Device-to-device copy bandwidth in bytes per second (read + write counted once each, as
    /// the bandwidth bounds in BENCHMARKS.md): `iterations` copies of `bytes` between two
    /// buffers allocated for the measurement (outside any memory plan; for gpu-check only).
    pub fn measure_copy_bandwidth(
        &mut self,
        bytes: usize,
        iterations: u32,
    ) -> Result<f64, DeviceError> {
        let src = self.alloc(bytes)?;
        let dst = self.alloc(bytes)?;
        let (a, b) = (self.address(src, 0, bytes)?, self.address(dst, 0, bytes)?);
        let copy = |s: &Self| {
            // SAFETY: both ranges are whole live allocations of `bytes` bytes.
            unsafe { result::memcpy_dtod_async(b, a, bytes, s.stream.cu_stream()) }
                .map_err(driver("cuMemcpyDtoDAsync"))
        };
        copy(self)?; // warm-up
        self.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..iterations {
            copy(self)?;
        }
        self.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        Ok(2.0 * bytes as f64 * f64::from(iterations) / seconds)
    }

    /// Waits for every launch so far (the benchmark's timing points).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }
}

impl DeviceOps for CudarcDevice {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevBuf, DeviceError> {
        let slice =
            self.stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| DeviceError::OutOfMemory {
                    bytes,
                    detail: e.to_string(),
                })?;
        // With event tracking off the guard records nothing; the address is fixed for the
        // slice's life.
        let address = slice.device_ptr(&self.stream).0;
        self.addresses.push(address);
        self.slices.push(slice);
        Ok(self.table.record(bytes))
    }

    fn upload(&mut self, dst: DevBuf, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let at = self.address(dst, offset, src.len())?;
        // SAFETY: `at..at + src.len()` is inside a live allocation (checked above). A copy
        // from pageable host memory returns only once the source has been staged, so `src`
        // may be reused as soon as this returns.
        unsafe { result::memcpy_htod_async(at, src, self.stream.cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    fn download(&mut self, src: DevBuf, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        let at = self.address(src, offset, dst.len())?;
        // SAFETY: the range is inside a live allocation; the stream is synchronised before
        // `dst` is read or released.
        unsafe { result::memcpy_dtoh_async(dst, at, self.stream.cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    fn launch(
        &mut self,
        name: &str,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| DeviceError::UnknownKernel(name.to_string()))?;
        // The driver's own refusal names no limit; this one does.
        dims.check_limits(name)?;
        if dims.shared_bytes > DEFAULT_MAX_SHARED {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dims.shared_bytes as i32,
            )
            .map_err(driver(name))?;
        }
        enum Value {
            U64(u64),
            I32(i32),
            I64(i64),
            F32(f32),
        }
        let mut values = Vec::with_capacity(args.len());
        for arg in args {
            values.push(match *arg {
                KernelArg::Buf { buf, offset } => Value::U64(self.address(buf, offset, 0)?),
                KernelArg::I32(v) => Value::I32(v),
                KernelArg::I64(v) => Value::I64(v),
                KernelArg::F32(v) => Value::F32(v),
            });
        }
        let mut builder = self.stream.launch_builder(f);
        for v in &values {
            match v {
                Value::U64(p) => builder.arg(p),
                Value::I32(x) => builder.arg(x),
                Value::I64(x) => builder.arg(x),
                Value::F32(x) => builder.arg(x),
            };
        }
        let [x, y, z] = dims.grid;
        let cfg = LaunchConfig {
            grid_dim: (x, y, z),
            block_dim: (dims.threads, 1, 1),
            shared_mem_bytes: dims.shared_bytes,
        };
        // SAFETY: the arguments are the kernel's parameters in order, with its types (device
        // pointers as 64-bit addresses inside live allocations); the launch sequence sizes
        // every buffer for the geometry it launches, which the emulator tests check on the CPU.
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(|e| DeviceError::Launch {
                kernel: name.to_string(),
                detail: format!("{dims}: {e}"),
            })
    }

    fn memory(&self) -> DeviceMemory {
        let mut m = self.table.memory();
        m.driver_free_total = self
            .ctx
            .mem_get_info()
            .ok()
            .map(|(free, total)| (free as u64, total as u64));
        m
    }
}
