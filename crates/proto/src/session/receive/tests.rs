//! The receive session against simulated senders and drivers, in virtual
//! time (each step is one event): random interleavings of announcements,
//! blocks and ends, duplicated, dropped, reordered and late messages, and
//! senders that lie about sizes, offsets and files.

use super::*;
use crate::frame::{Owner, Xattr};
use crate::session::audit::Audit;
use proptest::prelude::*;
use std::collections::HashSet;

/// A small block size, so that small files have several blocks.
const BS: u64 = 4;

/// The checksum of block `b` of file `id`, as the sender computes it.
fn sum(id: u64, b: u64) -> Sum {
    let mut s = [0; 16];
    s[..8].copy_from_slice(&id.to_le_bytes());
    s[8..].copy_from_slice(&b.to_le_bytes());
    s
}

fn meta(path: &str, size: u64) -> FileMeta {
    FileMeta { path: path.into(), size, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() }
}

fn session(discard: bool) -> Receive {
    Receive::new(Config { block_size: BS, discard, accept: None })
}

/// The sender's digest of a file of `size` bytes.
fn digest(id: u64, size: u64) -> Sum {
    let sums: Vec<Sum> = (0..size.div_ceil(BS)).map(|b| sum(id, b)).collect();
    file_digest(&sums)
}

/// What a simulated driver does, step by step.
#[derive(Debug, Clone)]
enum Step {
    /// The sender announces file `f` (again, if it did), claiming `extra`
    /// bytes more than it has; as a directory if `dir` (a lie if it claims
    /// any data).
    Announce {
        f: u8,
        extra: u8,
        dir: bool,
    },
    /// Block `b` of file `f` arrives on a data connection.
    Block {
        f: u8,
        b: u8,
        damaged: bool,
    },
    /// A data frame with an arbitrary header for file `f`.
    Frame {
        f: u8,
        offset: u8,
        len: u8,
    },
    /// The sender ends file `f`, with its true digest or not.
    End {
        f: u8,
        true_digest: bool,
    },
    Abort {
        f: u8,
    },
    /// The driver answers the oldest preparation; `how` picks the outcome.
    Prepare {
        how: u8,
    },
    /// The driver ends the oldest commit, well or not.
    Commit {
        ok: bool,
    },
    /// A local event about a file the session may not know.
    Stray {
        f: u8,
        what: u8,
    },
    Echo,
    Finish,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..6u8, prop_oneof![4 => Just(0u8), 1 => 1..9u8], prop::bool::weighted(0.2)).prop_map(|(f, extra, dir)| Step::Announce { f, extra, dir }),
        8 => (0..6u8, 0..12u8, prop::bool::weighted(0.1)).prop_map(|(f, b, damaged)| Step::Block { f, b, damaged }),
        1 => (0..6u8, any::<u8>(), 0..9u8).prop_map(|(f, offset, len)| Step::Frame { f, offset, len }),
        3 => (0..6u8, prop::bool::weighted(0.9)).prop_map(|(f, true_digest)| Step::End { f, true_digest }),
        1 => (0..6u8).prop_map(|f| Step::Abort { f }),
        3 => any::<u8>().prop_map(|how| Step::Prepare { how }),
        3 => prop::bool::weighted(0.9).prop_map(|ok| Step::Commit { ok }),
        1 => (0..8u8, any::<u8>()).prop_map(|(f, what)| Step::Stray { f, what }),
        1 => Just(Step::Echo),
        1 => Just(Step::Finish),
    ]
}

/// The sizes of the sender's files (by id), from 0 to 10 blocks.
fn sizes() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..41u64, 6)
}

