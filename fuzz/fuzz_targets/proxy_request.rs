//! Any bytes as one whole connection to the metadata proxy (the first byte picks the caller:
//! a narrowed entry, `served`, an entry without paths, an unknown one, another generation),
//! served in memory by the proxy's own connection code with a stand-in metadata service
//! behind it. Fails on a panic, a hang, or a request forwarded that the caller's access block
//! does not serve (or with a forwarding header, a hop-by-hop header, another Host).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gate_agent::fuzz_proxy_connection(data);
});
