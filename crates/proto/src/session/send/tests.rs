//! The send session against receive sessions (`session::receive`), in
//! virtual time (each step is one event): random interleavings of offers,
//! control messages, chunk reads and blocks arriving in any order, with
//! files that cannot be read (so that late messages come), duplicated and
//! dropped messages, receivers that lie about files, blocks and totals,
//! and other names (hard links) of files offered earlier.

use super::*;
use crate::session::receive::{self, Gate, Receive, Subject};
use proptest::prelude::*;

/// A small block size and chunk, so that small files have several chunks.
const BS: u64 = 4;
const CHUNK: u64 = 2;
const WINDOW: usize = 2;

/// The checksum of block `b` of the file at `path`, as a reader computes it.
fn sum(path: &str, b: u64) -> Sum {
    let mut s = [0; 16];
    s[..8].copy_from_slice(&(path.len() as u64 * 31 + path.bytes().map(u64::from).sum::<u64>()).to_le_bytes());
    s[8..].copy_from_slice(&b.to_le_bytes());
    s
}

fn meta(path: &str, size: u64) -> FileMeta {
    FileMeta { path: path.into(), size, mtime_s: 0, mtime_ns: 0, mode: 0o644, ..Default::default() }
}

fn session(hosts: usize) -> Send {
    Send::new(Config { hosts, block_size: BS, window: WINDOW, chunk_blocks: CHUNK })
}

/// One destination host: a receive session, a simulated receiving driver,
/// and the connections to it.
struct Host {
    rx: Receive,
    /// Control messages each way, in order (a TCP connection each).
    to_rx: VecDeque<ToReceiver>,
    to_tx: VecDeque<ToSender>,
    /// Blocks on the data connections: any order.
    data: Vec<(u64, u64, Sum)>,
    prepares: VecDeque<u64>,
    commits: VecDeque<u64>,
    gates: HashMap<u64, Gate>,
    /// Events the receiver heard.
    heard: usize,
}

impl Host {
    fn new() -> Host {
        Host {
            rx: Receive::new(receive::Config { block_size: BS, discard: false, accept: None }),
            to_rx: VecDeque::new(),
            to_tx: VecDeque::new(),
            data: Vec::new(),
            prepares: VecDeque::new(),
            commits: VecDeque::new(),
            gates: HashMap::new(),
            heard: 0,
        }
    }

    /// The receiver hears `e` and its driver carries out what it says.
    fn feed(&mut self, e: receive::Event) {
        self.heard += 1;
        self.rx.handle(e);
        while let Some(a) = self.rx.poll() {
            match a {
                receive::Action::Send(m) => self.to_tx.push_back(m),
                receive::Action::Prepare { id, .. } => self.prepares.push_back(id),
                receive::Action::Open { id, gate } => {
                    self.gates.insert(id, gate);
                }
                receive::Action::Commit { id, .. } => self.commits.push_back(id),
                receive::Action::Close { id } | receive::Action::Remove { id } => {
                    self.gates.remove(&id);
                }
                receive::Action::Refuse { id, kind, subject, message } => {
                    let subject = match subject {
                        Subject::Said(s) | Subject::Path(s) => s,
                    };
                    self.to_tx.push_back(ToSender::Failed { id, kind, subject, message });
                }
                receive::Action::Echo { stamp } => {
                    self.to_tx.push_back(ToSender::Echo { stamp, received: 0, staged: 0, server_received: 0, transfers: 0 })
                }
                receive::Action::Finish(t) => {
                    self.to_tx.push_back(ToSender::Finished { files: t.files, bytes: t.bytes, set_digest: t.set.0 })
                }
                // The driver makes another name at once.
                receive::Action::HardLink { id, .. } => self.rx.handle(receive::Event::Prepared { id, outcome: receive::Outcome::Made }),
                receive::Action::Rejournal { .. } | receive::Action::Dial => {}
                a => panic!("the receiver ended: {a:?}"),
            }
        }
    }
}

/// What the simulation does, step by step.
#[derive(Debug, Clone)]
enum Step {
    /// The walk offers its next file, if the session wants one.
    Offer,
    /// The next control message reaches host `h`'s receiver.
    ToRx { h: u8 },
    /// The next control message from host `h` reaches the sender.
    ToTx { h: u8 },
    /// A reader reads one of the pending chunks.
    Read { i: u8 },
    /// One of host `h`'s blocks in flight arrives, maybe damaged.
    Arrive { h: u8, i: u8, damaged: bool },
    /// Host `h`'s driver answers its oldest preparation; `how` picks the outcome.
    Prepare { h: u8, how: u8 },
    /// Host `h`'s driver commits its oldest verified file.
    Commit { h: u8, ok: bool },
    /// The tuner probes host `h`.
    Probe { h: u8 },
    /// The next message from host `h` to the sender is duplicated.
    Duplicate { h: u8 },
    /// The next message from host `h` to the sender is lost.
    Drop { h: u8 },
}

