//! A seam for injecting faults, for the test suite.
//!
//! The engine has no fault of its own and reads no setting for one: a
//! program may install an [`Injector`] once, at start-up, and the sending
//! ends — a transfer's and a stream's (`dmover-stream`) — then hand it
//! every data block after checksumming it. Without one (always, in
//! `dmover` and in the stream library) every block goes out as read.
//!
//! The only program that installs one is `dmover-faulty`
//! (`crates/cli/src/bin/dmover-faulty.rs`), a test-only build of the same
//! command whose injector the end-to-end tests switch on with environment
//! variables. Keeping the injector out of the engine, rather than behind a
//! Cargo feature of the engine, is what keeps it out of every `dmover`
//! binary: Cargo unifies a package's features across everything one
//! command builds, so a feature the tests turn on would also be on in the
//! `dmover` that `cargo test --release` or `cargo build --all-targets`
//! builds next to them.

use std::sync::OnceLock;

/// Damages a data block in flight and says whether it did (the sender must
/// then send these bytes, not the file's).
pub type Injector = Box<dyn Fn(&mut [u8]) -> bool + Send + Sync>;

static INJECTOR: OnceLock<Injector> = OnceLock::new();

/// Installs `injector` for the rest of the process.
///
/// # Panics
///
/// If one was installed already.
pub fn install(injector: Injector) {
    assert!(INJECTOR.set(injector).is_ok(), "a fault injector is installed already");
}

/// Passes `block` to the injector, if one is installed.
pub(crate) fn corrupt_in_flight(block: &mut [u8]) {
    if let Some(inject) = INJECTOR.get() {
        inject(block);
    }
}

/// A copy of `block` as the injector damaged it, if one is installed and
/// damaged it: for a sender whose block is shared and must stay intact
/// (a stream keeps it until a sink holds it).
pub fn damaged_copy(block: &[u8]) -> Option<Vec<u8>> {
    let inject = INJECTOR.get()?;
    let mut copy = block.to_vec();
    inject(&mut copy).then_some(copy)
}
