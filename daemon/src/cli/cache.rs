//! `stoker cache ls | warm | drop`: the daemon's node-wide caches per
//! dataset as a table or JSON, a dataset read through once to fill them (with
//! a progress bar), and their entries dropped.

use std::process::ExitCode;

use super::CacheAction;
use super::connect::Target;
use super::output::{human_bytes, shorten, table};

/// `stoker cache ls | warm | drop`.
pub(super) fn run(action: CacheAction) -> anyhow::Result<ExitCode> {
    match action {
        CacheAction::Ls { target, json } => {
            let report = target.connect()?.cache_list()?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                out!("{}", format_cache(&report));
            }
        }
        CacheAction::Drop { dataset, all: _, target, json } => {
            let (entries, bytes) = target.connect()?.cache_drop(dataset.as_deref())?;
            if json {
                outln!("{}", serde_json::json!({ "dataset": dataset, "entries": entries, "bytes": bytes }));
            } else {
                outln!(
                    "dropped {entries} entries ({}) of {}",
                    human_bytes(bytes),
                    dataset.as_deref().unwrap_or("every dataset")
                );
            }
        }
        CacheAction::Warm { dataset, target, epochs, batch_size, json } => {
            warm(&dataset, &target, epochs, batch_size, json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `stoker cache warm DATASET`: reads the dataset through the daemon `epochs`
/// times in order, then tells how much of it the caches hold.
fn warm(dataset: &str, target: &Target, epochs: u64, batch_size: u64, json: bool) -> anyhow::Result<()> {
    let client = target.connect()?;
    let before = client.cache_list()?;
    let open = stoker_proto::OpenStream {
        dataset: stoker_proto::DatasetRef::Named(dataset.to_owned()),
        batch_size,
        shuffle: false,
        block: None,
        seed: 0,
        drop_last: false,
        rank: 0,
        world_size: 1,
        epoch: 0,
        step: 0,
    };
    let stream = client.open_stream(open)?;
    let per_epoch = stream.info().batches_per_epoch;
    let bar = if json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(per_epoch.saturating_mul(epochs))
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} batches, {per_sec}, eta {eta}")
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .progress_chars("=> "),
    );
    bar.set_message(format!("warming {dataset}"));
    let started = std::time::Instant::now();
    let mut samples = 0u64;
    for epoch in 0..epochs {
        stream.set_epoch(epoch, 0)?;
        while let Some(batch) = stream.next()? {
            samples += batch.rows();
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    stream.close()?;
    let after = client.cache_list()?;
    let held = |r: &stoker_proto::CacheReport| {
        r.datasets
            .iter()
            .filter(|d| d.dataset == dataset)
            .map(|d| (d.bytes, d.entries))
            .fold((0, 0), |(b, e), (db, de)| (b + db, e + de))
    };
    let ((b0, _), (b1, e1)) = (held(&before), held(&after));
    let seconds = started.elapsed().as_secs_f64();
    if json {
        let value = serde_json::json!({
            "dataset": dataset, "epochs": epochs, "samples": samples, "seconds": seconds,
            "bytes": b1, "entries": e1, "added_bytes": b1.saturating_sub(b0),
        });
        outln!("{value}");
    } else {
        outln!(
            "warmed {dataset}: read {samples} samples in {seconds:.1} s; the caches hold {} of it in {e1} \
             entries",
            human_bytes(b1)
        );
    }
    Ok(())
}

/// `stoker cache ls` as a table.
pub fn format_cache(r: &stoker_proto::CacheReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let rate = |hits: u64, misses: u64| {
        let n = hits + misses;
        if n == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * hits as f64 / n as f64) }
    };
    for (name, c) in [("chunk cache", &r.chunks), ("sample cache", &r.samples)] {
        let _ = writeln!(
            out,
            "{name}: {} of {}, {} entries, hit rate {}, {} evictions",
            human_bytes(c.bytes),
            human_bytes(c.capacity),
            c.entries,
            rate(c.hits, c.misses),
            c.evictions
        );
    }
    let _ = writeln!(out, "policy: {}, planning over {} registered streams\n", r.policy, r.streams);
    if r.datasets.is_empty() {
        let _ = writeln!(out, "nothing cached yet");
        return out;
    }
    let rows = r.datasets.iter().map(|d| {
        vec![
            shorten(&d.dataset, 40),
            d.cache.clone(),
            human_bytes(d.bytes),
            d.entries.to_string(),
            rate(d.hits, d.misses),
            d.hits.to_string(),
            d.misses.to_string(),
            d.evictions.to_string(),
            d.rejected.to_string(),
        ]
    });
    table(
        &mut out,
        &["DATASET", "CACHE", "BYTES", "ENTRIES", "HIT RATE", "HITS", "MISSES", "EVICTED", "REFUSED"],
        rows,
    );
    out
}