/// A simulated driver: it carries out the session's actions, checks them
/// with an [`Audit`] and with what it knows of the sender's lies.
struct Driver {
    rx: Receive,
    audit: Audit,
    /// Announced sizes (the truth is `sizes`; an announcement may lie).
    announced: HashMap<u64, u64>,
    /// Files in flight announced as directories: the destination makes
    /// them (`Made`), as it makes nothing else.
    dirs: HashSet<u64>,
    prepares: VecDeque<u64>,
    commits: VecDeque<u64>,
    gates: HashMap<u64, Gate>,
    /// Files in flight as the sender sees them, and those it ended.
    flight: HashSet<u64>,
    ended: HashSet<u64>,
    planned: HashSet<u64>,
    /// Files confirmed (`Done`), and how the session ended, if it did.
    done: HashMap<u64, Sum>,
    end: Option<Action>,
    /// The driver refused a data frame the gate did not admit.
    refused: bool,
    /// Blocks asked for again, not yet sent.
    nacks: Vec<(u64, u64)>,
    /// The sender said `Finish`.
    finished: bool,
}

impl Driver {
    fn new(discard: bool) -> Driver {
        Driver {
            rx: session(discard),
            audit: Audit::new(discard),
            announced: HashMap::new(),
            dirs: HashSet::new(),
            prepares: VecDeque::new(),
            commits: VecDeque::new(),
            gates: HashMap::new(),
            flight: HashSet::new(),
            ended: HashSet::new(),
            planned: HashSet::new(),
            done: HashMap::new(),
            end: None,
            refused: false,
            nacks: Vec::new(),
            finished: false,
        }
    }

    /// Gives the session an event and carries out what it says.
    fn feed(&mut self, e: Event) -> Vec<Action> {
        self.audit.event(&e);
        self.rx.handle(e);
        assert!(self.rx.open_files() <= MAX_OPEN_FILES);
        let mut out = Vec::new();
        while let Some(a) = self.rx.poll() {
            self.audit.action(&a).unwrap_or_else(|e| panic!("{e}"));
            match &a {
                Action::Prepare { id, .. } => self.prepares.push_back(*id),
                Action::Open { id, gate } => {
                    self.gates.insert(*id, *gate);
                    self.planned.insert(*id);
                }
                Action::Commit { id, .. } => self.commits.push_back(*id),
                Action::Send(ToSender::Nack { id, block }) => self.nacks.push((*id, *block)),
                Action::Send(ToSender::Done { id, digest }) => {
                    self.done.insert(*id, *digest);
                    self.settle(*id);
                }
                Action::Send(ToSender::Plan { id, skip: true, .. }) | Action::Refuse { id, .. } => self.settle(*id),
                Action::Close { id } | Action::Remove { id } => {
                    self.gates.remove(id);
                    self.settle(*id);
                }
                Action::Finish(_) | Action::Violation(_) | Action::PeerFailed { .. } => {
                    self.end = Some(a.clone());
                }
                _ => {}
            }
            out.push(a);
        }
        out
    }

    fn settle(&mut self, id: u64) {
        self.flight.remove(&id);
        self.ended.remove(&id);
        self.planned.remove(&id);
    }

    fn violated(out: &[Action]) -> bool {
        out.iter().any(|a| matches!(a, Action::Violation(_)))
    }

    /// A data frame: the driver admits it through the file's gate, as the
    /// engine's data connections do, then has it written (or reports it
    /// damaged). Returns false if the frame was refused (the engine then
    /// ends the session).
    fn frame(&mut self, id: u64, offset: u64, len: u32, damaged: bool) -> bool {
        let ok_header = check_header(BS, offset, len).is_ok();
        let Some(gate) = self.gates.get(&id).copied() else {
            return ok_header; // no such file (any more): dropped
        };
        let size = self.announced[&id];
        let whole = offset.is_multiple_of(BS) && offset < size && u64::from(len) == (size - offset).min(BS);
        let Ok(block) = gate.admit(id, offset, len) else {
            assert!(!whole, "a whole block of file {id} at {offset}+{len} (size {size}) refused");
            return false;
        };
        assert!(whole && offset + u64::from(len) <= size, "a write at {offset}+{len} admitted for a file of {size} bytes");
        if damaged {
            self.feed(Event::Damaged { id, block });
        } else {
            self.feed(Event::Written { id, block, sum: sum(id, block) });
        }
        true
    }

