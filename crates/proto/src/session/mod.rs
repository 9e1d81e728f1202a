//! The transfer's protocol rules as state machines that do no I/O.
//!
//! A session takes what happened — a message from the peer, or the outcome
//! of some work its driver did (a block written, a file committed, a chunk
//! read) — with `handle`, and says what to do next through `poll`:
//! messages to send, files to prepare, open, read, commit or remove. It
//! never touches a socket, a file, a thread or a clock, so random
//! interleavings of events can drive it in tests and under a fuzzer. The
//! engine's drivers own the connections and the disks and feed their
//! sessions from one event channel each.
//!
//! * [`send`] — the sending end of a transfer.
//! * [`receive`] — the receiving end of a transfer.
//! * [`audit`] — checks a receive session's actions against its rules
//!   from the outside (for property tests and the fuzzer).

pub mod audit;
pub mod receive;
pub mod send;
