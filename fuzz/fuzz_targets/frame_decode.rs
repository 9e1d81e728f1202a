//! The frame decoder on arbitrary bytes: every input decodes into frames,
//! asks for more bytes or is refused — never a panic, never a read past the
//! input — and every frame decoded, control message or data block, encodes
//! into a frame that decodes back to the same frame.
#![no_main]

use dmover_proto::frame::{decode, Frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode(rest) {
        assert!(used > 0 && used <= rest.len(), "decode used {used} of {} bytes", rest.len());
        let mut again = Vec::new();
        match &frame {
            Frame::Msg(m) => m.encode(&mut again),
            Frame::Data(h, block) => {
                assert_eq!(h.len as usize, block.len(), "{h:?} carries {} bytes", block.len());
                again.extend_from_slice(&h.encode());
                again.extend_from_slice(block);
            }
        }
        match decode(&again) {
            Ok(Some((back, n))) => {
                assert_eq!(n, again.len(), "{frame:?} re-encoded decodes short");
                assert_eq!(back, frame, "{frame:?} does not survive encoding");
            }
            other => panic!("{frame:?} re-encoded does not decode: {other:?}"),
        }
        rest = &rest[used..];
    }
});
