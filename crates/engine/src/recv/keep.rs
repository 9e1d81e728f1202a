//! What a received file keeps besides its content: its mode, times,
//! owner, group and extended attributes, by the transfer's flags and by
//! what this end may set.
//!
//! Modes lose the bits this process's umask clears unless the transfer
//! keeps permissions whole (`--perms`), as rsync without `-p` and cp
//! without `-p` create files; setuid and setgid bits are never applied.
//! Owners and groups (`--owner`, `--group`) are set where the receiving
//! end may: a local copy sets the owner as root only and a group it is in
//! (as cp -a does); a server only into an export its operator lets clients
//! set owners in (`dmover serve --allow-owners`), which also admits
//! extended attributes outside `user.*` (`trusted.*`, `security.*`: file
//! capabilities among them). Anywhere else a transfer that asks for owners
//! is refused, unless they came with `--archive` (kept where allowed).
//! Names map to this end's ids unless the transfer keeps ids as numbers
//! (`--numeric-ids`); a name unknown here keeps its number.

use crate::error::{Error, Result};
use crate::ids;
use crate::storage::{Attrs, Keeps, Xattr, ACL_XATTRS};
use dmover_proto::frame::{FileMeta, TransferFlags};
use dmover_proto::ErrorKind;
use std::collections::HashSet;
use std::sync::Mutex;

/// The rules one receiving end applies to what it is sent.
#[derive(Debug)]
pub(super) struct Keep {
    /// Mode bits cleared (this process's umask, or none with `--perms`).
    umask: u32,
    flags: TransferFlags,
    /// Owners and groups other than this process's may be set, and
    /// extended attributes outside `user.*`.
    privileged: bool,
    /// Devices, FIFOs and sockets may be made.
    nodes: bool,
    /// Any owner and group may be given: this process runs as root, or
    /// the storage records owners without enforcing them.
    root: bool,
    /// The groups this process is in: those it may give its files.
    groups: HashSet<u32>,
}

impl Keep {
    /// The rules for a transfer with `flags` into `dest` (named in a
    /// refusal), a storage that keeps `keeps`; `privileged`: this end lets
    /// the sender set owners and make devices. An explicit `--owner`,
    /// `--group`, `--devices` or `--specials` where they may not be set or
    /// kept is refused, and so are `--xattrs` and `--acls` where the
    /// storage keeps no extended attributes.
    pub(super) fn new(flags: TransferFlags, keeps: Keeps, privileged: bool, dest: &str) -> Result<Keep> {
        let explicit = !flags.contains(TransferFlags::IF_ALLOWED);
        let asked = |f: TransferFlags| explicit && flags.intersects(f);
        let ids = TransferFlags::OWNER | TransferFlags::GROUP;
        let nodes = TransferFlags::DEVICES | TransferFlags::SPECIALS;
        for (f, kept, what) in [
            (ids, Keeps::OWNERS, "owners or groups (--owner, --group)"),
            (nodes, Keeps::SPECIALS, "devices, FIFOs or sockets (--devices, --specials)"),
        ] {
            if asked(f) && !keeps.contains(kept) {
                return Err(Error::new(ErrorKind::Usage, dest, format!("this storage keeps no {what}")).advised("copy without them"));
            }
            if asked(f) && !privileged {
                return Err(Error::new(ErrorKind::Refused, dest, format!("this export does not let clients set {what}"))
                    .advised("copy without them, or ask the server's operator to allow them (dmover serve --allow-owners EXPORT)"));
            }
        }
        if flags.contains(TransferFlags::XATTRS) && !keeps.contains(Keeps::XATTRS) {
            return Err(
                Error::new(ErrorKind::Usage, dest, "this storage keeps no extended attributes (--xattrs)").advised("copy without them")
            );
        }
        if flags.contains(TransferFlags::ACLS) && !keeps.contains(Keeps::ACLS) {
            return Err(Error::new(ErrorKind::Usage, dest, "this storage keeps no ACLs (--acls)").advised("copy without them"));
        }
        let nodes = privileged && keeps.contains(Keeps::SPECIALS);
        let privileged = privileged && keeps.contains(Keeps::OWNERS);
        let umask = if flags.contains(TransferFlags::PERMS) { 0 } else { umask() };
        let root = ids::own_uid() == 0 || keeps.contains(Keeps::ANY_OWNER);
        Ok(Keep { umask, flags, privileged, nodes, root, groups: ids::own_groups().into_iter().collect() })
    }

    /// Whether the device, FIFO or socket `meta` announces is made: one the
    /// transfer asked for (`--devices`, `--specials`), where this end may
    /// (a device as root only, as mknod(2) allows). Err says why not, and
    /// whether the transfer only asked for what is allowed (`--archive`:
    /// then it is passed over rather than failed).
    pub(super) fn makes(&self, meta: &FileMeta) -> std::result::Result<(), (bool, &'static str)> {
        let flag = if meta.is_device() { TransferFlags::DEVICES } else { TransferFlags::SPECIALS };
        if !self.flags.contains(flag) {
            return Err((false, "a device, FIFO or socket, and this transfer does not copy them (--devices, --specials)"));
        }
        let soft = self.flags.contains(TransferFlags::IF_ALLOWED);
        if !self.nodes || (meta.is_device() && !self.root) {
            return Err((soft, "devices are made only by root, and devices, FIFOs and sockets only where the receiving end allows them"));
        }
        Ok(())
    }

