//! What this host offers a CUDA backend, found without panicking: the NVIDIA driver
//! (`libcuda.so.1`, asked for its version and GPUs), NVRTC and cuBLAS. cudarc panics on the
//! first call into a library that is absent, so `--device` is decided from this report first,
//! and every missing piece becomes a one-line reason instead of a crash.
//!
//! Only the few driver entry points the report needs are declared here, by hand; everything
//! else will go through cudarc once a device has been found usable.

use std::ffi::{OsString, c_char, c_int};
use std::fmt;
use std::path::{Path, PathBuf};

use super::nvrtc::Nvrtc;

/// Where one CUDA library is looked for.
#[derive(Clone, Copy, Debug)]
pub struct LibrarySearch {
    /// What the library is, for messages ("NVIDIA driver", "NVRTC", "cuBLAS").
    pub what: &'static str,
    /// A path in this variable replaces the search: the library the operator named is used or
    /// reported broken, never silently swapped for another one found elsewhere.
    pub env: &'static str,
    /// Names for the dynamic loader (`LD_LIBRARY_PATH`, ld.so.cache), newest CUDA line first.
    pub sonames: &'static [&'static str],
    /// Folders, relative to a Python package root, where NVIDIA's PyPI wheels put the library
    /// (`nvidia/cu13/lib` for the CUDA 13 wheels, `nvidia/<name>/lib` for the `-cu12` ones).
    pub wheel_dirs: &'static [&'static str],
    /// What to install, for the message when nothing is found.
    pub install_hint: &'static str,
}

/// The NVIDIA driver's user-space library. It comes with the kernel driver, never from a wheel.
pub const DRIVER: LibrarySearch = LibrarySearch {
    what: "NVIDIA driver",
    env: "KVGATE_CUDA_DRIVER_LIB",
    sonames: &["libcuda.so.1"],
    wheel_dirs: &[],
    install_hint: "install the NVIDIA driver (it provides libcuda.so.1)",
};

/// NVRTC, which compiles the kernels at start-up.
pub const NVRTC: LibrarySearch = LibrarySearch {
    what: "NVRTC",
    env: "KVGATE_NVRTC_LIB",
    sonames: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    wheel_dirs: &["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"],
    install_hint: "install NVRTC, e.g. `pip install nvidia-cuda-nvrtc-cu12`, or set \
                   KVGATE_NVRTC_LIB or LD_LIBRARY_PATH",
};

/// cuBLAS, for the larger-batch matrix products.
pub const CUBLAS: LibrarySearch = LibrarySearch {
    what: "cuBLAS",
    env: "KVGATE_CUBLAS_LIB",
    sonames: &["libcublas.so.13", "libcublas.so.12"],
    wheel_dirs: &["nvidia/cu13/lib", "nvidia/cublas/lib"],
    install_hint: "install cuBLAS, e.g. `pip install nvidia-cublas-cu12`, or set \
                   KVGATE_CUBLAS_LIB or LD_LIBRARY_PATH",
};

impl LibrarySearch {
    /// The paths and names to try, in order: the environment variable's path alone if set,
    /// else the sonames, then wheel copies under this host's Python package roots.
    pub fn candidates(&self) -> Vec<PathBuf> {
        self.candidates_in(std::env::var_os(self.env), &python_package_roots())
    }

    /// [`Self::candidates`] with the variable's value and the package roots given.
    pub fn candidates_in(&self, env_value: Option<OsString>, roots: &[PathBuf]) -> Vec<PathBuf> {
        if let Some(path) = env_value.filter(|v| !v.is_empty()) {
            return vec![PathBuf::from(path)];
        }
        let mut candidates: Vec<PathBuf> = self.sonames.iter().map(PathBuf::from).collect();
        for root in roots {
            for dir in self.wheel_dirs {
                for soname in self.sonames {
                    let path = root.join(dir).join(soname);
                    // Only copies that exist: the error lists what was tried, and a list of
                    // every possible wheel path would bury the one useful line.
                    if path.is_file() && !candidates.contains(&path) {
                        candidates.push(path);
                    }
                }
            }
        }
        candidates
    }