fn step(faults: bool) -> impl Strategy<Value = Step> {
    let f = if faults { 1 } else { 0 };
    prop_oneof![
        3 => Just(Step::Offer),
        4 => (0..3u8).prop_map(|h| Step::ToRx { h }),
        4 => (0..3u8).prop_map(|h| Step::ToTx { h }),
        4 => any::<u8>().prop_map(|i| Step::Read { i }),
        6 => (0..3u8, any::<u8>(), prop::bool::weighted(0.1)).prop_map(|(h, i, damaged)| Step::Arrive { h, i, damaged }),
        3 => (0..3u8, any::<u8>()).prop_map(|(h, how)| Step::Prepare { h, how }),
        2 => (0..3u8, prop::bool::weighted(0.95)).prop_map(|(h, ok)| Step::Commit { h, ok }),
        1 => (0..3u8).prop_map(|h| Step::Probe { h }),
        f => (0..3u8).prop_map(|h| Step::Duplicate { h }),
        f => (0..3u8).prop_map(|h| Step::Drop { h }),
    ]
}

/// Files to send: a size of 0 to 10 blocks, pinned to a host or not, and
/// whether its source cannot be read.
fn files() -> impl Strategy<Value = Vec<(u64, Option<u8>, bool)>> {
    prop::collection::vec((0..41u64, prop::option::weighted(0.3, 0..4u8), prop::bool::weighted(0.1)), 0..12)
}

/// Other names: each of the file it picks among those above, offered at a
/// place it picks after that file.
fn links() -> impl Strategy<Value = Vec<(u8, u8)>> {
    prop::collection::vec(any::<(u8, u8)>(), 0..6)
}

/// The whole transfer: the sender's session, its simulated driver, and the hosts.
struct Sim {
    tx: Send,
    hosts: Vec<Host>,
    /// The files and other names, by offer order (file `i + 1` is
    /// `files[i]`): an other name has size 0 and the name of its file in
    /// `firsts`; a file with other names is marked in `linked`.
    files: Vec<(FileMeta, Option<usize>, bool)>,
    firsts: Vec<Option<String>>,
    linked: Vec<bool>,
    /// Where each file was announced, and how many other names were.
    hosts_of: HashMap<String, usize>,
    links_announced: u64,
    offered: usize,
    reads: Vec<Read>,
    settled: HashMap<u64, Outcome>,
    /// `Finish` went to these hosts.
    finished: HashSet<usize>,
    complete: Option<Summary>,
    /// How the session ended otherwise.
    ended: Option<Action>,
    /// Messages that reached the sender twice: a violation may follow.
    duplicated: bool,
    /// A file's confirmation (`Done`, `Failed`) was lost: the receiver's
    /// totals then come before the file is settled, a violation.
    lost_settlement: bool,
    /// Events the sender heard.
    heard: usize,
}

impl Sim {
    fn new(hosts: usize, files: &[(u64, Option<u8>, bool)], links: &[(u8, u8)]) -> Sim {
        let mut items: Vec<(FileMeta, Option<usize>, bool, Option<String>)> = files
            .iter()
            .enumerate()
            .map(|(i, (size, pin, bad))| (meta(&format!("d/f{i}"), *size), pin.map(usize::from), *bad, None))
            .collect();
        for (j, (of, at)) in links.iter().enumerate().filter(|_| !files.is_empty()) {
            let first = format!("d/f{}", *of as usize % files.len());
            let after = items.iter().position(|f| f.0.path == first).expect("a file offered");
            let at = after + 1 + *at as usize % (items.len() - after);
            items.insert(at, (meta(&format!("d/link{j}"), 0), None, false, Some(first)));
        }
        let linked = items.iter().map(|f| items.iter().any(|l| l.3.as_deref() == Some(f.0.path.as_str()))).collect();
        let firsts = items.iter().map(|f| f.3.clone()).collect();
        Sim {
            tx: session(hosts),
            hosts: (0..hosts).map(|_| Host::new()).collect(),
            files: items.into_iter().map(|(m, p, b, _)| (m, p, b)).collect(),
            firsts,
            linked,
            hosts_of: HashMap::new(),
            links_announced: 0,
            offered: 0,
            reads: Vec::new(),
            settled: HashMap::new(),
            finished: HashSet::new(),
            complete: None,
            ended: None,
            duplicated: false,
            lost_settlement: false,
            heard: 0,
        }
    }

