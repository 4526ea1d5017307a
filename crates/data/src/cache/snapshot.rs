//! The caches across a daemon restart: at a clean stop the daemon writes
//! every entry into a sealed memfd and hands it to systemd's file descriptor
//! store (`FileDescriptorStoreMax=`); the next daemon of the unit gets it
//! back (`LISTEN_FDS`, named [`FD_NAME`]), loads what fits its caches, and
//! asks systemd to forget it.
//!
//! Only entries whose files are still the same files are restored: each
//! dataset's files (resolved path and identity: device, inode, size, mtime,
//! ctime, birth time) travel with the snapshot, and the entries of a dataset
//! any of whose files changed, went or was never recorded are skipped. (Their
//! keys hold the old identities, so they could never be hit; restoring them
//! would only take memory.)
//!
//! Format (little-endian): magic `STOKCSH2`, the daemon version, then
//! records: `tag u8` (1 label, 4 files, 2 chunk, 3 sample, 0 end). A label
//! is `dataset u64, len u32, utf-8`; files `dataset u64, count u32` and per
//! file `len u32, utf-8 path, dev u64, ino u64, size u64, mtime i128, ctime
//! i128, btime i128`; a chunk `space u64, item u64, dataset u64, lo u64, hi
//! u64, len u64, bytes`; a sample the same plus `dtype u8, ndim u8, dims
//! u64…` before `len`. Sizes are checked against the caches' capacities
//! before anything is allocated: a snapshot from another version or a
//! damaged one is refused and the daemon starts cold.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use stoker_proto::DType;

use super::{Caches, Decoded, Key, Uses};
use stoker_decode::codec::{AlignedBuf, ArrayInfo};

/// The name of the fd in the store.
pub const FD_NAME: &str = "stoker-cache";

const MAGIC: &[u8; 8] = b"STOKCSH2";

/// Bytes of paths one dataset's files may take when loaded back.
const MAX_PATH_BYTES: usize = 64 << 20;

const DTYPES: [DType; 11] = [
    DType::Bool,
    DType::U8,
    DType::I8,
    DType::U16,
    DType::I16,
    DType::U32,
    DType::I32,
    DType::U64,
    DType::I64,
    DType::F16,
    DType::F32,
];

fn dtype_code(d: DType) -> u8 {
    match DTYPES.iter().position(|&x| x == d) {
        Some(at) => at as u8,
        None => 255, // F64
    }
}

fn dtype_of(code: u8) -> io::Result<DType> {
    match code {
        255 => Ok(DType::F64),
        c => DTYPES.get(c as usize).copied().ok_or_else(|| bad("unknown dtype")),
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("cache snapshot: {what}"))
}

/// What a snapshot held, or what was loaded from one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Entries.
    pub entries: u64,
    /// Bytes of values.
    pub bytes: u64,
    /// Entries skipped on import because their files changed (or are gone).
    pub stale: u64,
}

