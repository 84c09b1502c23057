//! Rendezvous for multi-process launches: a tiny TCP key-value store (rank 0 serves it at
//! `MASTER_ADDR:MASTER_PORT`, every rank connects) and the launcher environment torchrun sets
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). The NCCL communicator uses it
//! to hand every rank of a group the NCCL unique id; nothing here needs a GPU.
//!
//! Protocol, one request per line on a TCP connection: `SET <key> <len>\n<len bytes>` (answer
//! `OK\n`) and `GET <key>\n` (waits until the key exists, answers `<len>\n<len bytes>`). Keys are
//! printable ASCII without spaces; values are at most [`MAX_VALUE`] bytes, lines at most
//! [`MAX_LINE`] (a longer one ends the connection).
//!
//! **Secret**: with a shared secret (`DISTGRAD_STORE_SECRET`, the same on every rank; our own
//! launcher makes one) every connection first sends `AUTH <secret>\n`; the store answers `OK\n`,
//! or `DENIED\n` and closes, comparing in constant time. A `MASTER_ADDR` that is not a loopback
//! address needs one: anyone who reached the store could otherwise read the NCCL id or plant a
//! false one. The store listens only where `MASTER_ADDR` says.
//!
//! **Bounds**: at most [`MAX_CONNS`] connections at once (one more is answered `BUSY\n` and
//! closed), [`MAX_KEYS`] keys and [`MAX_BYTES`] bytes of values (a `SET` of a new key beyond them
//! is answered `FULL\n`), so that a local user who reaches the port cannot grow the store's
//! threads or memory without end. Our launcher binds the store's listener itself and serves the
//! store from that same socket ([`StoreServer::from_listener`], [`SERVED_VAR`]): no port is freed
//! and bound again, which another local user could take in between.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Largest value the store keeps.
pub const MAX_VALUE: usize = 1 << 20;

/// Longest request or answer line, newline included.
pub const MAX_LINE: usize = 512;

/// The environment variable holding the store's shared secret.
pub const SECRET_VAR: &str = "DISTGRAD_STORE_SECRET";

/// The environment variable our launcher sets (to `1`) where it serves the store itself: rank 0
/// then connects to it like the others instead of serving one.
pub const SERVED_VAR: &str = "DISTGRAD_STORE_SERVED";

/// Most connections the store serves at once.
pub const MAX_CONNS: usize = 1024;

/// The store's answer to a connection beyond [`MAX_CONNS`] (then it closes it).
const BUSY: &str = "BUSY\n";

/// Most keys the store holds.
pub const MAX_KEYS: usize = 4096;

/// Most bytes of values the store holds in all.
pub const MAX_BYTES: usize = 64 << 20;

fn err(detail: impl Into<String>) -> Error {
    Error::Input(format!("rendezvous: {}", detail.into()))
}

/// Where this process sits in a launch (torchrun's variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank (`RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`).
    pub world: usize,
    /// Rank on this machine (`LOCAL_RANK`, default = `RANK`): picks the GPU.
    pub local_rank: usize,
    /// The store's address (`MASTER_ADDR:MASTER_PORT`).
    pub master: String,
    /// The store's shared secret ([`SECRET_VAR`]); required unless `MASTER_ADDR` is loopback.
    pub secret: Option<String>,
    /// The launcher serves the store ([`SERVED_VAR`] is `1`): rank 0 does not.
    pub served: bool,
}

