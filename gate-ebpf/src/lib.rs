//! The kernel programs live in `main.rs` (built for bpfel-unknown-none by gate-agent's
//! build.rs). This empty library exists so that gate-agent can name the crate as a
//! build-dependency and be rebuilt when it changes.
#![no_std]