    fn step(&mut self, s: &Step, sizes: &[u64]) {
        match *s {
            Step::Announce { f, extra, dir } => {
                let id = u64::from(f);
                let size = sizes[f as usize] + u64::from(extra);
                let live = !self.rx.is_over();
                let again = self.flight.contains(&id);
                let mut m = meta(&format!("d/f{f}"), size);
                if dir {
                    m.mode = FileMeta::DIR | 0o755;
                }
                let e = Event::Control(ToReceiver::Announce { id, meta: m, digest: None });
                if !again {
                    // A new file under a settled file's id: what was confirmed of that one is not its.
                    self.done.remove(&id);
                    self.announced.insert(id, size);
                    self.flight.insert(id);
                    if dir {
                        self.dirs.insert(id);
                    } else {
                        self.dirs.remove(&id);
                    }
                }
                let out = self.feed(e);
                let late = self.finished;
                assert!(
                    !live || (again || late) == Self::violated(&out),
                    "a second announcement of file {id} in flight, or one after the end, must end the session"
                );
            }
            Step::Block { f, b, damaged } => {
                let (id, b) = (u64::from(f), u64::from(b));
                let size = sizes[f as usize];
                let len = size.saturating_sub(b * BS).min(BS) as u32;
                self.refused |= !self.frame(id, b * BS, len, damaged);
            }
            Step::Frame { f, offset, len } => {
                self.refused |= !self.frame(u64::from(f), u64::from(offset), u32::from(len), false);
            }
            Step::End { f, true_digest } => {
                let id = u64::from(f);
                let d = if true_digest { digest(id, sizes[f as usize]) } else { [7; 16] };
                let live = !self.rx.is_over();
                let lie = self.flight.contains(&id) && (self.ended.contains(&id) || !self.planned.contains(&id));
                if self.flight.contains(&id) {
                    self.ended.insert(id);
                }
                let out = self.feed(Event::Control(ToReceiver::FileEnd { id, digest: d }));
                assert!(!live || lie == Self::violated(&out), "an end twice or before the plan must end the session");
            }
            Step::Abort { f } => {
                self.feed(Event::Control(ToReceiver::Abort { id: u64::from(f), kind: ErrorKind::Internal, message: "gone".into() }));
            }
            Step::Prepare { how } => {
                let Some(id) = self.prepares.pop_front() else { return };
                let blocks = self.announced[&id].div_ceil(BS);
                let outcome = match how % 8 {
                    0 => Outcome::Present,
                    1 => Outcome::Refused { kind: ErrorKind::Permission, message: "no".into() },
                    _ if self.dirs.contains(&id) => Outcome::Made,
                    // Blocks from an earlier run, some of them stale.
                    2 | 3 => Outcome::Receive {
                        held: (0..blocks)
                            .filter(|b| (b + u64::from(how)) % 3 == 0)
                            .map(|b| (b, if how % 8 == 2 { sum(id, b) } else { [9; 16] }))
                            .collect(),
                    },
                    _ => Outcome::Receive { held: vec![] },
                };
                self.feed(Event::Prepared { id, outcome });
            }
            Step::Commit { ok } => {
                let Some(id) = self.commits.pop_front() else { return };
                let e = if ok { Event::Committed { id } } else { Event::Failed { id, kind: ErrorKind::Internal, message: "disk".into() } };
                self.feed(e);
            }
            Step::Stray { f, what } => {
                let id = u64::from(f);
                let e = match what % 5 {
                    0 => Event::Committed { id },
                    // Made answers a file's preparation only if it is a directory.
                    1 if !self.prepares.contains(&id) || self.dirs.contains(&id) => Event::Prepared { id, outcome: Outcome::Made },
                    2 => Event::Failed { id, kind: ErrorKind::Internal, message: "late".into() },
                    3 => Event::Prepared { id, outcome: Outcome::Receive { held: vec![(u64::from(what), [1; 16])] } },
                    _ => Event::Control(ToReceiver::Ping {}),
                };
                self.feed(e);
            }
            Step::Echo => {
                let out =
                    self.feed(Event::Control(ToReceiver::Echo { stamp: 5, received: 0, staged: 0, server_received: 0, transfers: 0 }));
                assert!(out == vec![Action::Echo { stamp: 5 }] || self.rx.is_over());
                let out = self.feed(Event::Control(ToReceiver::Dial {}));
                assert!(out == vec![Action::Dial] || self.rx.is_over());
            }
            Step::Finish => {
                self.feed(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }));
                self.finished = true;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Whatever happens in whatever order, and whatever the sender claims,
    /// the session's actions keep the rules (the audit), every lie it can
    /// see ends the session, and a confirmed file carries the digest of
    /// the blocks the sender really has.
    #[test]
    fn any_interleaving_keeps_the_rules(sizes in sizes(), steps in prop::collection::vec(step(), 0..300), discard in prop::bool::weighted(0.2)) {
        let mut d = Driver::new(discard);
        // After the session ends, whatever still comes must not be heard
        // (the audit fails on any action); after the driver refused a
        // frame, the engine would have ended the session.
        for s in &steps {
            if d.refused {
                break;
            }
            d.step(s, &sizes);
        }
        for (id, dg) in &d.done {
            let size = d.announced[id];
            prop_assert_eq!(*dg, digest(*id, size), "file {} of {} bytes confirmed with a digest the sender does not have", id, size);
        }
    }

    /// A faithful sender over data connections that reorder, repeat and
    /// damage blocks, with the sender's ends arriving at any point after
    /// each plan and its `Finish` as soon as every file has ended, gets
    /// every file confirmed with its digest, and then the totals, which
    /// count them all.
    #[test]
    fn a_faithful_sender_gets_every_file_confirmed(sizes in sizes(), order in prop::collection::vec(any::<prop::sample::Index>(), 200), damage in prop::collection::vec(prop::bool::weighted(0.1), 200)) {
        let mut d = Driver::new(false);
        for f in 0..sizes.len() {
            d.step(&Step::Announce { f: f as u8, extra: 0, dir: false }, &sizes);
            // Some resume with part of their blocks, some of those stale.
            let how = [2, 3, 4][f % 3];
            d.step(&Step::Prepare { how }, &sizes);
        }
        // What the sender still has to send: each planned block, and each end.
        let mut todo: Vec<Step> = Vec::new();
        for (f, size) in sizes.iter().enumerate() {
            for b in 0..size.div_ceil(BS) {
                todo.push(Step::Block { f: f as u8, b: b as u8, damaged: false });
            }
            todo.push(Step::End { f: f as u8, true_digest: true });
        }
        let mut i = 0;
        let mut finished = false;
        while !todo.is_empty() {
            let k = order[i % order.len()].index(todo.len());
            let s = todo.swap_remove(k);
            if let Step::Block { f, b, .. } = s {
                let damaged = damage[i % damage.len()];
                d.step(&Step::Block { f, b, damaged }, &sizes);
                if i % 7 == 0 {
                    todo.push(s.clone()); // and some arrive twice
                }
            } else {
                d.step(&s, &sizes);
            }
            while !d.commits.is_empty() {
                d.step(&Step::Commit { ok: true }, &sizes);
            }
            // Blocks asked for again (damaged, or stale from an earlier run).
            todo.extend(d.nacks.drain(..).map(|(f, b)| Step::Block { f: f as u8, b: b as u8, damaged: false }));
            if !finished && !todo.iter().any(|s| matches!(s, Step::End { .. })) {
                finished = true;
                d.feed(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }));
            }
            let confirmed = d.done.len() == sizes.len();
            prop_assert!(d.end.is_none() || confirmed, "the session ended early: {:?}", d.end);
            i += 1;
        }
        prop_assert!(!d.refused);
        prop_assert_eq!(d.done.len(), sizes.len());
        for (id, dg) in &d.done {
            prop_assert_eq!(*dg, digest(*id, sizes[*id as usize]));
        }
        let Some(Action::Finish(t)) = &d.end else { panic!("no totals") };
        prop_assert_eq!(t.files, sizes.len() as u64);
        prop_assert_eq!(t.bytes, sizes.iter().sum::<u64>());
    }

    /// A gate admits exactly the whole blocks of its file.
    #[test]
    fn a_gate_admits_only_whole_blocks_inside_the_file(size in 0..1000u64, offset in 0..1100u64, len in 0..20u32) {
        let g = Gate { size, block_size: 16 };
        match g.admit(1, offset, len) {
            Ok(b) => {
                prop_assert_eq!(b * 16, offset);
                prop_assert!(offset + u64::from(len) <= size);
                prop_assert_eq!(u64::from(len), (size - offset).min(16));
            }
            Err(_) => prop_assert!(!offset.is_multiple_of(16) || offset >= size || u64::from(len) != (size - offset).min(16)),
        }
    }

    /// A hole stands for whole blocks of its file, each of which the gate
    /// admits, and for nothing else.
    #[test]
    fn a_gate_admits_holes_of_whole_blocks_inside_the_file(size in 0..1000u64, offset in 0..1100u64, len in 0..200u64) {
        let g = Gate { size, block_size: 16 };
        let end = offset + len;
        let whole = len > 0 && end <= size && offset.is_multiple_of(16) && (end.is_multiple_of(16) || end == size);
        match g.admit_hole(1, offset, len) {
            Ok(blocks) => {
                prop_assert!(whole, "a hole at {}+{} admitted for a file of {} bytes", offset, len, size);
                let mut covered = 0;
                for b in blocks {
                    let blen = (size - b * 16).min(16);
                    prop_assert_eq!(g.admit(1, b * 16, blen as u32), Ok(b));
                    covered += blen;
                }
                prop_assert_eq!(covered, len);
            }
            Err(_) => prop_assert!(!whole),
        }
    }
}

