//! A child process as a byte stream: what it writes on its standard output
//! is read, what is written goes to its standard input. A connection
//! carried by another program (`ssh host dmover remote --relay ...` when a
//! firewall hides the remote end's port) is one of these.

use super::Transport;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Both ends of a child's pipes, shared by the halves of one connection.
struct Pipes {
    /// The child's standard output.
    out: OwnedFd,
    /// The child's standard input (None once closed).
    inp: Mutex<Option<OwnedFd>>,
    child: Mutex<Child>,
    timeout: Mutex<Option<Duration>>,
    peer: String,
}

impl Drop for Pipes {
    fn drop(&mut self) {
        let mut child = self.child.lock().expect("child lock");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A transport over a child process's standard input and output.
pub struct Piped(Arc<Pipes>);

impl Piped {
    /// `child`, started with piped standard input and output, as a byte
    /// stream to `peer`. The child is killed when the last half is dropped.
    pub fn new(mut child: Child, peer: String) -> io::Result<Piped> {
        let missing = || io::Error::new(io::ErrorKind::InvalidInput, "the child's standard input and output must be pipes");
        let out: OwnedFd = child.stdout.take().ok_or_else(missing)?.into();
        let inp: OwnedFd = child.stdin.take().ok_or_else(missing)?.into();
        Ok(Piped(Arc::new(Pipes { out, inp: Mutex::new(Some(inp)), child: Mutex::new(child), timeout: Mutex::new(None), peer })))
    }
}

impl Read for Piped {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let timeout = *self.0.timeout.lock().expect("timeout lock");
        if let Some(t) = timeout {
            let mut fds = [PollFd::new(&self.0.out, PollFlags::IN)];
            let ts = Timespec { tv_sec: t.as_secs() as i64, tv_nsec: t.subsec_nanos() as i64 };
            if poll(&mut fds, Some(&ts))? == 0 {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "nothing received within the timeout"));
            }
        }
        Ok(rustix::io::read(&self.0.out, buf)?)
    }
}

impl Write for Piped {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let inp = self.0.inp.lock().expect("stdin lock");
        let fd = inp.as_ref().ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "the connection was closed for writing"))?;
        Ok(rustix::io::write(fd.as_fd(), buf)?)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for Piped {
    fn split(&self) -> io::Result<Box<dyn Transport>> {
        Ok(Box::new(Piped(self.0.clone())))
    }
    /// Ends the child: reads see the end of the stream, writes fail.
    fn close(&self) {
        let _ = self.0.child.lock().expect("child lock").kill();
    }
    fn close_write(&self) {
        self.0.inp.lock().expect("stdin lock").take();
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        *self.0.timeout.lock().expect("timeout lock") = t;
        Ok(())
    }
    fn peer(&self) -> String {
        self.0.peer.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn cat() -> Piped {
        let child = Command::new("cat").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        Piped::new(child, "cat".into()).unwrap()
    }

    #[test]
    fn bytes_go_through_the_child_and_end_when_its_input_is_closed() {
        let mut t = cat();
        let mut r = t.split().unwrap();
        t.write_all(b"hello").unwrap();
        t.close_write();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"hello");
        assert!(t.write_all(b"more").is_err());
    }

    #[test]
    fn reads_time_out_and_close_ends_them() {
        let t = cat();
        let mut r = t.split().unwrap();
        r.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        assert_eq!(r.read(&mut [0u8; 8]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        t.close();
        r.set_read_timeout(None).unwrap();
        assert_eq!(r.read(&mut [0u8; 8]).unwrap(), 0);
    }
}
