//! `include/dmover_stream.h` is what cbindgen makes of `src/ffi.rs`: this
//! test regenerates it and fails on any difference. Run it with
//! `DMOVER_BLESS=1` to rewrite the header after changing the C ABI.

use dmover_proto::ErrorKind;
use dmover_stream::ffi;
use std::path::Path;

#[test]
fn the_header_is_generated_from_the_ffi_module() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new().with_config(config).with_src(dir.join("src/ffi.rs")).generate().expect("cbindgen");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let header = dir.join("include/dmover_stream.h");
    if std::env::var_os("DMOVER_BLESS").is_some() {
        std::fs::write(&header, &generated).expect("write the header");
        return;
    }
    let checked_in = std::fs::read(&header).expect("read the header");
    assert!(
        checked_in == generated,
        "{} is not what cbindgen makes of src/ffi.rs; run `DMOVER_BLESS=1 cargo test -p dmover-stream --test header` \
         and commit the header. cbindgen gives:\n{}",
        header.display(),
        String::from_utf8_lossy(&generated)
    );
}

#[test]
fn error_codes_are_the_error_kinds() {
    for (code, kind) in [
        (ffi::DMS_EINTERNAL, ErrorKind::Internal),
        (ffi::DMS_EUSAGE, ErrorKind::Usage),
        (ffi::DMS_ENOTFOUND, ErrorKind::NotFound),
        (ffi::DMS_EPERMISSION, ErrorKind::Permission),
        (ffi::DMS_ENOSPACE, ErrorKind::NoSpace),
        (ffi::DMS_EUNREACHABLE, ErrorKind::Unreachable),
        (ffi::DMS_EAUTH, ErrorKind::Auth),
        (ffi::DMS_EREFUSED, ErrorKind::Refused),
        (ffi::DMS_EVERIFY, ErrorKind::Verify),
    ] {
        assert_eq!(code, kind as i32, "{kind:?}");
    }
}
