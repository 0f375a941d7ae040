//! HTTP/1.1 connections: `httparse` (hyper's parser) reads each request head, and one thread per
//! connection reads the body, calls the handler and writes the answer, keeping the connection
//! open between requests unless the client says `Connection: close` (or speaks HTTP/1.0).
//!
//! Bodies need `Content-Length` (a chunked body is answered 411); `Expect: 100-continue` is
//! answered before the body is read; a body over the limit is answered 413 unread. Every read
//! has a deadline: 60 s for a request once it has begun, and a connection idle for 30 s between
//! requests is closed (as servers do; clients reconnect). A client that goes away mid-request
//! only ends its own connection.
//!
//! tiny_http was the first choice; its pool serves each open connection on one of its threads
//! and can leave a burst of new connections queued behind idle keep-alive ones: with the
//! `openai` client, 4 of 8 concurrent requests waited until the client's 120 s timeout. Here
//! every connection has its own thread, so none waits for another.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The largest request head read.
const MAX_HEAD: usize = 64 << 10;
/// How long a request, once begun, may take to arrive.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection may sit idle between requests.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The granularity at which blocked reads notice a shutdown.
const TICK: Duration = Duration::from_millis(200);

/// A request as the handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpRequest {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// The body (empty without `Content-Length`).
    pub body: Vec<u8>,
}

/// An answer.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
    /// More headers (e.g. `Allow`).
    pub headers: Vec<(&'static str, String)>,
}

impl HttpResponse {
    /// A JSON answer.
    pub fn json(status: u16, body: String) -> Self {
        Self { status, content_type: "application/json", body, headers: Vec::new() }
    }
}

/// Serves the requests of one connection until it closes, fails, idles out or `stop` is set.
/// `error(status, why)` makes the answer to a request that cannot be read (`why` is empty for a
/// 413: the body is over `max_body`).
pub fn serve_connection(
    mut stream: TcpStream,
    max_body: usize,
    stop: &AtomicBool,
    handler: &dyn Fn(&HttpRequest) -> HttpResponse,
    error: &dyn Fn(u16, String) -> HttpResponse,
) {
    if stream.set_nonblocking(false).is_err()
        || stream.set_read_timeout(Some(TICK)).is_err()
        || stream.set_write_timeout(Some(REQUEST_TIMEOUT)).is_err()
    {
        return;
    }
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let head = match read_head(&mut stream, &mut buf, stop) {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err((status, why)) => {
                let _ = write_response(&mut stream, &error(status, why), false);
                return;
            }
        };
        let Head { method, path, length, keep_alive, expect_continue, size } = head;
        buf.drain(..size);
        if length > max_body {
            let _ = write_response(&mut stream, &error(413, String::new()), false);
            return;
        }
        if expect_continue
            && buf.len() < length
            && stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err()
        {
            return;
        }
        if !read_exact_into(&mut stream, &mut buf, length) {
            tracing::debug!("{method} {path}: the client went away before sending its body");
            return;
        }
        let body: Vec<u8> = buf.drain(..length).collect();
        let response = handler(&HttpRequest { method, path, body });
        let keep = keep_alive && !stop.load(Ordering::SeqCst);
        if write_response(&mut stream, &response, keep).is_err() {
            tracing::debug!("the client went away before its answer");
            return;
        }
        if !keep {
            return;
        }
    }
}

/// What the handler needs from a request head.
struct Head {
    method: String,
    path: String,
    length: usize,
    keep_alive: bool,
    expect_continue: bool,
    /// The head's size in bytes.
    size: usize,
}

/// Reads until `buf` holds a whole request head and parses it. `Ok(None)`: the connection
/// closed, idled out or the server stops, before a request began. `Err`: the answer to send.
fn read_head(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    stop: &AtomicBool,
) -> Result<Option<Head>, (u16, String)> {
    let mut deadline = Instant::now() + IDLE_TIMEOUT;
    let mut begun = !buf.is_empty();
    loop {
        if !buf.is_empty() {
            if !begun {
                begun = true;
                deadline = Instant::now() + REQUEST_TIMEOUT;
            }
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(buf) {
                Ok(httparse::Status::Complete(size)) => return head(&req, size).map(Some),
                Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                    return Err((431, format!("the request head is over {MAX_HEAD} bytes")))
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err((400, format!("malformed HTTP request: {e}"))),
            }
        }
        let mut chunk = [0u8; 8192];
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if (!begun && stop.load(Ordering::SeqCst)) || Instant::now() > deadline {
                    return if begun {
                        Err((408, "the request took too long to arrive".into()))
                    } else {
                        Ok(None)
                    };
                }
            }
            Err(_) => return Ok(None),
        }
    }
}

