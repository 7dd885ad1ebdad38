//! Any bytes as an Ethernet frame or a bare IP packet (the first byte picks which, and for a
//! bare packet the next two the protocol the sk_buff claims), read by the parser the packet
//! programs run and checked against a plain reading of the header. Fails on a panic, a
//! protected destination passed, another one stopped, or an address, port or fragment read
//! differently from the header (`gate-common/src/packet/fuzzing.rs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gate_common::packet::fuzzing::check(data);
});