    /// The sender hears `e` and its driver carries out what it says.
    fn feed(&mut self, e: Event) {
        self.heard += 1;
        self.tx.handle(e);
        while let Some(a) = self.tx.poll() {
            assert!(self.complete.is_none() && self.ended.is_none(), "{a:?} after the session ended");
            match a {
                Action::Send { host, msg } => {
                    assert!(!self.finished.contains(&host), "{msg:?} after Finish to host {host}");
                    if let ToReceiver::Finish { .. } = msg {
                        assert!(self.tx.walk_done && self.tx.offers.is_empty(), "Finish before the walk was over");
                        let unended = self.tx.files.values().any(|f| !matches!(f.stage, Stage::Ended(_)));
                        assert!(!unended, "Finish with a file that has not ended");
                        self.finished.insert(host);
                    }
                    if let ToReceiver::Announce { id, meta, .. } = &msg {
                        let pin = self.files[*id as usize - 1].1.filter(|p| *p < self.hosts.len());
                        assert!(pin.is_none_or(|p| p == host), "file {id} pinned to {pin:?} announced to {host}");
                        assert!(self.tx.in_flight(host) <= WINDOW, "more than the window in flight");
                        self.hosts_of.insert(meta.path.clone(), host);
                    }
                    if let ToReceiver::HardLink { first, .. } = &msg {
                        let of = self.files.iter().position(|f| f.0.path == *first).expect("a file offered") as u64 + 1;
                        assert!(matches!(self.settled.get(&of), Some(Outcome::Sent | Outcome::Skipped)), "a link to {first}, not settled");
                        assert_eq!(self.hosts_of.get(first), Some(&host), "a link to {first} sent to another host");
                        assert!(self.tx.in_flight(host) <= WINDOW, "more than the window in flight");
                        self.links_announced += 1;
                    }
                    self.hosts[host].to_rx.push_back(msg);
                }
                Action::Read(r) => {
                    let size = self.files[r.id as usize - 1].0.size;
                    let blocks = size.div_ceil(BS);
                    assert!(r.first < r.end && r.end <= blocks, "a read of blocks {}..{} of a file of {blocks}", r.first, r.end);
                    assert!(r.send.iter().all(|(a, e)| a < e && *e <= blocks));
                    self.reads.push(r);
                }
                Action::Settle { id, outcome, .. } => {
                    assert!(self.settled.insert(id, outcome).is_none(), "file {id} settled twice");
                }
                Action::Complete(s) => self.complete = Some(s),
                a => {
                    assert!(self.duplicated || self.lost_settlement, "an honest receiver was refused: {a:?}");
                    self.ended = Some(a);
                }
            }
        }
    }

