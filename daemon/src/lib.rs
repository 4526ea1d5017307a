//! stoker's daemon: config, HDF5 source, sampler, shared-memory rings, streams
//! and the tokio control server, plus the CLI subcommands that talk to it.
//! `main.rs` only parses flags and calls into this crate.

pub mod cache;
pub mod cli;
pub mod codec;
pub mod config;
pub mod dataset;
pub mod filter;
pub mod fsaccess;
pub mod inspect;
pub mod libjpeg;
pub mod metrics;
pub mod ring;
pub mod sampler;
pub mod server;
pub mod source;
pub mod stream;
pub mod transform;