#[test]
fn a_hole_is_at_most_max_hole_blocks() {
    let g = Gate { size: 1 << 40, block_size: 16 };
    assert_eq!(g.admit_hole(1, 32, 16 * MAX_HOLE_BLOCKS), Ok(2..2 + MAX_HOLE_BLOCKS));
    assert!(g.admit_hole(1, 32, 16 * (MAX_HOLE_BLOCKS + 1)).is_err());
    assert!(g.admit_hole(1, 32, u64::MAX).is_err(), "an end past 2^64");
}

#[test]
fn more_files_in_flight_than_any_sender_keeps_end_the_session() {
    let mut d = Driver::new(true);
    for id in 0..MAX_OPEN_FILES as u64 {
        d.feed(Event::Control(ToReceiver::Announce { id, meta: meta("a", 1), digest: None }));
    }
    assert!(d.end.is_none());
    let out = d.feed(Event::Control(ToReceiver::Announce { id: u64::MAX, meta: meta("a", 1), digest: None }));
    assert!(Driver::violated(&out));
    assert_eq!(d.rx.open_files(), 0, "an ended session keeps no state");
}

#[test]
fn a_file_refused_by_name_or_size_fails_alone() {
    let mut rx = Receive::new(Config {
        block_size: 1,
        discard: false,
        accept: Some(Arc::new(|p| if p == "no" { Err("not here".into()) } else { Ok(()) })),
    });
    rx.handle(Event::Control(ToReceiver::Announce { id: 1, meta: meta("../x", 1), digest: None }));
    rx.handle(Event::Control(ToReceiver::Announce { id: 2, meta: meta("no", 1), digest: None }));
    rx.handle(Event::Control(ToReceiver::Announce { id: 3, meta: meta("big", u64::MAX), digest: None }));
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    assert!(matches!(&out[0], Action::Refuse { id: 1, kind: ErrorKind::Refused, subject: Subject::Said(p), .. } if p == "../x"));
    assert!(matches!(&out[1], Action::Refuse { id: 2, message, .. } if message == "not here"));
    assert!(matches!(&out[2], Action::Refuse { id: 3, subject: Subject::Path(_), .. }));
    assert_eq!(out.len(), 3);
    assert!(!rx.is_over());
}