    fn step(&mut self, s: &Step) {
        let n = self.hosts.len();
        match *s {
            Step::Offer => {
                if !self.tx.wants_file() {
                    return;
                }
                let Some((meta, pinned, _)) = self.files.get(self.offered).cloned() else {
                    return self.feed(Event::WalkDone);
                };
                let (first, linked) = (self.firsts[self.offered].clone(), self.linked[self.offered]);
                self.offered += 1;
                match first {
                    Some(first) => self.feed(Event::OfferLink { path: meta.path, first, subject: String::new() }),
                    None => self.feed(Event::Offer { meta, digest: None, pinned, linked }),
                }
            }
            Step::ToRx { h } => {
                let host = &mut self.hosts[h as usize % n];
                if let Some(m) = host.to_rx.pop_front() {
                    host.feed(receive::Event::Control(m));
                }
            }
            Step::ToTx { h } => {
                let host = h as usize % n;
                if let Some(msg) = self.hosts[host].to_tx.pop_front() {
                    self.feed(Event::Control { host, msg });
                }
            }
            Step::Read { i } => {
                if self.reads.is_empty() {
                    return;
                }
                let r = self.reads.swap_remove(i as usize % self.reads.len());
                self.heard += 1;
                let (meta, _, bad) = self.files[r.id as usize - 1].clone();
                if bad {
                    let e =
                        Event::ReadFailed { id: r.id, kind: ErrorKind::SourceChanged, subject: "src".into(), message: "changed".into() };
                    return self.feed(e);
                }
                let sums: Vec<Sum> = (r.first..r.end).map(|b| sum(&meta.path, b)).collect();
                for b in (r.first..r.end).filter(|b| r.sends(*b)) {
                    self.hosts[r.host].data.push((r.id, b, sum(&meta.path, b)));
                }
                if !r.resend {
                    self.feed(Event::Read { id: r.id, first: r.first, sums, kept: None });
                }
            }
            Step::Arrive { h, i, damaged } => {
                let host = &mut self.hosts[h as usize % n];
                if host.data.is_empty() {
                    return;
                }
                let (id, block, s) = host.data.swap_remove(i as usize % host.data.len());
                // Blocks of a file the receiver no longer has are dropped.
                host.heard += 1;
                if host.gates.contains_key(&id) {
                    host.feed(if damaged { receive::Event::Damaged { id, block } } else { receive::Event::Written { id, block, sum: s } });
                }
            }
            Step::Prepare { h, how } => {
                let host = &mut self.hosts[h as usize % n];
                let Some(id) = host.prepares.pop_front() else { return };
                let path = self.files[id as usize - 1].0.path.clone();
                let blocks = self.files[id as usize - 1].0.size.div_ceil(BS);
                let outcome = match how % 6 {
                    0 => receive::Outcome::Present,
                    1 => receive::Outcome::Refused { kind: ErrorKind::Permission, message: "no".into() },
                    // Blocks of an earlier run, right or stale.
                    2 | 3 => receive::Outcome::Receive {
                        held: (0..blocks)
                            .filter(|b| (b + u64::from(how)) % 3 == 0)
                            .map(|b| (b, if how % 6 == 2 { sum(&path, b) } else { [9; 16] }))
                            .collect(),
                    },
                    _ => receive::Outcome::Receive { held: vec![] },
                };
                host.feed(receive::Event::Prepared { id, outcome });
            }
            Step::Commit { h, ok } => {
                let host = &mut self.hosts[h as usize % n];
                let Some(id) = host.commits.pop_front() else { return };
                let e = if ok {
                    receive::Event::Committed { id }
                } else {
                    receive::Event::Failed { id, kind: ErrorKind::Internal, message: "disk".into() }
                };
                host.feed(e);
            }
            Step::Probe { h } => {
                let host = h as usize % n;
                self.feed(Event::Probe { host, stamp: 1 });
                self.feed(Event::Dial { host });
            }
            Step::Duplicate { h } => {
                let host = &mut self.hosts[h as usize % n];
                if let Some(m) = host.to_tx.front().cloned() {
                    // A repeated re-request is within the rules; anything else is a lie.
                    // A repeated re-request may pass the budget.
                    self.duplicated |= !matches!(m, ToSender::Echo { .. });
                    host.to_tx.push_front(m);
                }
            }
            Step::Drop { h } => {
                let lost = self.hosts[h as usize % n].to_tx.pop_front();
                self.lost_settlement |= matches!(lost, Some(ToSender::Done { .. } | ToSender::Failed { .. }));
            }
        }
    }

    /// Runs every host and reader until nothing moves: no damage, every
    /// commit succeeds, every preparation is a fresh file.
    fn settle_all(&mut self) {
        for _ in 0..10_000 {
            let before = self.moves();
            self.step(&Step::Offer);
            for h in 0..self.hosts.len() as u8 {
                self.step(&Step::ToRx { h });
                self.step(&Step::ToTx { h });
                self.step(&Step::Arrive { h, i: 0, damaged: false });
                self.step(&Step::Prepare { h, how: 5 });
                self.step(&Step::Commit { h, ok: true });
            }
            self.step(&Step::Read { i: 0 });
            if self.moves() == before {
                return;
            }
        }
        panic!("the transfer does not settle");
    }

