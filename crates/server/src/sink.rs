//! The receiving end of in-situ streams (`dmover sink`).
//!
//! A producer — a running simulation linked with `dmover-stream` — opens a
//! streaming session with `Stream` on an authenticated control connection
//! and attaches data connections to it like any transfer. Data frames carry
//! (step, offset in the step); the sink checks each block's checksum, writes
//! it to `DIR/PRODUCER/step-NNNNNN.dat` at its offset and acknowledges it
//! (`Acked`), or asks for it again (`Nack`) if it arrived damaged. When the
//! producer ends a step (`StepEnd`, sent once every block of the step is
//! acknowledged somewhere) the sink checks that it holds every block the
//! producer says it holds, writes the step's manifest
//! (`step-NNNNNN.json`: producer, step, metadata, writes, blocks with their
//! checksums and locations), answers `StepSaved`, and, when every block of
//! the step is here, runs the post-processing hook with the manifest.
//!
//! Every file goes through the sink directory's [`Storage`], confined
//! beneath it like an export: data files, manifests and their temporary
//! names are never written through a symlink.
//!
//! The sink keeps no state across sessions beyond its files: a block
//! acknowledged by an earlier session (or an earlier sink process) is found
//! again by reading it back from the step's file and checking its sum.

use crate::metrics::Metrics;
use dmover_engine::error::{Error, Result};
use dmover_engine::storage::{self, Attrs, Store, WriteFile};
use dmover_engine::transport::Transport;
use dmover_engine::wire::{FrameReader, FrameWriter, Incoming};
use dmover_proto::digest::Sum;
use dmover_proto::frame::{DataHeader, StepInfo, MAX_BLOCK};
use dmover_proto::phase::{FromSink, OnData, ToSink};
use dmover_proto::ErrorKind;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where streams go and what runs when a step is complete.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// Each producer's steps go to `dir/PRODUCER/`.
    pub dir: PathBuf,
    /// `dir` as a storage that every path is confined to.
    pub store: Store,
    /// The hook run when a step is complete here, if any.
    pub hooks: Option<Arc<Hooks>>,
    /// This sink's name in manifests, its own and, told to producers that
    /// ask (`Identify`), theirs and other sinks'.
    pub name: String,
}

/// The post-processing hook, a shell command run with a complete step's
/// manifest as its last argument (and in `DMOVER_MANIFEST`): one queue per
/// producer, served by one thread that runs the hook for one step at a
/// time, in the order queued, and then leaves a marker
/// (`.step-NNNNNN.hooked`) beside the manifest. A sink that starts again
/// after a crash queues the hooks of the complete steps without a marker
/// ([`Hooks::catch_up`]), so every complete step's hook runs at least once.
#[derive(Debug)]
pub struct Hooks {
    cmd: String,
    /// The sink's directory, as a storage and on disk.
    store: Store,
    dir: PathBuf,
    queues: Mutex<HashMap<String, crossbeam_channel::Sender<u64>>>,
}

impl Hooks {
    /// Hooks that run `cmd` for the steps in the sink directory `dir`
    /// (`store` is the same directory, every path confined beneath it).
    pub fn new(cmd: String, store: Store, dir: PathBuf) -> Hooks {
        Hooks { cmd, store, dir, queues: Mutex::default() }
    }