fn xattr(name: &[u8], value: &[u8]) -> Xattr {
    Xattr { name: name.to_vec(), value: value.to_vec() }
}

#[test]
fn a_symlink_or_directory_claiming_data_or_a_bad_target_fails_alone() {
    let mut rx = session(false);
    let link = |target: Option<&str>, size| FileMeta { mode: FileMeta::LINK | 0o777, target: target.map(Into::into), ..meta("l", size) };
    let bad = [
        link(Some("t"), 1),
        link(Some(""), 0),
        link(None, 0),
        link(Some("a\\q"), 0),
        link(Some("a\0b"), 0),
        link(Some(&"x".repeat(4097)), 0),
        FileMeta { mode: FileMeta::DIR | 0o755, ..meta("d", 3) },
        FileMeta { owner: Some(Owner { user: "a\0b".into(), ..Default::default() }), ..meta("o", 0) },
        FileMeta { owner: Some(Owner { group: "g".repeat(257), ..Default::default() }), ..meta("o", 0) },
        FileMeta { xattrs: vec![xattr(b"", b"v")], ..meta("x", 0) },
        FileMeta { xattrs: vec![xattr(b"user.a\0", b"v")], ..meta("x", 0) },
        FileMeta { xattrs: vec![xattr(&[b'n'; 256], b"v")], ..meta("x", 0) },
        FileMeta { xattrs: vec![xattr(b"user.big", &[0; (64 << 10) + 1])], ..meta("x", 0) },
        FileMeta { xattrs: vec![xattr(b"user.a", b"v"); 257], ..meta("x", 0) },
        FileMeta { mode: 0o070644, ..meta("t", 0) },
        FileMeta { mode: FileMeta::FIFO | 0o644, ..meta("p", 1) },
        FileMeta { rdev: 5, ..meta("r", 0) },
    ];
    let count = bad.len();
    for (id, m) in bad.into_iter().enumerate() {
        rx.handle(Event::Control(ToReceiver::Announce { id: id as u64, meta: m, digest: None }));
    }
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    assert_eq!(out.len(), count, "{out:?}");
    assert!(out.iter().all(|a| matches!(a, Action::Refuse { kind: ErrorKind::Refused, .. })), "{out:?}");
    rx.handle(Event::Control(ToReceiver::Announce { id: 9, meta: link(Some("../a\\xff"), 0), digest: None }));
    assert!(!matches!(rx.poll(), Some(Action::Refuse { .. })), "a good symlink was refused");
}