impl LaunchEnv {
    /// Read the variables through `get` (e.g. `|k| std::env::var(k).ok()`); `None` when `RANK` is
    /// unset (not launched by a launcher), an error naming the variable when one is malformed.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let Some(rank) = get("RANK") else {
            return Ok(None);
        };
        let num = |k: &str, v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| err(format!("{k}={v:?} is not a number")))
        };
        let rank = num("RANK", &rank)?;
        let world = num(
            "WORLD_SIZE",
            &get("WORLD_SIZE").ok_or_else(|| err("RANK is set but WORLD_SIZE is not"))?,
        )?;
        if world == 0 || rank >= world {
            return Err(err(format!("RANK={rank} must be below WORLD_SIZE={world}")));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v)?,
            None => rank,
        };
        let addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = num(
            "MASTER_PORT",
            &get("MASTER_PORT").ok_or_else(|| err("RANK is set but MASTER_PORT is not"))?,
        )?;
        if port == 0 || port > 65535 {
            return Err(err(format!("MASTER_PORT={port} is not a port")));
        }
        let master = if addr.contains(':') && !addr.starts_with('[') {
            format!("[{addr}]:{port}")
        } else {
            format!("{addr}:{port}")
        };
        let secret = get(SECRET_VAR).filter(|s| !s.is_empty());
        let bare = addr.trim_start_matches('[').trim_end_matches(']');
        let loopback = bare == "localhost"
            || bare
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if secret.is_none() && !loopback {
            return Err(err(format!(
                "MASTER_ADDR={addr} is reachable from other machines: set {SECRET_VAR} to the \
                 same random value on every rank (e.g. `openssl rand -hex 16`) so that only \
                 this launch's ranks can use the rendezvous store"
            )));
        }
        if let Some(s) = &secret
            && (s.len() > MAX_LINE / 2 || !s.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(err(format!(
                "{SECRET_VAR} must be printable ASCII without spaces, at most {} bytes",
                MAX_LINE / 2
            )));
        }
        let served = match get(SERVED_VAR).as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(v) => return Err(err(format!("{SERVED_VAR}={v:?} must be 0 or 1"))),
        };
        Ok(Some(LaunchEnv {
            rank,
            world,
            local_rank,
            master,
            secret,
            served,
        }))
    }

    /// From the process environment.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }
}

#[derive(Default)]
struct Table {
    values: HashMap<String, Vec<u8>>,
    /// Bytes of all values.
    bytes: usize,
}

impl Table {
    /// Store `v` under `key` unless a new key or the bytes it adds go beyond the bounds.
    fn set(&mut self, key: &str, v: Vec<u8>) -> bool {
        let old = self.values.get(key).map(Vec::len);
        let bytes = self.bytes - old.unwrap_or(0) + v.len();
        if (old.is_none() && self.values.len() >= MAX_KEYS) || bytes > MAX_BYTES {
            return false;
        }
        self.bytes = bytes;
        self.values.insert(key.to_string(), v);
        true
    }
}

