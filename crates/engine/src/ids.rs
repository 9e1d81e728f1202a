//! User and group names and ids, as the system's name service knows them:
//! the sender names a file's owner and group with them, and a receiver
//! maps names back to its own ids (as rsync does without `--numeric-ids`).
//! Answers are kept, so each id or name is looked up once per process.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::Mutex;

/// A kept answer, by id or by name.
type Kept<K, V> = Mutex<Option<HashMap<K, V>>>;

static USER_NAMES: Kept<u32, String> = Mutex::new(None);
static GROUP_NAMES: Kept<u32, String> = Mutex::new(None);
static USER_IDS: Kept<String, Option<u32>> = Mutex::new(None);
static GROUP_IDS: Kept<String, Option<u32>> = Mutex::new(None);

fn kept<K: std::hash::Hash + Eq + Clone, V: Clone>(cache: &Kept<K, V>, key: &K, look: impl FnOnce() -> V) -> V {
    if let Some(v) = cache.lock().expect("id cache").get_or_insert_with(HashMap::new).get(key) {
        return v.clone();
    }
    let v = look();
    cache.lock().expect("id cache").get_or_insert_with(HashMap::new).insert(key.clone(), v.clone());
    v
}

/// An entry's name and id, or None where there is none; Err(()) when
/// the buffer was too small for it (ERANGE).
type Found = Result<Option<(String, u32)>, ()>;

/// Calls a `get*_r` function with a buffer that grows until the entry
/// fits (up to 1 MiB).
fn lookup(call: impl Fn(&mut [libc::c_char]) -> Found) -> Option<(String, u32)> {
    let mut buf = vec![0 as libc::c_char; 1024];
    loop {
        match call(&mut buf) {
            Ok(found) => return found,
            Err(()) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Err(()) => return None,
        }
    }
}

fn user(by: Result<u32, &CStr>, buf: &mut [libc::c_char]) -> Found {
    // SAFETY: passwd is plain data; the buffer outlives the call and its
    // length is given; `found` is null or points at `pw`.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut found = std::ptr::null_mut();
        let rc = match by {
            Ok(uid) => libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found),
            Err(name) => libc::getpwnam_r(name.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut found),
        };
        if rc == libc::ERANGE {
            return Err(());
        }
        Ok((rc == 0 && !found.is_null()).then(|| (CStr::from_ptr(pw.pw_name).to_string_lossy().into_owned(), pw.pw_uid)))
    }
}

fn group(by: Result<u32, &CStr>, buf: &mut [libc::c_char]) -> Found {
    // SAFETY: as in `user`.
    unsafe {
        let mut gr: libc::group = std::mem::zeroed();
        let mut found = std::ptr::null_mut();
        let rc = match by {
            Ok(gid) => libc::getgrgid_r(gid, &mut gr, buf.as_mut_ptr(), buf.len(), &mut found),
            Err(name) => libc::getgrnam_r(name.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut found),
        };
        if rc == libc::ERANGE {
            return Err(());
        }
        Ok((rc == 0 && !found.is_null()).then(|| (CStr::from_ptr(gr.gr_name).to_string_lossy().into_owned(), gr.gr_gid)))
    }
}

/// The name of user `uid`, or "" if it has none.
pub fn user_name(uid: u32) -> String {
    kept(&USER_NAMES, &uid, || lookup(|b| user(Ok(uid), b)).map(|(n, _)| n).unwrap_or_default())
}

/// The name of group `gid`, or "" if it has none.
pub fn group_name(gid: u32) -> String {
    kept(&GROUP_NAMES, &gid, || lookup(|b| group(Ok(gid), b)).map(|(n, _)| n).unwrap_or_default())
}

/// The id of the user named `name` here, if there is one.
pub fn user_id(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    kept(&USER_IDS, &name.to_string(), || lookup(|b| user(Err(&c), b)).map(|(_, id)| id))
}

/// The id of the group named `name` here, if there is one.
pub fn group_id(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    kept(&GROUP_IDS, &name.to_string(), || lookup(|b| group(Err(&c), b)).map(|(_, id)| id))
}

/// This process's effective user id.
pub fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The groups this process is in (effective and supplementary).
pub fn own_groups() -> Vec<u32> {
    let mut all: Vec<u32> = rustix::process::getgroups().map(|g| g.into_iter().map(|g| g.as_raw()).collect()).unwrap_or_default();
    all.push(rustix::process::getegid().as_raw());
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_known_both_ways_and_an_unknown_name_is_none() {
        assert_eq!(user_name(0), "root");
        assert_eq!(user_id("root"), Some(0));
        assert_eq!(group_id(&group_name(0)), Some(0));
        assert_eq!(user_id("no-such-user-of-dmover"), None);
        assert_eq!(user_id("a\0b"), None);
    }
}