    /// The mode a received file or directory is given: its source's
    /// permission bits less those the umask clears. A directory keeps its
    /// sticky bit, which only restricts who may remove names in it. Setuid
    /// and setgid bits are applied only with `--perms` where the sender may
    /// set owners (as rsync's `-p` keeps them), so that a peer cannot plant
    /// them elsewhere.
    pub(super) fn mode(&self, meta: &FileMeta) -> u32 {
        let kept = match (self.privileged && self.flags.contains(TransferFlags::PERMS), meta.is_dir()) {
            (true, _) => 0o7777,
            (false, true) => 0o1777,
            (false, false) => 0o777,
        };
        meta.mode & kept & !self.umask
    }

    /// Everything to set on what `meta` announces, but a digest.
    pub(super) fn attrs(&self, meta: &FileMeta) -> Attrs {
        let (owner, group) = self.ids(meta);
        Attrs {
            mode: self.mode(meta),
            mtime: Some((meta.mtime_s, meta.mtime_ns)),
            digest: None,
            owner,
            group,
            xattrs: meta.xattrs.iter().filter(|x| self.takes(x)).cloned().collect(),
        }
    }

    /// The user and group ids to give, where this end may set them.
    fn ids(&self, meta: &FileMeta) -> (Option<u32>, Option<u32>) {
        let (Some(o), true) = (&meta.owner, self.privileged) else { return (None, None) };
        let numeric = self.flags.contains(TransferFlags::NUMERIC_IDS);
        let uid = match (numeric, o.user.as_str()) {
            (false, name) if !name.is_empty() => ids::user_id(name).unwrap_or(o.uid),
            _ => o.uid,
        };
        let gid = match (numeric, o.group.as_str()) {
            (false, name) if !name.is_empty() => ids::group_id(name).unwrap_or(o.gid),
            _ => o.gid,
        };
        let owner = (self.flags.contains(TransferFlags::OWNER) && self.root).then_some(uid);
        let group = (self.flags.contains(TransferFlags::GROUP) && (self.root || self.groups.contains(&gid))).then_some(gid);
        (owner, group)
    }

    /// Whether an announced extended attribute is set: `user.*` with
    /// `--xattrs`, ACLs with `--acls`, `trusted.*` and `security.*` with
    /// `--xattrs` where this end is privileged; nothing else of `system.*`.
    fn takes(&self, x: &Xattr) -> bool {
        let name = x.name.as_slice();
        if ACL_XATTRS.contains(&name) {
            return self.flags.contains(TransferFlags::ACLS);
        }
        if !self.flags.contains(TransferFlags::XATTRS) {
            return false;
        }
        name.starts_with(b"user.") || (self.privileged && (name.starts_with(b"trusted.") || name.starts_with(b"security.")))
    }
}

/// Whether a symlink at `link` (a path within the transfer) with `target`
/// leads to somewhere inside the tree copied, as `--safe-links` asks: not
/// absolute, and never climbing above the tree's top with `..`.
pub(super) fn stays_inside(link: &str, target: &[u8]) -> bool {
    if target.starts_with(b"/") {
        return false;
    }
    let mut depth = link.split('/').filter(|c| !c.is_empty() && *c != ".").count() as i64 - 1;
    for c in target.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => depth += 1,
        }
    }
    true
}

/// This process's umask: from `/proc/self/status`, or where that does not
/// say, by setting it and putting it back at once (under a lock, so that
/// two readers cannot leave it changed).
fn umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let said = status.lines().find_map(|l| l.strip_prefix("Umask:").and_then(|m| u32::from_str_radix(m.trim(), 8).ok()));
    said.unwrap_or_else(|| {
        static LOCK: Mutex<()> = Mutex::new(());
        let _held = LOCK.lock().expect("umask lock");
        // SAFETY: umask(2) cannot fail; the mask read is put back at once.
        unsafe {
            let mask = libc::umask(0o077);
            libc::umask(mask);
            mask as u32
        }
    })
}

#[cfg(test)]
mod tests {
    use super::stays_inside;

    #[test]
    fn a_safe_link_never_leads_above_the_tree() {
        for (link, target, inside) in [
            ("a", "b", true),
            ("a", "/etc/passwd", false),
            ("a", "..", false),
            ("a", "../a", false),
            ("d/a", "../b", true),
            ("d/a", "../../b", false),
            ("d/a", "x/../../b", true),
            ("d/a", "x/../../../b", false),
            ("d/e/a", "./../..//b", true),
            ("a", ".", true),
        ] {
            assert_eq!(stays_inside(link, target.as_bytes()), inside, "{link} -> {target}");
        }
    }
}