    /// Opens the first candidate that loads.
    pub fn open(
        &self,
        candidates: &[PathBuf],
    ) -> Result<(libloading::Library, PathBuf), ProbeError> {
        let mut tried = Vec::new();
        for path in candidates {
            // SAFETY: the CUDA libraries run no initialisers with preconditions when loaded;
            // symbols are only called with their documented C signatures.
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => return Ok((lib, path.clone())),
                Err(e) => tried.push(load_error_text(path, &e)),
            }
        }
        Err(self.not_found(tried))
    }

    fn not_found(&self, tried: Vec<String>) -> ProbeError {
        ProbeError::NotFound {
            what: self.what,
            tried: tried.join("; "),
            hint: self.install_hint,
        }
    }
}

/// dlerror's text names the path already; anything else gets the path put in front.
fn load_error_text(path: &Path, error: &libloading::Error) -> String {
    let text = error.to_string();
    let shown = path.display().to_string();
    if text.contains(&shown) {
        text
    } else {
        format!("{shown}: {text}")
    }
}

/// Python package folders on this host where NVIDIA's wheels may be installed: `PYTHONPATH`,
/// the active virtual or conda environment, the user's site-packages and the system ones.
fn python_package_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = std::env::var_os("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("python3") {
                roots.push(entry.path().join("site-packages"));
                roots.push(entry.path().join("dist-packages"));
            }
        }
    }
    roots.retain(|root| root.is_dir());
    roots
}

/// Why a CUDA device cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("no {what} ({tried}); {hint}")]
    NotFound {
        what: &'static str,
        tried: String,
        hint: &'static str,
    },
    #[error("{path} is not a usable {what}: it lacks {symbol}")]
    MissingSymbol {
        what: &'static str,
        path: String,
        symbol: &'static str,
    },
    #[error("the NVIDIA driver ({path}) failed: {call} returned {code} ({})", cu_error_name(*.code))]
    DriverCall {
        path: String,
        call: &'static str,
        code: c_int,
    },
    #[error("the NVIDIA driver ({path}) sees no GPU")]
    NoGpu { path: String },
    #[error("cuda:{ordinal} does not exist: the NVIDIA driver sees {count} GPU(s), cuda:0 to cuda:{}", .count - 1)]
    NoSuchOrdinal { ordinal: usize, count: usize },
}

/// The names of the driver results a probe can meet (from cuda.h's `CUresult`).
fn cu_error_name(code: c_int) -> &'static str {
    match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "see cuda.h CUresult",
    }
}

/// One GPU as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for an H100/H200: the `sm_90` NVRTC compiles for.
    pub compute_capability: (i32, i32),
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(f, "cuda:{} {} (sm_{major}{minor})", self.ordinal, self.name)
    }
}

/// The driver library and what it reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Driver {
    pub path: PathBuf,
    /// The CUDA version the driver supports, e.g. (13, 0) for driver 580.
    pub cuda_version: (i32, i32),
    pub gpus: Vec<Gpu>,
}

/// A library that loaded and exports what kvgate calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundLibrary {
    pub path: PathBuf,
    /// (major, minor) where the library reports one (NVRTC does).
    pub version: Option<(i32, i32)>,
}

/// Everything the CUDA backend needs from the host, each piece found or the reason it is not.
#[derive(Clone, Debug)]
pub struct DeviceProbe {
    pub driver: Result<Driver, ProbeError>,
    pub nvrtc: Result<FoundLibrary, ProbeError>,
    pub cublas: Result<FoundLibrary, ProbeError>,
}

impl DeviceProbe {
    /// Probes this host, searching the usual places (see [`LibrarySearch::candidates`]).
    pub fn run() -> DeviceProbe {
        DeviceProbe::with_candidates(
            &DRIVER.candidates(),
            &NVRTC.candidates(),
            &CUBLAS.candidates(),
        )
    }

    /// Probes with the given candidate paths for each library.
    pub fn with_candidates(driver: &[PathBuf], nvrtc: &[PathBuf], cublas: &[PathBuf]) -> Self {
        DeviceProbe {
            driver: probe_driver(driver),
            nvrtc: probe_nvrtc(nvrtc),
            cublas: probe_cublas(cublas),
        }
    }

