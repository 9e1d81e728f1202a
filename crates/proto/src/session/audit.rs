//! Checks a receive session from the outside, for property tests and the
//! fuzzer: it watches every event going in and every action coming out and
//! says when an action breaks a rule of the receiving end — a file opened
//! for another size than announced, a file committed or confirmed before
//! every block is written with the digest the sender gave, the end
//! confirmed while a file is in flight, anything said after the session
//! ended, a hard link made to a file that was not settled here as one
//! the sender said has other names. It keeps its own account of the
//! blocks written and of the names settled, so a session that loses track
//! of one is caught.

use super::receive::{Action, Event, Gate, Outcome};
use crate::digest::{file_digest, Sum};
use crate::phase::{ToReceiver, ToSender};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The watcher. Feed it each event before the session hears it
/// ([`Audit::event`]) and each action the session yields ([`Audit::action`]).
#[derive(Default)]
pub struct Audit {
    discard: bool,
    /// Each file's size, as last announced.
    sizes: HashMap<u64, u64>,
    /// The sender's digest of each file, as last sent.
    ends: HashMap<u64, Sum>,
    /// Files the session asked the driver to prepare, not yet answered.
    preparing: HashSet<u64>,
    /// Blocks the driver said were held, of files not yet opened.
    held: HashMap<u64, Vec<(u64, Sum)>>,
    /// Open files: their gate and the blocks written (the first sum of each).
    open: HashMap<u64, (Gate, BTreeMap<u64, Sum>)>,
    /// Files sent to commit, with their digest, and those committed since.
    commits: HashMap<u64, Sum>,
    committed: HashSet<u64>,
    /// Directories reported made.
    made: HashSet<u64>,
    /// Each file's name, as last announced, and whether the sender said
    /// it has other names (a regular file only).
    names: HashMap<u64, (String, bool)>,
    /// The file the sender said the next announcement is of has other names.
    linked_next: Option<u64>,
    /// The names a hard link may be made to.
    linkable: HashSet<String>,
    over: bool,
}

impl Audit {
    /// A watcher for a session with `discard` as configured.
    pub fn new(discard: bool) -> Audit {
        Audit { discard, ..Audit::default() }
    }

    /// Notes an event the session is about to hear.
    pub fn event(&mut self, e: &Event) {
        match e {
            Event::Control(ToReceiver::Announce { id, meta, .. }) => {
                self.ends.remove(id);
                self.sizes.insert(*id, meta.size);
                let linked = self.linked_next.take() == Some(*id) && !meta.is_dir() && !meta.is_link();
                self.names.insert(*id, (meta.path.clone(), linked));
            }
            Event::Control(ToReceiver::Linked { id }) => self.linked_next = Some(*id),
            // Another name, a file of no data.
            Event::Control(ToReceiver::HardLink { id, .. }) => {
                self.ends.remove(id);
                self.sizes.insert(*id, 0);
                self.names.remove(id);
            }
            Event::Control(ToReceiver::FileEnd { id, digest }) => {
                self.ends.insert(*id, *digest);
            }
            // An answer to no question is not heard.
            Event::Prepared { id, outcome } if self.preparing.remove(id) => match outcome {
                Outcome::Receive { held } => {
                    self.held.insert(*id, held.clone());
                }
                Outcome::Made => {
                    self.made.insert(*id);
                }
                _ => {}
            },
            Event::Written { id, block, sum } => {
                if let Some((gate, blocks)) = self.open.get_mut(id) {
                    if *block < gate.blocks() {
                        blocks.entry(*block).or_insert(*sum);
                    }
                }
            }
            Event::Committed { id } if self.commits.contains_key(id) => {
                self.committed.insert(*id);
            }
            _ => {}
        }
    }

    /// Checks an action the session yielded.
    pub fn action(&mut self, a: &Action) -> Result<(), String> {
        if self.over {
            return Err(format!("{a:?} after the session ended"));
        }
        match a {
            Action::HardLink { first, .. } if !self.linkable.contains(first) => {
                return Err(format!("a hard link to {first}, which was not settled here as a file with other names"));
            }
            Action::Prepare { id, .. } | Action::HardLink { id, .. } => {
                self.preparing.insert(*id);
            }
            Action::Open { id, gate } => {
                if self.sizes.get(id) != Some(&gate.size()) {
                    return Err(format!("file {id} opened for {} bytes, announced {:?}", gate.size(), self.sizes.get(id)));
                }
                let held = self.held.remove(id).unwrap_or_default();
                let n = gate.blocks();
                let mut blocks = BTreeMap::new();
                for (b, s) in held.into_iter().filter(|(b, _)| *b < n) {
                    blocks.entry(b).or_insert(s);
                }
                self.open.insert(*id, (*gate, blocks));
            }
            Action::Rejournal { id, held } => {
                let (_, blocks) = self.open.get_mut(id).ok_or(format!("rejournal of file {id}, not open"))?;
                *blocks = held.iter().copied().collect();
            }
            Action::Commit { id, digest } => {
                self.check_complete(*id, digest)?;
                self.commits.insert(*id, *digest);
            }
            Action::Send(ToSender::Plan { id, skip: true, .. }) => self.settled(*id),
            Action::Send(ToSender::Done { id, digest }) => {
                self.settled(*id);
                let committed = self.committed.remove(id) && self.commits.get(id) == Some(digest);
                let made = self.made.remove(id) && *digest == file_digest(&[]);
                if !(committed || made) {
                    if !self.discard {
                        return Err(format!("file {id} confirmed before it was committed"));
                    }
                    self.check_complete(*id, digest)?;
                }
                self.forget(*id);
            }
            Action::Close { id } | Action::Remove { id } => self.forget(*id),
            Action::Refuse { id, .. } => {
                self.names.remove(id);
            }
            // The end is confirmed only once every file is settled.
            Action::Finish(_) if !(self.open.is_empty() && self.commits.is_empty() && self.preparing.is_empty()) => {
                return Err(format!("finished with files in flight: open {:?}", self.open.keys().collect::<Vec<_>>()));
            }
            Action::Finish(_) | Action::Violation(_) | Action::PeerFailed { .. } => self.over = true,
            _ => {}
        }
        Ok(())
    }

    /// Every block of file `id` is written, and `digest` is both theirs
    /// and the sender's.
    fn check_complete(&self, id: u64, digest: &Sum) -> Result<(), String> {
        let (gate, blocks) = self.open.get(&id).ok_or(format!("file {id} verified but never opened"))?;
        let n = gate.blocks();
        if blocks.len() as u64 != n {
            return Err(format!("file {id} verified with {} of its {n} blocks written", blocks.len()));
        }
        if file_digest(blocks.values()) != *digest || self.ends.get(&id) != Some(digest) {
            return Err(format!("file {id} verified with a digest that is not its blocks' or the sender's"));
        }
        Ok(())
    }

    /// File `id` is settled here: its name takes hard links if the sender
    /// said it has other names.
    fn settled(&mut self, id: u64) {
        if let Some((name, true)) = self.names.remove(&id) {
            self.linkable.insert(name);
        }
    }

    fn forget(&mut self, id: u64) {
        self.names.remove(&id);
        self.open.remove(&id);
        self.commits.remove(&id);
        self.committed.remove(&id);
        self.held.remove(&id);
        self.preparing.remove(&id);
    }
}
