//! Whole transfers between the two ends of the engine, in one process over
//! socket pairs: damaged blocks in transit, and resumed blocks that no longer
//! match the source, must both end in a byte-identical copy.

use dmover_engine::journal::{self, Journal};
use dmover_engine::progress::Progress;
use dmover_engine::recv::{self, RecvConfig};
use dmover_engine::send::{self, Files, HostLink, MoreStreams, SendConfig};
use dmover_engine::source::STATE_DIR;
use dmover_engine::storage;
use dmover_engine::transport::{Connector, Transport};
use dmover_proto::digest::block_sum;
use dmover_proto::frame::{FileMeta, Stats, TransferFlags, TransferOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: u32 = 64 * 1024;

/// A socket that flips one bit of the byte at `at` in what it writes: a
/// link that damages data in flight.
struct Flipping {
    inner: UnixStream,
    written: Arc<AtomicU64>,
    at: u64,
}

impl Read for Flipping {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.inner.read(b)
    }
}

impl Write for Flipping {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let start = self.written.load(Ordering::SeqCst);
        let mut buf = b.to_vec();
        if (start..start + b.len() as u64).contains(&self.at) {
            buf[(self.at - start) as usize] ^= 0x40;
        }
        let n = self.inner.write(&buf)?;
        self.written.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Transport for Flipping {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Flipping { inner: self.inner.try_clone()?, written: self.written.clone(), at: self.at }))
    }
    fn close(&self) {
        self.inner.close()
    }
    fn close_write(&self) {
        self.inner.close_write()
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.inner.set_read_timeout(t)
    }
    fn peer(&self) -> String {
        "flipping".into()
    }
}

fn options() -> TransferOptions {
    TransferOptions { transfer_id: [7; 16], block_size: BLOCK, flags: TransferFlags::empty(), tcp_buffer: 0 }
}

