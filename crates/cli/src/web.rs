//! `--metrics ADDR` (`dmover serve`, `dmover sink`, `dmover run`,
//! `dmover submit`) and `dmover status --web ADDR`: the address given,
//! bound with the page token its visitors must show, and the pages of
//! `dmover-web` served there.

use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use dmover_web::{Access, Site};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

/// The address `flag` gives: a port (on loopback) or HOST:PORT.
pub fn address(addr: &str) -> String {
    if addr.parse::<u16>().is_ok() {
        format!("127.0.0.1:{addr}")
    } else {
        addr.to_string()
    }
}

/// The page token in `file`, checked as any token file is. It travels in
/// the clear (plain HTTP), so it is refused if it is `data`, the token
/// the server or the job authenticates with.
pub fn page_token(file: &Path, data: Option<&[u8]>) -> Result<Vec<u8>> {
    let token = dmover_engine::session::read_token(file)?;
    if data == Some(&token[..]) {
        return Err(Error::new(
            ErrorKind::Usage,
            file.display().to_string(),
            "holds the data token, which would then cross the network in the clear: the pages take a token of their own",
        )
        .advised("make one with `dmover token FILE` and give that file instead"));
    }
    Ok(token)
}

/// An address bound for the pages, with who may read them.
pub struct Pages {
    listener: TcpListener,
    access: Access,
}

/// Binds the address `flag` gives; off loopback there must be a page
/// `token`, which `token_flag` says how to give.
pub fn bind(flag: &str, addr: &str, token: Option<&[u8]>, token_flag: &str) -> Result<Pages> {
    let addr = address(addr);
    let listener = TcpListener::bind(&addr).map_err(|e| {
        Error::new(ErrorKind::Usage, format!("{flag} {addr}"), format!("cannot listen: {e}"))
            .advised(format!("give {flag} a free PORT (on loopback) or HOST:PORT"))
    })?;
    let access = Access::for_listener(&listener, token).ok_or_else(|| no_page_token(&format!("{flag} {addr}"), token_flag))?;
    Ok(Pages { listener, access })
}

/// The refusal of pages off loopback at `subject` without a page token;
/// `token_flag` says how to give one.
pub fn no_page_token(subject: &str, token_flag: &str) -> Error {
    Error::new(ErrorKind::Usage, subject, "not a loopback address, and there is no page token to ask visitors for").advised(format!(
        "give the pages a token of their own with {token_flag} (make one with `dmover token FILE`; never the data token), \
         or serve on loopback and reach them with `ssh -L`"
    ))
}

impl Pages {
    /// Serves `site` from now on; returns a line that says where, for the
    /// caller to show.
    pub fn serve(self, site: Arc<dyn Site>) -> Result<String> {
        let at = self.listener.local_addr().map_err(|e| Error::io("the pages' address", &e))?;
        let how = match self.access {
            Access::Open => "",
            Access::Token(_) => {
                " (with the page token: open the page as /#token=TOKEN; Prometheus sends it with \
                 `authorization: {credentials_file: FILE}`)"
            }
        };
        dmover_web::serve(self.listener, site, self.access);
        Ok(format!("dmover: status page at http://{at}/, metrics at http://{at}/metrics{how}"))
    }
}