    /// Queues the hook of `producer`'s step `step` (its manifest written and complete).
    pub fn queue(&self, producer: &str, step: u64) {
        let mut queues = self.queues.lock().expect("hook queues lock");
        let tx = queues.entry(producer.to_string()).or_insert_with(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<u64>();
            let (cmd, store, dir, producer) = (self.cmd.clone(), self.store.clone(), self.dir.clone(), producer.to_string());
            std::thread::spawn(move || {
                for step in rx {
                    run_hook(&cmd, &dir.join(&producer).join(manifest_name(step)));
                    let marker = Path::new(&producer).join(hooked_name(step));
                    if let Err(e) = store.create(&marker) {
                        log::warn!("{}: {e}; the hook of step {step} will run again after a restart", dir.join(&marker).display());
                    }
                }
            });
            tx
        });
        let _ = tx.send(step);
    }

    /// Queues, in step order, the hooks of every complete step in the sink's
    /// directory that has no marker: those that were queued or running
    /// when an earlier sink process stopped. Returns how many.
    pub fn catch_up(&self) -> usize {
        let mut queued = 0;
        for producer in self.store.list(Path::new("")).unwrap_or_default() {
            let Some(name) = producer.name.to_str().map(str::to_string) else { continue };
            if check_producer(&name).is_err() || !producer.stat.as_ref().is_ok_and(|s| s.is_dir()) {
                continue;
            }
            let mut steps: Vec<u64> = self
                .store
                .list(Path::new(&name))
                .unwrap_or_default()
                .iter()
                .filter_map(|e| e.name.to_str()?.strip_prefix("step-")?.strip_suffix(".json")?.parse().ok())
                .filter(|&step| self.store.stat(&Path::new(&name).join(hooked_name(step))).is_err())
                .filter(|&step| self.complete(&name, step))
                .collect();
            steps.sort_unstable();
            for step in steps {
                self.queue(&name, step);
                queued += 1;
            }
        }
        queued
    }

    /// Whether the manifest of `producer`'s step `step` says it is complete here.
    fn complete(&self, producer: &str, step: u64) -> bool {
        let path = Path::new(producer).join(manifest_name(step));
        let text = self.store.read_all(&path, MAX_MANIFEST).ok();
        text.and_then(|t| serde_json::from_slice::<StepManifest>(&t).ok()).is_some_and(|m| m.complete)
    }
}

/// The largest step manifest the sink reads back.
const MAX_MANIFEST: u64 = 256 << 20;

/// The name of the marker left once a step's hook has run.
fn hooked_name(step: u64) -> String {
    format!(".step-{step:06}.hooked")
}

/// Smallest block a producer may use (the largest is a data frame's `MAX_BLOCK`).
pub const MIN_BLOCK: u32 = 4096;

/// Checks a producer name: one path component of letters, digits, `.`,
/// `_` and `-`, not starting with a dot, at most 64 bytes.
pub fn check_producer(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Usage, name, "a producer name is 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"))
    }
}

/// The directory of a producer's steps in the sink's storage, created if
/// missing: refused if the name is not a plain component or the path is
/// anything but a directory (a symlink included).
pub fn producer_dir(cfg: &SinkConfig, producer: &str) -> Result<PathBuf> {
    check_producer(producer)?;
    let dir = PathBuf::from(producer);
    let named = || cfg.dir.join(producer).display().to_string();
    if cfg.store.stat(&dir).is_ok_and(|m| !m.is_dir()) {
        return Err(Error::new(ErrorKind::Refused, named(), "exists and is not a directory"));
    }
    cfg.store.make_dirs(&dir).map_err(|e| Error::io(named(), &e))?;
    Ok(dir)
}

/// Checks a producer's block size.
pub fn check_block_size(b: u32) -> Result<()> {
    if (MIN_BLOCK..=MAX_BLOCK).contains(&b) {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Usage, "", format!("block size {b} is outside {MIN_BLOCK}..={MAX_BLOCK} bytes")))
    }
}

/// The file name of a step's data.
pub fn data_name(step: u64) -> String {
    format!("step-{step:06}.dat")
}

/// The file name of a step's manifest.
pub fn manifest_name(step: u64) -> String {
    format!("step-{step:06}.json")
}

/// A step's manifest (`step-NNNNNN.json`), as the sink writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepManifest {
    pub producer: String,
    pub step: u64,
    pub bytes: u64,
    pub block_size: u32,
    /// XXH3-128 of the block checksums in offset order, in hex.
    #[serde(with = "hex::serde")]
    pub digest: Sum,
    /// Every block is in this sink's data file.
    pub complete: bool,
    /// This sink's name.
    pub sink: String,
    /// The data file on disk.
    pub data: PathBuf,
    /// The producer's key/value pairs.
    pub metadata: BTreeMap<String, String>,
    /// Each write of the step.
    pub records: Vec<Record>,
    pub blocks: Vec<ManifestBlock>,
}

/// One write of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub offset: u64,
    pub len: u64,
}

