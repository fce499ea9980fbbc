//! The command line the proxy benchmark's helper programs share (`stub_upstream`,
//! `bare_proxy`, `raw_proxy`): `PROGRAM ADDR... [WORKER_THREADS]`, each mistake named on one
//! line before the usage, and the program's future run on a tokio runtime of that many worker
//! threads. Included by each with `#[path]`: examples cannot share a library of their own.

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

/// One helper program's name and usage line.
pub struct BenchCli {
    pub program: &'static str,
    pub usage: &'static str,
}

impl BenchCli {
    /// Prints the usage line and exits with 2.
    pub fn usage(&self) -> ! {
        eprintln!("usage: {}", self.usage);
        std::process::exit(2)
    }

    /// The address argument named `what`, or the usage.
    pub fn addr(&self, text: Option<String>, what: &str) -> SocketAddr {
        match text.map(|text| text.parse::<SocketAddr>()) {
            Some(Ok(addr)) => addr,
            Some(Err(error)) => {
                eprintln!("{}: {what}: {error}", self.program);
                self.usage()
            }
            None => self.usage(),
        }
    }

    /// Listens on `listen` and hands each connection (`TCP_NODELAY` set: small answers on
    /// kept-alive connections go out at once) to a task of its own running `connection`.
    pub async fn accept_each<F, C>(&self, listen: SocketAddr, connection: F) -> std::io::Result<()>
    where
        F: Fn(TcpStream) -> C,
        C: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind(listen).await?;
        println!("{} listening on {}", self.program, listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            tokio::spawn(connection(stream));
        }
    }

    /// Runs `serve` on a multi-thread runtime of `threads` (the WORKER_THREADS argument)
    /// worker threads, or `default` when it is absent (`None`: tokio's own, one per core).
    /// Exits with 1 if the runtime cannot start or `serve` fails, naming `what` it served.
    pub fn run<F>(
        &self,
        threads: Option<String>,
        default: Option<usize>,
        what: impl Display,
        serve: F,
    ) where
        F: Future<Output = std::io::Result<()>>,
    {
        let mut runtime = tokio::runtime::Builder::new_multi_thread();
        match threads.map(|text| text.parse::<usize>()) {
            Some(Ok(threads)) if threads > 0 => {
                runtime.worker_threads(threads);
            }
            Some(_) => {
                eprintln!(
                    "{}: WORKER_THREADS must be a positive integer",
                    self.program
                );
                self.usage()
            }
            None => {
                if let Some(threads) = default {
                    runtime.worker_threads(threads);
                }
            }
        }
        let runtime = match runtime.enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                eprintln!("{}: cannot start the runtime: {error}", self.program);
                std::process::exit(1);
            }
        };
        if let Err(error) = runtime.block_on(serve) {
            eprintln!("{}: {what}: {error}", self.program);
            std::process::exit(1);
        }
    }
}
