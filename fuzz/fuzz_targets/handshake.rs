//! The server's side of the handshake against a peer that sends arbitrary
//! bytes (then hangs up), over a real socket pair: it must end with an
//! error — never a panic or a hang — and must never accept the peer, who
//! cannot know the token.
#![no_main]

use dmover_engine::handshake;
use dmover_engine::wire::{FrameReader, FrameWriter};
use dmover_proto::auth::TOKEN_KEY_ID;
use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;

const TOKEN: &[u8] = b"a token the fuzzer cannot know 0123456789";

fuzz_target!(|data: &[u8]| {
    // Larger inputs would fill the socket buffer before the server reads.
    if data.len() > 64 * 1024 {
        return;
    }
    let (mut peer, server) = UnixStream::pair().expect("socket pair");
    peer.write_all(data).expect("write the input");
    peer.shutdown(Shutdown::Write).expect("half-close");
    let mut r = FrameReader::new(Box::new(server.try_clone().expect("clone")));
    let mut w = FrameWriter::new(Box::new(server));
    let result = handshake::server(&mut r, &mut w, |id| (*id == TOKEN_KEY_ID).then(|| TOKEN.to_vec()));
    assert!(result.is_err(), "the handshake accepted a peer that does not know the token");
});
