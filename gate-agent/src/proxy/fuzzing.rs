//! The fuzz target's body (fuzz/fuzz_targets/proxy_request.rs), also run by the tests: any
//! bytes as a whole connection's input, served in memory by the real connection code, with
//! the stand-in metadata service behind it. Panics if the proxy panics, hangs, or forwards
//! anything the caller's access block does not serve, or with a forwarding header or
//! another `Host` than the destination's.
use std::{cell::RefCell, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    runtime::Runtime,
    sync::watch,
};

use super::{
    Caller, Callers, Limits, ProxyError,
    conn::{Shared, serve_connection},
    fake::{self, InMemory, Recorder},
    forward::Forwarder,
    headers,
    outcome::DecisionLog,
    table::Table,
};
use crate::{metrics::ProxyMetrics, policy::Policy};

/// The policy behind the target: an entry without paths, a narrowed one (with IMDSv2's token
/// `PUT` and GCP's `alt` parameter), and `served`.
pub(crate) const POLICY: &str = "platform: AWS
endpoints:
  - {name: imds, cidr: 169.254.169.254/32, ports: [80], protocols: [TCP]}
allow:
  - {name: plain, cgroup: plain}
  - name: csi
    cgroup: csi
    paths: [/latest/meta-data/instance-id, /latest/meta-data/placement/, /latest/api/token]
    methods: [GET, HEAD, PUT]
    queryParameters: [alt]
served:
  paths: [/latest/meta-data/placement/region]
";

const GENERATION: u32 = 3;

/// The kernel's side, fixed: every connection is the first byte's caller.
struct Fixed;

impl Callers for Fixed {
    fn caller(&self, _: &tokio::net::TcpStream) -> Result<Option<Caller>, ProxyError> {
        Ok(None)
    }
    fn live_generation(&self) -> Option<u32> {
        Some(GENERATION)
    }
}

thread_local! {
    static STATE: RefCell<Option<(Runtime, Arc<Table>)>> = const { RefCell::new(None) };
}

/// The caller a first byte stands for: mostly the narrowed entry and `served`, whose requests
/// may be forwarded; sometimes an entry without paths, one the policy does not have, or one
/// of another generation, whose requests never are.
fn caller(selector: u8) -> Caller {
    let (entry, generation) = match selector % 8 {
        0..=3 => (Some(1), GENERATION),
        4 | 5 => (None, GENERATION),
        6 => (Some(0), GENERATION),
        _ if selector & 0x80 == 0 => (Some(9), GENERATION),
        _ => (Some(1), GENERATION + 1),
    };
    Caller {
        cgroup_id: 42,
        workload: 42,
        generation,
        entry,
        endpoint: 0,
        dst: ([169, 254, 169, 254], 80).into(),
    }
}

/// Serve `data[1..]` as one connection from the caller `data[0]` picks, and check what reached
/// the metadata service.
pub(crate) fn one_connection(data: &[u8]) {
    if let Some((&selector, input)) = data.split_first() {
        let _ = serve_bytes(selector, input);
    }
}

/// Serve `input` as one connection from the caller `selector` picks; what reached the metadata
/// service, checked.
pub(crate) fn serve_bytes(selector: u8, input: &[u8]) -> Vec<Vec<u8>> {
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let (rt, table) = state.get_or_insert_with(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the fuzz target");
            let policy = Policy::parse("fuzz.yaml", POLICY).expect("the fuzz target's policy");
            (rt, Arc::new(Table::new(&policy, GENERATION)))
        });
        let caller = caller(selector);
        let recorder = Recorder::default();
        let (_tx, tables) = watch::channel(Some(Arc::clone(table)));
        let limits = Limits { header_read: Duration::from_secs(2), ..Limits::default() };
        let shared = Arc::new(Shared {
            tables,
            callers: Arc::new(Fixed),
            forwarder: Forwarder::new(Arc::new(InMemory(recorder.clone())), &limits),
            limits,
            metrics: ProxyMetrics::default(),
            log: DecisionLog::default(),
            paths: Arc::new(super::paths::PathLog::default()),
            // A fresh bucket per input: one request is never over the rate.
            rates: std::sync::Mutex::new(crate::ratelimit::Buckets::new(1)),
            sessions: Default::default(),
            answers: Default::default(),
        });
        rt.block_on(async {
            let (mut client, server) = tokio::io::duplex(64 * 1024);
            let served = tokio::spawn(serve_connection(server, caller, shared));
            let exchange = async {
                // Errors are the proxy closing early (a refusal): read what it said anyway.
                let _ = client.write_all(input).await;
                let _ = client.shutdown().await;
                let mut answer = Vec::new();
                let _ = client.read_to_end(&mut answer).await;
            };
            tokio::time::timeout(Duration::from_secs(20), exchange).await.expect("the proxy hung");
            served.await.expect("the connection task panicked");
        });
        let forwarded = recorder.requests();
        check_forwarded(table, &caller, &forwarded);
        forwarded
    })
}

