//! Confinement: a directory that wire paths are resolved under and can
//! never leave.
//!
//! A [`Root`] either confines (a server's export: wire paths are checked by
//! `dmover_proto::path`, and no component below the root may be a symlink,
//! so no symlink can lead out) or not (the client's own file system, where
//! the user may name any path). The check walks the components with
//! `lstat`; a symlink swapped in between the check and the use is outside
//! what this guards against.

use crate::error::{Error, Result};
use dmover_proto::path::check_relative;
use dmover_proto::ErrorKind;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Root {
    dir: PathBuf,
    confined: bool,
    /// Name shown in messages (an export's name).
    label: String,
}

impl Root {
    /// The local file system: paths are used as given.
    pub fn local() -> Root {
        Root { dir: PathBuf::new(), confined: false, label: String::new() }
    }

    /// An export: `dir` must exist; paths below it are confined.
    pub fn export(label: &str, dir: &Path) -> std::io::Result<Root> {
        Ok(Root { dir: dir.canonicalize()?, confined: true, label: label.to_string() })
    }

    pub fn is_confined(&self) -> bool {
        self.confined
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The name of `rel` for messages: `export/rel` or the local path.
    pub fn display(&self, rel: &str) -> String {
        if self.confined {
            dmover_proto::path::join(&self.label, rel)
        } else {
            rel.to_string()
        }
    }

    /// The name of a resolved path for messages: its export path, or the
    /// local path as it is.
    pub fn label_of(&self, path: &Path) -> String {
        match path.strip_prefix(&self.dir) {
            Ok(rel) if self.confined => self.display(&rel.to_string_lossy()),
            _ => path.display().to_string(),
        }
    }

    /// Resolves `rel` (a wire path when confined, a local path otherwise).
    /// When confined, refuses syntax that escapes and any existing component
    /// that is a symlink.
    pub fn resolve(&self, rel: &str) -> Result<PathBuf> {
        if !self.confined {
            return Ok(PathBuf::from(if rel.is_empty() { "." } else { rel }));
        }
        check_relative(rel).map_err(|e| self.refuse(rel, &e.to_string()))?;
        let mut p = self.dir.clone();
        let comps: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
        for (i, c) in comps.iter().enumerate() {
            p.push(c);
            match p.symlink_metadata() {
                Ok(m) if m.file_type().is_symlink() => return Err(self.refuse(rel, "symlinks are not followed inside an export")),
                Ok(_) => {}
                Err(_) => {
                    // Below a missing component nothing exists, so nothing is a symlink.
                    p.extend(&comps[i + 1..]);
                    return Ok(p);
                }
            }
        }
        Ok(p)
    }

    fn refuse(&self, rel: &str, why: &str) -> Error {
        Error::new(ErrorKind::Refused, self.display(rel), format!("path refused: {why}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confined_root_refuses_symlinks_and_dotdot() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("d")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("d/link")).unwrap();
        let r = Root::export("x", t.path()).unwrap();
        assert!(r.resolve("d/new/file").is_ok());
        assert_eq!(r.resolve("d/link/f").unwrap_err().kind, ErrorKind::Refused);
        assert_eq!(r.resolve("d/link").unwrap_err().kind, ErrorKind::Refused);
        assert_eq!(r.resolve("../x").unwrap_err().kind, ErrorKind::Refused);
        assert_eq!(r.resolve("/etc").unwrap_err().kind, ErrorKind::Refused);
        assert_eq!(r.resolve("missing/a/b").unwrap(), t.path().canonicalize().unwrap().join("missing/a/b"));
    }
}
