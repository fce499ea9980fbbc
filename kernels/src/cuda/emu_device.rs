//! [`DeviceOps`] on the CPU: the CUDA C sources compiled by g++ against the emulation layer in
//! `kernels/cuda/emu/` (a fiber per CUDA thread, barriers, per-warp shuffle exchange),
//! with "device memory" in host allocations. The CUDA backend's launch sequence runs on it
//! unchanged, which is how CI checks a whole forward step without a GPU. Slow (one CPU thread
//! runs every CUDA thread of a block in turn): for tests on tiny shapes only, behind the
//! `cuda-emu` feature.

use std::ffi::{CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::device::{
    AllocTable, DevBuf, DeviceError, DeviceMemory, DeviceOps, KernelArg, LaunchDims,
};

/// Launch geometry as `emu::Launch` in emu.h.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmuLaunch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u64,
}

impl From<LaunchDims> for EmuLaunch {
    fn from(d: LaunchDims) -> EmuLaunch {
        EmuLaunch {
            grid: d.grid,
            block: [d.threads, 1, 1],
            shared_bytes: u64::from(d.shared_bytes),
        }
    }
}

type LaunchByName = unsafe extern "C" fn(*const c_char, *const EmuLaunch, *mut *mut c_void) -> i32;
type HasKernel = unsafe extern "C" fn(*const c_char) -> i32;

/// Files the emulator library is built from (hashed into its cache name).
const SOURCES: [&str; 8] = [
    "prelude.cuh",
    "elementwise.cu",
    "attention.cu",
    "qdot.cuh",
    "matvec.cu",
    "mmq.cu",
    "emu/emu.h",
    "emu/launchers.cpp",
];

/// Builds (or finds, cached by source hash under the temp dir) the emulator library.
pub fn build_library() -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for f in SOURCES {
        std::fs::read(dir.join(f))
            .map_err(|e| format!("{}: {e}", dir.join(f).display()))?
            .hash(&mut hasher);
    }
    // Shared by every test process and run on purpose (g++ takes a while), and bounded: the
    // name is the sources' hash, so runs reuse one library and only a source change adds one.
    let out_dir = std::env::temp_dir().join("kvgate-cuda-emu");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let lib = out_dir.join(format!("emu-{:016x}.so", hasher.finish()));
    if lib.exists() {
        return Ok(lib);
    }
    // A partial file per process and call, renamed into place: concurrent test binaries never
    // load a half-written library, and tests of one binary building it at the same time (the
    // first run after a source change) never write or rename each other's file.
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = out_dir.join(format!("emu-{}-{build}.so.partial", std::process::id()));
    let output = Command::new("g++")
        .args([
            "-std=c++20",
            "-O2",
            "-fPIC",
            "-shared",
            "-pthread",
            "-Wall",
            "-Wextra",
            "-Wno-unknown-pragmas",
            "-Wno-unused-function",
            "-o",
        ])
        .arg(&partial)
        .arg(dir.join("emu/launchers.cpp"))
        .output()
        .map_err(|e| {
            format!("cannot run g++ ({e}): the CUDA emulator needs a C++20 compiler (Debian: apt-get install g++)")
        })?;
    if !output.status.success() {
        return Err(format!(
            "g++ failed to build the CUDA emulator:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    std::fs::rename(&partial, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    Ok(lib)
}

/// The emulated device: host memory plus the emulator's launch-by-name entry point.
pub struct EmuDevice {
    _lib: libloading::Library,
    launch_by_name: LaunchByName,
    has_kernel: HasKernel,
    /// One 16-byte aligned host allocation per buffer (device allocations are 256-byte
    /// aligned; the kernels' 16-byte loads rely on at least 16).
    memory: Vec<Vec<u128>>,
    table: AllocTable,
}

impl EmuDevice {
    /// Builds or loads the emulator library.
    pub fn new() -> Result<EmuDevice, DeviceError> {
        let path = build_library().map_err(DeviceError::Driver)?;
        // SAFETY: the library is the emulator built from this repository's sources; loading
        // it runs only C++ static initialisers.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| DeviceError::Driver(format!("{}: {e}", path.display())))?;
        // SAFETY: `emu_launch` is defined with exactly this signature in launchers.cpp.
        let launch_by_name = unsafe { lib.get::<LaunchByName>(b"emu_launch\0") }
            .map(|f| *f)
            .map_err(|e| DeviceError::Driver(format!("emu_launch: {e}")))?;
        // SAFETY: `emu_has_kernel` is defined with exactly this signature in launchers.cpp.
        let has_kernel = unsafe { lib.get::<HasKernel>(b"emu_has_kernel\0") }
            .map(|f| *f)
            .map_err(|e| DeviceError::Driver(format!("emu_has_kernel: {e}")))?;
        Ok(EmuDevice {
            _lib: lib,
            launch_by_name,
            has_kernel,
            memory: Vec::new(),
            table: AllocTable::default(),
        })
    }

    /// Whether the emulator has an entry for kernel `name`.
    pub fn has_kernel(&self, name: &str) -> bool {
        let Ok(cname) = CString::new(name) else {
            return false;
        };
        // SAFETY: a NUL-terminated string the call only reads.
        unsafe { (self.has_kernel)(cname.as_ptr()) == 1 }
    }

    fn bytes_mut(
        &mut self,
        buf: DevBuf,
        offset: usize,
        len: usize,
    ) -> Result<&mut [u8], DeviceError> {
        self.table.check(buf, offset, len)?;
        let words = &mut self.memory[buf.id()];
        // SAFETY: the table check put offset..offset+len inside the buffer's `bytes`, and the
        // allocation holds at least that many bytes (rounded up to whole u128 words).
        let all = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 16)
        };
        Ok(&mut all[offset..offset + len])
    }
}

