//! End-to-end: the real `stoker` binary serving HDF5 files written by h5py,
//! read through `stoker-client`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stoker_client::proto::{DatasetRef, ErrorKind, Hdf5Dataset, OpenStream, WindowDef};
use stoker_client::{Batch, Client, ClientError, Stream};

/// Python with h5py: $STOKER_PYTHON, else the repo's .venv, else python3.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("STOKER_PYTHON") {
        return p.into();
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if venv.exists() { venv } else { "python3".into() }
}

/// Two files (70 + 30 rows): `x` f32 [N, 3] with x[i, j] = 10 i + j, `id` big-endian u16 = i.
fn write_files(dir: &Path) {
    let script = r#"
import sys, h5py, numpy as np
d = sys.argv[1]
start = 0
for k, n in enumerate([70, 30]):
    i = np.arange(start, start + n)
    with h5py.File(f"{d}/part{k}.h5", "w") as f:
        f["x"] = (i[:, None] * 10 + np.arange(3)[None, :]).astype("f4")
        f.create_dataset("id", data=i, dtype=">u2", chunks=(16,), compression="gzip")
    start += n
"#;
    let status = Command::new(python()).arg("-c").arg(script).arg(dir).status().expect("run python");
    assert!(status.success(), "writing HDF5 files with h5py failed (is h5py installed? run scripts/setup.sh)");
}

struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    fn start(dir: &Path, depth: u32) -> Daemon {
        let socket = dir.join("stoker.sock");
        let config = dir.join("stoker.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nallowed_roots = [{dir:?}]\n[workers]\nthreads = 2\n[ring]\ndepth = {depth}\n\
                 [datasets.parts]\nformat = \"hdf5\"\nfiles = \"{}/part*.h5\"\nfields = {{ x = \"x\", id = \"id\" }}\n",
                dir.display()
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_stoker"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--socket")
            .arg(&socket)
            .stderr(Stdio::null())
            .spawn()
            .expect("start stoker");
        let deadline = Instant::now() + Duration::from_secs(20);
        while Client::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "daemon did not start listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sample ids (field `id`) of a batch.
fn ids(batch: &Batch) -> Vec<u16> {
    batch.field("id").unwrap().as_slice::<u16>().unwrap().to_vec()
}

/// The ids of every batch left in the stream's epoch.
fn rest_of_epoch(stream: &Stream) -> Vec<u16> {
    let mut out = Vec::new();
    while let Some(b) = stream.next().unwrap() {
        out.extend(ids(&b));
    }
    out
}

fn open(batch_size: u64, rank: u64, world_size: u64, shuffle: bool) -> OpenStream {
    OpenStream {
        dataset: DatasetRef::Named("parts".into()),
        batch_size,
        shuffle,
        seed: 3,
        drop_last: false,
        rank,
        world_size,
        epoch: 0,
        step: 0,
        block: None,
    }
}

#[test]
fn serves_every_sample_once_per_epoch_with_the_written_values() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let daemon = Daemon::start(dir.path(), 3);
    let mut seen = vec![0u32; 100];
    let mut orders = Vec::new();
    for rank in 0..2 {
        let client = Client::connect(&daemon.socket).unwrap();
        let stream = client.open_stream(open(16, rank, 2, true)).unwrap();
        assert_eq!(stream.info().batches_per_epoch, 4); // 50 per rank, batches of 16
        let mut order = Vec::new();
        while let Some(batch) = stream.next().unwrap() {
            let x = batch.field("x").unwrap();
            let ids = ids(&batch);
            let xs = x.as_slice::<f32>().unwrap();
            assert_eq!(x.shape(), vec![batch.rows(), 3]);
            for (row, &id) in ids.iter().enumerate() {
                let want: Vec<f32> = (0..3).map(|j| (u32::from(id) * 10 + j) as f32).collect();
                assert_eq!(&xs[row * 3..row * 3 + 3], &want[..], "sample {id}");
                seen[id as usize] += 1;
            }
            order.extend(ids);
        }
        orders.push(order);
    }
    assert!(seen.iter().all(|&c| c == 1), "each sample exactly once: {seen:?}");
    assert_ne!(orders[0], (0..50).map(|i| i * 2).collect::<Vec<u16>>());
}