impl Caches {
    /// Writes every entry into a new memfd, sealed against writes, for the fd store.
    pub fn export(&self) -> io::Result<(OwnedFd, Counts)> {
        let fd =
            rustix::fs::memfd_create(FD_NAME, rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING)?;
        let mut file = File::from(fd);
        let mut counts = Counts::default();
        {
            let mut w = BufWriter::with_capacity(1 << 20, &mut file);
            w.write_all(MAGIC)?;
            put_str(&mut w, env!("CARGO_PKG_VERSION"))?;
            for (dataset, label) in self.futures.labels.read().unwrap_or_else(std::sync::PoisonError::into_inner).iter()
            {
                w.write_all(&[1])?;
                w.write_all(&dataset.to_le_bytes())?;
                put_str(&mut w, label)?;
            }
            let chunks = self.chunks.snapshot();
            let samples = self.samples.snapshot();
            let datasets: std::collections::BTreeSet<u64> =
                chunks.iter().map(|e| e.2.dataset).chain(samples.iter().map(|e| e.2.dataset)).collect();
            for dataset in datasets {
                let Some(files) = self.futures.origins_of(dataset) else { continue };
                w.write_all(&[4])?;
                w.write_all(&dataset.to_le_bytes())?;
                w.write_all(&u32::try_from(files.len()).map_err(|_| bad("too many files"))?.to_le_bytes())?;
                for (path, id) in files.iter() {
                    put_str(&mut w, &path.to_string_lossy())?;
                    for v in [id.dev, id.ino, id.size] {
                        w.write_all(&v.to_le_bytes())?;
                    }
                    for v in [id.mtime_ns, id.ctime_ns, id.btime_ns] {
                        w.write_all(&v.to_le_bytes())?;
                    }
                }
            }
            let head = |w: &mut BufWriter<&mut File>, tag: u8, key: &Key, uses: &Uses| -> io::Result<()> {
                w.write_all(&[tag])?;
                for v in [key.space, key.item, uses.dataset, uses.lo, uses.hi] {
                    w.write_all(&v.to_le_bytes())?;
                }
                Ok(())
            };
            for (key, value, uses) in chunks {
                head(&mut w, 2, &key, &uses)?;
                w.write_all(&(value.len() as u64).to_le_bytes())?;
                w.write_all(&value)?;
                counts.entries += 1;
                counts.bytes += value.len() as u64;
            }
            for (key, value, uses) in samples {
                head(&mut w, 3, &key, &uses)?;
                let ndim = u8::try_from(value.info.shape.len()).map_err(|_| bad("too many dimensions"))?;
                w.write_all(&[dtype_code(value.info.dtype), ndim])?;
                for d in &value.info.shape {
                    w.write_all(&d.to_le_bytes())?;
                }
                let bytes = value.data.as_slice();
                w.write_all(&(bytes.len() as u64).to_le_bytes())?;
                w.write_all(bytes)?;
                counts.entries += 1;
                counts.bytes += bytes.len() as u64;
            }
            w.write_all(&[0])?;
            w.flush()?;
        }
        use rustix::fs::SealFlags;
        rustix::fs::fcntl_add_seals(&file, SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL)?;
        Ok((file.into(), counts))
    }

