//! One message type per phase of the protocol.
//!
//! [`Msg`] is the codec's view: every kind of control frame. An endpoint
//! never handles "any message": at each point of a conversation only a few
//! kinds may come, and each phase below is an enum of exactly those. A
//! reader decodes a frame and converts it into the phase it expects
//! ([`Phase::from_msg`]); a kind that does not belong there is refused
//! with a message that names both, so no loop needs a catch-all arm.
//! Writers send a phase's value; it encodes as the same frame. The wire
//! format does not change: a phase is a set of kinds, not a new frame.
//!
//! The phases, with the direction of each (C client, S server, Tx the
//! sending end of a transfer, Rx the receiving end):
//!
//! * [`ClientHello`] C→S and [`ServerHello`] S→C: authentication;
//! * [`Open`] C→S: what an authenticated connection is for;
//! * [`Request`] C→S on a control connection, answered by [`Reply`] S→C,
//!   and [`ListReply`] S→C while a listing streams;
//! * [`ToReceiver`] Tx→Rx and [`ToSender`] Rx→Tx on the control connection
//!   of a transfer, [`OnData`] Tx→Rx between blocks on a data connection;
//! * [`RemoteReport`] S→C while a server sends or pushes for a client;
//! * [`ToSink`] producer→sink and [`FromSink`] sink→producer in a stream.

use crate::auth::{ChallengeBytes, HelloKey, KeyId, ProofTag};
use crate::digest::Sum;
use crate::frame::{EngineParams, FileMeta, Msg, Stats, StepInfo, TicketedHost, TransferOptions};
use crate::record::Protection;
use crate::ErrorKind;

/// The messages that may come in one phase of the protocol.
pub trait Phase: Sized + Into<Msg> {
    /// Where in the protocol this is, for messages.
    const NAME: &'static str;
    /// The message as this phase, or back if its kind does not belong here
    /// (whole, to be reported or read as another phase).
    #[allow(clippy::result_large_err)]
    fn from_msg(m: Msg) -> Result<Self, Msg>;
}

impl Phase for Msg {
    const NAME: &'static str = "any phase";

    fn from_msg(m: Msg) -> Result<Msg, Msg> {
        Ok(m)
    }
}

/// Declares a phase: an enum whose variants are some of [`Msg`]'s, with
/// the same names and fields, and the conversions both ways.
macro_rules! phase {
    ($(#[$meta:meta])* $name:ident = $label:literal { $($(#[$vmeta:meta])* $variant:ident { $($field:ident : $ty:ty),* $(,)? }),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vmeta])* $variant { $($field: $ty),* }),+
        }

        impl From<$name> for Msg {
            fn from(m: $name) -> Msg {
                match m {
                    $($name::$variant { $($field),* } => Msg::$variant { $($field),* }),+
                }
            }
        }

        impl Phase for $name {
            const NAME: &'static str = $label;

            fn from_msg(m: Msg) -> Result<$name, Msg> {
                match m {
                    $(Msg::$variant { $($field),* } => Ok($name::$variant { $($field),* }),)+
                    m => Err(m),
                }
            }
        }
    };
}

phase! {
    /// C→S: the client's side of authentication.
    ClientHello = "the client's handshake" {
        /// First frame: which secret, what the records protect, and Noise message 1.
        Hello { key_id: KeyId, protection: Protection, hello: HelloKey },
        /// The client's proof.
        Proof { proof: ProofTag },
    }
}