#[test]
fn stale_journaled_blocks_are_asked_for_once_then_the_file_fails() {
    let mut rx = session(false);
    let id = 4;
    rx.handle(Event::Control(ToReceiver::Announce { id, meta: meta("f", 8), digest: None }));
    rx.handle(Event::Prepared { id, outcome: Outcome::Receive { held: vec![(0, [9; 16])] } });
    rx.handle(Event::Control(ToReceiver::FileEnd { id, digest: digest(id, 8) }));
    rx.handle(Event::Written { id, block: 1, sum: sum(id, 1) });
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    assert!(out.contains(&Action::Rejournal { id, held: vec![(1, sum(id, 1))] }));
    assert_eq!(out.last(), Some(&Action::Send(ToSender::Nack { id, block: 0 })));
    rx.handle(Event::Written { id, block: 0, sum: [8; 16] });
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    assert_eq!(out[0], Action::Remove { id });
    assert!(matches!(&out[1], Action::Refuse { kind: ErrorKind::Verify, .. }));
}

/// A full disk fails the file it stopped, alone: the file committing
/// meanwhile is confirmed, and the session still ends with its totals.
#[test]
fn a_full_disk_fails_its_file_and_keeps_the_others() {
    let mut rx = session(false);
    for (id, path) in [(1, "big"), (2, "small")] {
        rx.handle(Event::Control(ToReceiver::Announce { id, meta: meta(path, 8), digest: None }));
        rx.handle(Event::Prepared { id, outcome: Outcome::Receive { held: vec![] } });
    }
    rx.handle(Event::Control(ToReceiver::FileEnd { id: 2, digest: digest(2, 8) }));
    for block in 0..8u64.div_ceil(BS) {
        rx.handle(Event::Written { id: 2, block, sum: sum(2, block) });
    }
    rx.handle(Event::Failed { id: 1, kind: ErrorKind::NoSpace, message: "full".into() });
    rx.handle(Event::Committed { id: 2 });
    rx.handle(Event::Control(ToReceiver::Finish { files: 1, bytes: 8, set_digest: 0 }));
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    let refused = out.iter().position(|a| matches!(a, Action::Refuse { id: 1, kind: ErrorKind::NoSpace, .. }));
    assert!(refused.is_some(), "the file that did not fit is not refused: {out:?}");
    assert!(out.contains(&Action::Remove { id: 1 }), "{out:?}");
    assert!(out.contains(&Action::Send(ToSender::Done { id: 2, digest: digest(2, 8) })), "{out:?}");
    assert!(matches!(out.last(), Some(Action::Finish(Totals { files: 1, bytes: 8, failed: 1, out_of_space: true, .. }))), "{out:?}");
}