    /// Loads a snapshot from [`Caches::export`] (of this daemon version),
    /// as much as the caches take.
    pub fn import(&self, fd: OwnedFd) -> io::Result<Counts> {
        let mut file = File::from(fd);
        file.rewind()?;
        let mut r = BufReader::with_capacity(1 << 20, file);
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(bad("not a stoker cache snapshot"));
        }
        let version = get_str(&mut r)?;
        if version != env!("CARGO_PKG_VERSION") {
            return Err(bad(&format!("written by stoker {version}, this is {}", env!("CARGO_PKG_VERSION"))));
        }
        let mut counts = Counts::default();
        // Datasets whose files are all still the files the entries came from.
        let mut same = std::collections::HashSet::new();
        loop {
            let mut tag = [0u8; 1];
            r.read_exact(&mut tag)?;
            match tag[0] {
                0 => return Ok(counts),
                1 => {
                    let dataset = get_u64(&mut r)?;
                    let label = get_str(&mut r)?;
                    self.futures.label(dataset, &label);
                }
                4 => {
                    let dataset = get_u64(&mut r)?;
                    let mut n = [0u8; 4];
                    r.read_exact(&mut n)?;
                    let n = u32::from_le_bytes(n) as usize;
                    if n > super::MAX_ORIGIN_FILES {
                        return Err(bad("a dataset of more files than recorded"));
                    }
                    let mut files = Vec::with_capacity(n.min(4096));
                    let mut path_bytes = 0usize;
                    let mut unchanged = true;
                    for _ in 0..n {
                        let path = std::path::PathBuf::from(get_str(&mut r)?);
                        let [dev, ino, size] = [get_u64(&mut r)?, get_u64(&mut r)?, get_u64(&mut r)?];
                        let [mtime_ns, ctime_ns, btime_ns] = [get_i128(&mut r)?, get_i128(&mut r)?, get_i128(&mut r)?];
                        let id = crate::fsaccess::FileId { dev, ino, size, mtime_ns, ctime_ns, btime_ns };
                        // Checked now by path, as the daemon: a path swapped for
                        // another file gives another identity, and no entry is
                        // served from it (the keys hold the identity too).
                        unchanged &= crate::fsaccess::FileId::of_path(&path).is_ok_and(|now| now == id);
                        // Kept to be recorded again, within a bound on memory.
                        path_bytes += path.as_os_str().len();
                        if unchanged && path_bytes <= MAX_PATH_BYTES {
                            files.push((path, id));
                        }
                    }
                    if unchanged {
                        same.insert(dataset);
                        if path_bytes > MAX_PATH_BYTES {
                            continue; // restored, but not recorded for the next snapshot
                        }
                        self.futures.origins(dataset, files);
                    }
                }
                2 | 3 => {
                    let mut v = [0u64; 5];
                    for x in &mut v {
                        *x = get_u64(&mut r)?;
                    }
                    let key = Key { space: v[0], item: v[1] };
                    let uses = Uses { dataset: v[2], lo: v[3], hi: v[4] };
                    let info = if tag[0] == 3 {
                        let mut dn = [0u8; 2];
                        r.read_exact(&mut dn)?;
                        let dtype = dtype_of(dn[0])?;
                        let shape = (0..dn[1]).map(|_| get_u64(&mut r)).collect::<io::Result<Vec<u64>>>()?;
                        Some(ArrayInfo { dtype, shape })
                    } else {
                        None
                    };
                    let len = get_u64(&mut r)?;
                    if !same.contains(&uses.dataset) {
                        // Its files changed (or were never recorded): skip its bytes.
                        io::copy(&mut (&mut r).take(len), &mut io::sink())?;
                        counts.stale += 1;
                        continue;
                    }
                    let capacity = if info.is_some() { self.samples.capacity() } else { self.chunks.capacity() };
                    let fits = usize::try_from(len).ok().filter(|&n| n <= capacity);
                    let Some(n) = fits else {
                        // Larger than this daemon's cache: skip its bytes.
                        io::copy(&mut (&mut r).take(len), &mut io::sink())?;
                        continue;
                    };
                    let admitted = match info {
                        Some(info) => {
                            if info.shape.iter().try_fold(info.dtype.size() as u64, |a, &d| a.checked_mul(d))
                                != Some(len)
                            {
                                return Err(bad("a sample's shape disagrees with its size"));
                            }
                            let mut data = AlignedBuf::new();
                            r.read_exact(data.resize(n))?;
                            self.samples.insert(key, Arc::new(Decoded { info, data }), n, uses)
                        }
                        None => {
                            let mut data = vec![0u8; n];
                            r.read_exact(&mut data)?;
                            self.chunks.insert(key, Arc::new(data), n, uses)
                        }
                    };
                    if admitted {
                        counts.entries += 1;
                        counts.bytes += len;
                    }
                }
                _ => return Err(bad("unknown record")),
            }
        }
    }
}

fn put_str(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u32).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn get_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_i128(r: &mut impl Read) -> io::Result<i128> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    Ok(i128::from_le_bytes(b))
}

