//! The dmover transfer engine.
//!
//! A transfer has a sending end ([`send`]) and a receiving end ([`recv`]),
//! joined by one control connection and N data connections per destination
//! host. The same two ends serve every direction: the client sends and a
//! server receives (upload), a server sends and the client receives
//! (download), one server sends to others (third party), or both ends run in
//! one process over in-memory pairs (local copy). [`session`] opens those
//! connections from the client's side; the server crate accepts them.
//!
//! * [`source`] — source specs, globs and the streaming tree walk
//! * [`pool`] — the staging block pool under a memory budget
//! * [`send`], [`recv`] — the two ends, with their threads and stages
//! * [`journal`] — resume state of partial files
//! * [`transport`], [`wire`], [`handshake`] — byte streams, frames, authentication
//! * [`storage`] — every file operation, confined to an export by directory handles
//! * [`tuning`] — runs a stream tuner (`dmover-tune`) against a live transfer
//! * [`progress`] — live counters; [`history`] — rate over time
//! * [`fault`] — a seam for injecting faults, used only by the test suite

pub mod error;
pub mod fault;
pub mod halt;
pub mod handshake;
pub mod history;
pub mod ids;
pub mod journal;
pub mod pool;
pub mod progress;
pub mod recv;
pub mod retry;
pub mod send;
pub mod session;
pub mod source;
pub mod storage;
pub mod transport;
pub mod tuning;
pub mod wire;

pub use error::{Error, Result};
