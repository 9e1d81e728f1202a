//! Rules for relative paths on the wire.
//!
//! Paths travel as UTF-8 strings with `/` separators, relative to an export
//! (or to a transfer's destination directory). A path is refused if it is
//! absolute, contains a NUL byte, an empty, `.` or `..` component, or a
//! backslash. Symlinks are the file system's business: the server checks
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
    #[error("backslash in path")]
    Backslash,
    #[error("path too long")]
    TooLong,
}

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
    if p.contains('\\') {
        return Err(PathError::Backslash);
    }
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

/// `s` with its control characters (escape, newline, ...) escaped as in
/// Rust (`\u{1b}`, `\n`), for printing or logging a name that came from a
/// peer or a file system: it cannot move the cursor, clear a terminal or
/// forge a log line.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return s.into();
    }
    s.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.to_string() }).collect::<String>().into()
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
    }

    #[test]
    fn accepts_plain_paths() {
        assert!(check_relative("").is_ok());
        assert!(check_relative("a/b.c/..d/e..").is_ok());
    }
}
