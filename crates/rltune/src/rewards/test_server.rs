//! A scripted HTTP server on loopback for the HTTP rewards' tests: a thread per connection, every
//! socket with a timeout, stopped (and joined) on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

/// One scripted answer.
pub struct Reply {
    pub status: u16,
    pub body: String,
    /// Slept before answering (to trip a client's timeout).
    pub delay: Duration,
    pub headers: Vec<(String, String)>,
}

impl Reply {
    pub fn json(status: u16, body: Value) -> Self {
        Self { status, body: body.to_string(), delay: Duration::ZERO, headers: Vec::new() }
    }
}

type Handler = dyn Fn(usize, &Value) -> Reply + Send + Sync;

/// A server answering POSTs with `handler(request number, body)`.
pub struct TestServer {
    pub url: String,
    /// Every request's (path, headers lowercased, body), in arrival order.
    pub seen: Arc<Mutex<Vec<(String, String, Value)>>>,
    stop: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start(handler: impl Fn(usize, &Value) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (s, st) = (seen.clone(), stop.clone());
        let accept = std::thread::spawn(move || {
            let count = Arc::new(AtomicUsize::new(0));
            let mut conns = Vec::new();
            for stream in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (h, s, c) = (handler.clone(), s.clone(), count.clone());
                conns.push(std::thread::spawn(move || answer(stream, &*h, &s, &c)));
            }
            for c in conns {
                let _ = c.join();
            }
        });
        Self { url: format!("http://{addr}"), seen, stop, addr, accept: Some(accept) }
    }

    /// The bodies received so far.
    pub fn bodies(&self) -> Vec<Value> {
        self.seen.lock().unwrap().iter().map(|(_, _, b)| b.clone()).collect()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}

fn answer(
    stream: TcpStream,
    handler: &Handler,
    seen: &Mutex<Vec<(String, String, Value)>>,
    count: &AtomicUsize,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return; // The wake-up connection, or a client gone.
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = String::new();
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        let lower = h.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        headers.push_str(&lower);
    }
    let mut body = vec![0u8; length.min(1 << 24)];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let n = count.fetch_add(1, Ordering::SeqCst);
    seen.lock().unwrap().push((path, headers, body.clone()));
    let reply = handler(n, &body);
    std::thread::sleep(reply.delay);
    let extra: String = reply.headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let text = format!(
        "HTTP/1.1 {} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{}",
        reply.status,
        reply.body.len(),
        reply.body
    );
    let _ = (&stream).write_all(text.as_bytes());
}