/// What this end passes over by its own rules goes back as a skip that
/// says why, and is not counted as received.
#[test]
fn a_file_passed_over_is_skipped_with_its_reason_and_not_counted() {
    let mut rx = session(false);
    rx.handle(Event::Control(ToReceiver::Announce { id: 1, meta: meta("l", 0), digest: None }));
    rx.handle(Event::Prepared { id: 1, outcome: Outcome::PassedOver("out of the tree".into()) });
    rx.handle(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }));
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    let plan = ToSender::Plan { id: 1, skip: true, ranges: vec![], passed_over: "out of the tree".into() };
    assert_eq!(out.get(1), Some(&Action::Send(plan)), "{out:?}");
    assert!(matches!(out.last(), Some(Action::Finish(Totals { files: 0, failed: 0, .. }))), "{out:?}");
}

#[test]
fn the_end_is_confirmed_once_the_files_in_flight_are_settled() {
    let mut d = Driver::new(false);
    let id = 1;
    d.feed(Event::Control(ToReceiver::Announce { id, meta: meta("f", 8), digest: None }));
    d.feed(Event::Prepared { id, outcome: Outcome::Receive { held: vec![] } });
    d.feed(Event::Control(ToReceiver::FileEnd { id, digest: digest(id, 8) }));
    // The sender has ended every file; its blocks are still on their way.
    let out = d.feed(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }));
    assert!(out.is_empty() && d.end.is_none(), "{out:?}");
    for block in 0..8u64.div_ceil(BS) {
        d.feed(Event::Written { id, block, sum: sum(id, block) });
    }
    assert!(d.end.is_none(), "the end confirmed before the file was committed");
    let out = d.feed(Event::Committed { id });
    assert_eq!(out[0], Action::Send(ToSender::Done { id, digest: digest(id, 8) }));
    assert!(matches!(out.last(), Some(Action::Finish(t)) if t.files == 1 && t.bytes == 8));
}