/// The store's server (rank 0). Stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl StoreServer {
    /// Listen on `addr` (port 0: any free port) and serve in background threads; with `secret`,
    /// only to connections that present it.
    pub fn start(addr: &str, secret: Option<&str>) -> Result<StoreServer> {
        let listener =
            TcpListener::bind(addr).map_err(|e| err(format!("cannot listen on {addr}: {e}")))?;
        StoreServer::from_listener(listener, secret)
    }

    /// Serve on `listener`, already bound (a launcher binds it before it names the port to its
    /// ranks, so nobody can take the port in between); with `secret`, only to connections that
    /// present it.
    pub fn from_listener(listener: TcpListener, secret: Option<&str>) -> Result<StoreServer> {
        StoreServer::serve_on(listener, secret, MAX_CONNS)
    }

    /// [`StoreServer::from_listener`] serving at most `max_conns` connections at once.
    fn serve_on(
        listener: TcpListener,
        secret: Option<&str>,
        max_conns: usize,
    ) -> Result<StoreServer> {
        let secret: Arc<Option<String>> = Arc::new(secret.map(str::to_string));
        let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| err(e.to_string()))?;
        let table = Arc::new((Mutex::new(Table::default()), Condvar::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let st = stop.clone();
        std::thread::Builder::new()
            .name("rendezvous".into())
            .spawn(move || {
                while !st.load(std::sync::atomic::Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((mut s, _)) => {
                            if open.load(std::sync::atomic::Ordering::Relaxed) >= max_conns {
                                let _ = s.set_nonblocking(false);
                                let _ = s.write_all(BUSY.as_bytes());
                                continue;
                            }
                            open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let (t, st, secret, count) =
                                (table.clone(), st.clone(), secret.clone(), open.clone());
                            let spawned = std::thread::Builder::new()
                                .name("rendezvous-conn".into())
                                .spawn(move || {
                                    serve(s, &t, &st, secret.as_deref());
                                    count.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                                });
                            if spawned.is_err() {
                                open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
            .map_err(|e| err(format!("cannot start the store thread: {e}")))?;
        Ok(StoreServer { addr, stop })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // Wake waiting GETs: they re-check `stop` on every wake-up.
    }
}

type Shared = (Mutex<Table>, Condvar);

/// Read one line of at most [`MAX_LINE`] bytes into `line`: `false` at the end of the stream, on
/// an error, on a longer line or on one that is not UTF-8.
fn read_bounded_line(r: &mut impl BufRead, line: &mut String) -> bool {
    line.clear();
    let mut raw = Vec::new();
    match r.take(MAX_LINE as u64).read_until(b'\n', &mut raw) {
        Ok(n) if n > 0 && raw.ends_with(b"\n") => match String::from_utf8(raw) {
            Ok(s) => {
                *line = s;
                true
            }
            Err(_) => false,
        },
        _ => false,
    }
}

fn serve(s: TcpStream, table: &Shared, stop: &std::sync::atomic::AtomicBool, secret: Option<&str>) {
    let _ = s.set_nonblocking(false);
    let Ok(w) = s.try_clone() else { return };
    let mut w = w;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    if let Some(secret) = secret {
        // Bounded wait for the secret: a silent connection does not hold a thread for long.
        let _ = r.get_ref().set_read_timeout(Some(Duration::from_secs(10)));
        let given = read_bounded_line(&mut r, &mut line)
            .then(|| line.trim_end().strip_prefix("AUTH "))
            .flatten();
        if !given.is_some_and(|g| crate::wire::secret_eq(g, secret)) {
            let _ = w.write_all(b"DENIED\n");
            return;
        }
        if w.write_all(b"OK\n").is_err() {
            return;
        }
        let _ = r.get_ref().set_read_timeout(None);
    }
    loop {
        if !read_bounded_line(&mut r, &mut line) {
            return;
        }
        let parts: Vec<&str> = line.trim_end().split(' ').collect();
        let reply: Vec<u8> = match parts.as_slice() {
            ["SET", key, len] => {
                let Ok(len) = len.parse::<usize>() else {
                    return;
                };
                if len > MAX_VALUE {
                    return;
                }
                let mut v = vec![0u8; len];
                if r.read_exact(&mut v).is_err() {
                    return;
                }
                let (m, cv) = table;
                let mut t = m.lock().unwrap_or_else(|p| p.into_inner());
                if t.set(key, v) {
                    cv.notify_all();
                    b"OK\n".to_vec()
                } else {
                    b"FULL\n".to_vec()
                }
            }
            ["GET", key] => {
                let (m, cv) = table;
                let mut t = m.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(v) = t.values.get(*key) {
                        let mut out = format!("{}\n", v.len()).into_bytes();
                        out.extend_from_slice(v);
                        break out;
                    }
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    t = cv
                        .wait_timeout(t, Duration::from_millis(100))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            _ => return,
        };
        if w.write_all(&reply).is_err() {
            return;
        }
    }
}

/// A connection to the store.
pub struct Store {
    r: BufReader<TcpStream>,
    w: TcpStream,
    timeout: Duration,
}

impl Store {
    /// Connect to `addr`, retrying until `timeout` (rank 0 may not be listening yet), and present
    /// `secret` where the store has one.
    pub fn connect(addr: &str, timeout: Duration, secret: Option<&str>) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = loop {
                match TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(err(format!(
                            "cannot reach the store at {addr} within {timeout:?}: {e}"
                        )));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let _ = s.set_nodelay(true);
            s.set_read_timeout(Some(timeout))
                .map_err(|e| err(e.to_string()))?;
            let w = s.try_clone().map_err(|e| err(e.to_string()))?;
            let mut store = Store {
                r: BufReader::new(s),
                w,
                timeout,
            };
            let Some(secret) = secret else {
                return Ok(store);
            };
            store
                .w
                .write_all(format!("AUTH {secret}\n").as_bytes())
                .map_err(|e| err(format!("sending the secret to {addr}: {e}")))?;
            let answer = store.answer_line().unwrap_or_default();
            // Busy (its connections taken, by other ranks or by someone else on the host): try
            // again until the deadline.
            if answer == BUSY && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            if answer == BUSY {
                return Err(err(format!(
                    "the store at {addr} was serving its most connections ({MAX_CONNS}) for \
                     {timeout:?}"
                )));
            }
            if answer != "OK\n" {
                return Err(err(format!(
                    "the store at {addr} refused this rank's {SECRET_VAR} (it must be the same \
                     on every rank)"
                )));
            }
            return Ok(store);
        }
    }

    /// The store's next answer line (bounded like its requests).
    fn answer_line(&mut self) -> std::io::Result<String> {
        let mut line = String::new();
        if read_bounded_line(&mut self.r, &mut line) {
            Ok(line)
        } else {
            Err(std::io::Error::other(
                "no answer line (closed, timed out, or too long)",
            ))
        }
    }

    fn check_key(key: &str) -> Result<()> {
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err(format!("bad key {key:?}")));
        }
        Ok(())
    }

    /// Store `value` under `key` (overwrites).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        Self::check_key(key)?;
        if value.len() > MAX_VALUE {
            return Err(err(format!("value of {} bytes is too large", value.len())));
        }
        let mut msg = format!("SET {key} {}\n", value.len()).into_bytes();
        msg.extend_from_slice(value);
        self.w
            .write_all(&msg)
            .map_err(|e| err(format!("SET {key}: {e}")))?;
        let line = self
            .answer_line()
            .map_err(|e| err(format!("SET {key}: {e}")))?;
        match line.as_str() {
            "OK\n" => {}
            "FULL\n" => {
                return Err(err(format!(
                    "SET {key}: the store is full (at most {MAX_KEYS} keys and {MAX_BYTES} bytes \
                     of values)"
                )));
            }
            BUSY => {
                return Err(err(format!(
                    "SET {key}: the store is serving its most connections ({MAX_CONNS})"
                )));
            }
            _ => return Err(err(format!("SET {key}: unexpected answer {line:?}"))),
        }
        Ok(())
    }

    /// The value under `key`, waiting (up to the connect timeout) until some rank sets it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        Self::check_key(key)?;
        self.w
            .write_all(format!("GET {key}\n").as_bytes())
            .map_err(|e| err(format!("GET {key}: {e}")))?;
        let line = self.answer_line().map_err(|e| {
            err(format!(
                "GET {key}: no value within {:?} ({e})",
                self.timeout
            ))
        })?;
        if line == BUSY {
            return Err(err(format!(
                "GET {key}: the store is serving its most connections ({MAX_CONNS})"
            )));
        }
        let len: usize = line
            .trim_end()
            .parse()
            .map_err(|_| err(format!("GET {key}: bad answer {line:?}")))?;
        if len > MAX_VALUE {
            return Err(err(format!("GET {key}: value of {len} bytes")));
        }
        let mut v = vec![0u8; len];
        self.r
            .read_exact(&mut v)
            .map_err(|e| err(format!("GET {key}: {e}")))?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_env_parsing() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(a, _)| *a == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(LaunchEnv::from_vars(vars(&[])).unwrap(), None);
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            (SECRET_VAR, "f00d"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 2,
                world: 4,
                local_rank: 2,
                master: "10.0.0.1:29500".into(),
                secret: Some("f00d".into()),
                served: false,
            }
        );
        // Reachable from other machines without a secret: refused, saying how to set one.
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains(SECRET_VAR) && e.contains("10.0.0.1"), "{e}");
        let e = LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.master, "[::1]:1");
        for (bad, what) in [
            (
                &[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "1")][..],
                "below",
            ),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "1")][..],
                "RANK",
            ),
            (&[("RANK", "0"), ("MASTER_PORT", "1")][..], "WORLD_SIZE"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")][..], "MASTER_PORT"),
        ] {
            let owned: Vec<(String, String)> = bad
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let e = LaunchEnv::from_vars(|k| {
                owned.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone())
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(what), "{e}");
        }
    }

    #[test]
    fn ranks_exchange_values_through_the_store() {
        let server = StoreServer::start("127.0.0.1:0", Some("s3")).unwrap();
        let addr = server.addr().to_string();
        let n = 4;
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let mut st =
                            Store::connect(&addr, Duration::from_secs(10), Some("s3")).unwrap();
                        // Rank 0 publishes an id; everyone reads it, publishes its own value,
                        // and reads every other rank's.
                        if r == 0 {
                            st.set("id", &[7u8; 128]).unwrap();
                        }
                        let id = st.get("id").unwrap();
                        st.set(&format!("v/{r}"), format!("rank {r}").as_bytes())
                            .unwrap();
                        let all: Vec<String> = (0..n)
                            .map(|p| String::from_utf8(st.get(&format!("v/{p}")).unwrap()).unwrap())
                            .collect();
                        (id, all)
                    })
                })
                .collect();
            for h in hs {
                let (id, all) = h.join().unwrap();
                assert_eq!(id, vec![7u8; 128]);
                assert_eq!(all, (0..n).map(|p| format!("rank {p}")).collect::<Vec<_>>());
            }
        });
    }

    #[test]
    fn store_errors_are_clear() {
        // Nobody listens: the connect gives up with the address in the message.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        let e = Store::connect(&addr, Duration::from_millis(200), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&addr), "{e}");
        // A key nobody sets: GET times out instead of hanging.
        let server = StoreServer::start("127.0.0.1:0", None).unwrap();
        let mut st =
            Store::connect(&server.addr().to_string(), Duration::from_millis(300), None).unwrap();
        let e = st.get("never").unwrap_err().to_string();
        assert!(e.contains("never"), "{e}");
        assert!(st.set("bad key", b"x").is_err());
    }

    /// A store with a secret serves only connections that present it; a line longer than
    /// [`MAX_LINE`] ends the connection instead of growing the store's memory.
    #[test]
    fn the_store_checks_its_secret_and_bounds_lines() {
        let server = StoreServer::start("127.0.0.1:0", Some("right")).unwrap();
        let addr = server.addr().to_string();
        let t = Duration::from_secs(5);
        for wrong in [None, Some("wrong"), Some("righ")] {
            match (wrong, Store::connect(&addr, t, wrong)) {
                (Some(_), Err(e)) => assert!(e.to_string().contains(SECRET_VAR), "{e}"),
                // Without a secret the first request is taken as the secret and refused.
                (None, Ok(mut st)) => {
                    let e = st.set("k", b"v").unwrap_err().to_string();
                    assert!(e.contains("SET k"), "{e}");
                }
                (w, r) => panic!("{w:?}: {:?}", r.map(|_| "connected")),
            }
        }
        let mut st = Store::connect(&addr, t, Some("right")).unwrap();
        st.set("k", b"v").unwrap();
        assert_eq!(st.get("k").unwrap(), b"v");
        // A line without end: the store closes the connection after MAX_LINE bytes.
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(t)).unwrap();
        raw.write_all(b"AUTH right\n").unwrap();
        let mut ok = [0u8; 3];
        raw.read_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"OK\n");
        let _ = raw.write_all(&vec![b'G'; 4 * MAX_LINE]);
        let mut rest = Vec::new();
        let n = raw.read_to_end(&mut rest).unwrap_or(0);
        assert_eq!(n, 0, "the store answered a {}-byte line", 4 * MAX_LINE);
    }

    /// The store bounds what a local user who reaches its port can make it hold: connections
    /// beyond its cap are answered `BUSY` (and one closing frees its place), new keys beyond
    /// [`MAX_KEYS`] and values beyond [`MAX_BYTES`] in all are refused (`FULL`); overwriting a
    /// key within the bounds still works. Served on a listener bound by the caller.
    #[test]
    fn the_store_bounds_connections_keys_and_bytes() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = StoreServer::serve_on(listener, None, 4).unwrap();
        let addr = server.addr().to_string();
        let t = Duration::from_secs(5);
        let mut st = Store::connect(&addr, t, None).unwrap();
        for k in 0..MAX_KEYS {
            st.set(&format!("k{k}"), b"").unwrap();
        }
        let e = st.set("one-more", b"x").unwrap_err().to_string();
        assert!(e.contains("the store is full"), "{e}");
        st.set("k0", b"still fits").unwrap();
        assert_eq!(st.get("k0").unwrap(), b"still fits");
        // Bytes: a second store, filled with 1 MiB values up to MAX_BYTES.
        let server2 = StoreServer::start("127.0.0.1:0", None).unwrap();
        let mut st2 = Store::connect(&server2.addr().to_string(), t, None).unwrap();
        let big = vec![7u8; MAX_VALUE];
        for k in 0..MAX_BYTES / MAX_VALUE {
            st2.set(&format!("v{k}"), &big).unwrap();
        }
        let e = st2.set("v-more", b"x").unwrap_err().to_string();
        assert!(e.contains("the store is full"), "{e}");
        // Connections: 4 served (st is one), the 5th told BUSY.
        let held: Vec<Store> = (0..3)
            .map(|_| Store::connect(&addr, t, None).unwrap())
            .collect();
        let mut fifth = Store::connect(&addr, t, None).unwrap();
        let e = fifth.get("k0").unwrap_err().to_string();
        assert!(e.contains("most connections"), "{e}");
        drop(held);
        let t0 = Instant::now();
        loop {
            let mut again = Store::connect(&addr, t, None).unwrap();
            match again.get("k0") {
                Ok(v) => {
                    assert_eq!(v, b"still fits");
                    break;
                }
                Err(e) if t0.elapsed() < t => {
                    assert!(e.to_string().contains("most connections"), "{e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("closed connections did not free their places: {e}"),
            }
        }
    }
}
