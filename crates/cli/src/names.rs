//! The names a download may receive: only those its request can produce,
//! so that a server cannot plant other files in the destination.
//!
//! A source spec names a file or a directory (`dir` arrives as `dir/...`,
//! `dir/` as its contents) or a glob (names below the glob's base that it
//! matches, and names inside a matching directory), as the sender's walk
//! makes them (`dmover_engine::source`). Never accepted, whatever the
//! request (as by every receiver): names in dmover's resume state and its
//! partial files. Names with control characters are taken (a file system
//! holds them, and an upload takes them) and escaped wherever they are
//! printed.

use dmover_engine::recv::NameCheck;
use globset::{GlobBuilder, GlobMatcher};
use std::sync::Arc;

/// What one source spec lets through.
enum Rule {
    /// A directory's contents: any name.
    Any,
    /// A file or directory of this name: the name itself and names below it.
    Base(String),
    /// Names the glob matches, and names below those.
    Glob(GlobMatcher),
}

impl Rule {
    /// The rule for `spec`, a path below an export.
    fn of(spec: &str) -> Option<Rule> {
        let trimmed = if spec.len() > 1 { spec.trim_end_matches('/') } else { spec };
        let comps: Vec<&str> = trimmed.split('/').collect();
        if let Some(g) = comps.iter().position(|c| c.contains(['*', '?', '[', '{'])) {
            let glob = GlobBuilder::new(&comps[g..].join("/")).literal_separator(true).build().ok()?;
            return Some(Rule::Glob(glob.compile_matcher()));
        }
        if spec.ends_with('/') || spec.is_empty() {
            return Some(Rule::Any);
        }
        Some(Rule::Base(comps.last()?.to_string()))
    }

    fn allows(&self, name: &str) -> bool {
        match self {
            Rule::Any => true,
            Rule::Base(b) => name == b || name.strip_prefix(b.as_str()).is_some_and(|rest| rest.starts_with('/')),
            Rule::Glob(g) => name.match_indices('/').map(|(i, _)| &name[..i]).chain([name]).any(|n| g.is_match(n)),
        }
    }
}

/// The check for a download of `sources` (`EXPORT/path` each).
pub fn expected(sources: &[String]) -> NameCheck {
    let rules: Vec<Rule> = sources.iter().filter_map(|s| Rule::of(s.split_once('/').map_or("", |(_, rest)| rest))).collect();
    Arc::new(move |name: &str| {
        if !rules.iter().any(|r| r.allows(name)) {
            return Err("the server sent a name the request cannot produce; it is not taken".into());
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn takes(sources: &[&str], name: &str) -> bool {
        expected(&sources.iter().map(|s| s.to_string()).collect::<Vec<_>>())(name).is_ok()
    }

    #[test]
    fn names_follow_the_request() {
        assert!(takes(&["e/data/report.pdf"], "report.pdf"));
        assert!(takes(&["e/data/dir"], "dir/sub/a.dat"));
        assert!(!takes(&["e/data/report.pdf"], ".bashrc"));
        assert!(!takes(&["e/data/report.pdf"], "report.pdfx"));
        assert!(!takes(&["e/data/report.pdf"], ".ssh/authorized_keys"));
        assert!(takes(&["e/data/"], ".ssh/authorized_keys"));
        assert!(takes(&["e"], "a/b"));
        assert!(takes(&["e/d/**/*.h5"], "x/y.h5"));
        assert!(takes(&["e/d/*"], "sub/deeper/file"));
        assert!(!takes(&["e/d/*.h5"], "x/y.h5"));
        assert!(!takes(&["e/d/*.h5"], "y.txt"));
        assert!(takes(&["e/d/*.h5", "e/d/notes"], "notes/a"));
        // Any name a file system holds is taken; it is escaped when printed.
        assert!(takes(&["e/d/"], "a\u{1b}[2Jb"));
        assert!(takes(&["e/d/"], "a\nb"));
        assert!(takes(&["e/d/"], "bad\\xff.bin"));
    }
}
