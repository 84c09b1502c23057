//! `distgrad relay`: the relay server on one port (rooms, routing, WebRTC signaling, data
//! streams, and the built web app's files), until Ctrl-C or SIGTERM.

use super::runtime;

/// Flags of `distgrad relay`.
#[derive(clap::Args)]
pub struct RelayArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Serve this folder (the built web app) at `/`.
    #[arg(long = "static")]
    static_dir: Option<std::path::PathBuf>,
    /// Serve the web app without the cross-origin isolation headers (COOP same-origin, COEP
    /// require-corp). Without them the page's clock steps by 100 µs instead of 5 µs (Chromium),
    /// which coarsens the room benchmark's sub-millisecond figures.
    #[arg(long)]
    no_isolation: bool,
    /// Largest data-frame payload in bytes, at least 1024 (members split larger messages; the
    /// welcome tells them this limit).
    #[arg(long, default_value_t = distgrad::wire::DEFAULT_FRAME_PAYLOAD)]
    max_frame: usize,
    /// Largest world size of a room.
    #[arg(long, default_value_t = 64)]
    max_members: u32,
    /// Most rooms at once.
    #[arg(long, default_value_t = 256)]
    max_rooms: usize,
    /// Bytes that may queue for one member before its senders are slowed down.
    #[arg(long, default_value_t = 16 << 20)]
    max_pending_bytes: usize,
    /// Bytes that may wait in all members' queues together (e.g. 2G, 512M): beyond it senders
    /// wait, and one that waits twice the idle timeout is dropped. Default: a quarter of this
    /// host's memory, at most 4G.
    #[arg(long, value_parser = distgrad::relay::parse_bytes)]
    memory_budget: Option<usize>,
    /// Close connections silent for this many seconds.
    #[arg(long, default_value_t = 30)]
    idle_timeout_secs: u64,
    /// Seconds a new connection has to send its join (and an announced data stream to attach).
    #[arg(long, default_value_t = 10)]
    join_timeout_secs: u64,
    /// Most connections open at once from one address (a class behind one NAT shares one).
    #[arg(long, default_value_t = 512)]
    max_conns_per_addr: usize,
    /// Most rooms open at once (started or not) per address that created them; an IPv6
    /// address counts as its /64.
    #[arg(long, default_value_t = 64)]
    max_rooms_per_addr: usize,
    /// Most connections open at once in all (default: half the open-file limit, less 64).
    #[arg(long)]
    max_conns: Option<usize>,
    /// Close a room that has not filled this many seconds after it was created.
    #[arg(long, default_value_t = 300)]
    room_fill_secs: u64,
    /// Let clients create rooms with a token of their own (32 hex digits), for scripted setups
    /// whose ranks all start with the token. Default: the relay makes every room's token.
    #[arg(long)]
    client_tokens: bool,
    /// Serve HTTPS and wss:// with this PEM certificate chain (browsers give WebGPU only to
    /// secure pages); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// With --tls-cert: refuse plain http:// and ws:// connections and plain data streams (not
    /// behind a proxy that terminates TLS).
    #[arg(long, requires = "tls_cert")]
    require_tls: bool,
    /// A STUN or TURN server for the tabs' WebRTC links (repeat; e.g. stun:stun.example.org:3478).
    /// Default: none, tabs link only through host candidates (one network).
    #[arg(long)]
    ice_server: Vec<String>,
    /// STUN/TURN servers with credentials: a JSON file holding a WebRTC `iceServers` array
    /// (`[{"urls": "turn:…", "username": "…", "credential": "…"}]`), added to --ice-server.
    #[arg(long)]
    ice_servers_file: Option<std::path::PathBuf>,
    /// A TURN server that takes credentials made with a shared secret (coturn's
    /// use-auth-secret; repeat for several URLs, e.g. turn:turn.example.org:3478); needs
    /// --turn-secret-file. Each member gets, in its ready, a credential of its own that expires.
    #[arg(long, requires = "turn_secret_file")]
    turn_url: Vec<String>,
    /// A file holding the secret shared with the TURN server (coturn's static-auth-secret).
    #[arg(long, requires = "turn_url")]
    turn_secret_file: Option<std::path::PathBuf>,
    /// How long a TURN credential lasts, in seconds.
    #[arg(long, default_value_t = 3600)]
    turn_ttl_secs: u64,
    /// Browser origins that may use the relay besides the page it serves itself (repeat or
    /// comma-separate; e.g. http://127.0.0.1:8080 for `trunk serve`); `*` lets any page in.
    /// Default: only the relay's own page.
    #[arg(long, value_delimiter = ',')]
    allowed_origin: Vec<String>,
    /// The token of the admin page (/admin: rooms, members, closing a room, removing a member,
    /// the relay's use against its budgets). Default: one made at start and printed.
    #[arg(long)]
    admin_token: Option<String>,
    /// Another relay the page served here may connect to (repeat or comma-separate; e.g.
    /// wss://other.example.org): named in the page's Content-Security-Policy, which otherwise
    /// allows only this relay. A link's ?relay= to it still asks the student to confirm.
    #[arg(long, value_delimiter = ',')]
    connect_src: Vec<String>,
    /// A reverse proxy in front of the relay (its address; repeat or comma-separate): members
    /// connecting through it are counted against the client it names in X-Forwarded-For (or
    /// Forwarded), not against the proxy.
    #[arg(long, value_delimiter = ',')]
    trusted_proxy: Vec<std::net::IpAddr>,
    /// Refuse data streams: native members send their data on the WebSocket too.
    #[arg(long)]
    no_streams: bool,
    /// Forward data-stream payloads through a buffer instead of splice(2) (Linux).
    #[arg(long)]
    no_splice: bool,
    /// No Unix-domain socket for data streams: members on this host attach over TCP too.
    #[arg(long)]
    no_local_streams: bool,
}