    /// GPU `ordinal`, if it and every library the backend needs are usable; else the first
    /// thing missing, in the order an operator would fix them (driver, GPU, NVRTC, cuBLAS).
    pub fn usable_gpu(&self, ordinal: usize) -> Result<&Gpu, ProbeError> {
        let driver = self.driver.as_ref().map_err(Clone::clone)?;
        let gpu = match driver.gpus.get(ordinal) {
            Some(gpu) => gpu,
            None if driver.gpus.is_empty() => {
                return Err(ProbeError::NoGpu {
                    path: driver.path.display().to_string(),
                });
            }
            None => {
                return Err(ProbeError::NoSuchOrdinal {
                    ordinal,
                    count: driver.gpus.len(),
                });
            }
        };
        self.nvrtc.as_ref().map_err(Clone::clone)?;
        self.cublas.as_ref().map_err(Clone::clone)?;
        Ok(gpu)
    }
}

type CuInit = unsafe extern "C" fn(flags: u32) -> c_int;
type CuDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(device: *mut c_int, ordinal: c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(name: *mut c_char, len: c_int, device: c_int) -> c_int;
type CuDeviceGetAttribute =
    unsafe extern "C" fn(value: *mut c_int, attribute: c_int, device: c_int) -> c_int;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR`. Asked through
/// cuDeviceGetAttribute rather than the deprecated cuDeviceComputeCapability, which CUDA 13
/// dropped from its headers.
const CC_MAJOR: c_int = 75;
const CC_MINOR: c_int = 76;

/// Loads the driver, initialises it and lists its GPUs.
fn probe_driver(candidates: &[PathBuf]) -> Result<Driver, ProbeError> {
    let (lib, path) = DRIVER.open(candidates)?;
    let shown = path.display().to_string();
    let symbol = |name: &'static str| -> Result<*const (), ProbeError> {
        // SAFETY: only looked up here; each is cast to its cuda.h signature below.
        unsafe { lib.get::<*const ()>(format!("{name}\0").as_bytes()) }
            .map(|s| *s)
            .map_err(|_| ProbeError::MissingSymbol {
                what: DRIVER.what,
                path: shown.clone(),
                symbol: name,
            })
    };
    let call = |name: &'static str, code: c_int| -> Result<(), ProbeError> {
        match code {
            0 => Ok(()),
            code => Err(ProbeError::DriverCall {
                path: shown.clone(),
                call: name,
                code,
            }),
        }
    };
    // SAFETY: each pointer is the named driver function, cast to its signature from cuda.h;
    // every out-pointer is a live local and the name buffer's length is passed with it.
    unsafe {
        let init: CuInit = std::mem::transmute(symbol("cuInit")?);
        let driver_version: CuDriverGetVersion = std::mem::transmute(symbol("cuDriverGetVersion")?);
        let device_count: CuDeviceGetCount = std::mem::transmute(symbol("cuDeviceGetCount")?);
        let device_get: CuDeviceGet = std::mem::transmute(symbol("cuDeviceGet")?);
        let device_name: CuDeviceGetName = std::mem::transmute(symbol("cuDeviceGetName")?);
        let attribute: CuDeviceGetAttribute = std::mem::transmute(symbol("cuDeviceGetAttribute")?);

        let mut version = 0;
        call("cuDriverGetVersion", driver_version(&mut version))?;
        let cuda_version = (version / 1000, (version % 1000) / 10);
        match init(0) {
            0 => {}
            // A driver without a GPU (or with its GPUs hidden): a fact, not a failure.
            100 => {
                return Ok(Driver {
                    path,
                    cuda_version,
                    gpus: Vec::new(),
                });
            }
            code => call("cuInit", code)?,
        }
        let mut count = 0;
        call("cuDeviceGetCount", device_count(&mut count))?;
        let mut gpus = Vec::new();
        for ordinal in 0..count.max(0) {
            let mut device = 0;
            call("cuDeviceGet", device_get(&mut device, ordinal))?;
            let mut name = [0 as c_char; 256];
            call(
                "cuDeviceGetName",
                device_name(name.as_mut_ptr(), name.len() as c_int, device),
            )?;
            let (mut major, mut minor) = (0, 0);
            call(
                "cuDeviceGetAttribute",
                attribute(&mut major, CC_MAJOR, device),
            )?;
            call(
                "cuDeviceGetAttribute",
                attribute(&mut minor, CC_MINOR, device),
            )?;
            let bytes: Vec<u8> = name
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            gpus.push(Gpu {
                ordinal: ordinal as usize,
                name: String::from_utf8_lossy(&bytes).into_owned(),
                compute_capability: (major, minor),
            });
        }
        Ok(Driver {
            path,
            cuda_version,
            gpus,
        })
    }
}

/// NVRTC through the compiler's own loader, so the probe and the compile find the same library.
fn probe_nvrtc(candidates: &[PathBuf]) -> Result<FoundLibrary, ProbeError> {
    let nvrtc = Nvrtc::open_first(candidates.to_vec()).map_err(|e| ProbeError::NotFound {
        what: NVRTC.what,
        tried: match e {
            super::nvrtc::NvrtcError::NotFound(tried) => tried,
            other => other.to_string(),
        },
        hint: NVRTC.install_hint,
    })?;
    Ok(FoundLibrary {
        path: PathBuf::from(nvrtc.path()),
        version: Some(nvrtc.version()),
    })
}

/// cuBLAS: present and exporting the handle constructor the backend starts with.
fn probe_cublas(candidates: &[PathBuf]) -> Result<FoundLibrary, ProbeError> {
    let (lib, path) = CUBLAS.open(candidates)?;
    // SAFETY: only the symbol's presence is checked; it is not called.
    unsafe { lib.get::<*const ()>(b"cublasCreate_v2\0") }.map_err(|_| {
        ProbeError::MissingSymbol {
            what: CUBLAS.what,
            path: path.display().to_string(),
            symbol: "cublasCreate_v2",
        }
    })?;
    Ok(FoundLibrary {
        path,
        version: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty dir, removed with all in it when the guard drops (on a panic too).
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("kvgate-probe-{name}-"))
            .tempdir()
            .expect("scratch dir")
    }

    #[test]
    fn a_driver_path_that_does_not_exist_is_named_with_how_to_fix_it() {
        let missing = PathBuf::from("/nonexistent/libcuda.so.1");
        let probe = DeviceProbe::with_candidates(
            std::slice::from_ref(&missing),
            &[PathBuf::from("/nonexistent/libnvrtc.so.12")],
            &[PathBuf::from("/nonexistent/libcublas.so.12")],
        );
        let err = probe.usable_gpu(0).expect_err("no driver there");
        let text = err.to_string();
        assert!(
            text.starts_with("no NVIDIA driver (/nonexistent/libcuda.so.1"),
            "{text}"
        );
        assert!(text.contains("install the NVIDIA driver"), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        assert!(matches!(
            probe.nvrtc,
            Err(ProbeError::NotFound { what: "NVRTC", .. })
        ));
        assert!(
            matches!(&probe.cublas, Err(ProbeError::NotFound { what: "cuBLAS", tried, .. })
                if tried.contains("/nonexistent/libcublas.so.12")),
            "{:?}",
            probe.cublas
        );
    }

    #[test]
    fn a_file_that_is_not_a_shared_library_is_refused_not_loaded() {
        let dir = scratch("not-elf");
        let fake = dir.path().join("libcuda.so.1");
        std::fs::write(&fake, b"this is not an ELF shared object\n").unwrap();
        let err = probe_driver(std::slice::from_ref(&fake)).expect_err("not a library");
        match &err {
            ProbeError::NotFound { what, tried, .. } => {
                assert_eq!(*what, "NVIDIA driver");
                assert!(tried.contains(&fake.display().to_string()), "{tried}");
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
        let cublas = probe_cublas(std::slice::from_ref(&fake)).expect_err("not a library");
        assert!(matches!(
            cublas,
            ProbeError::NotFound { what: "cuBLAS", .. }
        ));
    }

    #[test]
    fn a_shared_library_without_the_driver_entry_points_is_not_a_driver() {
        // libc loads everywhere but exports no cuInit: found, but not usable.
        let libc = PathBuf::from("libc.so.6");
        let err = probe_driver(std::slice::from_ref(&libc)).expect_err("libc is no driver");
        assert_eq!(
            err,
            ProbeError::MissingSymbol {
                what: "NVIDIA driver",
                path: "libc.so.6".into(),
                symbol: "cuInit",
            }
        );
        assert_eq!(
            err.to_string(),
            "libc.so.6 is not a usable NVIDIA driver: it lacks cuInit"
        );
        let cublas = probe_cublas(&[libc]).expect_err("libc is no cuBLAS");
        assert!(matches!(
            cublas,
            ProbeError::MissingSymbol {
                symbol: "cublasCreate_v2",
                ..
            }
        ));
    }

    #[test]
    fn the_first_candidate_that_loads_wins_and_failures_before_it_are_forgotten() {
        let (_, path) = DRIVER
            .open(&[
                PathBuf::from("/nonexistent/libc.so.6"),
                PathBuf::from("libc.so.6"),
            ])
            .expect("libc loads");
        assert_eq!(path, PathBuf::from("libc.so.6"));
    }

    #[test]
    fn wheel_layouts_are_searched_after_the_loader_and_the_variable_replaces_both() {
        let tmp = scratch("wheels");
        let root = tmp.path();
        let cu12 = root.join("nvidia/cublas/lib");
        let cu13 = root.join("nvidia/cu13/lib");
        std::fs::create_dir_all(&cu12).unwrap();
        std::fs::create_dir_all(&cu13).unwrap();
        std::fs::write(cu12.join("libcublas.so.12"), b"").unwrap();
        std::fs::write(cu13.join("libcublas.so.13"), b"").unwrap();
        let roots = [root.to_path_buf(), root.join("absent")];
        let found = CUBLAS.candidates_in(None, &roots);
        assert_eq!(
            found,
            vec![
                PathBuf::from("libcublas.so.13"),
                PathBuf::from("libcublas.so.12"),
                cu13.join("libcublas.so.13"),
                cu12.join("libcublas.so.12"),
            ]
        );
        let pinned = CUBLAS.candidates_in(Some("/opt/x/libcublas.so.12".into()), &roots);
        assert_eq!(pinned, vec![PathBuf::from("/opt/x/libcublas.so.12")]);
        let empty = CUBLAS.candidates_in(Some("".into()), &[]);
        assert_eq!(empty.len(), 2, "an empty variable is unset: {empty:?}");
        assert_eq!(
            DRIVER.candidates_in(None, &roots),
            vec![PathBuf::from("libcuda.so.1")]
        );
    }

    #[test]
    fn usable_gpu_names_the_first_missing_piece_in_fixing_order() {
        let driver = |gpus: Vec<Gpu>| {
            Ok(Driver {
                path: "libcuda.so.1".into(),
                cuda_version: (13, 0),
                gpus,
            })
        };
        let h200 = Gpu {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
        };
        let lib = |p: &str| {
            Ok(FoundLibrary {
                path: p.into(),
                version: None,
            })
        };
        let missing = |what| ProbeError::NotFound {
            what,
            tried: "x".into(),
            hint: "y",
        };
        let all = DeviceProbe {
            driver: driver(vec![h200.clone()]),
            nvrtc: lib("libnvrtc.so.13"),
            cublas: lib("libcublas.so.13"),
        };
        assert_eq!(all.usable_gpu(0), Ok(&h200));
        assert_eq!(h200.to_string(), "cuda:0 NVIDIA H200 (sm_90)");
        assert_eq!(
            all.usable_gpu(2).unwrap_err().to_string(),
            "cuda:2 does not exist: the NVIDIA driver sees 1 GPU(s), cuda:0 to cuda:0"
        );
        let no_gpu = DeviceProbe {
            driver: driver(Vec::new()),
            nvrtc: Err(missing("NVRTC")),
            ..all.clone()
        };
        assert_eq!(
            no_gpu.usable_gpu(0).unwrap_err().to_string(),
            "the NVIDIA driver (libcuda.so.1) sees no GPU"
        );
        let no_nvrtc = DeviceProbe {
            nvrtc: Err(missing("NVRTC")),
            cublas: Err(missing("cuBLAS")),
            ..all.clone()
        };
        assert_eq!(no_nvrtc.usable_gpu(0), Err(missing("NVRTC")));
        let no_cublas = DeviceProbe {
            cublas: Err(missing("cuBLAS")),
            ..all
        };
        assert_eq!(no_cublas.usable_gpu(0), Err(missing("cuBLAS")));
    }

    #[test]
    fn driver_errors_carry_the_cuda_result_name() {
        let err = ProbeError::DriverCall {
            path: "libcuda.so.1".into(),
            call: "cuInit",
            code: 34,
        };
        assert_eq!(
            err.to_string(),
            "the NVIDIA driver (libcuda.so.1) failed: cuInit returned 34 (CUDA_ERROR_STUB_LIBRARY)"
        );
    }
}
