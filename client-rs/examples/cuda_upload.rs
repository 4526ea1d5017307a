//! Uploads one epoch of a named dataset to GPU 0 and checks every field
//! against the host batch, byte for byte (`cuda` feature; a GPU node).
//!
//! ```sh
//! cargo run --release -p stoker-client --features cuda --example cuda_upload -- SOCKET DATASET [BATCH] [staging]
//! ```
//!
//! Exits 1 with the reason when no driver or GPU is usable, 2 on a mismatch.

use stoker_client::Client;
use stoker_client::cuda::{UploadMode, Uploader};
use stoker_client::proto::{DatasetRef, OpenStream};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, socket, dataset, rest @ ..] = args.as_slice() else {
        eprintln!("usage: cuda_upload SOCKET DATASET [BATCH] [staging]");
        std::process::exit(64);
    };
    let batch_size = rest.first().and_then(|b| b.parse().ok()).unwrap_or(32);
    let mode = if rest.iter().any(|a| a == "staging") { UploadMode::Staging } else { UploadMode::Registered };
    let mut uploader = Uploader::with_mode(0, mode).unwrap_or_else(|e| {
        eprintln!("cuda_upload: {e}");
        std::process::exit(1)
    });
    let client = Client::connect(socket).unwrap_or_else(|e| {
        eprintln!("cuda_upload: {e}");
        std::process::exit(1)
    });
    let open = OpenStream {
        dataset: DatasetRef::Named(dataset.clone()),
        batch_size,
        shuffle: true,
        seed: 0,
        drop_last: false,
        rank: 0,
        world_size: 1,
        epoch: 0,
        step: 0,
        block: None,
    };
    let stream = client.open_stream(open).unwrap_or_else(|e| {
        eprintln!("cuda_upload: {e}");
        std::process::exit(1)
    });
    let (mut batches, mut bytes) = (0u64, 0usize);
    while let Some(batch) = stream.next().expect("next batch") {
        let host: Vec<Vec<u8>> = batch.fields().map(|f| f.bytes().to_vec()).collect();
        let mut device = uploader.upload(batch).expect("upload");
        for (field, want) in device.fields.iter().zip(&host) {
            // Same stream as the upload: ordered after the copy.
            let got = uploader.stream().clone_dtoh(&field.data).expect("copy back");
            if &got[..want.len()] != want.as_slice() {
                eprintln!("cuda_upload: field {:?} of batch {} differs from the host batch", field.name(), batches);
                std::process::exit(2);
            }
            bytes += want.len();
        }
        device.wait().expect("upload event");
        assert!(device.is_uploaded());
        batches += 1;
    }
    println!("{batches} batches, {bytes} bytes uploaded ({:?}) and equal to the host batches", uploader.mode());
}
