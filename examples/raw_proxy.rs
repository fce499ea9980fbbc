//! A reverse proxy with no HTTP library around the parser, for the proxy benchmark
//! (`scripts/bench-proxy-tail.sh`, target `raw`): one tokio task per client connection owns
//! that connection and its own keep-alive connection to the upstream, reads a request's head
//! (`httparse`) and its `Content-Length` body, writes them upstream as they came, reads the
//! answer's head and body the same way and writes them back: one read and one write per
//! direction when the bytes arrive together, no channel between tasks, no second task per
//! request. It is the question "is the tail above nginx's the cost of hyper's machinery (a
//! connection task per side, a dispatch channel between them), or of any proxy on tokio on this
//! machine?" made a program. Only what the benchmark sends is handled: `Content-Length` bodies
//! (no chunked ones); anything else closes the connection.
//!
//! ```sh
//! cargo run --release --example raw_proxy -- 127.0.0.1:9103 127.0.0.1:9100 [WORKER_THREADS]
//! ```

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Most header lines read in one head.
const MAX_HEADERS: usize = 64;
/// Largest head plus body accepted (the benchmark's are a few hundred bytes).
const MAX_MESSAGE: usize = 1 << 20;

#[path = "support/bench_cli.rs"]
mod bench_cli;

const CLI: bench_cli::BenchCli = bench_cli::BenchCli {
    program: "raw_proxy",
    usage: "raw_proxy LISTEN UPSTREAM [WORKER_THREADS]   (e.g. 127.0.0.1:9103 127.0.0.1:9100)",
};

fn main() {
    let mut args = std::env::args().skip(1);
    let listen = CLI.addr(args.next(), "LISTEN");
    let upstream = CLI.addr(args.next(), "UPSTREAM");
    // The runtime's default, as kvgate's: one worker per core.
    CLI.run(args.next(), None, listen, serve(listen, upstream));
}

