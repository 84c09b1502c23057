//! A relay on a public host (issue #20). TLS: browsers give WebGPU only to secure pages, so a
//! relay on a host other than localhost serves the page over HTTPS and members over `wss://`.
//! Tested with a self-signed certificate made here (for `localhost` and 127.0.0.1): the page over
//! HTTPS, three native ranks over `wss://` trusting that certificate computing an exact
//! all_reduce, plain HTTP still on the same port, and a client that does not trust the
//! certificate refused with a certificate error. ICE servers: the operator's STUN/TURN list
//! reaches every member in its welcome, and malformed lists are refused. Loopback only.

mod common_relay;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common_relay::{TestRelay, all_ok, join_opts, run_ranks, scripted};
use distgrad::relay::{RelayConfig, tls_config};
use distgrad::transport::ws::WsTransport;
use distgrad::{CommOptions, Communicator, Error, ReduceOp, Tensor};

/// A fresh folder holding a self-signed certificate and key (PEM) and a one-file web app.
struct Site {
    dir: PathBuf,
}

impl Site {
    fn new(name: &str) -> Site {
        let dir = std::env::temp_dir().join(format!("distgrad-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("www")).unwrap();
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
            .expect("self-signed certificate");
        std::fs::write(dir.join("cert.pem"), ck.cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), ck.signing_key.serialize_pem()).unwrap();
        std::fs::write(dir.join("www/index.html"), "<p>distgrad over TLS</p>").unwrap();
        Site { dir }
    }

    fn cert(&self) -> PathBuf {
        self.dir.join("cert.pem")
    }

    fn relay(&self) -> TestRelay {
        self.relay_requiring(false)
    }

    fn relay_requiring(&self, require_tls: bool) -> TestRelay {
        let tls = tls_config(&self.cert(), &self.dir.join("key.pem")).expect("TLS config");
        TestRelay::start(RelayConfig {
            tls: Some(tls),
            require_tls,
            static_dir: Some(self.dir.join("www")),
            ..scripted()
        })
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET /` over TLS trusting only `cert`; the whole answer.
fn https_get(addr: std::net::SocketAddr, cert: &std::path::Path) -> String {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(cert).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(distgrad::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = "localhost".try_into().unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name).unwrap();
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    tls.write_all(b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    // A peer closing without close_notify is an error here, after the body arrived.
    let _ = tls.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// `GET /` without TLS; the whole answer.
fn plain_get(addr: std::net::SocketAddr) -> String {
    let mut plain = TcpStream::connect(addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = plain.read_to_string(&mut answer);
    answer
}

#[test]
fn the_page_comes_over_https_and_plain_http_still_works() {
    let site = Site::new("page");
    let relay = site.relay();
    let answer = https_get(relay.addr, &site.cert());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("distgrad over TLS"), "{answer}");
    // The same port without TLS (a reverse proxy in front, or a page on localhost).
    let answer = plain_get(relay.addr);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("distgrad over TLS"),
        "{answer}"
    );
}

/// `require_tls`: plain HTTP (and so plain ws://) on the relay's port is refused, saying to use
/// TLS, and a plain data stream is dropped; the page still comes over HTTPS, and members joining
/// over wss:// (whose data then goes on the WebSocket, over TLS) compute exactly. Without a
/// certificate the option is refused.
#[test]
fn a_relay_requiring_tls_refuses_plain_connections() {
    let site = Site::new("require");
    let relay = site.relay_requiring(true);
    let answer = https_get(relay.addr, &site.cert());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answer = plain_get(relay.addr);
    assert!(
        answer.starts_with("HTTP/1.1 403") && answer.contains("this relay takes only TLS"),
        "{answer}"
    );
    let mut stream = TcpStream::connect(relay.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(&distgrad::wire::STREAM_MAGIC).unwrap();
    let mut got = Vec::new();
    let n = stream.read_to_end(&mut got).unwrap_or(0);
    assert_eq!(n, 0, "a plain data stream got an answer: {got:?}");
    let url = format!("wss://127.0.0.1:{}/ws", relay.addr.port());
    let joins = (0..2)
        .map(|r| {
            let mut j = join_opts("tls-only", "t", 2, r);
            j.ca_cert = Some(site.cert());
            j
        })
        .collect();
    let results = run_ranks(
        &url,
        joins,
        CommOptions::default(),
        |rank, comm| async move {
            let x = Tensor::vector(&[rank as f32 + 1.0]);
            comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await
                .map(|t| t.to_vec())
        },
    );
    assert_eq!(all_ok("tls-only", results), vec![vec![3.0]; 2]);
    let e = RelayConfig {
        require_tls: true,
        ..RelayConfig::default()
    }
    .check()
    .unwrap_err()
    .to_string();
    assert!(e.contains("require_tls needs a certificate"), "{e}");
}

#[test]
fn members_join_over_wss_with_the_relays_certificate_and_compute_exactly() {
    let site = Site::new("wss");
    let relay = site.relay();
    let url = format!("wss://127.0.0.1:{}/ws", relay.addr.port());
    let joins = (0..3)
        .map(|r| {
            let mut j = join_opts("tls", "t", 3, r);
            j.ca_cert = Some(site.cert());
            j
        })
        .collect();
    let res = run_ranks(
        &url,
        joins,
        CommOptions::default(),
        |rank, comm| async move {
            let x = Tensor::vector(&[rank as f32 + 1.0, 7.0]);
            comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await
                .map(|t| t.to_vec())
        },
    );
    assert_eq!(all_ok("all_reduce over wss", res), vec![vec![6.0, 21.0]; 3]);
}

#[test]
fn a_member_that_does_not_trust_the_certificate_is_told_why() {
    let site = Site::new("untrusted");
    let relay = site.relay();
    let url = format!("wss://127.0.0.1:{}/ws", relay.addr.port());
    let rt = common_relay::rank_runtime();
    let r = rt.block_on(WsTransport::connect(&url, join_opts("tls", "t", 1, 0)));
    match r {
        Err(Error::Relay { detail }) => {
            assert!(detail.contains("certificate"), "{detail}");
        }
        Err(e) => panic!("expected a relay error about the certificate, got {e:?}"),
        Ok(_) => panic!("a self-signed relay was trusted without its certificate"),
    }
}

/// The operator's STUN/TURN servers reach every member in its `ready`, never in the `welcome`
/// (which anyone who joins gets, before the room is full); with a TURN secret each member's
/// `ready` adds a TURN server with a credential of its own that expires (`<expiry>:r<room>-<rank>`
/// and its HMAC; the HMAC itself is checked against Python's in `src/relay/turn.rs`); a relay
/// without them names none; malformed lists are refused at start.
#[test]
fn ice_servers_reach_the_members_in_ready_and_bad_lists_are_refused() {
    use distgrad::wire::Control;
    let ice = serde_json::json!([
        { "urls": "stun:stun.example.org:3478" },
        { "urls": ["turn:turn.example.org:3478?transport=udp"], "username": "class", "credential": "pw" }
    ]);
    let turn = distgrad::relay::TurnRest {
        urls: vec!["turn:turn.example.org:3478".into()],
        secret: "north-wind-secret".into(),
        ttl: Duration::from_secs(600),
    };
    let relay = TestRelay::start(RelayConfig {
        ice_servers: Some(ice.clone()),
        turn: Some(turn.clone()),
        ..scripted()
    });
    let rt = common_relay::rank_runtime();
    // Two members of one room: (welcome's ice_servers, ready's ice_servers) for each.
    let both = |url: String, room: &'static str| {
        rt.block_on(async move {
            let mut out = Vec::new();
            let mut members = Vec::new();
            for rank in 0..2 {
                let mut c = common_relay::Raw::connect(&url).await;
                c.send_control(&Control::Join {
                    room: room.into(),
                    token: Some(common_relay::tok("ice")),
                    world: 2,
                    rank: Some(rank),
                    stream: false,
                })
                .await;
                match c.next_control().await {
                    Control::Welcome { ice_servers, .. } => out.push(ice_servers),
                    other => panic!("expected a welcome, got {other:?}"),
                }
                members.push(c);
            }
            let mut readies = Vec::new();
            for c in &mut members {
                loop {
                    match c.next_control().await {
                        Control::Ready { ice_servers, .. } => {
                            readies.push(ice_servers);
                            break;
                        }
                        Control::Members { .. } => continue,
                        other => panic!("expected ready, got {other:?}"),
                    }
                }
            }
            (out, readies)
        })
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (welcomes, readies) = both(relay.url(), "ice");
    assert_eq!(welcomes, vec![None, None], "no ICE servers in a welcome");
    for (rank, ready) in readies.iter().enumerate() {
        let list = ready
            .as_ref()
            .and_then(|v| v.as_array())
            .expect("ICE servers in ready");
        assert_eq!(
            &list[..2],
            ice.as_array().unwrap().as_slice(),
            "rank {rank}"
        );
        let t = &list[2];
        assert_eq!(t["urls"], serde_json::json!(["turn:turn.example.org:3478"]));
        let user = t["username"].as_str().unwrap();
        let (expiry, who) = user.split_once(':').unwrap();
        let expiry: u64 = expiry.parse().unwrap();
        assert!(
            (now + 600..=now + 610).contains(&expiry),
            "expiry {expiry}, now {now}, ttl 600"
        );
        assert!(
            who.starts_with('r') && who.ends_with(&format!("-{rank}")),
            "{user}"
        );
        let (_, want) = distgrad::relay::turn_credential(&turn, who, expiry - 600);
        assert_eq!(t["credential"], want.as_str(), "rank {rank}");
    }
    assert_ne!(readies[0], readies[1], "each member its own credential");
    let plain = TestRelay::default_config();
    assert_eq!(
        both(plain.url(), "plain"),
        (vec![None, None], vec![None, None])
    );
    for (bad, why) in [
        (serde_json::json!({ "urls": "stun:x" }), "array"),
        (serde_json::json!([{ "urls": "http://x" }]), "urls"),
        (serde_json::json!([{ "urls": [] }]), "urls"),
        (
            serde_json::json!([{ "urls": "stun:x", "password": "p" }]),
            "password",
        ),
        (
            serde_json::json!([{ "urls": "turn:x", "username": 7 }]),
            "username",
        ),
    ] {
        let cfg = RelayConfig {
            ice_servers: Some(bad.clone()),
            ..scripted()
        };
        let e = cfg.check().unwrap_err().to_string();
        assert!(e.contains(why), "{bad}: {e}");
    }
}