#[test]
fn holding_more_batches_than_the_depth_grows_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let daemon = Daemon::start(dir.path(), 2);
    let client = Client::connect(&daemon.socket).unwrap();
    let stream = client.open_stream(open(10, 0, 1, false)).unwrap();
    // Keep every batch of the epoch: five times the ring's depth.
    let held: Vec<Batch> = (0..10).map(|_| stream.next().unwrap().unwrap()).collect();
    assert!(stream.next().unwrap().is_none(), "the epoch has 10 batches");
    for (step, batch) in held.iter().enumerate() {
        assert_eq!(batch.step(), step as u64);
        assert_eq!(ids(batch), (10 * step as u16..10 * step as u16 + 10).collect::<Vec<u16>>());
    }
    let status = client.status().unwrap();
    assert!(status.streams[0].depth >= 10, "the ring grew: {:?}", status.streams[0]);
    drop(held);
    stream.set_epoch(1, 0).unwrap();
    assert_eq!(rest_of_epoch(&stream).len(), 100);
}

#[test]
fn set_epoch_resumes_mid_epoch_in_the_same_order() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let daemon = Daemon::start(dir.path(), 4);
    let client = Client::connect(&daemon.socket).unwrap();
    let stream = client.open_stream(open(8, 0, 1, true)).unwrap();
    stream.set_epoch(5, 0).unwrap();
    let full = rest_of_epoch(&stream);
    let resumed = client.open_stream(OpenStream { epoch: 5, step: 3, ..open(8, 0, 1, true) }).unwrap();
    assert_eq!(&full[24..], &rest_of_epoch(&resumed)[..]);
}

#[test]
fn bad_dataset_names_the_file_and_field_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let daemon = Daemon::start(dir.path(), 2);
    let client = Client::connect(&daemon.socket).unwrap();
    let bad = OpenStream {
        dataset: DatasetRef::Hdf5(Box::new(Hdf5Dataset::new(
            format!("{}/part*.h5", dir.path().display()),
            [("y".to_string(), "missing/path".to_string())],
        ))),
        ..open(4, 0, 1, false)
    };
    match client.open_stream(bad) {
        Err(ClientError::Daemon { kind: ErrorKind::Dataset, message }) => {
            assert!(
                message.contains("part0.h5") && message.contains("missing/path") && message.contains("\"y\""),
                "{message}"
            );
        }
        other => panic!("expected a dataset error, got {other:?}"),
    }
    let stream = client.open_stream(open(4, 0, 1, false)).unwrap();
    assert!(stream.next().unwrap().is_some());
}

/// One request on a raw connection: the reply, or `None` when the daemon closed it.
fn raw_exchange(sock: &mut std::os::unix::net::UnixStream, frame: &[u8]) -> Option<stoker_client::proto::Response> {
    use std::io::{Read, Write};
    sock.write_all(frame).ok()?;
    let mut header = [0u8; 4];
    sock.read_exact(&mut header).ok()?;
    let len = stoker_client::proto::frame_len(header, stoker_client::proto::MAX_FRAME_BYTES).ok()?;
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).ok()?;
    stoker_client::proto::decode_body(&body).ok()
}