async fn serve(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<()> {
    CLI.accept_each(listen, move |client| async move {
        if let Err(error) = relay_connection(client, upstream).await {
            eprintln!("raw_proxy: connection ended: {error}");
        }
    })
    .await
}

/// Which kind of head [`read_message`] reads.
#[derive(Clone, Copy)]
enum Head {
    Request,
    Response,
}

/// Relays requests from `client` one at a time until it closes.
async fn relay_connection(mut client: TcpStream, upstream: SocketAddr) -> std::io::Result<()> {
    let mut to_upstream: Option<TcpStream> = None;
    let mut request = Vec::with_capacity(4096);
    let mut answer = Vec::with_capacity(4096);
    loop {
        // The client closing between requests is the normal end.
        let Some(request_len) = read_message(&mut client, &mut request, Head::Request).await?
        else {
            return Ok(());
        };
        let server = match to_upstream.as_mut() {
            Some(server) => server,
            None => {
                let server = TcpStream::connect(upstream).await?;
                server.set_nodelay(true)?;
                to_upstream.insert(server)
            }
        };
        server.write_all(&request[..request_len]).await?;
        let Some(answer_len) = read_message(server, &mut answer, Head::Response).await? else {
            return Err(std::io::Error::other(
                "the upstream closed before answering",
            ));
        };
        client.write_all(&answer[..answer_len]).await?;
        // Pipelined bytes past this message stay for the next one.
        request.drain(..request_len);
        answer.drain(..answer_len);
    }
}

/// Reads one whole message (head and `Content-Length` body) into `buffer`, which may already
/// hold bytes of it; returns its length, or `None` if the peer closed before a first byte.
async fn read_message(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    head: Head,
) -> std::io::Result<Option<usize>> {
    // Known once the head is complete: a body arriving in pieces does not re-parse it.
    let mut total = None;
    loop {
        if total.is_none() {
            total = message_length(buffer, head)?;
        }
        if let Some(total) = total
            && buffer.len() >= total
        {
            return Ok(Some(total));
        }
        if buffer.len() >= MAX_MESSAGE {
            return Err(std::io::Error::other("message too large"));
        }
        buffer.reserve(4096);
        if stream.read_buf(buffer).await? == 0 {
            return if buffer.is_empty() {
                Ok(None)
            } else {
                Err(std::io::Error::other("closed in the middle of a message"))
            };
        }
    }
}

/// The whole message's length once its head is complete in `buffer`.
fn message_length(buffer: &[u8], head: Head) -> std::io::Result<Option<usize>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let parsed = match head {
        Head::Request => httparse::Request::new(&mut headers).parse(buffer),
        Head::Response => httparse::Response::new(&mut headers).parse(buffer),
    };
    let head_len = match parsed.map_err(std::io::Error::other)? {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => return Ok(None),
    };
    let mut body_len = 0;
    for header in headers.iter().take_while(|header| !header.name.is_empty()) {
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(std::io::Error::other("chunked bodies are not handled"));
        }
        if header.name.eq_ignore_ascii_case("content-length") {
            body_len = std::str::from_utf8(header.value)
                .ok()
                .and_then(|text| text.trim().parse::<usize>().ok())
                .ok_or_else(|| std::io::Error::other("a bad Content-Length"))?;
        }
    }
    Ok(Some(head_len + body_len))
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;

    #[test]
    fn a_message_is_its_head_and_its_content_length() {
        let request =
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(
            message_length(request, Head::Request).unwrap(),
            Some(request.len())
        );
        // The head alone is enough to know the length; the body may still be on its way.
        let head_only = &request[..request.len() - 5];
        assert_eq!(
            message_length(head_only, Head::Request).unwrap(),
            Some(request.len())
        );
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        assert_eq!(
            message_length(answer, Head::Response).unwrap(),
            Some(answer.len())
        );
    }

    #[test]
    fn a_partial_head_waits_and_what_it_cannot_relay_is_an_error() {
        assert_eq!(
            message_length(b"GET / HTTP/1.1\r\nHost:", Head::Request).unwrap(),
            None
        );
        assert!(
            message_length(
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Head::Request
            )
            .is_err()
        );
        assert!(
            message_length(
                b"POST / HTTP/1.1\r\nContent-Length: lots\r\n\r\n",
                Head::Request
            )
            .is_err()
        );
        assert!(message_length(b"\x00\x01 nonsense\r\n\r\n", Head::Request).is_err());
    }

    /// A body that arrives after its head, in pieces, is read whole before the message is.
    #[tokio::test]
    async fn a_body_in_pieces_is_waited_for() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sender = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            for piece in ["POST / HTTP/1.1\r\nContent-Length: 6\r\n\r\n", "abc", "def"] {
                stream.write_all(piece.as_bytes()).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            stream
        });
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut buffer = Vec::new();
        let length = read_message(&mut stream, &mut buffer, Head::Request)
            .await
            .unwrap()
            .unwrap();
        assert!(buffer[..length].ends_with(b"\r\n\r\nabcdef"), "{buffer:?}");
        drop(sender.await.unwrap());
    }

    /// Two requests pipelined in one write reach the upstream one at a time, and each
    /// answer comes back whole, in order, on the client's connection.
    #[tokio::test]
    async fn pipelined_requests_are_relayed_one_at_a_time() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = upstream.accept().await.unwrap();
            let mut buffer = Vec::new();
            for answer in ["first", "other"] {
                let length = read_message(&mut stream, &mut buffer, Head::Request)
                    .await
                    .unwrap()
                    .unwrap();
                buffer.drain(..length);
                let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{answer}");
                stream.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy_addr = proxy.local_addr().unwrap();
        tokio::spawn(async move {
            let (client, _) = proxy.accept().await.unwrap();
            relay_connection(client, upstream_addr).await
        });
        let mut client = TcpStream::connect(proxy_addr).await.unwrap();
        let one = "POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
        client
            .write_all(format!("{one}{one}").as_bytes())
            .await
            .unwrap();
        let mut answers = Vec::new();
        let mut buffer = Vec::new();
        for _ in 0..2 {
            let length = read_message(&mut client, &mut buffer, Head::Response)
                .await
                .unwrap()
                .unwrap();
            answers.push(String::from_utf8(buffer.drain(..length).collect()).unwrap());
        }
        assert!(answers[0].ends_with("\r\n\r\nfirst"), "{answers:?}");
        assert!(answers[1].ends_with("\r\n\r\nother"), "{answers:?}");
    }
}
