//! Log lines about connections refused before they authenticated, at most
//! one a second for each cause. A flood of bad connections would otherwise
//! write a line for each (tens of megabytes a minute from one client);
//! what is held back is counted, and told in one summary line per cause
//! and second ([`Throttle::summarise`], which the accept loop calls).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A cause's lines are written at most this often.
pub const EVERY: Duration = Duration::from_secs(1);

/// The log lines of each cause: when one was last written, and how many
/// were held back since.
#[derive(Default)]
pub struct Throttle {
    causes: Mutex<HashMap<&'static str, Cause>>,
}

struct Cause {
    level: log::Level,
    /// When a line of this cause was last written (or summarised).
    logged: Instant,
    /// Lines held back since.
    held: u64,
    /// The last line held back.
    last: String,
}

impl Throttle {
    /// Writes `line` to the log at `level`, unless a line of `cause` was
    /// written less than [`EVERY`] ago: then counts it for the cause's next
    /// summary (which shows it if it is the last).
    pub fn log(&self, level: log::Level, cause: &'static str, line: String) {
        let now = Instant::now();
        let mut causes = self.causes.lock().expect("throttle lock");
        match causes.get_mut(cause) {
            Some(c) if now.duration_since(c.logged) < EVERY => {
                c.held += 1;
                c.last = line;
                return;
            }
            Some(c) => c.logged = now,
            None => {
                causes.insert(cause, Cause { level, logged: now, held: 0, last: String::new() });
            }
        }
        drop(causes);
        log::log!(level, "{line}");
    }

    /// Writes one line for each cause whose lines were held back for
    /// [`EVERY`] or longer: how many, over how long, and the last of them.
    pub fn summarise(&self) {
        let now = Instant::now();
        let mut causes = self.causes.lock().expect("throttle lock");
        for (cause, c) in causes.iter_mut().filter(|(_, c)| c.held > 0 && now.duration_since(c.logged) >= EVERY) {
            let over = now.duration_since(c.logged).as_secs_f64();
            log::log!(c.level, "{} more connections {cause} in the last {over:.1} s; the last: {}", c.held, c.last);
            c.held = 0;
            c.logged = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines held back, and the last, by cause.
    fn held(t: &Throttle) -> Vec<(&'static str, u64, String)> {
        let mut v: Vec<_> = t.causes.lock().unwrap().iter().map(|(k, c)| (*k, c.held, c.last.clone())).collect();
        v.sort();
        v
    }

    #[test]
    fn one_line_a_second_per_cause_and_the_rest_counted_until_summarised() {
        let t = Throttle::default();
        for i in 0..100 {
            t.log(log::Level::Warn, "refused: a", format!("a{i}"));
        }
        t.log(log::Level::Warn, "refused: b", "b".into());
        assert_eq!(held(&t), [("refused: a", 99, "a99".into()), ("refused: b", 0, String::new())], "one line per cause written");
        t.summarise();
        assert_eq!(held(&t)[0].1, 99, "summarised before a second had passed");
        std::thread::sleep(EVERY);
        t.summarise();
        assert_eq!(held(&t).iter().map(|h| h.1).collect::<Vec<_>>(), [0, 0]);
        // The summary counts as the cause's line for this second.
        t.log(log::Level::Warn, "refused: a", "a100".into());
        assert_eq!(held(&t)[0].1, 1);
    }
}