    /// Events heard so far by both ends (a block or chunk read is heard as
    /// it arrives) (for [`Sim::settle_all`]).
    fn moves(&self) -> usize {
        self.heard + self.hosts.iter().map(|h| h.heard).sum::<usize>()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// With honest receivers and connections that lose nothing, every
    /// file is settled once, the transfer completes, and the totals each
    /// host confirms are the ones the sender counted.
    #[test]
    fn honest_receivers_settle_every_file(
        hosts in 1..4usize,
        files in files(),
        links in links(),
        steps in prop::collection::vec(step(false), 0..300),
    ) {
        let mut sim = Sim::new(hosts, &files, &links);
        for s in &steps {
            sim.step(s);
        }
        sim.settle_all();
        let summary = sim.complete.clone().expect("the transfer completes");
        prop_assert_eq!(sim.settled.len(), sim.files.len());
        // Other names of a file that failed fail unannounced.
        prop_assert_eq!(summary.files, files.len() as u64 + sim.links_announced);
        for (i, first) in sim.firsts.iter().enumerate() {
            let Some(first) = first else { continue };
            let of = sim.files.iter().position(|f| f.0.path == *first).unwrap() as u64 + 1;
            let sent = |id| matches!(sim.settled.get(&id), Some(Outcome::Sent | Outcome::Skipped));
            prop_assert_eq!(sent(i as u64 + 1), sent(of), "{} and its file {} settled apart", sim.files[i].0.path, first);
        }
        prop_assert!(summary.digests_match());
        for (id, outcome) in &sim.settled {
            let (_, _, bad) = &sim.files[*id as usize - 1];
            // An unreadable file is never confirmed as sent.
            prop_assert!(!bad || *outcome != Outcome::Sent || sim.files[*id as usize - 1].0.size == 0);
        }
        let failed = sim.settled.values().filter(|o| matches!(o, Outcome::Failed(_))).count();
        prop_assert_eq!(summary.errors.len(), failed);
        for (h, host) in summary.hosts.iter().enumerate() {
            prop_assert_eq!(host.confirmed, Some((host.files, host.bytes, host.set.0)), "host {}", h);
        }
    }

    /// Messages from receivers duplicated and lost: the session never
    /// settles a file twice, sends nothing after `Finish`, and ends with a
    /// violation only when a message that must come once came twice, or a
    /// file's confirmation was lost (the totals then come too early).
    #[test]
    fn duplicated_and_lost_messages_break_no_rule(
        hosts in 1..4usize,
        files in files(),
        links in links(),
        steps in prop::collection::vec(step(true), 0..400),
    ) {
        let mut sim = Sim::new(hosts, &files, &links);
        for s in &steps {
            sim.step(s);
        }
    }

    /// A receiver that says anything: the session stays within its rules
    /// and refuses what no honest receiver says.
    #[test]
    fn lying_receivers_are_refused(files in files(), lies in prop::collection::vec((any::<u8>(), 0..14u64, 0..16u64, any::<bool>()), 1..200)) {
        let mut tx = session(2);
        let mut offered = 0;
        let mut settled = HashSet::new();
        let mut over = false;
        for (what, id, n, flag) in lies {
            if tx.wants_file() && offered < files.len() && what % 4 == 0 {
                offered += 1;
                tx.handle(Event::Offer { meta: meta(&format!("f{offered}"), files[offered - 1].0), digest: None, pinned: None, linked: false });
            }
            let host = usize::from(what % 3 == 0);
            let msg = match what % 7 {
                0 => ToSender::Plan { id, skip: flag, ranges: vec![(n / 2, n)], passed_over: String::new() },
                1 => ToSender::Nack { id, block: n },
                2 => ToSender::Done { id, digest: if flag { file_digest(&[]) } else { [n as u8; 16] } },
                3 => ToSender::Failed { id, kind: ErrorKind::Refused, subject: String::new(), message: "no".into() },
                4 => ToSender::Finished { files: n, bytes: n, set_digest: 0 },
                5 => ToSender::Ping {},
                _ => ToSender::Echo { stamp: n, received: n, staged: 0, server_received: 0, transfers: 0 },
            };
            let never = matches!(msg, ToSender::Plan { .. } | ToSender::Nack { .. } | ToSender::Done { .. } | ToSender::Failed { .. })
                && (id == 0 || id > tx.offered);
            let early = matches!(msg, ToSender::Finished { .. }) && !tx.finishing;
            tx.handle(Event::Control { host, msg });
            while let Some(a) = tx.poll() {
                prop_assert!(!over, "{:?} after the end", a);
                match a {
                    Action::Settle { id, .. } => prop_assert!(settled.insert(id), "file {} settled twice", id),
                    Action::Read(r) => prop_assert!(r.end <= files[r.id as usize - 1].0.div_ceil(BS)),
                    Action::Violation { .. } | Action::Complete(_) | Action::PeerFailed { .. } | Action::Unreadable { .. } => over = true,
                    Action::Send { .. } => {}
                }
            }
            prop_assert!(over || !(never || early), "a message no receiver may send was taken");
            for h in 0..2 {
                prop_assert!(tx.in_flight(h) <= WINDOW);
            }
        }
    }
}

/// Gives `tx` an event and returns what it says.
fn run(tx: &mut Send, e: Event) -> Vec<Action> {
    tx.handle(e);
    std::iter::from_fn(|| tx.poll()).collect()
}

fn violated(out: &[Action]) -> bool {
    out.iter().any(|a| matches!(a, Action::Violation { .. }))
}

fn plan(id: u64, ranges: Vec<(u64, u64)>) -> Event {
    Event::Control { host: 0, msg: ToSender::Plan { id, skip: false, ranges, passed_over: String::new() } }
}

#[test]
fn the_window_holds_files_back_until_one_settles() {
    let mut tx = session(1);
    for i in 0..3 {
        run(&mut tx, Event::Offer { meta: meta(&format!("f{i}"), 0), digest: None, pinned: None, linked: false });
    }
    assert!(!tx.wants_file(), "the third file waits for room");
    assert_eq!(tx.in_flight(0), WINDOW);
    let out =
        run(&mut tx, Event::Control { host: 0, msg: ToSender::Plan { id: 1, skip: true, ranges: vec![], passed_over: String::new() } });
    assert!(out.iter().any(|a| matches!(a, Action::Send { msg: ToReceiver::Announce { id: 3, .. }, .. })));
    assert!(tx.wants_file());
}

#[test]
fn a_confirmation_twice_is_a_violation() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 0), digest: None, pinned: None, linked: false });
    run(&mut tx, plan(1, vec![]));
    let done = Event::Control { host: 0, msg: ToSender::Done { id: 1, digest: file_digest(&[]) } };
    assert!(matches!(run(&mut tx, done.clone()).as_slice(), [Action::Settle { outcome: Outcome::Sent, .. }]));
    assert!(violated(&run(&mut tx, done)));
}