/// One block of a step, and where it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestBlock {
    pub offset: u64,
    pub len: u32,
    #[serde(with = "hex::serde")]
    pub xxh3: Sum,
    /// In this sink's data file.
    pub here: bool,
    /// The sink that holds it: this one, or another if the producer failed
    /// over in the middle of the step.
    pub at: String,
}

impl StepManifest {
    /// The manifest of a step whose blocks are `here` or not.
    fn new(cfg: &SinkConfig, producer: &str, block_size: u32, info: &StepInfo, here: &[bool], complete: bool, data: &Path) -> StepManifest {
        let blocks = info
            .blocks
            .iter()
            .zip(here)
            .map(|(b, &here)| {
                let at = if here || b.at.is_empty() { &cfg.name } else { &b.at };
                ManifestBlock { offset: b.offset, len: b.len, xxh3: b.sum, here, at: at.clone() }
            })
            .collect();
        StepManifest {
            producer: producer.to_string(),
            step: info.step,
            bytes: info.bytes,
            block_size,
            digest: info.digest,
            complete,
            sink: cfg.name.clone(),
            data: data.to_path_buf(),
            metadata: info.metadata.iter().cloned().collect(),
            records: info.records.iter().map(|&(offset, len)| Record { offset, len }).collect(),
            blocks,
        }
    }
}

/// Blocks of one step written by this session.
#[derive(Default)]
struct StepFiles {
    file: Option<Arc<dyn WriteFile>>,
    /// offset → (length, checksum)
    blocks: HashMap<u64, (u32, Sum)>,
    /// The step was complete here before this session: its blocks are
    /// compared with what is stored, never written.
    sealed: bool,
}

/// What the data connections and the control connection of one session share.
struct Shared {
    store: Store,
    /// The producer's directory in `store`.
    dir: PathBuf,
    /// The same on disk, for messages, manifests and hooks.
    disk_dir: PathBuf,
    block_size: u32,
    /// Steps with blocks written; data threads insert, the control thread
    /// removes a step at its end. Never held while writing a frame.
    steps: Mutex<HashMap<u64, StepFiles>>,
    /// The control connection's writer: data threads send `Acked` and
    /// `Nack`, the control thread `StepSaved`.
    writer: Mutex<FrameWriter>,
    /// Payload bytes taken off the data connections.
    received: AtomicU64,
    /// The server's counters.
    metrics: Arc<Metrics>,
}

impl Shared {
    fn send(&self, m: FromSink) -> Result<()> {
        self.writer.lock().expect("writer lock").send(m)
    }

    /// The step's data file, opened (or created) on first use, and whether
    /// the step was complete here before this session.
    fn file(&self, step: u64) -> Result<(Arc<dyn WriteFile>, bool)> {
        let mut steps = self.steps.lock().expect("steps lock");
        let s = steps.entry(step).or_default();
        if let Some(f) = &s.file {
            return Ok((f.clone(), s.sealed));
        }
        s.sealed = self.complete_here(step).is_some();
        let f = self.open_data(step)?;
        s.file = Some(f.clone());
        Ok((f, s.sealed))
    }

    /// The manifest of `step`, if the step is complete here.
    fn complete_here(&self, step: u64) -> Option<StepManifest> {
        let text = self.store.read_all(&self.dir.join(manifest_name(step)), MAX_MANIFEST).ok()?;
        serde_json::from_slice::<StepManifest>(&text).ok().filter(|m| m.complete)
    }

    /// A step's data file: the one an earlier session wrote, or a new one.
    fn open_data(&self, step: u64) -> Result<Arc<dyn WriteFile>> {
        let path = self.dir.join(data_name(step));
        let err = |e: std::io::Error| Error::io(self.disk_dir.join(data_name(step)).display().to_string(), &e);
        if let Some(f) = self.store.reopen(&path).map_err(err)? {
            return Ok(f.into());
        }
        let f = self.store.create(&path).map_err(err)?;
        f.set_attrs(&Attrs { mode: 0o644, ..Default::default() }).map_err(err)?;
        Ok(f.into())
    }
}

