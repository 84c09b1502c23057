//! Process orchestration for the commands that start processes or servers: a relay in this
//! process ([`LocalRelay`], for `demo` and `bench --processes`), waiting for rank processes so that
//! the first failure stops the others ([`wait_ranks`]), and one process per GPU with torchrun's
//! variables set ([`per_gpu`], for `train` and `bench` over NCCL).

use super::runtime;

/// A relay on an ephemeral loopback port of 127.0.0.1, in its own thread and runtime, for
/// the worker processes of `demo` and `bench --processes`; stopped (and its thread joined) by
/// [`LocalRelay::stop`] or when dropped, on any path out of the caller.
pub struct LocalRelay {
    /// The relay's WebSocket URL.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LocalRelay {
    /// Serve on an ephemeral port of 127.0.0.1 in a thread of its own.
    pub fn start(cfg: distgrad::relay::RelayConfig) -> distgrad::Result<LocalRelay> {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let rt = runtime(true)?;
        let thread = std::thread::spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = addr_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = addr_tx.send(listener.local_addr().map_err(|e| e.to_string()));
                let _ = distgrad::relay::serve(listener, cfg, async {
                    let _ = stop_rx.await;
                })
                .await;
            })
        });
        let addr = addr_rx
            .recv()
            .map_err(|_| distgrad::Error::Input("relay thread died".into()))?
            .map_err(|e| distgrad::Error::Input(format!("relay: {e}")))?;
        Ok(LocalRelay {
            url: format!("ws://{addr}/ws"),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stop serving and wait for the relay's thread.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for LocalRelay {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Run `distgrad worker` once per rank against a relay started here (room "demo"), each given
/// the room token in its environment, `args` added to every command line, with direct TCP links
/// between them if `direct`; returns each rank's output. Says where on stderr.
pub fn workers_over_relay(
    what: &str,
    world: usize,
    direct: bool,
    args: &[String],
) -> distgrad::Result<Vec<Finished>> {
    // Its own relay: the workers all start with the token made here.
    let relay = LocalRelay::start(distgrad::relay::RelayConfig {
        client_tokens: true,
        ..Default::default()
    })?;
    let url = relay.url.clone();
    let token =
        distgrad::relay::random_token().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    eprintln!(
        "{what}: relay at {url}, room \"demo\", {world} worker processes{}",
        if direct {
            ", data over direct links"
        } else {
            ""
        }
    );
    let exe = std::env::current_exe().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    let children: Vec<_> = (0..world)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["worker", "--relay", &url, "--room", "demo", "--json"])
                .env(TOKEN_ENV, &token)
                .args(["--world", &world.to_string(), "--rank", &r.to_string()])
                .args(args)
                .args(if direct {
                    &["--direct", "127.0.0.1:0"][..]
                } else {
                    &[][..]
                })
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
        })
        .collect();
    let done = wait_ranks("worker", children)
        .into_iter()
        .collect::<Result<Vec<_>, String>>()
        .map_err(distgrad::Error::Input);
    relay.stop();
    let done = done?;
    // Say which pairs linked directly (the workers' own report).
    for d in &done {
        for line in String::from_utf8_lossy(&d.stderr).lines() {
            if line.contains("direct links") {
                eprintln!("{what}: {line}");
            }
        }
    }
    Ok(done)
}

/// Where a parent hands the room token to its rank processes (not on their command lines,
/// which other local users can read).
pub const TOKEN_ENV: &str = "DISTGRAD_TOKEN";

/// What a rank process left: its piped output (empty where not piped).
pub struct Finished {
    /// Its standard output.
    pub stdout: Vec<u8>,
    /// Its standard error.
    pub stderr: Vec<u8>,
}

/// Wait for every rank process (`what` names them in errors). The first that fails, or that
/// did not start, gets the others killed: they would otherwise wait for a peer that is gone
/// until their own timeouts. Piped outputs are read as they come (a full pipe never blocks
/// a rank). A failed rank's error carries its status and the end of its piped stderr.
pub fn wait_ranks(
    what: &str,
    children: Vec<std::io::Result<std::process::Child>>,
) -> Vec<Result<Finished, String>> {
    use std::io::Read;
    fn drain<R: Read + Send + 'static>(
        pipe: Option<R>,
    ) -> Option<std::thread::JoinHandle<Vec<u8>>> {
        pipe.map(|mut p| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = p.read_to_end(&mut v);
                v
            })
        })
    }
    let collect = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        h.map(|h| h.join().unwrap_or_default()).unwrap_or_default()
    };
    struct Running {
        child: std::process::Child,
        out: Option<std::thread::JoinHandle<Vec<u8>>>,
        err: Option<std::thread::JoinHandle<Vec<u8>>>,
    }
    let mut results: Vec<Option<Result<Finished, String>>> = Vec::new();
    let mut running: Vec<Option<Running>> = Vec::new();
    let mut first_failure: Option<String> = None;
    for (r, c) in children.into_iter().enumerate() {
        match c {
            Ok(mut child) => {
                let out = drain(child.stdout.take());
                let err = drain(child.stderr.take());
                running.push(Some(Running { child, out, err }));
                results.push(None);
            }
            Err(e) => {
                first_failure.get_or_insert_with(|| format!("{what} {r} did not start"));
                running.push(None);
                results.push(Some(Err(format!("starting {what} {r}: {e}"))));
            }
        }
    }
    while running.iter().any(Option::is_some) {
        if let Some(why) = &first_failure {
            for (r, slot) in running.iter_mut().enumerate() {
                if let Some(mut p) = slot.take() {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    // Its readers are left to end on their own (a grandchild may still
                    // hold the pipes open).
                    drop((p.out, p.err));
                    results[r] = Some(Err(format!("{what} {r} stopped: {why}")));
                }
            }
            break;
        }
        let mut progressed = false;
        for (r, slot) in running.iter_mut().enumerate() {
            let Some(p) = slot.as_mut() else { continue };
            let status = match p.child.try_wait() {
                Ok(None) => continue,
                Ok(Some(s)) => Ok(s),
                Err(e) => Err(e),
            };
            progressed = true;
            let Some(p) = slot.take() else { continue };
            let (stdout, stderr) = (collect(p.out), collect(p.err));
            results[r] = Some(match status {
                Ok(s) if s.success() => Ok(Finished { stdout, stderr }),
                Ok(s) => {
                    first_failure.get_or_insert_with(|| format!("{what} {r} failed"));
                    let text = String::from_utf8_lossy(&stderr);
                    let text = text.trim();
                    // The end of a long stderr is where the reason is.
                    let mut cut = text.len().saturating_sub(2000);
                    while !text.is_char_boundary(cut) {
                        cut += 1;
                    }
                    let tail = &text[cut..];
                    Err(if tail.is_empty() {
                        format!("{what} {r} {s} (its errors above)")
                    } else {
                        format!("{what} {r} {s}: {tail}")
                    })
                }
                Err(e) => {
                    first_failure.get_or_insert_with(|| format!("{what} {r} was lost"));
                    Err(format!("{what} {r}: {e}"))
                }
            });
        }
        if !progressed {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|| Err(format!("{what} {r}: no result"))))
        .collect()
}

