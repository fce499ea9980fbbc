//! CI's compile check, no GPU needed: NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel that
//! `scripts/test.sh` installs, or `KVGATE_NVRTC_LIB`) compiles every program to a CUBIN for
//! sm_80 and sm_90 with ptxas' verbose report; any error, any warning and any register spill
//! fails. Without NVRTC the check is skipped, which `KVGATE_REQUIRE_NVRTC=1` (set by `.ci/run`)
//! turns into a failure.

use super::{PROGRAMS, nvrtc_options};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::PathBuf;

const ARCHS: &[&str] = &["sm_80", "sm_90"];

type Program = *mut c_void;
type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetBytes = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// libnvrtc, opened by path (the wheel's copy is not on the loader's search path).
struct Nvrtc {
    lib: libloading::Library,
    path: String,
}

/// What one compile produced.
struct Compiled {
    log: String,
    cubin: Vec<u8>,
}

impl Nvrtc {
    /// `KVGATE_NVRTC_LIB`, else the wheel in `.cache/kvgate/nvrtc` (scripts/test.sh), else
    /// the system's libnvrtc.
    fn open() -> Result<Nvrtc, String> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(path) = std::env::var_os("KVGATE_NVRTC_LIB") {
            candidates.push(path.into());
        }
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/kvgate/nvrtc/lib");
        if let Ok(entries) = std::fs::read_dir(&venv) {
            for entry in entries.flatten() {
                candidates.push(
                    entry
                        .path()
                        .join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"),
                );
            }
        }
        candidates.extend(["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"].map(PathBuf::from));
        let mut tried = Vec::new();
        for path in candidates {
            // SAFETY: loading libnvrtc runs no initialisers with preconditions; symbols are
            // looked up with their documented C signatures below.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => {
                    return Ok(Nvrtc {
                        lib,
                        path: path.display().to_string(),
                    });
                }
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(tried.join("; "))
    }

    fn symbol<T: Copy>(&self, name: &[u8]) -> T {
        // SAFETY: each call site names the NVRTC function whose C signature `T` is.
        unsafe {
            *self
                .lib
                .get::<T>(name)
                .unwrap_or_else(|e| panic!("{}: {e}", self.path))
        }
    }

    fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        unsafe { self.symbol::<Version>(b"nvrtcVersion\0")(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles `source` with `options`: Ok with the log and CUBIN, or Err with the log.
    fn compile(&self, name: &str, source: &str, options: &[String]) -> Result<Compiled, String> {
        let src = CString::new(source).expect("sources contain no NUL");
        let cname = CString::new(name).expect("names contain no NUL");
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).expect("options contain no NUL"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string or array of them for the call;
        // the program handle is destroyed before returning.
        unsafe {
            let rc = self.symbol::<CreateProgram>(b"nvrtcCreateProgram\0")(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            assert_eq!(rc, 0, "nvrtcCreateProgram failed ({rc})");
            let rc = self.symbol::<CompileProgram>(b"nvrtcCompileProgram\0")(
                prog,
                opt_ptrs.len() as c_int,
                opt_ptrs.as_ptr(),
            );
            let log = self.read(prog, b"nvrtcGetProgramLogSize\0", b"nvrtcGetProgramLog\0");
            let log = CStr::from_bytes_until_nul(&log)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let result = if rc == 0 {
                let cubin = self.read(prog, b"nvrtcGetCUBINSize\0", b"nvrtcGetCUBIN\0");
                Ok(Compiled { log, cubin })
            } else {
                Err(format!("nvrtcCompileProgram returned {rc}:\n{log}"))
            };
            self.symbol::<DestroyProgram>(b"nvrtcDestroyProgram\0")(&mut prog);
            result
        }
    }

    /// # Safety
    /// `prog` must be a live, compiled program; the symbols a (size, bytes) getter pair.
    unsafe fn read(&self, prog: Program, size_fn: &[u8], bytes_fn: &[u8]) -> Vec<u8> {
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

/// ptxas' verdict on one kernel.
#[derive(Debug, PartialEq, Eq)]
struct EntryReport {
    name: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
}

/// The per-kernel reports in a `--ptxas-options=--verbose` log, in order.
fn parse_ptxas_log(log: &str) -> Vec<EntryReport> {
    let mut out: Vec<EntryReport> = Vec::new();
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let end = line.find(what)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(EntryReport {
                name,
                registers: 0,
                spill_stores: u32::MAX,
                spill_loads: u32::MAX,
            });
        } else if let Some(entry) = out.last_mut() {
            if let (Some(stores), Some(loads)) = (
                number_before(line, "bytes spill stores"),
                number_before(line, "bytes spill loads"),
            ) {
                entry.spill_stores = stores;
                entry.spill_loads = loads;
            }
            if let Some(regs) = number_before(line, "registers") {
                entry.registers = regs;
            }
        }
    }
    out
}

/// Lines that report a problem: NVRTC's front-end warnings and errors, ptxas' warnings.
fn problems(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("warning") || l.contains("error")
        })
        .collect()
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_warnings_or_spills() {
    let nvrtc = match Nvrtc::open() {
        Ok(nvrtc) => nvrtc,
        Err(tried) => {
            assert!(
                std::env::var("KVGATE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "KVGATE_REQUIRE_NVRTC=1 but libnvrtc was not found (tried {tried})"
            );
            eprintln!("skipped: libnvrtc not found (set KVGATE_NVRTC_LIB); tried {tried}");
            return;
        }
    };
    let (major, minor) = nvrtc.version();
    eprintln!("NVRTC {major}.{minor} from {}", nvrtc.path);
    let mut failures = Vec::new();
    for program in PROGRAMS {
        for arch in ARCHS {
            let compiled =
                match nvrtc.compile(program.name, &program.full_source(), &nvrtc_options(arch)) {
                    Ok(c) => c,
                    Err(log) => {
                        failures.push(format!("{} {arch}: {log}", program.name));
                        continue;
                    }
                };
            let bad = problems(&compiled.log);
            if !bad.is_empty() {
                failures.push(format!("{} {arch}: {}", program.name, bad.join("\n")));
            }
            if !compiled.cubin.starts_with(b"\x7fELF") {
                failures.push(format!("{} {arch}: output is not a CUBIN", program.name));
            }
            let reports = parse_ptxas_log(&compiled.log);
            let mut names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
            names.sort_unstable();
            let mut expected = program.kernels.to_vec();
            expected.sort_unstable();
            if names != expected {
                failures.push(format!(
                    "{} {arch}: ptxas compiled {names:?}, the registry lists {expected:?}",
                    program.name
                ));
            }
            for r in &reports {
                eprintln!(
                    "{arch} {:<24} {:>3} registers, spills {}/{}",
                    r.name, r.registers, r.spill_stores, r.spill_loads
                );
                if r.spill_stores != 0 || r.spill_loads != 0 {
                    failures.push(format!(
                        "{} {arch}: {} spills ({} bytes stored, {} loaded)",
                        program.name, r.name, r.spill_stores, r.spill_loads
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn ptxas_report_parser_reads_registers_and_spills() {
    let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'matvec_q4_0' for 'sm_90'
ptxas info    : Function properties for matvec_q4_0
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
ptxas         .     24 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 64 bytes smem
";
    let reports = parse_ptxas_log(log);
    assert_eq!(
        reports,
        vec![
            EntryReport {
                name: "matvec_q4_0".into(),
                registers: 40,
                spill_stores: 0,
                spill_loads: 0,
            },
            EntryReport {
                name: "big".into(),
                registers: 255,
                spill_stores: 24,
                spill_loads: 16,
            },
        ]
    );
    // An entry whose spill line is missing counts as spilling, never as clean.
    let truncated = parse_ptxas_log("ptxas info    : Compiling entry function 'x' for 'sm_80'\n");
    assert_eq!(truncated[0].spill_stores, u32::MAX);
    assert_eq!(
        problems("a.cu(3): warning #177-D: unused\nok\n"),
        ["a.cu(3): warning #177-D: unused"]
    );
}
