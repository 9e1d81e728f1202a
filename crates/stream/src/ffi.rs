//! The C ABI: opaque handles, integer error codes, and a per-thread
//! message for the last error.
//!
//! Every function returns 0 on success or a dmover error class (the same
//! numbers as `dmover`'s exit codes, `DMS_E*` in the header); the message
//! of the last failure on the calling thread is `dms_last_error()`.
//! `dms_open` gives the caller a handle that only `dms_close` frees.
//! Panics never cross the boundary: they become `DMS_EINTERNAL`.
//!
//! `include/dmover_stream.h` is generated from this file by cbindgen
//! (`cbindgen.toml`); the doc comments here are the header's. The test
//! `tests/header.rs` fails when the header differs from what this file
//! gives, and rewrites it when run with `DMOVER_BLESS=1`.

use crate::{seconds, token_from_env, Config, Report, Stream};
use dmover_engine::error::Error;
use dmover_proto::ErrorKind;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Success.
pub const DMS_OK: c_int = 0;
/// A bug: please report it.
pub const DMS_EINTERNAL: c_int = 1;
/// A bad argument or configuration.
pub const DMS_EUSAGE: c_int = 2;
/// E.g. the spill directory does not exist.
pub const DMS_ENOTFOUND: c_int = 3;
/// Permission denied (spill directory).
pub const DMS_EPERMISSION: c_int = 4;
/// The spill directory is full.
pub const DMS_ENOSPACE: c_int = 5;
/// No sink reachable, or blocks left undelivered.
pub const DMS_EUNREACHABLE: c_int = 6;
/// The sinks do not know this token.
pub const DMS_EAUTH: c_int = 7;
/// A sink refused the stream.
pub const DMS_EREFUSED: c_int = 8;
/// Data read back damaged.
pub const DMS_EVERIFY: c_int = 10;

/// An open stream; opaque.
pub struct DmsStream(Stream);

/// What dms_close reports.
#[repr(C)]
#[derive(Default)]
pub struct DmsReport {
    pub steps: u64,
    /// Bytes written by the producer.
    pub bytes: u64,
    pub blocks: u64,
    /// Blocks that overflowed the buffer to disk.
    pub spilled_blocks: u64,
    pub spilled_bytes: u64,
    /// Sent again after a failover or damage.
    pub resent_blocks: u64,
    /// Times a sink failed and the next took over.
    pub failovers: u64,
    /// Left in the spill file at close.
    pub undelivered_blocks: u64,
    /// Most data connections used at once.
    pub max_streams: u32,
    pub seconds: f64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(e: &Error) -> c_int {
    let text = format!("{e} ({})", e.hint()).replace('\0', " ");
    LAST_ERROR.with(|l| *l.borrow_mut() = CString::new(text).expect("NULs replaced"));
    e.kind as c_int
}

/// Runs `f`, turning errors and panics into codes.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => DMS_OK,
        Ok(Err(e)) => set_error(&e),
        Err(_) => set_error(&Error::internal("dmover-stream panicked")),
    }
}

fn usage(msg: &str) -> Error {
    Error::new(ErrorKind::Usage, "", msg)
}

/// A required C string argument.
///
/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
unsafe fn string(p: *const c_char, what: &str) -> Result<String, Error> {
    if p.is_null() {
        return Err(usage(&format!("{what} is NULL")));
    }
    // SAFETY: the caller promises a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(str::to_string).map_err(|_| usage(&format!("{what} is not UTF-8")))
}

/// Opens a stream and connects to the first sink that accepts it. The
/// close and ack timeouts come from DMOVER_CLOSE_TIMEOUT and
/// DMOVER_ACK_TIMEOUT (seconds) if set, else 600 s and 90 s; dms_set_timeouts
/// changes them. The replicas come from DMOVER_REPLICAS if set, else 1;
/// dms_set_replicas changes them.
///   producer      this producer's name: 1-64 of [A-Za-z0-9._-], e.g. "gtc-17"
///   destinations  sinks as "host:port,host:port,...", in order of preference
///   spill_dir     an existing directory for overflow and the manifest
///   buffer_bytes  circular buffer size (0: 80 MiB)
///   block_bytes   block size, 4 KiB to 64 MiB (0: 1 MiB)
///   max_wait_ms   longest a write waits for room before spilling (0: never waits)
///   out           receives the handle; the caller owns it until dms_close
///
/// # Safety
/// String arguments are valid NUL-terminated strings (or NULL, refused);
/// out is valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn dms_open(
    producer: *const c_char,
    destinations: *const c_char,
    spill_dir: *const c_char,
    buffer_bytes: u64,
    block_bytes: u64,
    max_wait_ms: u32,
    out: *mut *mut DmsStream,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(usage("the handle pointer is NULL"));
        }
        // SAFETY: checked non-null; the caller gives a valid pointer.
        unsafe { *out = std::ptr::null_mut() };
        // SAFETY: the caller's strings are valid or NULL.
        let (producer, dests, spill) =
            unsafe { (string(producer, "producer")?, string(destinations, "destinations")?, string(spill_dir, "spill_dir")?) };
        let dests: Vec<&str> = dests.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
        crate::log_to_stderr();
        let mut cfg = Config::new(&producer, &dests, &token_from_env()?, spill);
        cfg.options_from_env()?;
        if buffer_bytes > 0 {
            cfg.buffer = buffer_bytes;
        }
        if block_bytes > 0 {
            cfg.block_size = u32::try_from(block_bytes).map_err(|_| usage("block size too large"))?;
        }
        cfg.max_wait = Duration::from_millis(max_wait_ms as u64);
        let s = Stream::open(cfg)?;
        // SAFETY: as above.
        unsafe { *out = Box::into_raw(Box::new(DmsStream(s))) };
        Ok(())
    })
}