/// Run `distgrad relay`.
pub fn run(a: RelayArgs) -> distgrad::Result<()> {
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(
            distgrad::relay::tls_config(cert, key)
                .map_err(|e| distgrad::Error::Input(format!("relay: TLS: {e}")))?,
        ),
        _ => None,
    };
    let mut ice: Vec<serde_json::Value> = a
        .ice_server
        .iter()
        .map(|u| serde_json::json!({ "urls": u }))
        .collect();
    if let Some(f) = &a.ice_servers_file {
        let text = std::fs::read_to_string(f)
            .map_err(|e| distgrad::Error::Input(format!("{}: {e}", f.display())))?;
        match serde_json::from_str(&text) {
            Ok(serde_json::Value::Array(more)) => ice.extend(more),
            Ok(_) => {
                return Err(distgrad::Error::Input(format!(
                    "{}: expected a JSON array of ICE servers",
                    f.display()
                )));
            }
            Err(e) => {
                return Err(distgrad::Error::Input(format!("{}: {e}", f.display())));
            }
        }
    }
    let cfg = distgrad::relay::RelayConfig {
        tls,
        ice_servers: (!ice.is_empty()).then_some(serde_json::Value::Array(ice)),
        turn: match &a.turn_secret_file {
            None => None,
            Some(f) => {
                let secret = std::fs::read_to_string(f)
                    .map_err(|e| distgrad::Error::Input(format!("{}: {e}", f.display())))?
                    .trim()
                    .to_string();
                if secret.is_empty() {
                    return Err(distgrad::Error::Input(format!(
                        "{}: the TURN secret is empty",
                        f.display()
                    )));
                }
                Some(distgrad::relay::TurnRest {
                    urls: a.turn_url.clone(),
                    secret,
                    ttl: std::time::Duration::from_secs(a.turn_ttl_secs.max(1)),
                })
            }
        },
        require_tls: a.require_tls,
        max_frame: a.max_frame,
        max_members: a.max_members,
        max_rooms: a.max_rooms,
        max_pending_bytes: a.max_pending_bytes,
        memory_budget: a
            .memory_budget
            .unwrap_or_else(distgrad::relay::default_memory_budget),
        idle_timeout: std::time::Duration::from_secs(a.idle_timeout_secs),
        join_timeout: std::time::Duration::from_secs(a.join_timeout_secs),
        max_conns_per_addr: a.max_conns_per_addr,
        max_conns: a.max_conns.unwrap_or_else(|| {
            // The host's limit, not a low default soft limit, sets the default cap.
            let _ = distgrad::relay::raise_file_limit();
            distgrad::relay::default_max_conns()
        }),
        max_rooms_per_addr: a.max_rooms_per_addr,
        room_fill_timeout: std::time::Duration::from_secs(a.room_fill_secs),
        client_tokens: a.client_tokens,
        allowed_origins: a.allowed_origin,
        trusted_proxies: a.trusted_proxy,
        connect_src: a.connect_src,
        admin_token: Some(match a.admin_token {
            Some(t) if t.trim().len() >= 16 => t.trim().to_string(),
            Some(_) => {
                return Err(distgrad::Error::Input(
                    "relay: --admin-token must be at least 16 characters (e.g. `openssl rand -hex \
                     16`)"
                        .into(),
                ));
            }
            None => distgrad::relay::random_token()
                .map_err(|e| distgrad::Error::Input(format!("relay: {e}")))?,
        }),
        static_dir: a.static_dir,
        cross_origin_isolated: !a.no_isolation,
        streams: !a.no_streams,
        splice: !a.no_splice,
        local_streams: !a.no_local_streams,
    };
    serve(&a.addr, cfg)
}

