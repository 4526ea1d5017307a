//! The control server's middle, without a socket listener: admission
//! (who may connect, how many), what each uid sees in `status`, and the
//! frame reader's bounds over a real socket pair.

use std::path::Path;
use std::time::Duration;

use stoker_proto::{ClientStatus, ErrorKind, Request, Response};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use super::admission::Full;
use super::frames::{BadFrame, read_frames};
use super::*;
use crate::config::Config;

/// A daemon (no listener) with `toml` as its config.
fn daemon(toml: &str) -> Arc<Daemon> {
    let settings = Config::parse(toml, Path::new("test.toml")).unwrap().check().unwrap();
    Daemon::new(settings).unwrap()
}

#[test]
fn connections_are_counted_per_uid_and_in_total_and_freed_on_drop() {
    let d = daemon("[limits]\nmax_connections = 3\nmax_connections_per_uid = 2\n");
    let a = d.admit(1000).unwrap();
    let _b = d.admit(1000).unwrap();
    assert_eq!(d.admit(1000).unwrap_err(), Full::Uid { uid: 1000, open: 2 });
    // The daemon's own uid is not capped per uid, only in total.
    let _own = d.admit(d.own_uid).unwrap();
    assert_eq!(d.admit(2000).unwrap_err(), Full::Daemon { open: 3 });
    drop(a);
    let _c = d.admit(2000).expect("a freed place is taken again");
    let message = Full::Uid { uid: 7, open: 2 }.to_string();
    assert!(message.contains("max_connections_per_uid") && message.contains("uid 7"), "{message}");
}

#[test]
fn allowed_peers_are_root_the_daemon_listed_uids_and_members_of_listed_groups() {
    let d = daemon("[server]\nallowed_uids = [1000]\nallowed_gids = [4242]\n");
    assert!(d.allows(0, 0, 0), "root");
    assert!(d.allows(d.own_uid, 1, 0), "the daemon's own uid");
    assert!(d.allows(1000, 1, 0), "a listed uid");
    assert!(d.allows(2000, 4242, 0), "a listed group as the primary one");
    assert!(!d.allows(2000, 1, 0), "anyone else");
    // A pid now held by another user's process (this one, root's): its
    // supplementary groups are not the peer's.
    assert!(!d.allows(2000, 1, std::process::id()));
    let none = daemon("");
    assert!(!none.allows(2000, 4242, 0), "no allowed_gids: groups admit nobody");
}

#[test]
fn each_uid_sees_only_its_own_clients_and_root_sees_all() {
    let d = daemon("");
    let client = |id: u64, uid: u32| ClientStatus {
        id,
        pid: 100 + id as u32,
        uid,
        job: None,
        streams: 0,
        connected_s: 0.0,
        wait_s: 0.0,
        stall_percent: 0.0,
    };
    for (id, uid) in [(1, 1000), (2, 1000), (3, 2000)] {
        lock(&d.clients).insert(id, client(id, uid));
    }
    let ids = |viewer: u32, asker: u64| -> Vec<u64> {
        d.status(viewer, asker).clients.iter().map(|c| c.id).collect::<Vec<_>>()
    };
    assert_eq!(ids(1000, 99), [1, 2]);
    assert_eq!(ids(2000, 99), [3]);
    assert_eq!(ids(3000, 99), Vec::<u64>::new());
    assert_eq!(ids(0, 99), [1, 2, 3]);
    // The connection asking, without streams, is a status query, not a client.
    assert_eq!(ids(1000, 2), [1]);
}

#[test]
fn only_root_and_the_daemon_drop_a_named_datasets_shared_entries() {
    let d = daemon("[datasets.train]\nformat = \"hdf5\"\nfiles = \"/data/*.h5\"\nfields = { x = \"x\" }\n");
    let refused = d.cache_drop(1000, Some("train"));
    assert!(
        matches!(&refused, Response::Error { kind: ErrorKind::PermissionDenied, message } if message.contains("serve every user")),
        "{refused:?}"
    );
    assert!(matches!(d.cache_drop(1000, None), Response::Error { kind: ErrorKind::PermissionDenied, .. }));
    // Root may (nothing is cached here: it is told so, not refused).
    assert!(matches!(d.cache_drop(0, Some("train")), Response::Error { kind: ErrorKind::NotFound, .. }));
}

/// Runs the frame reader over one end of a socket pair; the test writes `bytes` to the other.
async fn frames_from(bytes: &[u8], limit: usize, deadline: Duration) -> Vec<Result<Request, BadFrame>> {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (reader, _writer) = theirs.into_split();
    let (tx, mut rx) = mpsc::channel(8);
    let task = tokio::spawn(read_frames(reader, tx, limit, deadline));
    let mut ours = ours;
    ours.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    // The reader ends on a bad frame; a good stream of frames ends when we hang up.
    let hang_up = tokio::time::sleep(Duration::from_secs(1));
    tokio::pin!(hang_up);
    loop {
        tokio::select! {
            frame = rx.recv() => match frame {
                Some(frame) => got.push(frame),
                None => break,
            },
            () = &mut hang_up => drop(ours.shutdown().await),
        }
    }
    task.await.unwrap();
    got
}

#[tokio::test]
async fn frames_are_read_in_order_and_bad_ones_end_the_connection() {
    let status = stoker_proto::encode_frame(&Request::Status).unwrap();
    let deadline = Duration::from_secs(5);
    let two = [status.clone(), status.clone()].concat();
    let got = frames_from(&two, 4096, Duration::from_millis(200)).await;
    assert!(got.len() == 2 && got.iter().all(|f| matches!(f, Ok(Request::Status))), "{got:?}");

    // A length prefix past the limit is refused from the prefix alone.
    let huge = [status.clone(), 5000u32.to_le_bytes().to_vec()].concat();
    let got = frames_from(&huge, 4096, deadline).await;
    assert!(matches!(got.as_slice(), [Ok(Request::Status), Err(BadFrame::TooLarge(_))]), "{got:?}");
    let message = got[1].as_ref().unwrap_err().to_string();
    assert!(message.contains("max_message_bytes"), "{message}");

    // A body that is no request of this protocol.
    let garbage = [3u32.to_le_bytes().to_vec(), vec![0xff, 0xff, 0xff]].concat();
    let got = frames_from(&garbage, 4096, deadline).await;
    assert!(matches!(got.as_slice(), [Err(BadFrame::Undecodable(_))]), "{got:?}");

    // A frame begun and not finished within the deadline.
    let begun = [100u32.to_le_bytes().to_vec(), vec![0; 10]].concat();
    let got = frames_from(&begun, 4096, Duration::from_millis(100)).await;
    assert!(matches!(got.as_slice(), [Err(BadFrame::Unfinished { .. })]), "{got:?}");
}