phase! {
    /// S→C: the server's side of authentication.
    ServerHello = "the server's handshake" {
        /// Noise message 2: proves the server knows the secret.
        Challenge { challenge: ChallengeBytes },
        /// Authenticated.
        Welcome {},
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// C→S, first after authentication: what this connection is for.
    Open = "opening a connection" {
        OpenControl {},
        OpenData { session: [u8; 16], index: u32 },
    }
}

phase! {
    /// C→S on a control connection: what the client asks for.
    Request = "a request" {
        Receive { dest: String, options: TransferOptions },
        Send { sources: Vec<String>, options: TransferOptions, params: EngineParams },
        Grant { dest: String },
        Renew { key_id: KeyId },
        Push { sources: Vec<String>, dest: String, hosts: Vec<TicketedHost>, options: TransferOptions, params: EngineParams },
        List { path: String },
        Stream { producer: String, block_size: u32 },
        /// Keeps an idle control connection alive.
        Ping {},
    }
}

phase! {
    /// S→C: the answer to a request.
    Reply = "the answer to a request" {
        SessionOpened { session: [u8; 16] },
        Ticket { key_id: KeyId, wrapped_secret: [u8; 32], lifetime: u32 },
        Renewed { lifetime: u32 },
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// S→C while a listing streams.
    ListReply = "a listing" {
        Listing { entries: Vec<FileMeta>, done: bool },
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// Tx→Rx on the control connection of a transfer.
    ToReceiver = "a transfer, at its receiving end" {
        Announce { id: u64, meta: FileMeta, digest: Option<Sum> },
        Dir { meta: FileMeta },
        Linked { id: u64 },
        HardLink { id: u64, path: String, first: String },
        FileEnd { id: u64, digest: Sum },
        Abort { id: u64, kind: ErrorKind, message: String },
        Finish { files: u64, bytes: u64, set_digest: u128 },
        Echo { stamp: u64, received: u64, staged: u8, server_received: u64, transfers: u32 },
        Dial {},
        Ping {},
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// Rx→Tx on the control connection of a transfer.
    ToSender = "a transfer, at its sending end" {
        Plan { id: u64, skip: bool, ranges: Vec<(u64, u64)>, passed_over: String },
        Nack { id: u64, block: u64 },
        Done { id: u64, digest: Sum },
        Failed { id: u64, kind: ErrorKind, subject: String, message: String },
        Finished { files: u64, bytes: u64, set_digest: u128 },
        Echo { stamp: u64, received: u64, staged: u8, server_received: u64, transfers: u32 },
        Ping {},
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// Tx→Rx on a data connection, between data frames.
    OnData = "a data connection" {
        Ping {},
        /// Nothing more comes on this connection.
        StreamEnd {},
        /// Blocks of a transfer's file that read as zeros, sent without
        /// their bytes (never part of a stream).
        Hole { id: u64, offset: u64, len: u64 },
    }
}

phase! {
    /// S→C while a server sends or pushes on a client's behalf.
    RemoteReport = "a server's report" {
        Progress { files: u64, bytes: u64, total_files: u64, total_bytes: u64, walk_done: bool },
        Report { stats: Stats },
        Ping {},
        Error { kind: ErrorKind, message: String },
    }
}

phase! {
    /// Producer→sink on the control connection of a stream.
    ToSink = "a stream, at the sink" {
        StepEnd { info: StepInfo },
        Ping {},
        Identify {},
        Fetch { step: u64, blocks: Vec<(u64, u32)> },
    }
}

phase! {
    /// Sink→producer on the control connection of a stream.
    FromSink = "a stream, at the producer" {
        Acked { blocks: Vec<(u64, u64)> },
        Nack { id: u64, block: u64 },
        StepSaved { step: u64, complete: bool },
        Identity { name: String },
        Ping {},
        Error { kind: ErrorKind, message: String },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_takes_its_kinds_and_gives_back_the_others() {
        let m = Msg::Plan { id: 1, skip: false, ranges: vec![(0, 1)], passed_over: String::new() };
        assert_eq!(
            ToSender::from_msg(m.clone()),
            Ok(ToSender::Plan { id: 1, skip: false, ranges: vec![(0, 1)], passed_over: String::new() })
        );
        assert_eq!(ToReceiver::from_msg(m.clone()), Err(m.clone()));
        assert_eq!(Msg::from(ToSender::from_msg(m.clone()).unwrap()), m);
        assert_eq!(OnData::from_msg(Msg::Ping), Ok(OnData::Ping {}));
        assert_eq!(Msg::from(OnData::StreamEnd {}), Msg::StreamEnd);
    }
}
