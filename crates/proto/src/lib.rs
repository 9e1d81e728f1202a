//! The dmover wire format and protocol rules, with no I/O.
//!
//! Everything two dmover endpoints say to each other is a [`frame`]: an
//! eight-byte header and a body. Control frames carry a [`Msg`]; data frames
//! carry one block of one file, addressed by (file, offset) and protected by
//! its own checksum, so that any block can travel on any stream in any order.
//!
//! * [`frame`] — headers, messages, encoding and decoding (decoding never
//!   panics on hostile input; incomplete input is `Ok(None)`).
//! * [`phase`] — the messages that may come at each point of a
//!   conversation, one type per phase.
//! * [`auth`] — the Noise handshake that authenticates a connection and
//!   gives it keys.
//! * [`record`] — the sealed records an authenticated connection carries.
//! * [`digest`] — block checksums and the per-file digest built from them.
//! * [`path`] — the rules a relative path must follow to cross the wire.
//! * [`session`] — the protocol's rules as state machines: events in,
//!   actions out, no I/O.
//!
//! The protocol is described for people in `docs/PROTOCOL.md`.

pub mod auth;
pub mod digest;
pub mod frame;
pub mod packed;
pub mod path;
pub mod phase;
pub mod record;
pub mod session;

pub use frame::{DataHeader, DecodeError, ErrorKind, Msg};
pub use phase::Phase;

#[cfg(test)]
mod tests {
    use super::ErrorKind;

    #[test]
    fn error_kinds_are_spelled_by_their_name_in_reports() {
        for code in 1..=10u8 {
            let k = ErrorKind::from_u8(code);
            assert_eq!(k as u8, code);
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.name()));
            assert_eq!(serde_json::from_str::<ErrorKind>(&json).unwrap(), k);
        }
    }
}