/// Hostile sizes, positions, windows, ids and bytes, sent to the real daemon:
/// each gets an answer or a closed connection, and the daemon keeps serving.
#[test]
fn fuzzed_requests_never_take_the_daemon_down() {
    use proptest::prelude::*;
    use stoker_client::proto::{PROTOCOL_VERSION, Request, Response, encode_frame};

    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let mut daemon = Daemon::start(dir.path(), 2);
    let glob = format!("{}/part*.h5", dir.path().display());
    let hello = encode_frame(&Request::Hello { version: PROTOCOL_VERSION, client: "fuzz".into(), job: None }).unwrap();
    let big = prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(1 << 32), Just(1 << 62), any::<u64>(), 0..200u64];
    let case = (0..4u8, big.clone(), big.clone(), big.clone(), big.clone(), big.clone(), big, any::<Vec<u8>>());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 300, ..ProptestConfig::default() });
    let socket = daemon.socket.clone();
    let child = std::cell::RefCell::new(&mut daemon.child);
    runner
        .run(&case, |(kind, a, b, c, d, e, f, bytes)| {
            let mut sock = std::os::unix::net::UnixStream::connect(&socket).expect("the daemon stopped listening");
            // Replies come at once; a frame that decodes as a one-way Release gets none.
            sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let greeted = matches!(raw_exchange(&mut sock, &hello), Some(Response::Hello { .. }));
            prop_assert!(greeted, "no Hello reply");
            let dataset = match kind {
                0 => DatasetRef::Named("parts".into()),
                // Hostile sizes, spacings and splits too: open refuses them, never overflows.
                1 => DatasetRef::Hdf5(Box::new(Hdf5Dataset {
                    window: Some(WindowDef {
                        size: (f % 2 == 0).then_some(e),
                        stride: f,
                        n_steps_input: (f % 2 == 1).then_some(f),
                        n_steps_output: (f % 2 == 1).then_some(e),
                        min_dt_stride: Some(f),
                        max_dt_stride: Some(e),
                        ..Default::default()
                    }),
                    output: vec!["x".into()],
                    ..Hdf5Dataset::new(glob.clone(), [("x".to_string(), "x".to_string())])
                })),
                _ => DatasetRef::Named("parts".into()),
            };
            let opened = match kind {
                3 => {
                    // Raw bytes after a valid length header.
                    let mut frame = (bytes.len() as u32).to_le_bytes().to_vec();
                    frame.extend_from_slice(&bytes);
                    let _ = raw_exchange(&mut sock, &frame);
                    None
                }
                _ => {
                    let open = OpenStream {
                        dataset,
                        batch_size: a,
                        shuffle: kind % 2 == 0,
                        seed: b,
                        drop_last: kind == 2,
                        rank: c,
                        world_size: d,
                        epoch: e,
                        step: f,
                        // Hostile block arguments, too: refused or served, never a panic.
                        block: (kind == 0).then_some(stoker_client::proto::BlockShuffle { block_size: a, window: b }),
                    };
                    match raw_exchange(&mut sock, &encode_frame(&Request::OpenStream(open)).unwrap()) {
                        Some(Response::StreamOpened(info)) => Some(info.stream),
                        _ => None,
                    }
                }
            };
            if let Some(stream) = opened {
                let _ = raw_exchange(
                    &mut sock,
                    &encode_frame(&Request::SetEpoch { stream, epoch: b, step: c % 8 }).unwrap(),
                );
                // One-way: no reply to wait for.
                let release = encode_frame(&Request::Release { stream, slot: (a % 1000) as u32 }).unwrap();
                let _ = std::io::Write::write_all(&mut sock, &release);
                let _ = raw_exchange(&mut sock, &encode_frame(&Request::Next { stream }).unwrap());
                let wake = encode_frame(&Request::Wake { stream }).unwrap();
                let _ = std::io::Write::write_all(&mut sock, &wake);
                let _ = raw_exchange(&mut sock, &encode_frame(&Request::Fetch { stream, seq: e as u32 }).unwrap());
                let _ = raw_exchange(&mut sock, &encode_frame(&Request::Segment { stream, slot: f as u32 }).unwrap());
            }
            let _ = raw_exchange(&mut sock, &encode_frame(&Request::Next { stream: d }).unwrap());
            let _ = raw_exchange(&mut sock, &encode_frame(&Request::Fetch { stream: d, seq: a as u32 }).unwrap());
            let _ = raw_exchange(&mut sock, &encode_frame(&Request::Segment { stream: d, slot: b as u32 }).unwrap());
            let _ = raw_exchange(&mut sock, &encode_frame(&Request::CacheList).unwrap());
            let label = (a % 3 == 0).then(|| format!("{d:x}"));
            let _ = raw_exchange(&mut sock, &encode_frame(&Request::CacheDrop { dataset: label }).unwrap());
            let exited = child.borrow_mut().try_wait().unwrap();
            prop_assert!(exited.is_none(), "the daemon died: {exited:?}");
            Ok(())
        })
        .unwrap();
    // Everyone else is still served, with the right values.
    let client = Client::connect(&daemon.socket).unwrap();
    let stream = client.open_stream(open(10, 0, 1, false)).unwrap();
    let mut all = rest_of_epoch(&stream);
    all.sort_unstable();
    assert_eq!(all, (0..100).collect::<Vec<u16>>());
}