#[test]
fn a_finish_before_every_file_ended_or_followed_by_an_announcement_is_a_violation() {
    let mut d = Driver::new(false);
    d.feed(Event::Control(ToReceiver::Announce { id: 1, meta: meta("f", 8), digest: None }));
    d.feed(Event::Prepared { id: 1, outcome: Outcome::Receive { held: vec![] } });
    assert!(Driver::violated(&d.feed(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }))));
    let mut d = Driver::new(false);
    d.feed(Event::Control(ToReceiver::Announce { id: 1, meta: meta("f", 8), digest: None }));
    d.feed(Event::Prepared { id: 1, outcome: Outcome::Receive { held: vec![] } });
    d.feed(Event::Control(ToReceiver::FileEnd { id: 1, digest: digest(1, 8) }));
    d.feed(Event::Control(ToReceiver::Finish { files: 0, bytes: 0, set_digest: 0 }));
    assert!(Driver::violated(&d.feed(Event::Control(ToReceiver::Announce { id: 2, meta: meta("g", 1), digest: None }))));
}

/// Receives file `id` named `path` of 8 bytes, said to have other names
/// when `linked`, up to its confirmation.
fn receive_file(rx: &mut Receive, id: u64, path: &str, linked: bool) {
    if linked {
        rx.handle(Event::Control(ToReceiver::Linked { id }));
    }
    rx.handle(Event::Control(ToReceiver::Announce { id, meta: meta(path, 8), digest: None }));
    rx.handle(Event::Prepared { id, outcome: Outcome::Receive { held: vec![] } });
    rx.handle(Event::Control(ToReceiver::FileEnd { id, digest: digest(id, 8) }));
    for block in 0..8u64.div_ceil(BS) {
        rx.handle(Event::Written { id, block, sum: sum(id, block) });
    }
    rx.handle(Event::Committed { id });
}

#[test]
fn a_hard_link_names_only_a_file_this_transfer_settled_and_was_told_has_other_names() {
    let mut rx = session(false);
    let link = |id, path: &str, first: &str| Event::Control(ToReceiver::HardLink { id, path: path.into(), first: first.into() });
    let refused = |rx: &mut Receive, id| {
        let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
        out.iter().any(|a| matches!(a, Action::Refuse { id: i, kind: ErrorKind::Refused, message, .. } if *i == id && message.contains("did not receive")))
    };
    // A file in flight, said to have other names: not yet settled, so not yet a link's target.
    rx.handle(Event::Control(ToReceiver::Linked { id: 1 }));
    rx.handle(Event::Control(ToReceiver::Announce { id: 1, meta: meta("f", 8), digest: None }));
    rx.handle(link(2, "early", "f"));
    assert!(refused(&mut rx, 2), "a link to a file still in flight was taken");
    receive_file(&mut rx, 3, "a/f", true);
    receive_file(&mut rx, 4, "plain", false);
    std::iter::from_fn(|| rx.poll()).for_each(drop);
    for (id, path, first) in [(5, "x", "elsewhere/shadow"), (6, "y", "plain"), (7, "a/f", "a/f")] {
        rx.handle(link(id, path, first));
        assert!(refused(&mut rx, id), "a link of {path} to {first} was taken");
    }
    rx.handle(link(8, "b/f", "a/f"));
    assert_eq!(rx.poll(), Some(Action::HardLink { id: 8, path: "b/f".into(), first: "a/f".into() }));
    rx.handle(Event::Prepared { id: 8, outcome: Outcome::Made });
    assert_eq!(rx.poll(), Some(Action::Send(ToSender::Done { id: 8, digest: file_digest(&[]) })));
    // A file found already there (a resumed or --sync run) takes links too.
    rx.handle(Event::Control(ToReceiver::Linked { id: 9 }));
    rx.handle(Event::Control(ToReceiver::Announce { id: 9, meta: meta("kept", 8), digest: None }));
    rx.handle(Event::Prepared { id: 9, outcome: Outcome::Present });
    rx.handle(link(10, "kept2", "kept"));
    let out: Vec<Action> = std::iter::from_fn(|| rx.poll()).collect();
    assert!(out.contains(&Action::HardLink { id: 10, path: "kept2".into(), first: "kept".into() }), "{out:?}");
    assert!(!rx.is_over());
}