#[test]
fn a_plan_past_the_end_is_a_violation() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 5), digest: None, pinned: None, linked: false });
    assert!(violated(&run(&mut tx, plan(1, vec![(0, 3)]))));
}

#[test]
fn a_block_asked_for_too_often_is_a_violation() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 8), digest: None, pinned: None, linked: false });
    run(&mut tx, plan(1, vec![(0, 2)]));
    let nack = Event::Control { host: 0, msg: ToSender::Nack { id: 1, block: 1 } };
    for _ in 0..NACK_BUDGET {
        assert!(matches!(run(&mut tx, nack.clone()).as_slice(), [Action::Read(Read { resend: true, first: 1, end: 2, .. })]));
    }
    assert!(violated(&run(&mut tx, nack)));
}

#[test]
fn late_messages_about_an_abandoned_file_are_ignored() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 8), digest: None, pinned: None, linked: false });
    run(&mut tx, plan(1, vec![(0, 2)]));
    let out =
        run(&mut tx, Event::ReadFailed { id: 1, kind: ErrorKind::SourceChanged, subject: "/src/f".into(), message: "changed".into() });
    assert!(matches!(&out[0], Action::Send { msg: ToReceiver::Abort { id: 1, .. }, .. }));
    assert!(matches!(&out[1], Action::Settle { outcome: Outcome::Failed(e), .. } if e.path == "/src/f"));
    let late =
        Event::Control { host: 0, msg: ToSender::Failed { id: 1, kind: ErrorKind::Verify, subject: String::new(), message: "x".into() } };
    assert!(run(&mut tx, late).is_empty());
}

#[test]
fn totals_larger_than_offered_are_a_violation() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 0), digest: None, pinned: None, linked: false });
    run(&mut tx, Event::Control { host: 0, msg: ToSender::Plan { id: 1, skip: true, ranges: vec![], passed_over: String::new() } });
    let out = run(&mut tx, Event::WalkDone);
    assert!(matches!(out.as_slice(), [Action::Send { msg: ToReceiver::Finish { files: 1, .. }, .. }]));
    assert!(violated(&run(&mut tx, Event::Control { host: 0, msg: ToSender::Finished { files: 2, bytes: 0, set_digest: 0 } })));
}

#[test]
fn finish_goes_out_with_the_last_end_and_totals_wait_for_every_file() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", BS), digest: None, pinned: None, linked: false });
    run(&mut tx, Event::WalkDone);
    run(&mut tx, plan(1, vec![(0, 1)]));
    let digest = file_digest(&[sum("f", 0)]);
    let out = run(&mut tx, Event::Read { id: 1, first: 0, sums: vec![sum("f", 0)], kept: None });
    assert!(matches!(&out[0], Action::Send { msg: ToReceiver::FileEnd { id: 1, .. }, .. }));
    assert!(matches!(&out[1], Action::Send { msg: ToReceiver::Finish { .. }, .. }), "{out:?}");
    // Totals before the file is confirmed: no honest receiver sends them.
    let mut early = session(1);
    for e in [
        Event::Offer { meta: meta("f", BS), digest: None, pinned: None, linked: false },
        Event::WalkDone,
        plan(1, vec![(0, 1)]),
        Event::Read { id: 1, first: 0, sums: vec![sum("f", 0)], kept: None },
    ] {
        run(&mut early, e);
    }
    assert!(violated(&run(&mut early, Event::Control { host: 0, msg: ToSender::Finished { files: 0, bytes: 0, set_digest: 0 } })));
    // A block asked for again after the end is still sent.
    let nack = Event::Control { host: 0, msg: ToSender::Nack { id: 1, block: 0 } };
    assert!(matches!(run(&mut tx, nack).as_slice(), [Action::Read(Read { resend: true, .. })]));
    let out = run(&mut tx, Event::Control { host: 0, msg: ToSender::Done { id: 1, digest } });
    assert!(matches!(out.as_slice(), [Action::Settle { outcome: Outcome::Sent, .. }]));
    let set_digest = tx.summary.hosts[0].set.0;
    let out = run(&mut tx, Event::Control { host: 0, msg: ToSender::Finished { files: 1, bytes: BS, set_digest } });
    assert!(matches!(out.as_slice(), [Action::Complete(s)] if s.digests_match()));
}