fn get_str(r: &mut impl Read) -> io::Result<String> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let len = u32::from_le_bytes(b) as usize;
    if len > 4096 {
        return Err(bad("a label longer than 4096 bytes"));
    }
    let mut s = vec![0u8; len];
    r.read_exact(&mut s)?;
    String::from_utf8(s).map_err(|_| bad("a label that is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Policy;

    fn origins_of_a_new_file(dir: &std::path::Path, name: &str) -> Vec<(std::path::PathBuf, crate::fsaccess::FileId)> {
        let path = dir.join(name);
        std::fs::write(&path, b"data").unwrap();
        let id = crate::fsaccess::FileId::of_path(&path).unwrap();
        vec![(path, id)]
    }

    #[test]
    fn a_snapshot_round_trips_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let caches = Caches::new(1 << 20, 1 << 20, Policy::Belady);
        caches.futures.label(7, "train");
        caches.futures.origins(7, origins_of_a_new_file(dir.path(), "train.h5"));
        let uses = Uses { dataset: 7, lo: 0, hi: 16 };
        caches.chunks.insert(Key { space: 1, item: 2 }, Arc::new(vec![9u8; 100]), 100, uses);
        let info = ArrayInfo { dtype: DType::U16, shape: vec![2, 3] };
        let sample = Decoded::copy_of(&info, &[1u8; 12]);
        caches.samples.insert(Key { space: 3, item: 4 }, Arc::new(sample), 12, Uses::one(7, 4));
        let (fd, counts) = caches.export().unwrap();
        assert_eq!(counts, Counts { entries: 2, bytes: 112, stale: 0 });

        let fresh = Caches::new(1 << 20, 1 << 20, Policy::Belady);
        let loaded = fresh.import(fd.try_clone().unwrap()).unwrap();
        assert_eq!(loaded, counts);
        assert_eq!(*fresh.chunks.get(&Key { space: 1, item: 2 }, 7).unwrap(), vec![9u8; 100]);
        let got = fresh.samples.get(&Key { space: 3, item: 4 }, 7).unwrap();
        assert_eq!((got.info.clone(), got.data.as_slice()), (info, &[1u8; 12][..]));
        assert_eq!(fresh.futures.label_of(7).as_deref(), Some("train"));

        // A smaller daemon takes what fits.
        let small = Caches::new(50, 1 << 20, Policy::Belady);
        assert_eq!(small.import(fd.try_clone().unwrap()).unwrap(), Counts { entries: 1, bytes: 12, stale: 0 });

        // Garbage is refused, and loads nothing.
        let junk = rustix::fs::memfd_create("junk", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = File::from(junk);
        f.write_all(b"STOKCSH2\xff\xff\xff\xff").unwrap();
        assert!(fresh.import(f.into()).is_err());
    }

    #[test]
    fn entries_of_files_changed_gone_or_unrecorded_are_not_restored() {
        let dir = tempfile::tempdir().unwrap();
        let caches = Caches::new(1 << 20, 1 << 20, Policy::Belady);
        let uses = |dataset| Uses { dataset, lo: 0, hi: 16 };
        for (dataset, name) in [(1, "kept.h5"), (2, "changed.h5"), (3, "gone.h5")] {
            caches.futures.origins(dataset, origins_of_a_new_file(dir.path(), name));
            caches.chunks.insert(Key { space: dataset, item: 0 }, Arc::new(vec![1u8; 10]), 10, uses(dataset));
        }
        // Dataset 4's files were never recorded.
        caches.chunks.insert(Key { space: 4, item: 0 }, Arc::new(vec![1u8; 10]), 10, uses(4));
        let (fd, counts) = caches.export().unwrap();
        assert_eq!(counts.entries, 4);
        // Rewritten in place with the same size (a new ctime), and removed.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(dir.path().join("changed.h5"), b"DATA").unwrap();
        std::fs::remove_file(dir.path().join("gone.h5")).unwrap();

        let fresh = Caches::new(1 << 20, 1 << 20, Policy::Belady);
        assert_eq!(fresh.import(fd).unwrap(), Counts { entries: 1, bytes: 10, stale: 3 });
        assert!(fresh.chunks.get(&Key { space: 1, item: 0 }, 1).is_some());
        for d in [2, 3, 4] {
            assert!(fresh.chunks.get(&Key { space: d, item: 0 }, d).is_none());
        }
    }
}