/// Everything the stand-in received was the caller's to read, as the proxy should have sent it.
pub(crate) fn check_forwarded(table: &Table, caller: &Caller, forwarded: &[Vec<u8>]) {
    let grant = (caller.generation == table.generation()).then(|| table.grant(caller.entry).ok());
    for raw in forwarded {
        let text = String::from_utf8_lossy(raw);
        let Some(Some(grant)) = grant else {
            panic!("forwarded for a caller that may read nothing: {text}");
        };
        let (method, target) = fake::request_line(raw).expect("a request line");
        assert!(
            grant.access.judge(&method, &target).is_ok(),
            "forwarded {method} {target}\n{text}"
        );
        let hdrs = fake::headers(raw);
        let hosts: Vec<_> = hdrs.iter().filter(|(k, _)| k == "host").map(|(_, v)| v).collect();
        assert_eq!(hosts, [headers::host(caller.dst).to_str().unwrap_or("?")], "{text}");
        for (k, _) in &hdrs {
            assert!(!super::request::FORWARDING.contains(&k.as_str()), "forwarded {k}\n{text}");
            assert!(!headers::HOP_BY_HOP.contains(&k.as_str()), "forwarded {k}\n{text}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_run_clean() {
        let seeds: [&[u8]; 8] = [
            b"\0GET /latest/meta-data/instance-id HTTP/1.1\r\nHost: x\r\n\r\n",
            b"\x04GET /latest/meta-data/placement/region HTTP/1.1\r\n\r\n",
            b"\0PUT /latest/api/token HTTP/1.1\r\nX-aws-ec2-metadata-token-ttl-seconds: 21600\r\nContent-Length: 0\r\n\r\n",
            b"\0GET /latest/meta-data/iam/info HTTP/1.1\r\n\r\n",
            b"\0GET /latest/meta-data/placement/../iam/ HTTP/1.1\r\n\r\n",
            b"\x06GET /latest/meta-data/instance-id HTTP/1.1\r\n\r\n",
            b"\x87GET /latest/meta-data/instance-id HTTP/1.1\r\n\r\n",
            b"\0GET /latest/meta-data/instance-id HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ];
        for s in seeds {
            one_connection(s);
        }
        one_connection(b"");
        one_connection(b"\0");
        // No task outlives its connection: the fuzz target's memory stays flat.
        let alive = STATE.with(|s| {
            let s = s.borrow();
            let (rt, _) = s.as_ref().expect("the runtime");
            rt.block_on(async {
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
            });
            rt.metrics().num_alive_tasks()
        });
        assert_eq!(alive, 0);
    }

    #[test]
    #[should_panic(expected = "forwarded GET /latest/meta-data/iam/info")]
    fn the_check_catches_a_forbidden_path() {
        let table = Table::new(&Policy::parse("t", POLICY).expect("policy"), GENERATION);
        let raw =
            b"GET /latest/meta-data/iam/info HTTP/1.1\r\nhost: 169.254.169.254\r\n\r\n".to_vec();
        check_forwarded(&table, &caller(0), &[raw]);
    }
}
