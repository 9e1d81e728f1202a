//! Rules for relative paths on the wire.
//!
//! Paths travel as UTF-8 strings with `/` separators, relative to an export
//! (or to a transfer's destination directory). A file name is bytes, and
//! not every name is UTF-8, so a path's string spells its bytes losslessly
//! ([`from_bytes`], [`to_bytes`]): UTF-8 stands for itself, a backslash is
//! written `\\`, and each byte of a sequence that is not UTF-8 is written
//! `\xHH`. Every name has exactly one spelling, so two names never meet in
//! one string. A path is refused if it is absolute, holds a NUL byte, an
//! empty, `.` or `..` component, or a backslash that is not one of those
//! two escapes. Symlinks are the file system's business: the server checks
//! where a path really leads after this syntactic check.

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("absolute paths are not allowed")]
    Absolute,
    #[error("NUL byte in path")]
    Nul,
    #[error("'..' is not allowed in paths")]
    DotDot,
    #[error("empty or '.' path component")]
    Empty,
    #[error("a backslash in a path must be written \\\\, and a byte that is not UTF-8 as \\x and two lower-case hex digits (80 to ff)")]
    Backslash,
    #[error("path too long")]
    TooLong,
}

use std::borrow::Cow;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Longest path accepted, in bytes.
pub const MAX_PATH: usize = 4096;

/// Checks a relative path; the empty string (the root itself) is allowed.
pub fn check_relative(p: &str) -> Result<(), PathError> {
    if p.len() > MAX_PATH {
        return Err(PathError::TooLong);
    }
    if p.contains('\0') {
        return Err(PathError::Nul);
    }
    if p.starts_with('/') {
        return Err(PathError::Absolute);
    }
    // Escapes spell bytes from 0x80 only: never a NUL, `/` or `.`.
    to_bytes(p)?;
    if p.is_empty() {
        return Ok(());
    }
    for c in p.split('/') {
        match c {
            ".." => return Err(PathError::DotDot),
            "" | "." => return Err(PathError::Empty),
            _ => {}
        }
    }
    Ok(())
}

/// The spelling of a name's bytes on the wire (see the module's doc): the
/// string itself when it is UTF-8 and holds no backslash.
pub fn from_bytes(b: &[u8]) -> Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(b) {
        if !s.contains('\\') {
            return Cow::Borrowed(s);
        }
    }
    let mut out = String::with_capacity(b.len() + 8);
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' {
                out.push_str("\\\\");
            } else {
                out.push(c);
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    Cow::Owned(out)
}

/// The bytes a wire path spells: refused if a backslash starts anything
/// but `\\` or `\xHH`, or if an escape spells bytes that do not need one
/// (a name has one spelling only).
pub fn to_bytes(s: &str) -> Result<Cow<'_, [u8]>, PathError> {
    if !s.contains('\\') {
        return Ok(Cow::Borrowed(s.as_bytes()));
    }
    let mut out = Vec::with_capacity(s.len());
    let mut rest = s.as_bytes();
    while let Some(i) = rest.iter().position(|&b| b == b'\\') {
        out.extend_from_slice(&rest[..i]);
        let (byte, len) = match rest.get(i + 1) {
            Some(b'\\') => (Some(b'\\'), 2),
            Some(b'x') => {
                let hex = rest.get(i + 2..i + 4).and_then(|h| std::str::from_utf8(h).ok());
                (hex.and_then(|h| u8::from_str_radix(h, 16).ok()).filter(|b| *b >= 0x80), 4)
            }
            _ => (None, 0),
        };
        out.push(byte.ok_or(PathError::Backslash)?);
        rest = &rest[i + len..];
    }
    out.extend_from_slice(rest);
    if from_bytes(&out) != s {
        return Err(PathError::Backslash);
    }
    Ok(Cow::Owned(out))
}