/// Serves one producer's streaming session until it closes its control
/// connection; its steps go to `dir` (from [`producer_dir`]). `data`
/// delivers the data connections attached to the session.
#[allow(clippy::too_many_arguments)]
pub fn run(
    cfg: &SinkConfig,
    producer: &str,
    dir: PathBuf,
    block_size: u32,
    control: Box<dyn Transport>,
    mut r: FrameReader,
    w: FrameWriter,
    data: crossbeam_channel::Receiver<Box<dyn Transport>>,
    metrics: Arc<Metrics>,
) -> Result<()> {
    let disk_dir = cfg.dir.join(&dir);
    let shared = Arc::new(Shared {
        store: cfg.store.clone(),
        dir,
        disk_dir,
        block_size,
        steps: Mutex::default(),
        writer: Mutex::new(w),
        received: AtomicU64::new(0),
        metrics,
    });
    // Attaches data connections as they arrive, until the session ends;
    // then closes them, so that none outlives a producer that vanished.
    let over = Arc::new(AtomicBool::new(false));
    let attacher = {
        let (shared, over) = (shared.clone(), over.clone());
        std::thread::spawn(move || {
            let mut open = Vec::new();
            while !over.load(Ordering::Relaxed) {
                if let Ok(t) = data.recv_timeout(Duration::from_millis(100)) {
                    if let Ok(handle) = t.split() {
                        open.push(handle);
                    }
                    let shared = shared.clone();
                    std::thread::spawn(move || {
                        let closer = t.split();
                        if let Err(e) = receive_blocks(&shared, t) {
                            log::warn!("stream data connection: {e}");
                            // Hang up on what was refused, now.
                            if let Ok(c) = closer {
                                c.close();
                            }
                        }
                    });
                }
            }
            open.iter().for_each(|t| t.close());
        })
    };
    let result = (|| loop {
        let m = match r.read_msg::<ToSink>() {
            Ok(m) => m,
            Err(e) if e.kind == ErrorKind::Unreachable => return Ok(()),
            Err(e) => return Err(e),
        };
        match m {
            ToSink::StepEnd { info } => {
                let step = info.step;
                shared.metrics.producer_events(&info.events);
                let complete = finish_step(&shared, cfg, producer, info)?;
                shared.metrics.step_saved(complete);
                // Hooks run one at a time, in step order, off the control thread.
                if let Some(hooks) = cfg.hooks.as_ref().filter(|_| complete) {
                    hooks.queue(producer, step);
                }
                shared.send(FromSink::StepSaved { step, complete })?;
            }
            ToSink::Ping {} => {}
            ToSink::Identify {} => shared.send(FromSink::Identity { name: cfg.name.clone() })?,
            ToSink::Fetch { step, blocks } => send_back(&shared, step, &blocks)?,
        }
    })();
    over.store(true, Ordering::Relaxed);
    let _ = attacher.join();
    log::info!("stream from {producer} ended: {} bytes received", shared.received.load(Ordering::Relaxed));
    if let Err(e) = &result {
        let _ = shared.send(FromSink::Error { kind: e.kind, message: e.to_string() });
        dmover_engine::transport::linger(control.as_ref());
    }
    result
}