#[test]
fn a_block_asked_for_again_after_the_end_that_cannot_be_read_ends_the_session() {
    let mut tx = session(1);
    for e in [
        Event::Offer { meta: meta("f", BS), digest: None, pinned: None, linked: false },
        Event::WalkDone,
        plan(1, vec![(0, 1)]),
        Event::Read { id: 1, first: 0, sums: vec![sum("f", 0)], kept: None },
        Event::Control { host: 0, msg: ToSender::Nack { id: 1, block: 0 } },
    ] {
        run(&mut tx, e);
    }
    let out =
        run(&mut tx, Event::ReadFailed { id: 1, kind: ErrorKind::SourceChanged, subject: "/src/f".into(), message: "changed".into() });
    assert!(matches!(out.as_slice(), [Action::Unreadable { host: 0, kind: ErrorKind::SourceChanged, .. }]), "{out:?}");
    assert!(tx.is_over());
}

fn hard_link(out: &[Action]) -> Option<(usize, u64, &str, &str)> {
    out.iter().find_map(|a| match a {
        Action::Send { host, msg: ToReceiver::HardLink { id, path, first } } => Some((*host, *id, path.as_str(), first.as_str())),
        _ => None,
    })
}

#[test]
fn other_names_wait_for_their_file_and_go_to_its_host() {
    let mut tx = session(2);
    let out = run(&mut tx, Event::Offer { meta: meta("f", BS), digest: None, pinned: Some(1), linked: true });
    assert!(
        matches!(
            &out[..],
            [
                Action::Send { host: 1, msg: ToReceiver::Linked { id: 1 } },
                Action::Send { host: 1, msg: ToReceiver::Announce { id: 1, .. } },
            ]
        ),
        "{out:?}"
    );
    let out = run(&mut tx, Event::OfferLink { path: "g".into(), first: "f".into(), subject: String::new() });
    assert!(out.is_empty(), "a name went before its file was settled: {out:?}");
    run(&mut tx, Event::WalkDone);
    run(&mut tx, Event::Control { host: 1, msg: ToSender::Plan { id: 1, skip: false, ranges: vec![(0, 1)], passed_over: String::new() } });
    let out = run(&mut tx, Event::Read { id: 1, first: 0, sums: vec![sum("f", 0)], kept: None });
    assert!(!out.iter().any(|a| matches!(a, Action::Send { msg: ToReceiver::Finish { .. }, .. })), "Finish while a name waits: {out:?}");
    let digest = file_digest(&[sum("f", 0)]);
    let out = run(&mut tx, Event::Control { host: 1, msg: ToSender::Done { id: 1, digest } });
    assert_eq!(hard_link(&out), Some((1, 2, "g", "f")), "{out:?}");
    let out = run(&mut tx, Event::Control { host: 1, msg: ToSender::Done { id: 2, digest: file_digest(&[]) } });
    assert!(out.iter().any(|a| matches!(a, Action::Settle { id: 2, outcome: Outcome::Sent, .. })), "{out:?}");
    assert_eq!(out.iter().filter(|a| matches!(a, Action::Send { msg: ToReceiver::Finish { .. }, .. })).count(), 2, "{out:?}");
    // A name offered once its file is settled goes at once.
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", 0), digest: None, pinned: None, linked: true });
    run(&mut tx, Event::Control { host: 0, msg: ToSender::Plan { id: 1, skip: true, ranges: vec![], passed_over: String::new() } });
    let out = run(&mut tx, Event::OfferLink { path: "h".into(), first: "f".into(), subject: String::new() });
    assert_eq!(hard_link(&out), Some((0, 2, "h", "f")), "{out:?}");
}

