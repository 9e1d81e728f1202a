//! The producer's manifest (`SPILL_DIR/PRODUCER.manifest.json`): where
//! every block of every step is, written at close and read by `drain`.

use dmover_proto::digest::Sum;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The file name of a producer's manifest in its spill directory.
pub fn file_name(producer: &str) -> String {
    format!("{producer}.manifest.json")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub producer: String,
    pub block_size: u32,
    /// Sinks as `host:port`, in order of preference.
    pub destinations: Vec<String>,
    /// The spill file.
    pub spill: PathBuf,
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub step: u64,
    pub bytes: u64,
    /// The producer's key/value pairs.
    pub metadata: BTreeMap<String, String>,
    /// Each write of the step: (offset, length), written as the sink's
    /// manifests write them, `{ "offset": .., "len": .. }`.
    #[serde(with = "records")]
    pub records: Vec<(u64, u64)>,
    /// The sink that saved the step's manifest, if one did.
    pub manifest_at: Option<String>,
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
}

/// Where a block is: its fields in the block's JSON object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Place {
    /// Acknowledged by this sink.
    At { at: String },
    /// In the spill file at this offset.
    Spilled { spill: PathBuf, spill_offset: u64 },
    /// Neither (still in memory when the stream closed).
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
        let block = |place| Block { offset: 0, len: 5, xxh3: [0xcd; 16], place };
        let m = Manifest {
            producer: "gtc-1".into(),
            block_size: 4096,
            destinations: vec!["a:1".into(), "b:2".into()],
            spill: "/s/gtc-1.spill".into(),
            steps: vec![Step {
                step: 0,
                bytes: 15,
                metadata: [("t".to_string(), "1".to_string())].into(),
                records: vec![(0, 15)],
                manifest_at: None,
                blocks: vec![
                    block(Place::At { at: "a:1".into() }),
                    block(Place::Spilled { spill: "/s/gtc-1.spill".into(), spill_offset: 64 }),
                    block(Place::Undelivered { undelivered: true }),
                ],
            }],
        };
        let v = serde_json::to_value(&m).unwrap();
        let blocks = &v["steps"][0]["blocks"];
        let xxh3 = "cd".repeat(16);
        assert_eq!(blocks[0], serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "at": "a:1" }));
        let spilled = serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "spill": "/s/gtc-1.spill", "spill_offset": 64 });
        assert_eq!(blocks[1], spilled);
        assert_eq!(blocks[2], serde_json::json!({ "offset": 0, "len": 5, "xxh3": xxh3, "undelivered": true }));
        assert_eq!(v["steps"][0]["records"], serde_json::json!([{ "offset": 0, "len": 15 }]));
        assert_eq!(v["steps"][0]["manifest_at"], serde_json::Value::Null);
        assert_eq!(serde_json::from_value::<Manifest>(v.clone()).unwrap(), m);
        // A manifest of an earlier version, with records as pairs, reads back too.
        let mut old = v;
        old["steps"][0]["records"] = serde_json::json!([[0, 15]]);
        assert_eq!(serde_json::from_value::<Manifest>(old).unwrap(), m);
    }
}
