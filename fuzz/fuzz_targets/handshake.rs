//! The server's side of the handshake against a peer that sends arbitrary
//! frames, with no socket: the frames are decoded as the server decodes
//! them and fed to the handshake's state (`dmover_proto::auth`). It must
//! never panic and never accept the peer, who cannot know the token. What
//! follows the handshake frames is fed to a record opener, which must
//! refuse it or open it, never panic.
#![no_main]

use dmover_proto::auth::{Responder, TOKEN_KEY_ID};
use dmover_proto::frame::{decode, Frame};
use dmover_proto::record::{Opener, Protection, HEADER};
use dmover_proto::Msg;
use libfuzzer_sys::fuzz_target;

const TOKEN: &[u8] = b"a token the fuzzer cannot know 0123456789";

/// The next control message at the front of `data`, if it holds one.
fn next(data: &mut &[u8]) -> Option<Msg> {
    let (frame, used) = decode(data).ok()??;
    *data = &data[used..];
    match frame {
        Frame::Msg(m) => Some(m),
        Frame::Data(..) => None,
    }
}

fuzz_target!(|input: &[u8]| {
    let mut data = input;
    if let Some(Msg::Hello { key_id, protection, hello }) = next(&mut data) {
        let secret = if key_id == TOKEN_KEY_ID { TOKEN.to_vec() } else { vec![9; 32] };
        if let Ok((responder, _challenge)) = Responder::answer(&key_id, &secret, protection, &hello) {
            if let Some(Msg::Proof { proof }) = next(&mut data) {
                assert!(responder.verify(&proof).is_err(), "the handshake accepted a peer that does not know the token");
            }
        }
    }
    // Records from a peer, opened with a key it may or may not have.
    for p in [Protection::Encrypted, Protection::Authenticated] {
        let mut opener = Opener::new(&[7; 32], p);
        let mut rest = data.to_vec();
        let mut at = 0;
        while let Some(header) = rest.get(at..at + HEADER) {
            let Ok(len) = Opener::payload_len(header.try_into().unwrap()) else { break };
            let end = (at + HEADER + len + 16).min(rest.len());
            if opener.open(&mut rest[at..end]).is_err() {
                break;
            }
            at = end;
        }
    }
});