fn serve(addr: &str, cfg: distgrad::relay::RelayConfig) -> distgrad::Result<()> {
    cfg.check()
        .map_err(|e| distgrad::Error::Input(format!("relay: {e}")))?;
    runtime(true)?.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| distgrad::Error::Input(format!("cannot listen on {addr}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| distgrad::Error::Input(e.to_string()))?;
        say_setup(&cfg, local);
        // Ctrl-C or SIGTERM (kill, service managers): stop cleanly, which also removes the
        // Unix-domain socket's directory. The handlers exist before anything is served: the
        // shutdown future first runs inside `serve`, after the socket directory is made.
        #[cfg(unix)]
        let stop = {
            use tokio::signal::unix::{SignalKind, signal};
            let handler = |kind: SignalKind| {
                signal(kind).map_err(|e| {
                    distgrad::Error::Input(format!("cannot handle a stop signal: {e}"))
                })
            };
            let (mut int, mut term) = (
                handler(SignalKind::interrupt())?,
                handler(SignalKind::terminate())?,
            );
            async move {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
        };
        #[cfg(not(unix))]
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        let shutdown = async move {
            stop.await;
            println!("distgrad relay: shutting down");
        };
        distgrad::relay::serve(listener, cfg, shutdown)
            .await
            .map_err(|e| distgrad::Error::Input(format!("relay failed: {e}")))
    })
}

/// Say where the relay listens and how it is set up: TLS, data streams, limits, the admin page,
/// trusted proxies, ICE servers, the web app.
fn say_setup(cfg: &distgrad::relay::RelayConfig, local: std::net::SocketAddr) {
    let (ws, http) = if cfg.tls.is_some() {
        ("wss", "https")
    } else {
        ("ws", "http")
    };
    println!("distgrad relay listening on {ws}://{local}/ws");
    if cfg.tls.is_some() {
        println!(
            "{}",
            if cfg.require_tls {
                "TLS on and required (plain ws://, http:// and data streams refused)"
            } else {
                "TLS on (plain ws:// and http:// on the same port still work, e.g. behind a proxy)"
            }
        );
    }
    println!(
        "native members' data streams (same port): {}",
        match (cfg.streams, cfg.splice) {
            (false, _) => "off (data on the WebSockets)",
            (true, true) => "on (forwarded with splice where the OS has it)",
            (true, false) => "on (forwarded through a buffer)",
        }
    );
    if cfg.streams {
        println!(
            "members on this host: {}",
            if cfg.local_streams && cfg!(unix) {
                "data streams on a Unix-domain socket (its path is in their welcome)"
            } else {
                "data streams over TCP"
            }
        );
    }
    println!(
        "limits: memory for queued data {} MiB; rooms {} (world <= {}); connections {}; per \
         address {} connections, {} rooms open; a room fills within {}s; join within {}s; idle \
         {}s; frames <= {} bytes; room tokens: {}; origins: {}",
        cfg.memory_budget >> 20,
        cfg.max_rooms,
        cfg.max_members,
        cfg.max_conns,
        cfg.max_conns_per_addr,
        cfg.max_rooms_per_addr,
        cfg.room_fill_timeout.as_secs(),
        cfg.join_timeout.as_secs(),
        cfg.idle_timeout.as_secs(),
        cfg.max_frame,
        if cfg.client_tokens {
            "made by the relay, or chosen by the creator (32 hex digits)"
        } else {
            "made by the relay"
        },
        if cfg.allowed_origins.is_empty() {
            "its own page".to_string()
        } else {
            format!("its own page, {}", cfg.allowed_origins.join(", "))
        },
    );
    if let Some(t) = &cfg.admin_token {
        println!("admin page: {http}://{local}/admin#token={t}");
    }
    if !cfg.trusted_proxies.is_empty() {
        let list: Vec<String> = cfg.trusted_proxies.iter().map(|p| p.to_string()).collect();
        println!(
            "trusted proxies (their members are counted per X-Forwarded-For client): {}",
            list.join(", ")
        );
    }
    match cfg.ice_servers.as_ref().and_then(|v| v.as_array()) {
        Some(list) => println!(
            "ICE servers for the tabs' WebRTC links: {}",
            list.iter()
                .map(|s| s["urls"].to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => println!(
            "ICE servers: none (tabs link through host candidates; tabs on other networks \
             use the relay; --ice-server adds STUN/TURN)"
        ),
    }
    if let Some(t) = &cfg.turn {
        println!(
            "TURN for the tabs: {} (a credential per member, in its ready, valid {}s)",
            t.urls.join(", "),
            t.ttl.as_secs()
        );
    }
    if let Some(d) = &cfg.static_dir {
        println!("serving {} at {http}://{local}/", d.display());
    }
}
