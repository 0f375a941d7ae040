//! HTTP on loopback for the tests of `rltune serve` and the HTTP rewards: a raw client, the
//! server process (killed on drop), and a scripted scoring service. Every socket has a timeout
//! and every wait a deadline, so no test can hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A socket's read and write timeout.
pub const IO_TIMEOUT: Duration = Duration::from_secs(120);

/// A response: status, headers (lowercased names), body.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Answer {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn connect(addr: &str) -> TcpStream {
    let sock = addr.parse().expect("an ip:port address");
    let s = TcpStream::connect_timeout(&sock, Duration::from_secs(10)).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

/// Sends `bytes` as they are and reads the answer to its end (the request says `Connection: close`).
pub fn raw(addr: &str, bytes: &[u8]) -> Answer {
    let mut s = connect(addr);
    s.write_all(bytes).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Answer { status, headers: head.to_ascii_lowercase(), body: body.to_string() }
}

/// One request with an optional JSON body.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Answer {
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    raw(addr, req.as_bytes())
}

/// POSTs `body` as JSON.
pub fn post(addr: &str, path: &str, body: &Value) -> Answer {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// Sends `bytes`, then closes the socket without reading (a client that goes away).
pub fn send_and_leave(addr: &str, bytes: &[u8]) {
    let mut s = connect(addr);
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Both);
}

/// `rltune serve` on a free loopback port; killed (and waited for) on drop.
pub struct Served {
    child: Child,
    /// `127.0.0.1:PORT`
    pub addr: String,
    /// Its stderr so far.
    pub stderr: Arc<Mutex<String>>,
}

impl Served {
    /// Starts `rltune serve --model MODEL --port 0 ARGS…` and waits (60 s at most) for its address.
    pub fn start(model: &Path, args: &[&str]) -> Self {
        Self::start_logging(model, args, "info")
    }

    /// [`Self::start`] with `RUST_LOG=log` (`debug` logs every request and batch).
    pub fn start_logging(model: &Path, args: &[&str], log: &str) -> Self {
        let hf_home = std::env::temp_dir().join("rltune-serve-test-hf");
        let mut child = Command::new(env!("CARGO_BIN_EXE_rltune"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_HOME", hf_home)
            .env("RUST_LOG", log)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rltune serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err_pipe, out_pipe) = (child.stderr.take().unwrap(), child.stdout.take().unwrap());
        let e = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                e.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out_pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut served = Self { child, addr: String::new(), stderr };
        while served.addr.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.split("http://").nth(1) {
                        served.addr = rest.trim_end_matches("/v1").to_string();
                    }
                }
                Err(_) => panic!("rltune serve did not start in 60 s:\n{}", served.stderr.lock().unwrap()),
            }
        }
        served
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// A metric of `/metrics`.
    pub fn metric(&self, name: &str) -> u64 {
        let m = request(&self.addr, "GET", "/metrics", None);
        m.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{}", m.body))
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let stderr = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
        assert!(std::thread::panicking() || !stderr.contains("panicked"), "rltune serve panicked:\n{stderr}");
    }
}

/// One scripted answer of [`ScoringService`].
pub struct Reply {
    pub status: u16,
    pub body: String,
    pub delay: Duration,
}

/// A scoring service on loopback: a thread per connection, each answered by
/// `handler(request number, body)`; stopped and joined on drop.
pub struct ScoringService {
    pub url: String,
    /// Every request body, in arrival order.
    pub bodies: Arc<Mutex<Vec<Value>>>,
    stop: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
    accept: Option<JoinHandle<()>>,
}

type Handler = dyn Fn(usize, &Value) -> Reply + Send + Sync;

impl ScoringService {
    pub fn start(handler: impl Fn(usize, &Value) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (b, st) = (bodies.clone(), stop.clone());
        let accept = std::thread::spawn(move || {
            let count = Arc::new(AtomicUsize::new(0));
            let mut conns = Vec::new();
            for stream in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (h, b, c) = (handler.clone(), b.clone(), count.clone());
                conns.push(std::thread::spawn(move || serve_one(stream, &*h, &b, &c)));
            }
            for c in conns {
                let _ = c.join();
            }
        });
        Self { url: format!("http://{addr}"), bodies, stop, addr, accept: Some(accept) }
    }
}

impl Drop for ScoringService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}

fn serve_one(stream: TcpStream, handler: &Handler, bodies: &Mutex<Vec<Value>>, count: &AtomicUsize) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(&stream);
    let mut length = 0usize;
    let mut first = true;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || (first && h.is_empty()) {
            return; // The wake-up connection.
        }
        first = false;
        if h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length.min(1 << 24)];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let n = count.fetch_add(1, Ordering::SeqCst);
    bodies.lock().unwrap().push(body.clone());
    let reply = handler(n, &body);
    std::thread::sleep(reply.delay);
    let text = format!(
        "HTTP/1.1 {} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        reply.status,
        reply.body.len(),
        reply.body
    );
    let _ = (&stream).write_all(text.as_bytes());
}

/// A copy of the PPO fixture's tiny GPT-2 (V = 288, 64 positions) with its tokenizer and a chat
/// template, in `dir/name`.
pub fn tiny_chat_model(dir: &Path, name: &str) -> std::path::PathBuf {
    let model = dir.join(name);
    std::fs::create_dir_all(&model).unwrap();
    for (src, dst) in [
        ("ppo/init/config.json", "config.json"),
        ("ppo/init/model.safetensors", "model.safetensors"),
        ("ppo/tokenizer.json", "tokenizer.json"),
    ] {
        std::fs::copy(super::fixture(src), model.join(dst)).unwrap();
    }
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>{% endif %}";
    let config = serde_json::json!({"chat_template": template, "eos_token": "<|endoftext|>"});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    model
}
