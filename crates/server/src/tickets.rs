//! Tickets: short-lived secrets a server issues so that another server can
//! deliver files to it on a client's behalf (third-party transfers). A
//! ticket allows receiving into one destination only, opens one session
//! only (its connections may join that session and no other), and expires:
//! the session it opened ends with it unless the client that asked for it
//! (a token holder) renews it. A ticket is forgotten soon after its
//! session ends (it can open no other); at most [`MAX_TICKETS`] are held
//! at once.

use dmover_engine::handshake::random;
use dmover_proto::auth::KeyId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a ticket stays valid after it is issued or renewed, by default.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(600);

/// Tickets a server holds at once (all issued to holders of its token):
/// each a few hundred bytes, for as long as it lives.
pub const MAX_TICKETS: usize = 1024;

/// How long a ticket is kept once its session has ended: its client may
/// renew it until the copy's report reaches it (which keeps the ticket no
/// longer).
const KEPT_AFTER_END: Duration = Duration::from_secs(10);

struct Ticket {
    secret: [u8; 32],
    dest: String,
    expires: Instant,
    /// The session the ticket opened, once it has.
    session: Option<[u8; 16]>,
    /// Its session has ended.
    ended: bool,
}

/// The tickets a server has issued; the control threads issue and look up.
pub struct Tickets {
    lifetime: Duration,
    map: Mutex<HashMap<KeyId, Ticket>>,
}

impl Tickets {
    /// Tickets that live `lifetime` unless renewed.
    pub fn new(lifetime: Duration) -> Tickets {
        Tickets { lifetime, map: Mutex::default() }
    }

    /// How long a ticket lives unless renewed.
    pub fn lifetime(&self) -> Duration {
        self.lifetime
    }

    /// A new ticket for receiving into `dest` (an export path); None when
    /// [`MAX_TICKETS`] are live.
    pub fn issue(&self, dest: &str) -> Option<(KeyId, [u8; 32])> {
        let (id, secret): (KeyId, [u8; 32]) = (random(), random());
        let mut m = self.map.lock().expect("tickets lock");
        let now = Instant::now();
        m.retain(|_, t| t.expires > now);
        if m.len() >= MAX_TICKETS {
            return None;
        }
        m.insert(id, Ticket { secret, dest: dest.to_string(), expires: now + self.lifetime, session: None, ended: false });
        Some((id, secret))
    }

    /// Marks a ticket's session ended: the ticket is forgotten
    /// [`KEPT_AFTER_END`] later, or when it expires if sooner.
    pub fn end(&self, id: &KeyId) {
        if let Some(t) = self.map.lock().expect("tickets lock").get_mut(id) {
            t.ended = true;
            t.expires = t.expires.min(Instant::now() + KEPT_AFTER_END);
        }
    }

    /// Extends a valid ticket's life by the lifetime from now (unless its
    /// session has ended); false if there is no such ticket or it has
    /// expired.
    pub fn renew(&self, id: &KeyId) -> bool {
        let mut m = self.map.lock().expect("tickets lock");
        let now = Instant::now();
        match m.get_mut(id) {
            Some(t) if t.expires > now => {
                if !t.ended {
                    t.expires = now + self.lifetime;
                }
                true
            }
            _ => false,
        }
    }

    /// How long a ticket has left; None once it has expired.
    pub fn left(&self, id: &KeyId) -> Option<Duration> {
        let m = self.map.lock().expect("tickets lock");
        m.get(id).and_then(|t| t.expires.checked_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    /// The secret of a valid ticket.
    pub fn secret(&self, id: &KeyId) -> Option<Vec<u8>> {
        let m = self.map.lock().expect("tickets lock");
        m.get(id).filter(|t| t.expires > Instant::now()).map(|t| t.secret.to_vec())
    }

    /// The destination a ticket allows.
    pub fn dest(&self, id: &KeyId) -> Option<String> {
        self.map.lock().expect("tickets lock").get(id).map(|t| t.dest.clone())
    }

    /// Binds the ticket to the session it opens; false if it has opened
    /// one already (a ticket is used once).
    pub fn claim(&self, id: &KeyId, session: [u8; 16]) -> bool {
        let mut m = self.map.lock().expect("tickets lock");
        match m.get_mut(id) {
            Some(t) if t.session.is_none() => {
                t.session = Some(session);
                true
            }
            _ => false,
        }
    }

    /// The session a ticket opened, if any.
    pub fn session(&self, id: &KeyId) -> Option<[u8; 16]> {
        self.map.lock().expect("tickets lock").get(id).and_then(|t| t.session)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_max_tickets_live_and_an_ended_ones_place_is_given_back() {
        let t = Tickets::new(Duration::from_secs(600));
        let ids: Vec<KeyId> = (0..MAX_TICKETS).map(|_| t.issue("e/in").expect("below the bound").0).collect();
        assert!(t.issue("e/in").is_none(), "a ticket beyond the bound was issued");
        // A ticket whose session ended can be renewed (its client may not
        // know yet) but is not kept longer for it.
        assert!(t.claim(&ids[0], [1; 16]));
        t.end(&ids[0]);
        assert!(t.renew(&ids[0]));
        assert!(t.left(&ids[0]).is_some_and(|d| d <= KEPT_AFTER_END), "renewing extended an ended ticket");
        t.map.lock().unwrap().get_mut(&ids[0]).unwrap().expires = Instant::now();
        assert!(t.issue("e/in").is_some(), "an ended ticket still took its place");
        assert!(!t.renew(&ids[0]) && t.secret(&ids[0]).is_none());
    }
}
