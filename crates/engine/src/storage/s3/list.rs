//! Listing directories (key prefixes).
//!
//! Listings carry no metadata, so each object listed takes a request for its
//! mode and mtime: a HEAD, or, where every object listed is to be read
//! ([`Options::fetch_listed`](super::Options::fetch_listed)), the GET of a
//! small object whole, kept in memory until it is read (one request per small
//! object in all).

use super::metadata::{answered, dir_stat, link_name, link_stat};
use super::read::{collect, total_size, Fetched};
use super::{dir_prefix, io_error, Inner};
use crate::storage::{DirEntry, Stat};
use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::Path;
use std::sync::{Condvar, Mutex};

/// Requests for the objects of listings at once, all listings together
/// (HEADs, or GETs of small ones). A listing's requests queue behind
/// those of the listings before it, so the connections they take are
/// kept busy from one listing to the next: left idle between listings, a
/// connection starts its next request in slow start.
pub(super) const HEADS_IN_FLIGHT: usize = 128;
/// Objects at most this large are fetched whole by a listing whose objects
/// are all to be read (see
/// [`Options::fetch_listed`](super::Options::fetch_listed)).
const FETCH_LISTED: u64 = 1 << 20;
/// How long a listing waits, with no object it fetched being read, for room
/// to fetch more; past that, listings stop fetching (the objects kept are
/// not being read: files skipped as already at their destination, say).
const LISTED_STALL: std::time::Duration = std::time::Duration::from_secs(5);

/// Small objects listings fetched whole, each kept until it is read (see
/// [`Options::fetch_listed`](super::Options::fetch_listed)), their memory
/// taken from the budget.
pub(super) struct Listed {
    state: Mutex<Kept>,
    /// Signalled when an object kept is taken.
    taken: Condvar,
}

#[derive(Default)]
struct Kept {
    /// Whether listings fetch small objects.
    on: bool,
    objects: HashMap<String, Fetched>,
    /// The sizes of `objects`, together.
    bytes: u64,
}

/// An object's attributes from a listing, with its key and what was
/// fetched of it where it was fetched whole.
type ListedObject = (Stat, Option<(String, Fetched)>);

impl Listed {
    pub(super) fn new(on: bool) -> Listed {
        Listed { state: Mutex::new(Kept { on, ..Kept::default() }), taken: Condvar::new() }
    }

    /// How many bytes of small objects a listing is to fetch, within `cap`
    /// together with those kept: first it waits until those take at most
    /// half of `cap` while they are being read (so listings run ahead of
    /// reading by what memory allows); none once that stalls for
    /// [`LISTED_STALL`], for good.
    fn room(&self, cap: u64) -> u64 {
        let mut k = self.state.lock().expect("listed lock");
        let mut last = k.bytes;
        while k.on && k.bytes > cap / 2 {
            let (next, waited) = self.taken.wait_timeout(k, LISTED_STALL).expect("listed lock");
            k = next;
            if waited.timed_out() && k.bytes >= last {
                log::debug!("objects fetched by a listing are not being read: listings fetch no more");
                k.on = false;
            }
            last = k.bytes;
        }
        if k.on {
            cap.saturating_sub(k.bytes)
        } else {
            0
        }
    }

    /// Keeps the objects fetched, in place of any kept under the same key.
    fn keep(&self, fetched: impl IntoIterator<Item = (String, Fetched)>) {
        let mut k = self.state.lock().expect("listed lock");
        for (key, f) in fetched {
            k.bytes += f.stat.size;
            if let Some(old) = k.objects.insert(key, f) {
                k.bytes -= old.stat.size;
            }
        }
    }

    /// Takes the object kept under `key`, if any.
    pub(super) fn take(&self, key: &str) -> Option<Fetched> {
        let mut k = self.state.lock().expect("listed lock");
        let f = k.objects.remove(key)?;
        k.bytes -= f.stat.size;
        self.taken.notify_all();
        Some(f)
    }
}

