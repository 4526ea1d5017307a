//! stoker's serving layer: config, the dataset registry, shared-memory rings,
//! streams and their worker pool, metrics, the tokio control server, and the
//! CLI subcommands that talk to it. `main.rs` only parses flags and calls
//! [`cli::run`].
//!
//! Layer 3 of 3 (`stoker-proto` ← `stoker-decode` ← `stoker-data` ←
//! **`stoker-daemon`**). `unsafe` is denied except in `ring` (the only module
//! that maps shared memory).

#![deny(unsafe_code)]

pub mod cli;
pub mod config;
pub mod dataset;
pub mod error;
pub mod helper;
pub mod memory;
pub mod metrics;
#[allow(unsafe_code)] // maps the rings' memfds and hands out slot slices
pub mod ring;
pub mod server;
pub mod stream;
