//! stoker's decode layer: pure computation from bytes to arrays. HDF5 filter
//! pipelines (`filter`), value codecs and image modes (`codec`), the JPEG
//! decoder over libjpeg-turbo (`libjpeg`) and the transform engine
//! (`transform`).
//!
//! Layer 1 of 3 (`stoker-proto` ← **`stoker-decode`** ← `stoker-data` ←
//! `stoker-daemon`): nothing here opens a file, a socket or a thread pool,
//! and nothing links libhdf5, LMDB or tokio, so it builds and tests alone.
//! Every input is treated as hostile bytes: sizes are checked before they are
//! allocated and a bad input is an error, never a panic. `unsafe` is denied
//! except in `libjpeg` (the FFI edge).

#![deny(unsafe_code)]

pub mod codec;
pub mod filter;
pub mod libjpeg;
pub mod transform;