/// # Safety
/// `h` is NULL or a handle from `dms_open` not yet closed.
unsafe fn handle<'a>(h: *mut DmsStream) -> Result<&'a mut Stream, Error> {
    // SAFETY: the caller passes a live handle or NULL.
    unsafe { h.as_mut() }.map(|h| &mut h.0).ok_or_else(|| usage("the stream handle is NULL"))
}

/// Copies len bytes into the buffer and returns (the data is not retained).
///
/// # Safety
/// h is a live handle; data is valid for reads of len bytes.
#[no_mangle]
pub unsafe extern "C" fn dms_write(h: *mut DmsStream, data: *const c_void, len: usize) -> c_int {
    guard(|| {
        // SAFETY: per the contract above.
        let s = unsafe { handle(h)? };
        if len == 0 {
            return Ok(());
        }
        if data.is_null() {
            return Err(usage("data is NULL"));
        }
        // SAFETY: the caller gives `len` readable bytes at `data`.
        s.write(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) })
    })
}

/// Attaches key=value to the current step (e.g. "var"="phi", "dims"="64,64").
///
/// # Safety
/// h is a live handle; key and value are valid NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn dms_write_metadata(h: *mut DmsStream, key: *const c_char, value: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract above.
        let (s, k, v) = unsafe { (handle(h)?, string(key, "key")?, string(value, "value")?) };
        s.write_metadata(&k, &v)
    })
}

/// Sets how long dms_close waits for delivery before leaving what is left
/// in the spill file (close_seconds), and how long a sink may acknowledge
/// nothing while blocks wait for it before it is taken for dead and the next
/// one takes over (ack_seconds); 0 leaves one unchanged.
///
/// # Safety
/// h is a live handle.
#[no_mangle]
pub unsafe extern "C" fn dms_set_timeouts(h: *mut DmsStream, close_seconds: f64, ack_seconds: f64) -> c_int {
    guard(|| {
        let timeout = |what: &str, s: f64| match s {
            0.0 => Ok(None),
            s => seconds(&s.to_string()).map(Some).map_err(|m| usage(&format!("{what} = {s}: {m}"))),
        };
        let (close, ack) = (timeout("close_seconds", close_seconds)?, timeout("ack_seconds", ack_seconds)?);
        // SAFETY: per the contract above.
        unsafe { handle(h)? }.set_timeouts(close, ack)
    })
}

/// Sets how many sinks each step goes to, whole: 1 (the default, or
/// DMOVER_REPLICAS if set) to the number of destinations. A block's memory
/// is freed only when that many sinks hold it; when one fails, the next
/// destination takes its place and gets a copy of what it held.
///
/// # Safety
/// h is a live handle.
#[no_mangle]
pub unsafe extern "C" fn dms_set_replicas(h: *mut DmsStream, replicas: u32) -> c_int {
    // SAFETY: per the contract above.
    guard(|| unsafe { handle(h)? }.set_replicas(replicas as usize))
}

/// Ends the current time step.
///
/// # Safety
/// h is a live handle.
#[no_mangle]
pub unsafe extern "C" fn dms_end_step(h: *mut DmsStream) -> c_int {
    // SAFETY: per the contract above.
    guard(|| unsafe { handle(h)? }.end_step())
}

/// Ends the current step if anything was written to it, sends everything
/// left, fills *report (if not NULL) and frees the handle, even when it
/// returns an error. SPILL_DIR/PRODUCER.PID.manifest.json is kept if
/// anything is left to drain (or DMOVER_KEEP_MANIFEST=1), removed otherwise.
///
/// # Safety
/// h is NULL or a live handle, which is invalid afterwards; report is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn dms_close(h: *mut DmsStream, report: *mut DmsReport) -> c_int {
    guard(|| {
        if h.is_null() {
            return Err(usage("the stream handle is NULL"));
        }
        // SAFETY: a live handle from dms_open, owned by us from here on.
        let s = unsafe { Box::from_raw(h) }.0;
        let r: Report = s.close()?;
        if !report.is_null() {
            let c = DmsReport {
                steps: r.steps,
                bytes: r.bytes,
                blocks: r.blocks,
                spilled_blocks: r.spilled_blocks,
                spilled_bytes: r.spilled_bytes,
                resent_blocks: r.resent_blocks,
                failovers: r.failovers,
                undelivered_blocks: r.undelivered_blocks,
                max_streams: r.max_streams as u32,
                seconds: r.seconds,
            };
            // SAFETY: the caller gives a writable report or NULL.
            unsafe { report.write(c) };
        }
        r.undelivered().map_or(Ok(()), Err)
    })
}

/// The calling thread's last error message ("" if none); valid until its next call.
#[no_mangle]
pub extern "C" fn dms_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}