#[test]
fn other_names_fail_with_their_file() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("f", BS), digest: None, pinned: None, linked: true });
    run(&mut tx, Event::OfferLink { path: "g".into(), first: "f".into(), subject: String::new() });
    let no = ToSender::Failed { id: 1, kind: ErrorKind::Permission, subject: String::new(), message: "denied".into() };
    let out = run(&mut tx, Event::Control { host: 0, msg: no });
    let failed = |out: &[Action], id: u64| {
        out.iter().any(|a| {
            matches!(a, Action::Settle { id: i, outcome: Outcome::Failed(e), .. }
            if *i == id && e.kind == ErrorKind::Permission && e.message.contains("another name of f, which failed: denied"))
        })
    };
    assert!(failed(&out, 2), "{out:?}");
    assert!(hard_link(&out).is_none(), "{out:?}");
    let out = run(&mut tx, Event::OfferLink { path: "h".into(), first: "f".into(), subject: String::new() });
    assert!(failed(&out, 3), "{out:?}");
    let out = run(&mut tx, Event::WalkDone);
    assert!(out.iter().any(|a| matches!(a, Action::Send { msg: ToReceiver::Finish { files: 0, .. }, .. })), "{out:?}");
}

/// A destination out of space fails the file it stopped; the file in
/// flight there still completes, nothing more is announced to it, and
/// what is offered after fails unsent, so the transfer ends with its totals.
#[test]
fn a_full_destination_gets_no_more_files_and_the_rest_fail_unsent() {
    let mut tx = session(1);
    for path in ["big", "small"] {
        run(&mut tx, Event::Offer { meta: meta(path, 0), digest: None, pinned: None, linked: false });
    }
    let full = ToSender::Failed { id: 1, kind: ErrorKind::NoSpace, subject: String::new(), message: "No space left".into() };
    run(&mut tx, Event::Control { host: 0, msg: full });
    let out = run(&mut tx, Event::Offer { meta: meta("later", 3), digest: None, pinned: None, linked: false });
    assert!(!out.iter().any(|a| matches!(a, Action::Send { msg: ToReceiver::Announce { .. }, .. })), "announced to a full host: {out:?}");
    assert!(
        matches!(&out[..], [Action::Settle { id: 3, outcome: Outcome::Failed(e), .. }] if e.kind == ErrorKind::NoSpace && e.path == "later"),
        "{out:?}"
    );
    assert!(tx.wants_file(), "the walk is held up");
    run(&mut tx, Event::WalkDone);
    run(&mut tx, plan(2, vec![]));
    run(&mut tx, Event::Control { host: 0, msg: ToSender::Done { id: 2, digest: file_digest(&[]) } });
    let out = run(&mut tx, Event::Control { host: 0, msg: ToSender::Finished { files: 1, bytes: 0, set_digest: 0 } });
    let Some(Action::Complete(s)) = out.last() else { panic!("the transfer did not complete: {out:?}") };
    let failed: Vec<&str> = s.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(failed, ["big", "later"]);
    assert_eq!((s.files, s.bytes, s.hosts[0].files), (3, 3, 1));
}

/// A receiver that passes a file over says why: the file is listed as
/// passed over, not skipped, and is no longer a file of the transfer.
#[test]
fn a_file_the_receiver_passes_over_is_listed_with_its_reason() {
    let mut tx = session(1);
    run(&mut tx, Event::Offer { meta: meta("l", 0), digest: None, pinned: None, linked: false });
    run(&mut tx, Event::WalkDone);
    let why = "a symlink leading out of the tree (--safe-links)";
    let msg = ToSender::Plan { id: 1, skip: true, ranges: vec![], passed_over: why.into() };
    let out = run(&mut tx, Event::Control { host: 0, msg });
    assert!(matches!(&out[0], Action::Settle { outcome: Outcome::PassedOver(e), .. } if e.message == why), "{out:?}");
    let out = run(&mut tx, Event::Control { host: 0, msg: ToSender::Finished { files: 0, bytes: 0, set_digest: 0 } });
    let Some(Action::Complete(s)) = out.last() else { panic!("the transfer did not complete: {out:?}") };
    assert_eq!((s.files, s.skipped_files, s.errors.len()), (0, 0, 0));
    assert_eq!(s.passed_over, [FileError { path: "l".into(), kind: ErrorKind::Refused, message: why.into() }]);
    assert!(s.digests_match());
}

/// However many files fail, the summary lists the first ones and counts the rest.
#[test]
fn failures_past_the_listed_ones_are_counted() {
    let mut s = Summary::default();
    for i in 0..MAX_LISTED_ERRORS + 5 {
        s.add_error(FileError { path: format!("f{i}"), kind: ErrorKind::NoSpace, message: "full".into() });
    }
    assert_eq!((s.errors.len(), s.errors_not_listed), (MAX_LISTED_ERRORS, 5));
}
