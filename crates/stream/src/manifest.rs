//! The producer's manifest (`SPILL_DIR/PRODUCER.PID.manifest.json`, beside
//! the spill file `PRODUCER.PID.spill`): where every block of every step
//! is. The queue manager keeps it on disk while the stream runs and writes
//! it a last time at close; `drain` reads it, also after the producer was
//! killed.

use dmover_proto::digest::Sum;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// What a spill file's name ends with.
pub const SPILL_SUFFIX: &str = ".spill";
/// What a producer's manifest's name ends with.
pub const MANIFEST_SUFFIX: &str = ".manifest.json";

/// The manifest that goes with the spill file `spill`
/// (`PRODUCER.PID.spill` → `PRODUCER.PID.manifest.json`, same directory).
pub fn beside(spill: &Path) -> PathBuf {
    let name = spill.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.strip_suffix(SPILL_SUFFIX).unwrap_or(&name);
    spill.with_file_name(format!("{stem}{MANIFEST_SUFFIX}"))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub producer: String,
    pub block_size: u32,
    /// How many sinks each step goes to ([`Config::replicas`](crate::Config::replicas)).
    #[serde(default = "one")]
    pub replicas: usize,
    /// Sinks as `host:port`, in order of preference.
    pub destinations: Vec<String>,
    /// Each sink's name — what `at` and `manifest_at` say, here and in
    /// the sinks' manifests — and the address the producer reached it at.
    /// A sink that never told its name is named by that address.
    #[serde(default)]
    pub sinks: BTreeMap<String, String>,
    /// The spill file.
    pub spill: PathBuf,
    pub steps: Vec<Step>,
}

impl Manifest {
    /// Writes the manifest to `path` atomically: under a temporary name in
    /// the same directory, then renamed over `path`, so a reader (or a
    /// producer killed meanwhile) finds the old manifest or the new one,
    /// whole.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.tmp"));
        let text = serde_json::to_string_pretty(self).expect("a manifest serializes") + "\n";
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub step: u64,
    /// The producer ended the step. A step not ended (the producer stopped
    /// while writing it) has no `bytes`, `metadata` or `records` yet.
    #[serde(default = "ended_by_default")]
    pub ended: bool,
    pub bytes: u64,
    /// The producer's key/value pairs.
    pub metadata: BTreeMap<String, String>,
    /// Each write of the step: (offset, length), written as the sink's
    /// manifests write them, `{ "offset": .., "len": .. }`.
    #[serde(with = "records")]
    pub records: Vec<(u64, u64)>,
    /// The sink that saved the step's manifest, if one did (one that
    /// saved it complete, if one did).
    pub manifest_at: Option<String>,
    /// Every sink that saved the step complete: where its copies are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub complete_at: Vec<String>,
    pub blocks: Vec<Block>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub offset: u64,
    pub len: u32,
    #[serde(with = "hex::serde")]
    pub xxh3: Sum,
    #[serde(flatten)]
    pub place: Place,
    /// The other sinks that acknowledged it (its copies beside `at`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<String>,
}

impl Step {
    /// Whether the producer stopped before the step was whole: not ended,
    /// or some of its blocks were only in its memory. It can never be sent.
    pub fn lost(&self) -> bool {
        !self.ended || self.blocks.iter().any(|b| matches!(b.place, Place::Undelivered { .. }))
    }

    /// Whether the step has blocks to send from the spill file.
    pub fn sendable_from_spill(&self) -> bool {
        !self.lost() && self.blocks.iter().any(|b| matches!(b.place, Place::Spilled { .. }))
    }
}

/// Manifests written before `replicas` existed sent each block to one sink.
fn one() -> usize {
    1
}

/// Manifests written before `ended` existed were written at close, when
/// every step was ended.
fn ended_by_default() -> bool {
    true
}

/// Where a block is: its fields in the block's JSON object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Place {
    /// Acknowledged by this sink (its name).
    At { at: String },
    /// In the spill file at this offset.
    Spilled { spill: PathBuf, spill_offset: u64 },
    /// Neither: in the producer's memory when the manifest was written.
    Undelivered { undelivered: bool },
}

/// A step's writes as JSON objects `{ "offset", "len" }`; read back from
/// those or from `[offset, len]` pairs (manifests of earlier versions).
mod records {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Record {
        offset: u64,
        len: u64,
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Object(Record),
        Pair(u64, u64),
    }

    pub fn serialize<S: Serializer>(v: &[(u64, u64)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|&(offset, len)| Record { offset, len }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u64, u64)>, D::Error> {
        let v = Vec::<Written>::deserialize(d)?;
        Ok(v.into_iter()
            .map(|w| match w {
                Written::Object(r) => (r.offset, r.len),
                Written::Pair(offset, len) => (offset, len),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_read_back_with_their_place_and_hex_checksums() {
        let block = |place| Block { offset: 0, len: 5, xxh3: [0xcd; 16], place, copies: Vec::new() };
        let m = Manifest {
            producer: "gtc-1".into(),
            block_size: 4096,
            replicas: 1,
            destinations: vec!["a:1".into(), "b:2".into()],
            sinks: [("ana-a".to_string(), "a:1".to_string()), ("b:2".to_string(), "b:2".to_string())].into(),
            spill: "/s/gtc-1.spill".into(),
            steps: vec![Step {
                step: 0,
                ended: true,
                bytes: 15,
                metadata: [("t".to_string(), "1".to_string())].into(),
                records: vec![(0, 15)],
                manifest_at: None,
                complete_at: Vec::new(),
                blocks: vec![
                    block(Place::At { at: "ana-a".into() }),
                    block(Place::Spilled { spill: "/s/gtc-1.spill".into(), spill_offset: 64 }),
                    block(Place::Undelivered { undelivered: true }),
                ],
            }],
        };
        let v = serde_json::to_value(&m).unwrap();
        let blocks = &v["steps"][0]["blocks"];
        let xxh3 = "cd".repeat(16);
        assert_eq!(blocks[0], serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "at": "ana-a" }));
        assert_eq!(v["sinks"], serde_json::json!({ "ana-a": "a:1", "b:2": "b:2" }));
        let spilled = serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "spill": "/s/gtc-1.spill", "spill_offset": 64 });
        assert_eq!(blocks[1], spilled);
        assert_eq!(blocks[2], serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "undelivered": true }));
        assert_eq!(v["steps"][0]["records"], serde_json::json!([{ "offset": 0, "len": 15 }]));
        assert_eq!(v["steps"][0]["manifest_at"], serde_json::Value::Null);
        assert_eq!(serde_json::from_value::<Manifest>(v.clone()).unwrap(), m);
        // A manifest of an earlier version, with records as pairs and
        // without `ended` (written at close: every step ended), reads back too.
        let mut old = v;
        old["steps"][0]["records"] = serde_json::json!([[0, 15]]);
        old["steps"][0].as_object_mut().unwrap().remove("ended");
        assert_eq!(serde_json::from_value::<Manifest>(old.clone()).unwrap(), m);
        // And without `sinks` (every sink named by its address).
        old.as_object_mut().unwrap().remove("sinks");
        assert!(serde_json::from_value::<Manifest>(old).unwrap().sinks.is_empty());
    }

    #[test]
    fn the_manifest_is_named_after_its_spill_file() {
        assert_eq!(beside(Path::new("/s/gtc-1.4242.spill")), Path::new("/s/gtc-1.4242.manifest.json"));
        assert_eq!(beside(Path::new("gtc-1.4242.spill")), Path::new("gtc-1.4242.manifest.json"));
    }
}