impl DeviceOps for EmuDevice {
    fn describe(&self) -> String {
        "CUDA emulator (CPU)".into()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevBuf, DeviceError> {
        let words = bytes.div_ceil(16).max(1);
        let mut storage = Vec::new();
        storage
            .try_reserve_exact(words)
            .map_err(|e| DeviceError::OutOfMemory {
                bytes,
                detail: e.to_string(),
            })?;
        storage.resize(words, 0u128);
        self.memory.push(storage);
        Ok(self.table.record(bytes))
    }

    fn upload(&mut self, dst: DevBuf, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.bytes_mut(dst, offset, src.len())?.copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: DevBuf, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        dst.copy_from_slice(self.bytes_mut(src, offset, dst.len())?);
        Ok(())
    }

    fn launch(
        &mut self,
        name: &str,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        // What a GPU would refuse is refused here too (the emulator itself would run a grid
        // of any size, and aborts the process on a block it cannot run).
        dims.check_limits(name)?;
        // Every parameter as 8 bytes: pointers are addresses, scalars sit in the low bytes
        // (little-endian), which is where the kernel's narrower parameter type reads them.
        let mut values = Vec::with_capacity(args.len());
        for arg in args {
            values.push(match *arg {
                KernelArg::Buf { buf, offset } => {
                    self.table.check(buf, offset, 0)?;
                    self.memory[buf.id()].as_mut_ptr() as u64 + offset as u64
                }
                KernelArg::I32(v) => u64::from(v as u32),
                KernelArg::I64(v) => v as u64,
                KernelArg::F32(v) => u64::from(v.to_bits()),
            });
        }
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        let cname = CString::new(name).map_err(|_| DeviceError::UnknownKernel(name.to_string()))?;
        let geometry = EmuLaunch::from(dims);
        // SAFETY: `params` holds one 8-byte value per kernel parameter, pointers into this
        // device's live allocations; the launch sequence sizes buffers for the geometry it
        // launches (checked against the CPU backend by the emulated forward-step tests).
        let rc = unsafe { (self.launch_by_name)(cname.as_ptr(), &geometry, params.as_mut_ptr()) };
        if rc != 0 {
            return Err(DeviceError::UnknownKernel(name.to_string()));
        }
        Ok(())
    }

    fn memory(&self) -> DeviceMemory {
        self.table.memory()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::PROGRAMS;

    #[test]
    fn every_kernel_launches_by_name_and_unknown_names_are_errors() {
        let mut dev = EmuDevice::new().expect("emulator builds");
        let x = dev.alloc(4 * 64).expect("alloc");
        let y = dev.alloc(4 * 64).expect("alloc");
        let ones: Vec<u8> = (0..64).flat_map(|_| 1.0f32.to_le_bytes()).collect();
        let twos: Vec<u8> = (0..64).flat_map(|_| 2.0f32.to_le_bytes()).collect();
        dev.upload(x, 0, &ones).expect("upload");
        dev.upload(y, 0, &twos).expect("upload");
        // x[16..64] += y[0..48], through offsets on both buffers.
        dev.launch(
            "add_inplace",
            LaunchDims::linear(1, 32),
            &[x.at(64), y.arg(), KernelArg::I64(48)],
        )
        .expect("launch");
        let mut back = vec![0u8; 4 * 64];
        dev.download(x, 0, &mut back).expect("download");
        let got: Vec<f32> = back
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert!(got[..16].iter().all(|&v| v == 1.0), "{got:?}");
        assert!(got[16..].iter().all(|&v| v == 3.0), "{got:?}");

        assert_eq!(
            dev.launch("no_such_kernel", LaunchDims::linear(1, 32), &[]),
            Err(DeviceError::UnknownKernel("no_such_kernel".into()))
        );
        assert!(
            dev.launch("add_inplace", LaunchDims::linear(1, 33), &[])
                .is_err()
        );
        assert!(dev.upload(x, 250, &[0; 8]).is_err(), "overrun");
        // Every kernel of every program can be launched by name on the emulator.
        for program in PROGRAMS {
            for &kernel in program.kernels {
                assert!(dev.has_kernel(kernel), "{kernel} missing from emu::ENTRIES");
            }
        }
        assert!(!dev.has_kernel("no_such_kernel"));
    }
}