/// The file-system path a wire path spells (see [`to_bytes`]).
pub fn to_path(s: &str) -> Result<PathBuf, PathError> {
    Ok(PathBuf::from(OsStr::from_bytes(&to_bytes(s)?)))
}

/// The wire spelling of a file-system path or name (see [`from_bytes`]).
pub fn from_path(p: &Path) -> Cow<'_, str> {
    from_bytes(p.as_os_str().as_bytes())
}

/// `s` with its control characters (escape, newline, ...) escaped as in
/// Rust (`\u{1b}`, `\n`), and the invisible characters that reorder or
/// hide text (bidirectional overrides and isolates, zero-width spaces and
/// joiners, the byte-order mark) as `\u{202e}`, for printing or logging a
/// name that came from a peer or a file system: it cannot move the cursor,
/// clear a terminal, forge a log line or show one name as another.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(hidden) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            _ if c.is_control() => out.extend(c.escape_debug()),
            _ if hidden(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            _ => out.push(c),
        }
    }
    out.into()
}

/// Whether `c` must be escaped to be shown (see [`printable`]).
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{061c}' | '\u{feff}')
}

/// Joins two relative paths with `/`.
pub fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}/{b}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_control_characters_only() {
        assert_eq!(printable("a b/é.dat"), "a b/é.dat");
        assert_eq!(printable("a\x1b[2J\nb\t'c'"), "a\\u{1b}[2J\\nb\\t'c'");
        assert_eq!(printable("invoice\u{202e}fdp.exe"), "invoice\\u{202e}fdp.exe");
        assert_eq!(printable("a\u{200b}b\u{feff}"), "a\\u{200b}b\\u{feff}");
    }

    #[test]
    fn refuses_escapes() {
        assert_eq!(check_relative("../etc/passwd"), Err(PathError::DotDot));
        assert_eq!(check_relative("a/../../b"), Err(PathError::DotDot));
        assert_eq!(check_relative("/etc"), Err(PathError::Absolute));
        assert_eq!(check_relative("a\0b"), Err(PathError::Nul));
        assert_eq!(check_relative("a//b"), Err(PathError::Empty));
        assert_eq!(check_relative("a/./b"), Err(PathError::Empty));
        assert_eq!(check_relative("a\\..\\b"), Err(PathError::Backslash));
        assert_eq!(check_relative("a\\x2e\\x2e/b"), Err(PathError::Backslash));
        assert_eq!(check_relative("a\\x00"), Err(PathError::Backslash));
    }

    #[test]
    fn names_are_spelled_losslessly_and_once() {
        let names: [&[u8]; 7] = [b"plain", "\u{e9}t\u{e9}".as_bytes(), b"bad\xff.bin", b"bad\xfe.bin", b"a\\b", b"a\\xff", b"\xc3\n\x80\\"];
        let spelled: Vec<String> = names.iter().map(|n| from_bytes(n).into_owned()).collect();
        for (n, s) in names.iter().zip(&spelled) {
            assert_eq!(&*to_bytes(s).unwrap(), *n, "{s}");
            assert!(check_relative(s).is_ok(), "{s}");
        }
        assert_eq!(spelled[2], "bad\\xff.bin");
        assert_eq!(spelled[4], "a\\\\b");
        assert_eq!(spelled[5], "a\\\\xff");
        let distinct: std::collections::HashSet<&String> = spelled.iter().collect();
        assert_eq!(distinct.len(), names.len());
        // One spelling per name: escapes of UTF-8 or of ASCII, upper-case
        // hex, and stray backslashes are refused.
        for bad in ["\\xc3\\xa9", "\\x41", "\\xFF", "a\\", "\\n", "\\x", "\\xf"] {
            assert_eq!(to_bytes(bad), Err(PathError::Backslash), "{bad}");
        }
    }

    #[test]
    fn accepts_plain_paths() {
        assert!(check_relative("").is_ok());
        assert!(check_relative("a/b.c/..d/e..").is_ok());
    }
}