impl Inner {
    /// The entries of directory `dir` ([`Storage::list`](crate::storage::Storage::list)).
    pub(super) fn list(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let k = self.key(dir)?;
        let prefix = dir_prefix(&k);
        let i = self;
        // Each object's name and size.
        let mut names: Vec<(String, u64)> = Vec::new();
        let mut dirs: Vec<String> = Vec::new();
        // The directory's own marker (`KEY/`, see `make_dir`): it is there, even empty.
        let mut marked = false;
        let mut token = None;
        loop {
            let req = i.client.list_objects_v2().bucket(&i.bucket).prefix(&prefix).delimiter("/").set_continuation_token(token);
            let r = i.rt.block_on(req.send()).map_err(|e| io_error(&k, e))?;
            for o in r.contents() {
                marked |= !prefix.is_empty() && o.key() == Some(prefix.as_str());
                // A "directory marker" some tools make: not a file.
                if let Some(name) = o.key().and_then(|x| x.strip_prefix(&prefix)).filter(|n| !n.is_empty() && !n.ends_with('/')) {
                    names.push((name.to_string(), o.size().unwrap_or(0).max(0) as u64));
                }
            }
            for p in r.common_prefixes() {
                if let Some(name) =
                    p.prefix().and_then(|x| x.strip_prefix(&prefix)).map(|n| n.trim_end_matches('/')).filter(|n| !n.is_empty())
                {
                    dirs.push(name.to_string());
                }
            }
            token = r.next_continuation_token().map(str::to_string);
            if token.is_none() {
                break;
            }
        }
        if names.is_empty() && dirs.is_empty() && k != i.root && !marked {
            return Err(match i.head(&k) {
                Ok(_) => io::Error::new(io::ErrorKind::NotADirectory, format!("{k}: an object, not a directory")),
                Err(_) => io::Error::new(io::ErrorKind::NotFound, format!("{k}: no object is below this prefix")),
            });
        }
        // Listings carry no metadata: each object's mode and mtime take a HEAD,
        // or the GET of the whole object where it is small and to be read, as
        // far as half the memory bound has room; such objects are kept until
        // they are read.
        let mut room = i.listed.room(i.budget.bound / 2);
        let answers: Vec<io::Result<ListedObject>> = i.rt.block_on(async {
            let tasks: Vec<_> = names
                .iter()
                .map(|&(ref n, size)| {
                    let lease = (0 < size && size <= FETCH_LISTED.min(room)).then(|| i.budget.try_take(size)).flatten();
                    if lease.is_some() {
                        room -= size;
                    }
                    let (client, bucket, key, heads) = (i.client.clone(), i.bucket.clone(), format!("{prefix}{n}"), i.heads.clone());
                    tokio::spawn(async move {
                        let _permit = heads.acquire().await;
                        let Some(held) = lease else {
                            let h = client.head_object().bucket(bucket).key(&key).send().await.map_err(|e| io_error(&key, e))?;
                            let (stat, _, _) = answered(h.content_length().unwrap_or(0) as u64, h.last_modified(), h.metadata(), None);
                            return Ok((stat, None));
                        };
                        let get = client.get_object().bucket(bucket).key(&key).range(format!("bytes=0-{}", size - 1));
                        let r = get.send().await.map_err(|e| io_error(&key, e))?;
                        let (stat, etag, digest) = answered(total_size(&r), r.last_modified(), r.metadata(), r.e_tag());
                        let data = collect(&key, r.body).await?;
                        // An object replaced since it was listed is read later, as a large one is.
                        if stat.size != size {
                            return Ok((stat, None));
                        }
                        if data.len() != size {
                            return Err(io::Error::other(format!("{key}: asked for {size} bytes, got {}", data.len())));
                        }
                        Ok((stat, Some((key, Fetched { stat, etag, digest, data, held }))))
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.unwrap_or_else(|e| Err(io::Error::other(e.to_string()))));
            }
            out
        });
        let mut fetched = Vec::new();
        let stats: Vec<io::Result<Stat>> = answers
            .into_iter()
            .map(|a| {
                a.map(|(stat, f)| {
                    fetched.extend(f);
                    stat
                })
            })
            .collect();
        i.listed.keep(fetched);
        // An object NAME.rclonelink is the symlink NAME, unless a file has that name.
        let files: std::collections::HashSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        let mut out: Vec<DirEntry> = names
            .iter()
            .zip(stats)
            .filter_map(|((n, _), stat)| match link_name(n) {
                Some(link) if files.contains(link) => None,
                Some(link) => Some(DirEntry { name: OsString::from(link), stat: stat.map(link_stat) }),
                None => Some(DirEntry { name: OsString::from(n), stat }),
            })
            .collect();
        out.extend(dirs.into_iter().map(|n| DirEntry { name: OsString::from(n), stat: Ok(dir_stat()) }));
        Ok(out)
    }
}
