//! CI's compile check, no GPU needed: NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel that
//! `scripts/test.sh` installs, or `KVGATE_NVRTC_LIB`) compiles every program to a CUBIN for
//! sm_80 and sm_90 with ptxas' verbose report; any error, any warning and any register spill
//! fails. Without NVRTC the check is skipped, which `KVGATE_REQUIRE_NVRTC=1` (set by `.ci/run`)
//! turns into a failure.

use super::nvrtc::{CacheOutcome, CubinCache, ELF_MAGIC, Nvrtc, NvrtcError};
use super::{PROGRAMS, nvrtc_options};
use std::path::PathBuf;

/// NVRTC as the tests find it: `KVGATE_NVRTC_LIB`, the wheel `scripts/test.sh` installs in
/// `.cache/kvgate/nvrtc`, then the system's library. `None` means skip, which
/// `KVGATE_REQUIRE_NVRTC=1` turns into a failure.
fn nvrtc_for_tests() -> Option<Nvrtc> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("KVGATE_NVRTC_LIB")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/kvgate/nvrtc/lib");
    if let Ok(entries) = std::fs::read_dir(&venv) {
        for entry in entries.flatten() {
            let lib = "site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12";
            candidates.push(entry.path().join(lib));
        }
    }
    candidates.extend(["libnvrtc.so.13", "libnvrtc.so.12"].map(PathBuf::from));
    match Nvrtc::open_first(candidates) {
        Ok(nvrtc) => Some(nvrtc),
        Err(e) => {
            assert!(
                std::env::var("KVGATE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "KVGATE_REQUIRE_NVRTC=1 but: {e}"
            );
            eprintln!("skipped: {e}");
            None
        }
    }
}

const ARCHS: &[&str] = &["sm_80", "sm_90"];

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
    let Some(nvrtc) = nvrtc_for_tests() else {
        return;
    };
    let (major, minor) = nvrtc.version();
    eprintln!("NVRTC {major}.{minor} from {}", nvrtc.path());
    let mut failures = Vec::new();
    for program in PROGRAMS {
        for arch in ARCHS {
            let compiled = match nvrtc.compile(program, &nvrtc_options(arch)) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{arch}: {e}"));
                    continue;
                }
            };
            let bad = problems(&compiled.log);
            if !bad.is_empty() {
                failures.push(format!("{} {arch}: {}", program.name, bad.join("\n")));
            }
            if !compiled.cubin.starts_with(ELF_MAGIC) {
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

#[test]
fn cubins_are_cached_per_architecture_and_reused() {
    let Some(nvrtc) = nvrtc_for_tests() else {
        return;
    };
    // Removed with its entries when the test ends, failed or not.
    let dir = tempfile::Builder::new()
        .prefix("kvgate-cubin-cache-")
        .tempdir()
        .expect("temp dir");
    let cache = CubinCache::new(dir.path());
    let program = &PROGRAMS[0];
    let (sm80, sm90) = (nvrtc_options("sm_80"), nvrtc_options("sm_90"));
    let (first, outcome) = cache
        .get_or_compile(&nvrtc, program, &sm80)
        .expect("compiles");
    assert_eq!(outcome, CacheOutcome::Compiled);
    let (again, outcome) = cache
        .get_or_compile(&nvrtc, program, &sm80)
        .expect("cached");
    assert_eq!(outcome, CacheOutcome::Cached);
    assert_eq!(first, again);
    let (other, outcome) = cache
        .get_or_compile(&nvrtc, program, &sm90)
        .expect("compiles");
    assert_eq!(
        outcome,
        CacheOutcome::Compiled,
        "another architecture is another entry"
    );
    assert_ne!(first, other);
    // A damaged entry is recompiled, not loaded.
    let path = cache.path_for(program, &sm80, nvrtc.version());
    std::fs::write(&path, b"garbage").expect("damage the entry");
    let (fixed, outcome) = cache
        .get_or_compile(&nvrtc, program, &sm80)
        .expect("recompiles");
    assert_eq!((fixed, outcome), (first, CacheOutcome::Compiled));
    // An entry that cannot be stored (a directory holds its name) is an error, and its
    // temporary file is not left in the cache.
    let sm75 = nvrtc_options("sm_75");
    std::fs::create_dir(cache.path_for(program, &sm75, nvrtc.version())).expect("block it");
    let blocked = cache.get_or_compile(&nvrtc, program, &sm75);
    assert!(
        matches!(blocked, Err(NvrtcError::Cache { .. })),
        "{blocked:?}"
    );
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list the cache")
        .map(|entry| entry.expect("entry").path())
        .collect();
    assert_eq!(
        entries.len(),
        3,
        "two CUBINs and the blocking dir: {entries:?}"
    );
    let partial = |path: &&PathBuf| path.to_string_lossy().contains("partial");
    assert_eq!(entries.iter().find(partial), None, "{entries:?}");
}

#[test]
fn a_missing_library_is_an_error_naming_what_was_tried() {
    let err = Nvrtc::open_first(vec![PathBuf::from("/nonexistent/libnvrtc.so.12")])
        .err()
        .expect("no library there");
    assert!(matches!(err, NvrtcError::NotFound(_)));
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/libnvrtc.so.12") && msg.contains("KVGATE_NVRTC_LIB"),
        "{msg}"
    );
}