/// Reads blocks from one data connection until the producer ends it.
fn receive_blocks(shared: &Shared, t: Box<dyn Transport>) -> Result<()> {
    let peer = t.peer();
    let mut r = FrameReader::new(t);
    let mut buf = vec![0u8; shared.block_size as usize];
    loop {
        let h = match r.read::<OnData>() {
            Ok(Incoming::Data(h)) => h,
            Ok(Incoming::Msg(OnData::StreamEnd {})) => return Ok(()),
            Ok(Incoming::Msg(OnData::Ping {})) => continue,
            Ok(Incoming::Msg(OnData::Hole { .. })) => {
                return Err(Error::protocol(
                    &peer,
                    "a hole (a block sent without its bytes) in a stream: a stream's blocks carry their data",
                ));
            }
            Err(e) if e.kind == ErrorKind::Unreachable => return Ok(()),
            Err(e) => return Err(e),
        };
        if h.len > shared.block_size || h.offset % shared.block_size as u64 != 0 {
            return Err(Error::protocol(&peer, format!("block at {} of {} bytes does not fit the block size", h.offset, h.len)));
        }
        let data = &mut buf[..h.len as usize];
        if r.read_block(data, &[&shared.received, shared.metrics.streamed()])? != h.sum {
            shared.metrics.damaged_stream_block();
            log::warn!("{peer}: step {} block at {} arrived damaged; asking again", h.file, h.offset);
            shared.send(FromSink::Nack { id: h.file, block: h.offset / shared.block_size as u64 })?;
            continue;
        }
        let (f, sealed) = shared.file(h.file)?;
        if sealed {
            // A complete step is never rewritten: the same block again (a
            // producer retrying) is acknowledged, any other is refused.
            let mut stored = vec![0u8; data.len()];
            let same = storage::read_block(f.as_ref(), &mut stored, h.offset).is_ok_and(|(n, sum)| n == data.len() && sum == h.sum);
            if !same {
                let msg = format!("step {} is complete here and is never rewritten; this block differs from it", h.file);
                return Err(Error::new(ErrorKind::Refused, &peer, msg));
            }
        } else {
            f.write_all_at(data, h.offset).map_err(|e| Error::io(shared.disk_dir.join(data_name(h.file)).display().to_string(), &e))?;
        }
        shared.steps.lock().expect("steps lock").entry(h.file).or_default().blocks.insert(h.offset, (h.len, h.sum));
        shared.send(FromSink::Acked { blocks: vec![(h.file, h.offset)] })?;
    }
}

/// Sends blocks of a step back to its producer (`Fetch`), as data frames on
/// the control connection, read from the step's data file here: to gather
/// a step that failover split, the producer moves them to the sink that
/// holds the rest. The producer checks each against the checksum it
/// recorded; the frame carries the checksum of what was read.
fn send_back(shared: &Shared, step: u64, blocks: &[(u64, u32)]) -> Result<()> {
    let named = || shared.disk_dir.join(data_name(step)).display().to_string();
    let f = shared.store.open(&shared.dir.join(data_name(step))).map_err(|e| Error::io(named(), &e))?;
    let bs = shared.block_size;
    let mut buf = Vec::new();
    for &(offset, len) in blocks {
        if len > bs || offset % bs as u64 != 0 {
            let msg = format!("step {step}: a block of {len} bytes at offset {offset} does not fit the block size of {bs} bytes");
            return Err(Error::protocol(named(), msg));
        }
        buf.resize(len as usize, 0);
        let (n, sum) = storage::read_block(f.as_ref(), &mut buf, offset).map_err(|e| Error::io(named(), &e))?;
        if n != buf.len() {
            return Err(Error::new(ErrorKind::NotFound, named(), format!("step {step}: the block at offset {offset} is not here")));
        }
        let h = DataHeader { file: step, offset, sum, len, sparse: false };
        shared.writer.lock().expect("writer lock").send_block(&h, &buf)?;
    }
    Ok(())
}

