//! NVRTC, loaded at run time (no CUDA toolkit at build time, and no panic when it is absent):
//! compiles the kernel programs to a CUBIN for one exact architecture, and caches CUBINs on
//! disk keyed by everything that changes them (source, options, NVRTC version, architecture),
//! since compiling every program takes seconds per start.

use super::Program;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why NVRTC could not be used or a program did not compile.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    #[error(
        "libnvrtc not found (install the NVRTC library, e.g. the nvidia-cuda-nvrtc-cu12 wheel, and set KVGATE_NVRTC_LIB or LD_LIBRARY_PATH); tried {0}"
    )]
    NotFound(String),
    #[error("{0} failed with NVRTC error {1}")]
    Call(&'static str, c_int),
    #[error("{program} does not compile:\n{log}")]
    Compile { program: String, log: String },
    #[error("CUBIN cache {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The NVRTC entry points kvgate calls (NUL-terminated for the loader).
const SYMBOLS: &[&str] = &[
    "nvrtcVersion\0",
    "nvrtcCreateProgram\0",
    "nvrtcCompileProgram\0",
    "nvrtcGetProgramLogSize\0",
    "nvrtcGetProgramLog\0",
    "nvrtcGetCUBINSize\0",
    "nvrtcGetCUBIN\0",
    "nvrtcDestroyProgram\0",
];

type ProgramHandle = *mut c_void;
type CreateProgram = unsafe extern "C" fn(
    *mut ProgramHandle,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(ProgramHandle, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(ProgramHandle, *mut usize) -> c_int;
type GetBytes = unsafe extern "C" fn(ProgramHandle, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut ProgramHandle) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// libnvrtc, opened by path or by name.
pub struct Nvrtc {
    lib: libloading::Library,
    path: String,
}

/// What one compile produced: ptxas' report and the CUBIN (an ELF image).
pub struct Compiled {
    pub log: String,
    pub cubin: Vec<u8>,
}

impl Nvrtc {
    /// `KVGATE_NVRTC_LIB` (a path, used alone), else `libnvrtc.so.13`, `.so.12` or `.so` from
    /// the loader's search path (the CUDA 13 line first, as on a driver-580 host), else a copy
    /// from NVIDIA's PyPI wheels ([`super::probe::NVRTC`]; the device probe searches the same).
    pub fn open() -> Result<Nvrtc, NvrtcError> {
        Self::open_first(super::probe::NVRTC.candidates())
    }

    /// The first candidate that loads and exports NVRTC's entry points.
    pub fn open_first(candidates: Vec<PathBuf>) -> Result<Nvrtc, NvrtcError> {
        let mut tried = Vec::new();
        for path in candidates {
            // SAFETY: loading libnvrtc runs no initialisers with preconditions; symbols are
            // looked up with their documented C signatures below.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => {
                    let nvrtc = Nvrtc {
                        lib,
                        path: path.display().to_string(),
                    };
                    match nvrtc.check_symbols() {
                        Ok(()) => return Ok(nvrtc),
                        Err(e) => tried.push(format!("{}: {e}", path.display())),
                    }
                }
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(NvrtcError::NotFound(tried.join("; ")))
    }

    /// Where the library was found.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Every symbol [`Self::compile`] calls, looked up once so later lookups cannot fail.
    fn check_symbols(&self) -> Result<(), libloading::Error> {
        for name in SYMBOLS {
            // SAFETY: only the symbol's presence is checked; it is not called.
            unsafe { self.lib.get::<*const c_void>(name.as_bytes())? };
        }
        Ok(())
    }

    /// # Safety
    /// `T` must be the C signature of the NVRTC function `name` (one of [`SYMBOLS`]).
    unsafe fn symbol<T: Copy>(&self, name: &str) -> T {
        // SAFETY: per this function's contract; presence was checked when the library opened.
        unsafe {
            *self
                .lib
                .get::<T>(name.as_bytes())
                .unwrap_or_else(|e| unreachable!("{}: {e} (checked at open)", self.path))
        }
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion has this signature and writes two ints.
        unsafe { self.symbol::<Version>("nvrtcVersion\0")(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles `source` with `options`: Ok with the log and CUBIN, or Err with the log.
    /// Compiles `program` with `options`.
    pub fn compile(&self, program: &Program, options: &[String]) -> Result<Compiled, NvrtcError> {
        let (name, source) = (program.name, program.full_source());
        let src = CString::new(source).expect("kernel sources contain no NUL");
        let cname = CString::new(name).expect("names contain no NUL");
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).expect("options contain no NUL"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: ProgramHandle = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string or array of them for the call;
        // the program handle is destroyed before returning.
        unsafe {
            let rc = self.symbol::<CreateProgram>("nvrtcCreateProgram\0")(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if rc != 0 {
                return Err(NvrtcError::Call("nvrtcCreateProgram", rc));
            }
            let rc = self.symbol::<CompileProgram>("nvrtcCompileProgram\0")(
                prog,
                opt_ptrs.len() as c_int,
                opt_ptrs.as_ptr(),
            );
            let log = self.read(prog, "nvrtcGetProgramLogSize\0", "nvrtcGetProgramLog\0");
            let log = CStr::from_bytes_until_nul(&log)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let result = if rc == 0 {
                let cubin = self.read(prog, "nvrtcGetCUBINSize\0", "nvrtcGetCUBIN\0");
                Ok(Compiled { log, cubin })
            } else {
                Err(NvrtcError::Compile {
                    program: name.to_string(),
                    log,
                })
            };
            self.symbol::<DestroyProgram>("nvrtcDestroyProgram\0")(&mut prog);
            result
        }
    }

    /// # Safety
    /// `prog` must be a live, compiled program; the symbols a (size, bytes) getter pair.
    unsafe fn read(&self, prog: ProgramHandle, size_fn: &str, bytes_fn: &str) -> Vec<u8> {
        let mut size = 0usize;
        // SAFETY: per this function's contract.
        unsafe {
            self.symbol::<GetSize>(size_fn)(prog, &mut size);
            let mut buf = vec![0u8; size];
            self.symbol::<GetBytes>(bytes_fn)(prog, buf.as_mut_ptr().cast());
            buf
        }
    }
}

/// Compiled CUBINs on disk, one file per (program source, options, NVRTC version, arch).
pub struct CubinCache {
    dir: PathBuf,
}

/// Whether [`CubinCache::get_or_compile`] compiled or read the CUBIN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Compiled,
    Cached,
}

impl CubinCache {
    pub fn new(dir: impl Into<PathBuf>) -> CubinCache {
        CubinCache { dir: dir.into() }
    }

    /// The file a CUBIN for these inputs lives in.
    pub fn path_for(
        &self,
        program: &Program,
        options: &[String],
        nvrtc_version: (i32, i32),
    ) -> PathBuf {
        let mut h = Fnv64::new();
        h.write(program.full_source().as_bytes());
        for o in options {
            h.write(&[0]);
            h.write(o.as_bytes());
        }
        h.write(format!("nvrtc {}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
        let stem = program.name.trim_end_matches(".cu");
        self.dir.join(format!("{stem}-{:016x}.cubin", h.finish()))
    }

    /// The CUBIN of `program` for `options` (which name the architecture): read from the
    /// cache, or compiled and stored (through a temporary file and a rename, so a concurrent
    /// or interrupted writer never leaves a partial CUBIN under the final name).
    pub fn get_or_compile(
        &self,
        nvrtc: &Nvrtc,
        program: &Program,
        options: &[String],
    ) -> Result<(Vec<u8>, CacheOutcome), NvrtcError> {
        let path = self.path_for(program, options, nvrtc.version());
        if let Ok(bytes) = std::fs::read(&path)
            && bytes.starts_with(ELF_MAGIC)
        {
            return Ok((bytes, CacheOutcome::Cached));
        }
        let compiled = nvrtc.compile(program, options)?;
        let io = |source| NvrtcError::Cache {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        // One name per writer, threads included: two threads of one process compiling the same
        // program shared the pid's name, and one could truncate the file the other had just
        // renamed into place while a reader loaded it.
        static WRITERS: AtomicU64 = AtomicU64::new(0);
        let writer = WRITERS.fetch_add(1, Ordering::Relaxed);
        let partial = path.with_extension(format!("partial-{}-{writer}", std::process::id()));
        let stored = std::fs::write(&partial, &compiled.cubin)
            .and_then(|()| std::fs::rename(&partial, &path));
        if let Err(error) = stored {
            // Not left behind in the user's cache: nothing would ever remove it.
            let _ = std::fs::remove_file(&partial);
            return Err(io(error));
        }
        Ok((compiled.cubin, CacheOutcome::Compiled))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The first bytes of every CUBIN (an ELF image).
pub const ELF_MAGIC: &[u8] = b"\x7fELF";

/// FNV-1a, 64 bits: a cache key that stays the same across Rust versions (std's hasher may
/// change between releases, which would orphan every cached CUBIN).
struct Fnv64(u64);

impl Fnv64 {
    fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
