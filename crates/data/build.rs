//! Compiles the C shim that runs LMDB's map reads under a SIGBUS/SIGSEGV guard
//! (see `src/source/lmdb/guard.rs`), linked against the LMDB that
//! `lmdb-master-sys` compiles.

fn main() {
    println!("cargo::rerun-if-changed=csrc/lmdb_guard.c");
    cc::Build::new()
        .file("csrc/lmdb_guard.c")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("stoker_lmdb_guard");
}