/// Runs one transfer of `src` (a directory's contents) into `dest`; the
/// sending end's data stream is `data`.
fn transfer(src: &Path, dest: &Path, data: Box<dyn Transport>, rx_data: UnixStream) -> Stats {
    let (tx, rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    tx.send(Box::new(rx_data)).unwrap();
    drop(tx);
    run_transfer(src, dest, data, rx, (None, None), send_config())
}

fn send_config() -> SendConfig {
    SendConfig {
        options: options(),
        concurrency: 2,
        staging: 1 << 20,
        idle_timeout: Duration::from_secs(30),
        progress: Arc::new(Progress::default()),
        bwlimit: 0,
        tuner: None,
    }
}

/// Runs a transfer whose receiver takes data connections from `rx`, and
/// dials more with `dial` when the sender asks.
fn run_transfer(
    src: &Path,
    dest: &Path,
    data: Box<dyn Transport>,
    rx: crossbeam_channel::Receiver<Box<dyn Transport>>,
    (more, dial): (Option<MoreStreams>, Option<Connector>),
    cfg: SendConfig,
) -> Stats {
    let (ctl_a, ctl_b) = UnixStream::pair().unwrap();
    let prepared = recv::prepare(recv_config(dest)).unwrap();
    let prepared = match dial {
        Some(d) => prepared.dialing(d),
        None => prepared,
    };
    let receiver = std::thread::spawn(move || prepared.run(Box::new(ctl_b), rx));
    let link = HostLink { name: "test".into(), control: Box::new(ctl_a), data: vec![data], attaching: None, more };
    let files = Files::Walk { store: storage::local(), specs: vec![format!("{}/", src.display())] };
    let stats = send::send(files, vec![link], cfg).expect("send");
    receiver.join().unwrap().expect("receive");
    stats
}

fn recv_config(dest: &Path) -> RecvConfig {
    RecvConfig {
        store: storage::local(),
        dest: dest.display().to_string(),
        options: options(),
        staging: 1 << 20,
        writers: 2,
        idle_timeout: Duration::from_secs(30),
        intake: Default::default(),
        write_errors: Default::default(),
        accept: None,
        privileged: true,
    }
}

/// The announcement of the file `name` in `dir`, as it is on disk.
fn meta_of(dir: &Path, name: &str) -> FileMeta {
    let m = std::fs::metadata(dir.join(name)).unwrap();
    FileMeta { path: name.into(), size: m.len(), mtime_s: m.mtime(), mtime_ns: m.mtime_nsec() as u32, mode: 0o644, ..Default::default() }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn a_block_damaged_in_flight_is_sent_again() {
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    std::fs::create_dir(&src).unwrap();
    let content = random_bytes(5 * BLOCK as usize + 123, 1);
    std::fs::write(src.join("f.bin"), &content).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    // A byte well inside the payload of the first or second block.
    let flipping = Flipping { inner: a, written: Arc::default(), at: 100_000 };
    let stats = transfer(&src, &dest, Box::new(flipping), b);
    assert_eq!(std::fs::read(dest.join("f.bin")).unwrap(), content);
    assert_eq!(stats.resent_blocks, 1, "exactly the damaged block is sent again");
    assert!(stats.errors.is_empty() && stats.digests_match);
}

#[test]
fn resumed_blocks_that_disagree_with_the_source_are_fetched_again() {
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(dest.join(STATE_DIR)).unwrap();
    let blocks = 6usize;
    let content = random_bytes(blocks * BLOCK as usize, 2);
    std::fs::write(src.join("f.bin"), &content).unwrap();
    let meta = meta_of(&src, "f.bin");
    // A partial file from an "earlier run": blocks 0-2 journaled, but block 1
    // on disk is not what the source holds (the journal's checksum matches the
    // damaged bytes, as if the source had been different then).
    let mut partial = content[..3 * BLOCK as usize].to_vec();
    partial[BLOCK as usize + 5] ^= 1;
    std::fs::write(dest.join(".f.bin.dmover-part"), &partial).unwrap();
    let mut j = Journal::create(storage::local().as_ref(), &journal::path_for(&dest.join(STATE_DIR), "f.bin"), &meta, BLOCK).unwrap();
    for b in 0..3 {
        let part = &partial[b * BLOCK as usize..(b + 1) * BLOCK as usize];
        j.record(b as u64, &block_sum(part)).unwrap();
    }
    drop(j);
    std::fs::write(dest.join(STATE_DIR).join(format!("transfer-{}", "07".repeat(16))), b"").unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let stats = transfer(&src, &dest, Box::new(a), b);
    assert_eq!(std::fs::read(dest.join("f.bin")).unwrap(), content, "the copy must match the source");
    assert_eq!(stats.resent_blocks, 3, "the three resumed blocks are fetched again");
    assert!(stats.sent_bytes < 2 * content.len() as u64);
    assert!(!dest.join(".f.bin.dmover-part").exists());
    assert!(!dest.join(STATE_DIR).exists(), "resume state is removed at the end");
}

#[test]
fn a_resumed_transfer_sends_only_missing_blocks() {
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(dest.join(STATE_DIR)).unwrap();
    let content = random_bytes(8 * BLOCK as usize, 3);
    std::fs::write(src.join("f.bin"), &content).unwrap();
    std::fs::write(src.join("done.bin"), b"already here").unwrap();
    let meta = meta_of(&src, "f.bin");
    let half = 4 * BLOCK as usize;
    std::fs::write(dest.join(".f.bin.dmover-part"), &content[..half]).unwrap();
    let mut j = Journal::create(storage::local().as_ref(), &journal::path_for(&dest.join(STATE_DIR), "f.bin"), &meta, BLOCK).unwrap();
    for b in 0..4 {
        j.record(b, &block_sum(&content[b as usize * BLOCK as usize..(b as usize + 1) * BLOCK as usize])).unwrap();
    }
    drop(j);
    // done.bin completed in the earlier run: same size and mtime.
    std::fs::copy(src.join("done.bin"), dest.join("done.bin")).unwrap();
    let dm = std::fs::metadata(src.join("done.bin")).unwrap();
    let f = std::fs::File::options().write(true).open(dest.join("done.bin")).unwrap();
    f.set_modified(dm.modified().unwrap()).unwrap();
    std::fs::write(dest.join(STATE_DIR).join(format!("transfer-{}", "07".repeat(16))), b"").unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let stats = transfer(&src, &dest, Box::new(a), b);
    assert_eq!(std::fs::read(dest.join("f.bin")).unwrap(), content);
    assert_eq!(stats.sent_bytes, (content.len() - half) as u64, "only the missing half is sent");
    assert_eq!(stats.skipped_files, 1);
    assert!(stats.digests_match && stats.errors.is_empty());
}

/// A tuner that asks for the next count of a script at every measurement.
struct Scripted(Vec<usize>);

impl dmover_tune::Tuner for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn initial(&self) -> usize {
        1
    }
    fn observe(&mut self, _: &dmover_tune::Observation) -> Option<usize> {
        if self.0.is_empty() {
            None
        } else {
            Some(self.0.remove(0))
        }
    }
}

/// Six files `f0.bin`… of about 40 blocks each (`step` bytes apart in
/// size), random from `seed`, in a new directory `src`; returns their contents.
fn six_files(src: &Path, step: usize, seed: u64) -> Vec<Vec<u8>> {
    std::fs::create_dir(src).unwrap();
    let contents: Vec<Vec<u8>> = (0..6).map(|i| random_bytes(40 * BLOCK as usize + i * step, i as u64 + seed)).collect();
    for (i, c) in contents.iter().enumerate() {
        std::fs::write(src.join(format!("f{i}.bin")), c).unwrap();
    }
    contents
}

/// Checks that `dest` holds the files [`six_files`] made.
fn assert_six_files(dest: &Path, contents: &[Vec<u8>]) {
    for (i, c) in contents.iter().enumerate() {
        assert_eq!(&std::fs::read(dest.join(format!("f{i}.bin"))).unwrap(), c, "f{i}.bin");
    }
}

#[test]
fn streams_opened_and_dropped_mid_transfer_lose_nothing() {
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    let contents = six_files(&src, 777, 3);
    let (tx, rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    let (a, b) = UnixStream::pair().unwrap();
    tx.send(Box::new(b)).unwrap();
    // New streams are socket pairs whose far end goes to the receiver.
    let connect: Connector = Arc::new(move || {
        let (a, b) = UnixStream::pair().map_err(|e| dmover_engine::Error::io("pair", &e))?;
        tx.send(Box::new(b)).map_err(|_| dmover_engine::Error::internal("receiver gone"))?;
        Ok(Box::new(a) as Box<dyn Transport>)
    });
    let script = vec![3, 1, 5, 2, 4, 1, 3];
    let cfg = SendConfig {
        // About two seconds of sending: the script plays out mid-transfer.
        bwlimit: 8 << 20,
        tuner: Some(Arc::new(move || Box::new(Scripted(script.clone())) as Box<dyn dmover_tune::Tuner>)),
        ..send_config()
    };
    let stats = run_transfer(&src, &dest, Box::new(a), rx, (Some(MoreStreams::Connect(connect)), None), cfg);
    assert_six_files(&dest, &contents);
    assert!(stats.digests_match && stats.errors.is_empty());
    let counts: Vec<u32> = stats.timeline.iter().map(|p| p.streams).collect();
    assert!(counts.starts_with(&[3, 1, 5, 2, 4, 1, 3]), "{counts:?}");
}

/// Where the receiver dials the data connections (a download), the tuner's
/// new streams are asked of it with `Dial`: it dials one for each, they
/// join the transfer, and dropped ones end cleanly.
#[test]
fn streams_the_receiver_dials_when_asked_lose_nothing() {
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    let contents = six_files(&src, 555, 9);
    let (first_tx, first_rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    let (a, b) = UnixStream::pair().unwrap();
    first_tx.send(Box::new(b)).unwrap();
    drop(first_tx);
    // The receiver dials: its end stays with it, the other attaches at the sender.
    let (attach_tx, attach_rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    let dials = Arc::new(AtomicU64::new(0));
    let d = dials.clone();
    let dial: Connector = Arc::new(move || {
        d.fetch_add(1, Ordering::SeqCst);
        let (x, y) = UnixStream::pair().map_err(|e| dmover_engine::Error::io("pair", &e))?;
        attach_tx.send(Box::new(x)).map_err(|_| dmover_engine::Error::internal("sender gone"))?;
        Ok(Box::new(y) as Box<dyn Transport>)
    });
    let script = vec![3, 1, 5, 2, 4, 1, 3];
    let cfg = SendConfig {
        bwlimit: 8 << 20,
        tuner: Some(Arc::new(move || Box::new(Scripted(script.clone())) as Box<dyn dmover_tune::Tuner>)),
        ..send_config()
    };
    let stats = run_transfer(&src, &dest, Box::new(a), first_rx, (Some(MoreStreams::Ask(attach_rx)), Some(dial)), cfg);
    assert_six_files(&dest, &contents);
    assert!(stats.digests_match && stats.errors.is_empty());
    let counts: Vec<u32> = stats.timeline.iter().map(|p| p.streams).collect();
    assert!(counts.starts_with(&[3, 1, 5, 2, 4, 1, 3]), "{counts:?}");
    // 1→3, 1→5, 2→4, 1→3: one dial per stream added, none more.
    assert_eq!(dials.load(Ordering::SeqCst), 2 + 4 + 2 + 2);
}

#[test]
fn a_fed_transfer_reports_each_file_as_it_settles() {
    use dmover_engine::send::Settled;
    use std::sync::Mutex;
    let t = tempfile::tempdir().unwrap();
    let (src, dest) = (t.path().join("src"), t.path().join("dest"));
    std::fs::create_dir(&src).unwrap();
    let names = ["a.dat", "b.dat", "gone.dat", "c.dat"];
    for (i, n) in names.iter().enumerate() {
        std::fs::write(src.join(n), random_bytes(3 * BLOCK as usize + i, i as u64)).unwrap();
    }
    let (ctl_a, ctl_b) = UnixStream::pair().unwrap();
    let (d_a, d_b) = UnixStream::pair().unwrap();
    let (tx, rx) = crossbeam_channel::unbounded::<Box<dyn Transport>>();
    tx.send(Box::new(d_b)).unwrap();
    drop(tx);
    let rcfg = recv_config(&dest);
    let receiver = std::thread::spawn(move || recv::receive(Box::new(ctl_b), rx, rcfg));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let o = outcomes.clone();
    let settled: send::SettleHook = Arc::new(move |meta: &FileMeta, host: usize, how: Settled<'_>| {
        let failed = matches!(how, Settled::Failed(_));
        o.lock().unwrap().push((meta.path.clone(), host, failed));
    });
    let (feed, entries) = crossbeam_channel::unbounded();
    let link = HostLink { name: "test".into(), control: Box::new(ctl_a), data: vec![Box::new(d_a)], attaching: None, more: None };
    let sender =
        std::thread::spawn(move || send::send(Files::Feed { store: storage::local(), entries, settled }, vec![link], send_config()));
    // Files are fed while the transfer runs; each is heard of as it settles.
    for n in names {
        let path = src.join(n);
        let entry = dmover_engine::source::entry(path.clone(), format!("sub/{n}"), &storage::local().stat(&path).unwrap());
        if n == "gone.dat" {
            std::fs::remove_file(&path).unwrap();
        }
        feed.send(send::FedFile { entry, host: Some(0) }).unwrap();
        let want = names.iter().position(|x| *x == n).unwrap() + 1;
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while outcomes.lock().unwrap().len() < want {
            assert!(std::time::Instant::now() < end, "no outcome for {n}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    drop(feed);
    let stats = sender.join().unwrap().expect("send");
    receiver.join().unwrap().expect("receive");
    let got = outcomes.lock().unwrap().clone();
    let want: Vec<(String, usize, bool)> = names.iter().map(|n| (format!("sub/{n}"), 0, *n == "gone.dat")).collect();
    assert_eq!(got, want);
    assert_eq!((stats.files, stats.dest_files, stats.errors.len()), (4, 3, 1));
    assert!(stats.digests_match);
    for n in ["a.dat", "b.dat", "c.dat"] {
        assert_eq!(
            std::fs::read(dest.join("sub").join(n)).unwrap(),
            random_bytes(
                3 * BLOCK as usize + names.iter().position(|x| *x == n).unwrap(),
                names.iter().position(|x| *x == n).unwrap() as u64
            )
        );
    }
}