/// Checks that every block the producer says is here is here, writes the
/// step's manifest, and says whether the whole step is here.
fn finish_step(shared: &Shared, cfg: &SinkConfig, producer: &str, info: StepInfo) -> Result<bool> {
    let step = info.step;
    let bs = shared.block_size;
    if let Some(b) = info.blocks.iter().find(|b| b.len > bs || b.offset % bs as u64 != 0) {
        let msg = format!("step {step}: a block of {} bytes at offset {} does not fit the block size of {bs} bytes", b.len, b.offset);
        return Err(Error::protocol(producer, msg));
    }
    if let Some(m) = shared.complete_here(step) {
        // Complete here already: a producer repeating the same step (its
        // answer was lost, or it runs again) hears so again, and its hook
        // runs again (hooks run at least once per complete step); another
        // version is refused.
        if m.digest == info.digest && m.bytes == info.bytes {
            return Ok(true);
        }
        let msg = format!("step {step} is complete here and is never rewritten; this version differs from it");
        return Err(Error::new(ErrorKind::Refused, producer, msg));
    }
    let mine = shared.steps.lock().expect("steps lock").remove(&step).unwrap_or_default();
    let data_path = shared.disk_dir.join(data_name(step));
    let stored_data = shared.dir.join(data_name(step));
    let mut file = mine.file.clone();
    let mut here = Vec::with_capacity(info.blocks.len());
    let mut buf = Vec::new();
    for b in &info.blocks {
        let present = match mine.blocks.get(&b.offset) {
            Some(&(len, sum)) => len == b.len && sum == b.sum,
            // Not written by this session: check what the file holds.
            None => {
                if file.is_none() && shared.store.stat(&stored_data).is_ok() {
                    file = Some(shared.open_data(step)?);
                }
                file.as_ref().is_some_and(|f| {
                    buf.resize(b.len as usize, 0);
                    storage::read_block(f.as_ref(), &mut buf, b.offset).is_ok_and(|(n, sum)| n == buf.len() && sum == b.sum)
                })
            }
        };
        if b.at.is_empty() && !present {
            let msg = format!("step {step}: the block at offset {} was acknowledged but is not in {}", b.offset, data_path.display());
            return Err(Error::new(ErrorKind::Verify, producer, msg));
        }
        here.push(present);
    }
    let complete = here.iter().all(|&h| h) && info.blocks.iter().map(|b| b.len as u64).sum::<u64>() == info.bytes;
    if complete {
        // An empty step still gets its (empty) data file; a complete one is
        // cut to its size in case an older, longer file was there.
        let f = match file {
            Some(f) => f,
            None => shared.open_data(step)?,
        };
        f.set_len(info.bytes).map_err(|e| Error::io(data_path.display().to_string(), &e))?;
    }
    let manifest = StepManifest::new(cfg, producer, shared.block_size, &info, &here, complete, &data_path);
    let stored = shared.dir.join(manifest_name(step));
    let tmp = shared.dir.join(format!(".{}.tmp", manifest_name(step)));
    let path = shared.disk_dir.join(manifest_name(step));
    let text = serde_json::to_string_pretty(&manifest).expect("a manifest serializes") + "\n";
    let err = |e: std::io::Error| Error::io(path.display().to_string(), &e);
    let f = shared.store.create(&tmp).map_err(err)?;
    f.write_all_at(text.as_bytes(), 0).map_err(err)?;
    f.commit(&stored, Some(&Attrs { mode: 0o644, ..Default::default() })).map_err(err)?;
    log::info!("{producer} step {step}: {} bytes, {}", info.bytes, if complete { "complete" } else { "partly elsewhere" });
    Ok(complete)
}

/// Runs the hook for one manifest; its output goes to the sink's own.
fn run_hook(cmd: &str, manifest: &Path) {
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{cmd} \"$1\""))
        .arg("dmover-hook")
        .arg(manifest)
        .env("DMOVER_MANIFEST", manifest)
        .current_dir(manifest.parent().unwrap_or(Path::new(".")))
        .status();
    match status {
        Ok(s) if s.success() => log::info!("hook done for {}", manifest.display()),
        Ok(s) => log::warn!("hook for {} failed: {s}", manifest.display()),
        Err(e) => log::warn!("cannot run the hook for {}: {e}", manifest.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_reads_back_with_its_field_names_and_hex_checksums() {
        let m = StepManifest {
            producer: "gtc-1".into(),
            step: 3,
            bytes: 10,
            block_size: 4096,
            digest: [0xab; 16],
            complete: true,
            sink: "ana-1".into(),
            data: "/d/gtc-1/step-000003.dat".into(),
            metadata: [("time".to_string(), "0.5".to_string())].into(),
            records: vec![Record { offset: 0, len: 10 }],
            blocks: vec![ManifestBlock { offset: 0, len: 10, xxh3: [1; 16], here: true, at: "ana-1".into() }],
        };
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["digest"], "ab".repeat(16));
        assert_eq!(v["blocks"][0]["xxh3"], "01".repeat(16));
        assert_eq!(v["records"][0], serde_json::json!({ "offset": 0, "len": 10 }));
        assert_eq!(v["metadata"], serde_json::json!({ "time": "0.5" }));
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        let want = ["block_size", "blocks", "bytes", "complete", "data", "digest", "metadata", "producer", "records", "sink", "step"];
        assert_eq!(keys, want);
        assert_eq!(serde_json::from_value::<StepManifest>(v).unwrap(), m);
    }
}
