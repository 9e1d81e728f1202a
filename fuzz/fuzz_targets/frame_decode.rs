//! The frame decoder on arbitrary bytes: every input decodes into frames,
//! asks for more bytes or is refused — never a panic, never a read past the
//! input — and every message decoded encodes into a frame that decodes
//! back to the same message.
#![no_main]

use dmover_proto::frame::{decode, Frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode(rest) {
        assert!(used > 0 && used <= rest.len(), "decode used {used} of {} bytes", rest.len());
        if let Frame::Msg(m) = frame {
            let mut again = Vec::new();
            m.encode(&mut again);
            match decode(&again) {
                Ok(Some((Frame::Msg(back), n))) => {
                    assert_eq!(n, again.len(), "{m:?} re-encoded decodes short");
                    assert_eq!(back, m, "{m:?} does not survive encoding");
                }
                other => panic!("{m:?} re-encoded does not decode: {other:?}"),
            }
        }
        rest = &rest[used..];
    }
});
