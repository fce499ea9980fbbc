//! The `kvgate` binary as a user runs it: a child process with its own working directory, its
//! stderr read line by line (a pipe, as under systemd or `2> file`), stopped with SIGTERM.
//!
//! The environment is inherited, so `KVGATE_CACHE_DIR` (where the tests' model is) reaches the
//! child, as it reaches a user's shell.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::ops::Deref;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// Longest wait for "kvgate ready" (the model loads first; the machine may be busy).
const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// The binary cargo built for this test run.
pub fn kvgate() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    command.stdin(Stdio::null());
    command
}

/// Runs `kvgate ARGS` in `cwd` to completion.
pub fn run(args: &[&str], cwd: &Path) -> Output {
    kvgate()
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("kvgate runs")
}

/// The stderr of a failed command: exactly one line, `kvgate: error: ...`, returned.
pub fn one_error_line(output: &std::process::Output) -> String {
    assert!(!output.status.success(), "expected a failure");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr, got:\n{stderr}");
    let line = lines[0];
    assert!(line.starts_with("kvgate: error: "), "{line}");
    line.to_owned()
}

/// A fresh empty directory outside the repository (a user's home, say), from [`scratch_dir`].
/// It is removed with all in it, whatever the test and the `kvgate` processes it started wrote
/// there, when it drops (on a panic too), so a test run leaves nothing in the temp dir: keep it
/// as long as something uses it. Derefs to its path.
pub struct ScratchDir(tempfile::TempDir);

impl Deref for ScratchDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

/// A new [`ScratchDir`] named `kvgate-NAME-XXXXXX` in the system temp dir.
pub fn scratch_dir(name: &str) -> ScratchDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("kvgate-{name}-"))
        .tempdir()
        .expect("scratch dir");
    ScratchDir(dir)
}

/// A running `kvgate serve`.
pub struct Served {
    child: Child,
    /// The address from the "kvgate ready" log line.
    pub addr: SocketAddr,
    /// stderr lines up to and including "kvgate ready".
    pub log: Vec<String>,
    lines: Receiver<String>,
    /// The working directory [`serve_in_scratch`] made, removed after the server is stopped.
    home: Option<ScratchDir>,
}

/// [`serve`] in a new [`scratch_dir`] that is removed once the server is dropped.
pub fn serve_in_scratch(name: &str, args: &[&str]) -> Served {
    let home = scratch_dir(name);
    let mut served = serve(args, &home);
    served.home = Some(home);
    served
}

/// Starts `kvgate serve ARGS` in `cwd` and waits for its "kvgate ready listen=ADDR" line.
pub fn serve(args: &[&str], cwd: &Path) -> Served {
    let mut child = kvgate()
        .arg("serve")
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvgate serve starts");
    let stderr = child.stderr.take().expect("piped stderr");
    let (sender, lines) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut log = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let ready = ready_addr(&line);
                log.push(line);
                if let Some(addr) = ready {
                    return Served {
                        child,
                        addr,
                        log,
                        lines,
                        home: None,
                    };
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!(
                    "no \"kvgate ready\" within {READY_TIMEOUT:?}; log:\n{}",
                    log.join("\n")
                );
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = child.wait().expect("wait");
                panic!(
                    "kvgate serve exited ({status}) before ready; log:\n{}",
                    log.join("\n")
                );
            }
        }
    }
}

/// `ADDR` of a "kvgate ready ... listen=ADDR ..." line.
pub fn ready_addr(line: &str) -> Option<SocketAddr> {
    if !line.contains("kvgate ready") {
        return None;
    }
    let value = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix("listen="))?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("unparsable listen= in {line:?}")),
    )
}

impl Served {
    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `SIG<name>` (`"TERM"`, `"INT"`) to the server.
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        // The shell's builtin `kill`: no libc binding needed, and no procps package either.
        let sent = Command::new("sh")
            .args(["-c", &format!("kill -{name} {pid}")])
            .status()
            .expect("sh runs");
        assert!(sent.success(), "SIG{name} to {pid}");
    }

    /// Reads stderr until a line containing `text` (returned), or `None` after `limit` or
    /// at EOF; the lines read are kept in `log`.
    pub fn wait_for_line(&mut self, text: &str, limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            self.log.push(line.clone());
            if line.contains(text) {
                return Some(line);
            }
        }
    }

    /// Waits up to `limit` for the server to exit by itself: its status, or `None` if it is
    /// still running (it is killed when this drops).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then the exit status and the rest of stderr.
    pub fn stop(mut self) -> (ExitStatus, Vec<String>) {
        self.signal("TERM");
        let status = self.child.wait().expect("wait");
        // The reader thread ends at EOF, which the exit brings.
        let rest = self.lines.iter().collect();
        (status, rest)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // A failed test must not leave a server behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
