//! stoker's data layer: files to samples. Checked opens under a client's
//! rights (`fsaccess`), the sampler and its orders (`sampler`), the node-wide
//! caches of decoded samples and chunks (`cache`), the HDF5 and LMDB sources
//! and the transform wrapper over any source (`source`), and the offline
//! reports of `stoker inspect` (`inspect`).
//!
//! Layer 2 of 3 (`stoker-proto` ← `stoker-decode` ← **`stoker-data`** ←
//! `stoker-daemon`): it reads files and fills caller-provided rows, and knows
//! nothing of sockets, rings, streams or config files. `unsafe` is denied
//! except where C is called (`source::hdf5::field`, `source::lmdb::guard`)
//! and in two functions of `fsaccess` (`setgroups`, descriptors from systemd).

#![deny(unsafe_code)]

pub mod cache;
pub mod cancel;
pub mod fsaccess;
pub mod inspect;
pub mod sampler;
pub mod source;