/// The fields of a parsed head.
fn head(req: &httparse::Request<'_, '_>, size: usize) -> Result<Head, (u16, String)> {
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
    };
    if header("transfer-encoding").is_some_and(|t| t != "identity") {
        return Err((411, "chunked request bodies are not supported; send Content-Length".into()));
    }
    let length = match header("content-length") {
        None => 0,
        Some(v) => v.parse::<usize>().map_err(|_| (400, format!("Content-Length {v:?} is not a number")))?,
    };
    let http10 = req.version == Some(0);
    let connection = header("connection").unwrap_or_default();
    let keep_alive = if http10 { connection.contains("keep-alive") } else { !connection.contains("close") };
    let path = req.path.unwrap_or("/");
    Ok(Head {
        method: req.method.unwrap_or("").to_string(),
        path: path.split('?').next().unwrap_or(path).to_string(),
        length,
        keep_alive,
        expect_continue: header("expect").is_some_and(|e| e == "100-continue"),
        size,
    })
}

/// Reads until `buf` holds `n` bytes; false when the client goes away or is too slow.
fn read_exact_into(stream: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> bool {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut chunk = vec![0u8; 64 << 10];
    while buf.len() < n {
        let want = (n - buf.len()).min(chunk.len());
        match stream.read(&mut chunk[..want]) {
            Ok(0) => return false,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if Instant::now() > deadline {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// The reason phrase of the statuses answered here.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Writes `r` with its length and the connection's fate.
pub fn write_response(stream: &mut TcpStream, r: &HttpResponse, keep_alive: bool) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len(),
        if keep_alive { "keep-alive" } else { "close" }
    );
    for (k, v) in &r.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(r.body.as_bytes())?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// Serves one connection with an echo handler; the client writes `request`, and then `rest`
    /// once it has read the start of an answer. Returns what the client read back.
    fn exchange_in_two(request: &[u8], rest: &[u8], max_body: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let stop = AtomicBool::new(false);
            let echo = |r: &HttpRequest| {
                HttpResponse::json(
                    200,
                    format!("{} {} {}", r.method, r.path, String::from_utf8_lossy(&r.body)),
                )
            };
            serve_connection(stream, max_body, &stop, &echo, &|s, why| HttpResponse::json(s, why));
        });
        let mut client = TcpStream::connect(addr).unwrap();
        client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        client.write_all(request).unwrap();
        let mut out = Vec::new();
        if !rest.is_empty() {
            let mut first = [0u8; 25];
            client.read_exact(&mut first).unwrap();
            out.extend_from_slice(&first);
            client.write_all(rest).unwrap();
        }
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = client.read_to_end(&mut out);
        server.join().unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    fn exchange(request: &[u8], max_body: usize) -> String {
        exchange_in_two(request, b"", max_body)
    }

    #[test]
    fn keep_alive_and_pipelined_requests_are_answered_in_order() {
        let two = b"POST /a?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\nhiGET /b HTTP/1.1\r\nConnection: close\r\n\r\n";
        let out = exchange(two, 100);
        let first = out.find("POST /a hi").unwrap();
        let second = out.find("GET /b ").unwrap();
        assert!(first < second, "{out}");
        assert!(out.contains("Connection: keep-alive") && out.contains("Connection: close"), "{out}");
    }

    #[test]
    fn bodies_need_a_length_within_the_limit_and_expect_continue_is_answered() {
        let out = exchange(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n", 100);
        assert!(out.starts_with("HTTP/1.1 411 Length Required"), "{out}");
        let out = exchange(b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 100);
        assert!(out.starts_with("HTTP/1.1 413 "), "{out}");
        let out = exchange(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", 100);
        assert!(out.starts_with("HTTP/1.1 400 ") && out.contains("not a number"), "{out}");
        let out = exchange_in_two(
            b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
            b"ok",
            100,
        );
        assert!(
            out.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") && out.ends_with("POST / ok"),
            "{out}"
        );
        let out = exchange(b"not http at all\r\n\r\n", 100);
        assert!(out.starts_with("HTTP/1.1 400 ") && out.contains("malformed"), "{out}");
        let out = exchange(b"GET / HTTP/1.0\r\n\r\n", 100);
        assert!(out.contains("Connection: close") && out.ends_with("GET / "), "{out}");
        // A body cut short: no answer, the connection ends.
        assert_eq!(exchange(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", 100), "");
    }
}
