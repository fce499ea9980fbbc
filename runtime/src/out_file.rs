//! Writing a whole output file (`kvgate synth-model`, `kvgate quantize`) so that a reader never
//! sees a half-written one: the bytes go to a temporary file next to it, which is renamed over
//! the output when complete and removed on any error.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Refuses an output path that exists and is not a regular file. The rename at the end would
/// replace it: `/dev/null` or a FIFO given as the output became a regular file (as root, that
/// destroyed /dev/null), and a directory left a temporary file behind.
pub fn check_output(out: &Path) -> io::Result<()> {
    match fs::metadata(out) {
        Ok(meta) if !meta.is_file() => Err(io::Error::other(
            "exists and is not a regular file; name a file to write",
        )),
        _ => Ok(()),
    }
}

/// Writes `out` through a temporary file `OUT.partial.PID.N` that no other writer uses (two
/// runs writing the same output once shared `OUT.partial` and interleaved their bytes, and
/// both reported success), renamed over `out` once `write` and a sync succeed. On any error
/// the temporary file is removed.
pub fn write_via_partial(
    out: &Path,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    check_output(out)?;
    let (partial, mut file) = create_partial(out)?;
    let result = write(&mut file)
        .and_then(|()| file.sync_all())
        .and_then(|()| {
            drop(file);
            fs::rename(&partial, out)
        });
    if result.is_err() {
        let _ = fs::remove_file(&partial);
    }
    result
}

/// A new file `OUT.partial.PID.N`: the process id tells processes apart, the counter writers
/// within one process, and `create_new` skips a name a crashed run left behind.
fn create_partial(out: &Path) -> io::Result<(PathBuf, File)> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    loop {
        let mut name = out.as_os_str().to_owned();
        name.push(format!(
            ".partial.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let partial = PathBuf::from(name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&partial)
        {
            Ok(file) => return Ok((partial, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty dir, removed with all in it when the guard drops (on a panic too).
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("kvgate-out-file-{name}-"))
            .tempdir()
            .expect("scratch dir")
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("lists")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn writes_the_whole_file_and_leaves_no_temporary_file() {
        let tmp = scratch("ok");
        let dir = tmp.path();
        let out = dir.join("m.gguf");
        fs::write(&out, b"old").expect("old file");
        write_via_partial(&out, |f| io::Write::write_all(f, b"new")).expect("writes");
        assert_eq!(fs::read(&out).expect("reads"), b"new");
        assert_eq!(entries(dir), ["m.gguf"]);
    }

    #[test]
    fn an_output_that_is_not_a_regular_file_is_refused_and_left_alone() {
        let tmp = scratch("not-file");
        let dir = tmp.path();
        let sub = dir.join("sub");
        fs::create_dir(&sub).expect("subdir");
        for out in [Path::new("/dev/null"), &sub] {
            let err = write_via_partial(out, |_| Ok(())).expect_err("refused");
            assert_eq!(
                err.to_string(),
                "exists and is not a regular file; name a file to write"
            );
        }
        let null = fs::metadata("/dev/null").expect("still there");
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(
            &null.file_type()
        ));
        assert_eq!(entries(dir), ["sub"], "no temporary file left");
    }

    #[test]
    fn a_failed_write_removes_its_temporary_file_and_keeps_the_old_output() {
        let tmp = scratch("fails");
        let dir = tmp.path();
        let out = dir.join("m.gguf");
        fs::write(&out, b"old").expect("old file");
        let err = write_via_partial(&out, |_| Err(io::Error::other("disk full"))).unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(fs::read(&out).expect("reads"), b"old");
        assert_eq!(entries(dir), ["m.gguf"]);
    }

    #[test]
    fn concurrent_writers_of_one_output_use_different_temporary_files() {
        let tmp = scratch("race");
        let dir = tmp.path();
        let out = dir.join("m.gguf");
        // Each writer sees only its own bytes in its temporary file, whatever the interleaving.
        std::thread::scope(|s| {
            for byte in [b'a', b'b'] {
                let out = &out;
                s.spawn(move || {
                    write_via_partial(out, |f| {
                        for _ in 0..64 {
                            io::Write::write_all(f, &[byte; 1024])?;
                            std::thread::yield_now();
                        }
                        Ok(())
                    })
                    .expect("writes")
                });
            }
        });
        let bytes = fs::read(&out).expect("reads");
        assert_eq!(bytes.len(), 64 * 1024);
        assert!(
            bytes.iter().all(|&b| b == bytes[0]),
            "one writer's bytes only"
        );
        assert_eq!(entries(dir), ["m.gguf"]);
    }
}