/// Start this same command once per GPU with torchrun's variables set, and wait for them.
#[cfg(feature = "native-nccl")]
pub fn per_gpu(world: usize, what: &str) -> distgrad::Result<()> {
    distgrad::nccl::check_libraries()?;
    let gpus = distgrad::nccl::device_count()?;
    if world == 0 || world > gpus {
        return Err(distgrad::Error::Nccl {
            op: "launch",
            rank: None,
            detail: format!(
                "--world {world} needs {world} GPUs (one per rank); this machine has {gpus}"
            ),
        });
    }
    // Only this launch's ranks may use the store (other users of the machine reach loopback too).
    let secret =
        distgrad::relay::random_token().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    // Served from here, on the socket bound here: no port freed and bound again, which another
    // local user could take in between.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| distgrad::Error::Input(format!("no free port: {e}")))?;
    let store = distgrad::rendezvous::StoreServer::from_listener(listener, Some(&secret))?;
    let port = store.addr().port();
    let exe = std::env::current_exe()
        .map_err(|e| distgrad::Error::Input(format!("cannot find this program: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    eprintln!("{what}: {world} processes (one per GPU), store at 127.0.0.1:{port}");
    let children: Vec<_> = (0..world)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(&args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(distgrad::rendezvous::SECRET_VAR, &secret)
                .env(distgrad::rendezvous::SERVED_VAR, "1")
                .spawn()
                .map_err(|e| distgrad::Error::Input(format!("starting rank {r}: {e}")))
        })
        .collect::<distgrad::Result<_>>()?;
    let mut failed = Vec::new();
    for (r, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r} exited with {s}")),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(distgrad::Error::Input(failed.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::wait_ranks;
    use std::process::{Command, Stdio};

    fn sh(script: &str) -> std::io::Result<std::process::Child> {
        Command::new("sh")
            .args(["-c", script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
    }

    #[test]
    fn all_ranks_succeeding_give_their_outputs() {
        let got = wait_ranks("rank", vec![sh("echo zero"), sh("echo one; echo note >&2")]);
        let got: Vec<_> = got.into_iter().map(|r| r.expect("ok")).collect();
        assert_eq!(got[0].stdout, b"zero\n");
        assert_eq!(got[1].stdout, b"one\n");
        assert_eq!(got[1].stderr, b"note\n");
    }

    /// One rank fails: the others, which would wait for it (here: a minute), are killed at
    /// once, and every error says what happened to whom.
    #[test]
    fn a_failed_rank_stops_the_others() {
        let t0 = std::time::Instant::now();
        let got = wait_ranks(
            "rank",
            vec![
                sh("exec sleep 60"),
                sh("sleep 1; echo boom >&2; exit 3"),
                sh("exec sleep 60"),
                sh("echo fine"),
            ],
        );
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "the waiting ranks were not stopped ({:?})",
            t0.elapsed()
        );
        let mut got = got.into_iter();
        let errs: Vec<String> = got
            .by_ref()
            .take(3)
            .map(|r| r.err().expect("ranks 0..3 fail"))
            .collect();
        // The rank that had finished before the failure keeps its result.
        let fine = got.next().expect("rank 3").expect("rank 3 succeeded");
        assert_eq!(fine.stdout, b"fine\n");
        assert!(
            errs[1].contains("rank 1") && errs[1].contains("boom"),
            "{}",
            errs[1]
        );
        assert!(errs[1].contains('3'), "the exit status: {}", errs[1]);
        for r in [0, 2] {
            assert!(
                errs[r].contains(&format!("rank {r} stopped: rank 1 failed")),
                "{}",
                errs[r]
            );
        }
    }

    #[test]
    fn a_rank_that_did_not_start_stops_the_others() {
        let missing = Command::new("/nonexistent/distgrad-test-binary").spawn();
        let got = wait_ranks("worker", vec![sh("exec sleep 60"), missing]);
        let errs: Vec<String> = got
            .into_iter()
            .map(|r| r.err().expect("all fail"))
            .collect();
        assert!(errs[1].starts_with("starting worker 1"), "{}", errs[1]);
        assert!(
            errs[0].contains("worker 0 stopped: worker 1 did not start"),
            "{}",
            errs[0]
        );
    }
}
