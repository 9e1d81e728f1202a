//! A transfer's stop signal: a flag its workers look at between steps, and
//! a channel that closes when the flag is raised, so that a thread waiting
//! in `select!` for work wakes at once instead of at its next poll.

use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub struct Halt {
    raised: AtomicBool,
    /// Dropped when raised: [`Halt::woken`] then disconnects.
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
}

impl Default for Halt {
    fn default() -> Halt {
        let (sender, receiver) = crossbeam_channel::bounded(0);
        Halt { raised: AtomicBool::new(false), sender: Mutex::new(Some(sender)), receiver }
    }
}

impl Halt {
    /// Raises the flag and wakes every thread waiting on [`Halt::woken`].
    pub fn raise(&self) {
        self.raised.store(true, Ordering::SeqCst);
        self.sender.lock().expect("halt lock").take();
    }

    pub fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    /// A channel on which nothing arrives: a receive from it returns (with
    /// an error) once the flag is raised.
    pub fn woken(&self) -> &Receiver<()> {
        &self.receiver
    }
}
