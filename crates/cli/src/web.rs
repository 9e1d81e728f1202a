//! `--metrics ADDR` (`dmover serve`, `dmover sink`, `dmover run`,
//! `dmover submit`) and `dmover status --web ADDR`: the address given,
//! bound, and the pages of `dmover-web` served there.

use dmover_engine::{Error, Result};
use dmover_proto::ErrorKind;
use dmover_web::{Access, Site};
use std::net::TcpListener;
use std::sync::Arc;

/// The address `flag` gives: a port (on loopback) or HOST:PORT.
pub fn address(addr: &str) -> String {
    if addr.parse::<u16>().is_ok() {
        format!("127.0.0.1:{addr}")
    } else {
        addr.to_string()
    }
}

/// Binds the address `flag` gives.
pub fn listen(flag: &str, addr: &str) -> Result<TcpListener> {
    let addr = address(addr);
    TcpListener::bind(&addr).map_err(|e| {
        Error::new(ErrorKind::Usage, format!("{flag} {addr}"), format!("cannot listen: {e}"))
            .advised(format!("give {flag} a free PORT (on loopback) or HOST:PORT"))
    })
}

/// Serves `site` on `listener` from now on; off loopback, only to requests
/// that show `token`. Returns a line that says where, for the caller to
/// show.
pub fn start(flag: &str, listener: TcpListener, site: Arc<dyn Site>, token: Option<&[u8]>) -> Result<String> {
    let at = listener.local_addr().map_err(|e| Error::io(flag, &e))?;
    let access = Access::for_listener(&listener, token).ok_or_else(|| {
        Error::new(ErrorKind::Usage, format!("{flag} {at}"), "not a loopback address, and there is no token to ask visitors for")
            .advised("set the job's token (token_file in the job file, --token-file or DMOVER_TOKEN), or serve on loopback and reach it with `ssh -L`")
    })?;
    let how = match access {
        Access::Open => String::new(),
        Access::Token(_) => " (open the page as /?token=TOKEN; Prometheus sends the token as a bearer credential)".into(),
    };
    dmover_web::serve(listener, site, access);
    Ok(format!("dmover: status page at http://{at}/, metrics at http://{at}/metrics{how}"))
}
