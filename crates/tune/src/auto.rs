//! dmover's default tuner.
//!
//! It measures goodput over windows of at least ten round trips, each after
//! the streams of the last change are open and have had time to ramp up,
//! and moves by experiment rather than by a model:
//!
//! 1. **Ramp**: from `n0`, double while doubling pays and no standing queue
//!    says the link is already full.
//! 2. **Hold**: keep the count, track the goodput, and now and then probe a
//!    quarter more streams, or — when a standing queue says there are more
//!    than the link needs — a quarter fewer; keep the change if it pays
//!    (more) or costs nothing (fewer). Failed probes back off, up to
//!    [`Params::max_probe_interval`] apart.
//! 3. A goodput that jumps or collapses for two windows (the link changed)
//!    starts the probing again at once.
//!
//! What "pays" depends on the path. With no standing queue (the round trip
//! is near its minimum) the link has room: more streams are kept for any
//! clear gain, fewer only if they cost next to nothing. With a standing
//! queue the link is full, and streams only move shares between this
//! transfer and other traffic. A transfer holding a share s of a full link
//! gains or loses about ε·(1−s) of its goodput when it changes its streams
//! by a fraction ε, so the tuner keeps ε more streams only if they bring at
//! least `grow_share·ε`, and keeps ε fewer if they cost at most
//! `shrink_share·ε`. A transfer with less than about half of a shared link
//! grows and one with more shrinks, so two dmover transfers meet near equal
//! shares — fairness — and one alone gives back streams the full link does
//! not need.
//!
//! Those probes judge shares by small differences in a goodput that
//! wanders by tens of percent while transfers compete, so on their own
//! they balance slowly. When the receiving server reports that it is
//! taking in several transfers at once, the tuner balances instead of
//! probing: over a few seconds it compares its own intake with the
//! server's, and while its share is more than [`Params::fair_band`] off an
//! even split, it moves half of the way (in ratio) to the count that would
//! even it out (on a full link streams get about equal rates, so
//! `n · fair / share`); the others move the other half.
//! Fewer streams are kept only if the others took up at least half of what
//! this transfer gave back (the bottleneck is shared), more only if this
//! transfer gained; a move that fails backs off like a failed probe. A
//! transfer that starts beside others stops doubling once it sees a queue
//! or holds more than an even share, and balances from there. (A transfer
//! sharing the server but not the bottleneck with the others is therefore
//! not grown past an even share by probes.)
//!
//! Streams cannot help when the source disk is the bottleneck (no block is
//! waiting for a stream) or the destination is (its write queues are full): then
//! the tuner adds none.

use crate::{Observation, Tuner, Window, Windows};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Streams to start with.
    pub n0: usize,
    pub max_streams: usize,
    /// Least time between a change and the start of its measurement (and at least 6 round trips).
    pub settle: Duration,
    /// Least measuring window (and at least 10 round trips).
    pub window: Duration,
    /// First wait between probes while holding; doubles after each failed probe.
    pub probe_interval: Duration,
    pub max_probe_interval: Duration,
    /// Relative goodput gain that counts as a gain.
    pub gain: f64,
    /// On a full link, the least relative gain per relative step up in streams.
    pub grow_share: f64,
    /// On a full link, the most relative loss per relative step down in streams.
    pub shrink_share: f64,
    /// Relative goodput loss that a step down may always cost and still be kept.
    pub tolerance: f64,
    /// A round trip this much (relative) above the least seen, plus 1 ms, means a standing queue.
    pub queue_slack: f64,
    /// A goodput this far (relative) from the held one for two windows means the link changed.
    pub change: f64,
    /// While a server takes in several transfers, how far (relative) a
    /// share may stray from an even split before streams are moved.
    pub fair_band: f64,
    /// Least time over which shares are compared.
    pub share_window: Duration,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            n0: 4,
            max_streams: 32,
            settle: Duration::from_millis(150),
            window: Duration::from_millis(500),
            probe_interval: Duration::from_secs(2),
            max_probe_interval: Duration::from_secs(16),
            gain: 0.05,
            grow_share: 0.55,
            shrink_share: 0.45,
            tolerance: 0.03,
            queue_slack: 0.15,
            change: 0.3,
            fair_band: 0.1,
            share_window: Duration::from_secs(3),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Base {
    n: usize,
    goodput: f64,
    /// A standing queue was seen at this count.
    queued: bool,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Doubling; `prev` is the last count measured.
    Ramp { prev: Option<Base> },
    /// Holding `base`; probe at `next_probe`, upward next if `up`.
    Hold { next_probe: Duration, up: bool, odd_windows: u32 },
    /// Trying `n` against `base`.
    Probe { up: bool },
    /// Took (`up`) or gave back streams to even out the shares of one
    /// server, which took in `before` at `base`.
    Balance { up: bool, before: Intake },
}

/// Intake measured since the last change settled.
#[derive(Debug, Default, Clone, Copy)]
struct Intake {
    length: Duration,
    own: u64,
    server: u64,
}

impl Intake {
    fn add(&mut self, w: &Window) {
        self.length += w.length;
        self.own += w.delivered;
        self.server += w.server_delivered;
    }

    fn rate(&self) -> f64 {
        self.own as f64 / self.length.as_secs_f64()
    }

    fn server_rate(&self) -> f64 {
        self.server as f64 / self.length.as_secs_f64()
    }
}

pub struct Auto {
    p: Params,
    n: usize,
    phase: Phase,
    base: Base,
    backoff: Duration,
    /// No yield or claim before this.
    next_balance: Duration,
    changed_at: Duration,
    windows: Windows,
    intake: Intake,
    rtt_min: Duration,
}

impl Auto {
    pub fn new(p: Params) -> Auto {
        let n = p.n0.clamp(1, p.max_streams.max(1));
        Auto {
            p,
            n,
            phase: Phase::Ramp { prev: None },
            base: Base { n, goodput: 0.0, queued: false },
            backoff: p.probe_interval,
            next_balance: Duration::ZERO,
            changed_at: Duration::ZERO,
            windows: Windows::default(),
            intake: Intake::default(),
            rtt_min: Duration::MAX,
        }
    }

    /// Whether `g` at `n` streams pays compared with `base`: enough more
    /// goodput for more streams, or little enough less for fewer.
    fn pays(&self, base: Base, n: usize, g: f64) -> bool {
        let step = (n as f64 - base.n as f64).abs() / base.n as f64;
        if n > base.n {
            let needed = if base.queued { self.p.gain.max(self.p.grow_share * step) } else { self.p.gain };
            g >= base.goodput * (1.0 + needed)
        } else {
            let allowed = if base.queued { self.p.tolerance.max(self.p.shrink_share * step) } else { self.p.tolerance };
            g >= base.goodput * (1.0 - allowed)
        }
    }

    fn go(&mut self, now: Duration, n: usize, phase: Phase) -> Option<usize> {
        self.phase = phase;
        if n == self.n {
            return None;
        }
        self.n = n;
        self.changed_at = now;
        self.windows.restart();
        self.intake = Intake::default();
        Some(n)
    }

    /// Moves streams toward an even split of a server shared by `transfers`
    /// transfers, when the shares measured over [`Params::share_window`]
    /// call for it (not while a failed move backs off).
    ///
    /// On a full link each stream gets about the same rate, so the count
    /// that gives an even split is about `n · fair / share`. The others
    /// move too, toward the same split, so each goes half of the way (in
    /// ratio: `n · √(fair / share)`), at most halving or doubling.
    fn balance(&mut self, now: Duration, transfers: usize, can_grow: bool) -> Option<usize> {
        if self.intake.length < self.p.share_window || self.intake.server == 0 || now < self.next_balance {
            return None;
        }
        let before = std::mem::take(&mut self.intake);
        let share = before.own as f64 / before.server as f64;
        let fair = 1.0 / transfers as f64;
        let n = self.n as f64;
        let even = ((n * (fair / share).sqrt()).round() as usize).clamp(self.n.div_ceil(2), (self.n * 2).min(self.p.max_streams));
        let up = if share > fair * (1.0 + self.p.fair_band) && even < self.n {
            false
        } else if share < fair * (1.0 - self.p.fair_band) && can_grow && even > self.n {
            true
        } else {
            return None;
        };
        self.base = Base { n: self.n, goodput: before.rate(), queued: true };
        self.go(now, even, Phase::Balance { up, before })
    }

    /// The share of the server's intake above which this transfer takes
    /// more than its part.
    fn fair_share(&self, transfers: usize) -> f64 {
        (1.0 + self.p.fair_band) / transfers as f64
    }

    /// Judges a balancing move once its intake has been measured long
    /// enough: more streams are kept if they brought more, fewer if what
    /// they gave up went at least half to the other transfers (the
    /// bottleneck is shared) or cost nothing.
    fn judge_balance(&mut self, now: Duration, up: bool, before: Intake, here: Base) -> Option<usize> {
        let after = self.intake;
        let own = after.rate() - before.rate();
        let others = (after.server_rate() - after.rate()) - (before.server_rate() - before.rate());
        let kept = if up { own > before.rate() * self.p.tolerance } else { own >= 0.0 || others >= -0.5 * own };
        let base = self.base;
        if kept {
            self.backoff = self.p.probe_interval;
            self.next_balance = now;
            self.base = here;
            self.phase = Phase::Hold { next_probe: now + self.backoff, up: false, odd_windows: 0 };
            None
        } else {
            self.next_balance = now + self.backoff;
            self.backoff = (self.backoff * 2).min(self.p.max_probe_interval);
            self.hold(now, base, false)
        }
    }

    fn hold(&mut self, now: Duration, base: Base, up: bool) -> Option<usize> {
        self.base = base;
        self.go(now, base.n, Phase::Hold { next_probe: now + self.backoff, up, odd_windows: 0 })
    }

    fn step(&self, up: bool) -> usize {
        let d = (self.n / 4).max(1);
        if up {
            (self.n + d).min(self.p.max_streams)
        } else {
            self.n.saturating_sub(d).max(1)
        }
    }

    fn decide(&mut self, now: Duration, w: &Window, queued: bool, can_grow: bool, transfers: usize) -> Option<usize> {
        let g = w.goodput;
        let here = Base { n: self.n, goodput: g, queued };
        self.intake.add(w);
        match self.phase {
            Phase::Balance { up, before } => {
                if self.intake.length < self.p.share_window {
                    return None;
                }
                let here = Base { goodput: self.intake.rate(), ..here };
                self.judge_balance(now, up, before, here)
            }
            Phase::Ramp { .. } if transfers >= 2 && (queued || w.share() > self.fair_share(transfers)) => {
                // A full link, or more than an even share, with other
                // transfers into the same server: balancing, not doubling,
                // finds this transfer's count.
                self.hold(now, here, false)
            }
            Phase::Ramp { prev } => {
                let better = prev.is_none_or(|b| self.pays(b, self.n, g));
                if queued && prev.is_none_or(|b| g >= b.goodput) {
                    // A standing queue: the link is full at this count, and
                    // more streams would only lengthen the queue.
                    return self.hold(now, here, false);
                }
                if !better {
                    let b = prev.expect("compared with a previous count");
                    let keep = if g > b.goodput { here } else { b };
                    return self.hold(now, keep, false);
                }
                if !can_grow || self.n >= self.p.max_streams {
                    return self.hold(now, here, false);
                }
                let n = (self.n * 2).min(self.p.max_streams);
                self.go(now, n, Phase::Ramp { prev: Some(here) })
            }
            Phase::Probe { up } => {
                let base = self.base;
                let kept = self.pays(base, self.n, g);
                if kept {
                    // Keep going the same way soon.
                    self.backoff = self.p.probe_interval;
                    self.base = here;
                    self.phase = Phase::Hold { next_probe: now, up, odd_windows: 0 };
                    None
                } else {
                    self.backoff = (self.backoff * 2).min(self.p.max_probe_interval);
                    self.hold(now, base, !up)
                }
            }
            Phase::Hold { next_probe, up, odd_windows } => {
                let off = (g - self.base.goodput).abs() > self.p.change * self.base.goodput;
                if off && odd_windows + 1 >= 2 {
                    // The link changed: hold what it gives now and probe at once,
                    // down first if it got worse.
                    self.backoff = self.p.probe_interval;
                    let up = g > self.base.goodput;
                    self.base = here;
                    self.phase = Phase::Hold { next_probe: now, up, odd_windows: 0 };
                    return None;
                }
                if !off {
                    self.base.goodput = 0.7 * self.base.goodput + 0.3 * g;
                    self.base.queued = queued;
                }
                let odd_windows = if off { odd_windows + 1 } else { 0 };
                if transfers >= 2 {
                    // Shares, not probes, decide while others take in too:
                    // a probe's gain would mostly be what it took from them.
                    let decision = self.balance(now, transfers, can_grow);
                    if matches!(self.phase, Phase::Hold { .. }) {
                        self.phase = Phase::Hold { next_probe, up, odd_windows };
                    }
                    return decision;
                }
                if now < next_probe {
                    self.phase = Phase::Hold { next_probe, up, odd_windows };
                    return None;
                }
                // Fewer streams are only worth trying when a queue stands;
                // more only when something else than the disks limits.
                let up = match (up, can_grow, queued) {
                    (_, true, false) => true,
                    (_, false, true) => false,
                    (up, _, _) => up,
                };
                let n = self.step(up);
                if n == self.n {
                    // Nowhere to go this way: try the other way next time.
                    self.phase = Phase::Hold { next_probe: now + self.backoff, up: !up, odd_windows };
                    return None;
                }
                self.go(now, n, Phase::Probe { up })
            }
        }
    }
}

impl Tuner for Auto {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn initial(&self) -> usize {
        self.n
    }

    fn observe(&mut self, o: &Observation) -> Option<usize> {
        if !o.rtt.is_zero() {
            self.rtt_min = self.rtt_min.min(o.rtt);
        }
        // Measure only once the streams asked for are open (or have had ample time to open).
        if o.streams < self.n && o.now < self.changed_at + Duration::from_secs(5) {
            self.windows.restart();
            return None;
        }
        let w = self.windows.measure(o, self.changed_at, self.p.settle, self.p.window)?;
        let queued = o.rtt > self.rtt_min.mul_f64(1.0 + self.p.queue_slack) + Duration::from_millis(1);
        let can_grow = o.starved < 0.5 && o.staged < 0.8;
        self.decide(o.now, &w, queued, can_grow, o.server.transfers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paper::{self, Paper};
    use crate::sim::{run, run_shared, Event, Link};
    use crate::ServerLoad;

    const SECOND: Duration = Duration::from_secs(1);

    fn auto() -> Auto {
        Auto::new(Params::default())
    }

    /// A tuner that never changes the count: the fixed-stream baseline.
    struct Fixed(usize);
    impl Tuner for Fixed {
        fn name(&self) -> &'static str {
            "fixed"
        }
        fn initial(&self) -> usize {
            self.0
        }
        fn observe(&mut self, _: &Observation) -> Option<usize> {
            None
        }
    }

    fn paper_link() -> Link {
        Link::new(100.0, Duration::from_millis(20), 100, 65536)
    }

    /// The paper's link with the share wobble of real TCP.
    fn shared_link() -> Link {
        Link { jitter: 0.2, ..paper_link() }
    }

    #[test]
    fn fills_the_papers_link_within_ten_seconds() {
        let trace = run(&mut auto(), &mut paper_link(), Duration::from_secs(60));
        let first = trace.steps.iter().find(|s| s.3 * 8.0 / 1e6 >= 93.0).expect("reaches 93 Mbit/s").0;
        assert!(first <= 10 * SECOND, "first at {first:?}: {:?}", trace.changes);
        let held = trace.goodput_mbit_after(10 * SECOND);
        assert!(held >= 93.0, "{held} Mbit/s after 10 s: {:?}", trace.changes);
        // And ends up with about the streams the link needs, not the most it may open.
        assert!((4..=10).contains(&trace.final_streams()), "{:?}", trace.changes);
    }

    #[test]
    fn beats_mi_to_the_link_rate() {
        let mi = run(
            &mut Paper::new(paper::Mode::Mi, paper::Params { chunk: 25_000_000, ..Default::default() }),
            &mut paper_link(),
            Duration::from_secs(60),
        );
        let ours = run(&mut auto(), &mut paper_link(), Duration::from_secs(60));
        assert!(ours.goodput_mbit_between(Duration::ZERO, 20 * SECOND) > mi.goodput_mbit_between(Duration::ZERO, 20 * SECOND));
    }

    #[test]
    fn one_big_window_stream_is_enough() {
        let mut link = Link::new(100.0, Duration::from_millis(20), 100, 8 << 20);
        let trace = run(&mut auto(), &mut link, Duration::from_secs(60));
        assert!(trace.goodput_mbit_after(10 * SECOND) > 95.0);
        assert!(trace.final_streams() <= 4, "{:?}", trace.changes);
    }

    #[test]
    fn random_loss_is_answered_with_more_streams() {
        // 0.1 % loss: one stream gets about 25 Mbit/s.
        let mut link = Link::new(100.0, Duration::from_millis(20), 100, 8 << 20);
        link.loss = 0.001;
        let trace = run(&mut auto(), &mut link, Duration::from_secs(60));
        assert!(trace.goodput_mbit_after(10 * SECOND) > 85.0, "{}", trace.goodput_mbit_after(10 * SECOND));
    }

    #[test]
    fn re_converges_when_the_link_rate_halves() {
        let events = [Event { at: 30 * SECOND, rate_mbit: 50.0 }];
        let mut t = auto();
        let trace = run_shared(vec![(&mut t, Duration::ZERO)], &mut paper_link(), Duration::from_secs(60), &events).pop().unwrap();
        assert!(trace.goodput_mbit_between(40 * SECOND, 60 * SECOND) > 0.93 * 50.0);
        // Streams the slower link does not need are given back.
        let before = trace.steps.iter().find(|s| s.0 == 29 * SECOND).unwrap().1;
        assert!(trace.final_streams() < before, "{:?}", trace.changes);
    }

    #[test]
    fn two_transfers_on_one_link_share_it_fairly() {
        let (mut a, mut b) = (auto(), auto());
        let traces = run_shared(vec![(&mut a, Duration::ZERO), (&mut b, Duration::ZERO)], &mut shared_link(), Duration::from_secs(90), &[]);
        let (ga, gb) = (traces[0].goodput_mbit_after(30 * SECOND), traces[1].goodput_mbit_after(30 * SECOND));
        assert!(ga.min(gb) / ga.max(gb) > 0.8, "{ga} vs {gb}");
        assert!(ga + gb > 90.0);
    }

    #[test]
    fn a_late_second_transfer_still_gets_its_share() {
        // a has the link to itself for 30 s, then b starts.
        let (mut a, mut b) = (auto(), auto());
        let traces = run_shared(vec![(&mut a, Duration::ZERO), (&mut b, 30 * SECOND)], &mut shared_link(), Duration::from_secs(150), &[]);
        let (ga, gb) = (traces[0].goodput_mbit_after(90 * SECOND), traces[1].goodput_mbit_after(60 * SECOND));
        assert!(ga.min(gb) / ga.max(gb) > 0.8, "{ga} vs {gb}: {:?} / {:?}", traces[0].changes, traces[1].changes);
    }

    /// Feeds `t` what a lone transfer at `streams` streams and `rate`
    /// bytes/s with round trip `rtt` sees for `length`, from `*now` on;
    /// returns the counts it asked for.
    fn feed(t: &mut Auto, now: &mut Duration, delivered: &mut u64, length: Duration, rate: f64, rtt: Duration) -> Vec<usize> {
        let step = Duration::from_millis(50);
        let end = *now + length;
        let mut asked = Vec::new();
        while *now < end {
            *now += step;
            *delivered += (rate * step.as_secs_f64()) as u64;
            let o = Observation {
                now: *now,
                delivered: *delivered,
                rtt,
                window: 8 << 20,
                streams: t.n,
                starved: 0.0,
                staged: 0.0,
                server: ServerLoad { delivered: *delivered, transfers: 1 },
            };
            asked.extend(t.observe(&o));
        }
        asked
    }

    #[test]
    fn a_standing_queue_ends_the_ramp() {
        // The round trip stands at three times its least: the link is full.
        // Windows that happen to measure half again as much later on
        // (goodput read through a busy control connection wanders that
        // much) must not take the count past one doubling.
        let (ms, mut now, mut delivered) = (Duration::from_millis, Duration::ZERO, 0);
        let mut t = auto();
        assert!(feed(&mut t, &mut now, &mut delivered, ms(50), 1e6, ms(50)).is_empty());
        let mut asked = feed(&mut t, &mut now, &mut delivered, ms(3000), 8e6, ms(150));
        asked.extend(feed(&mut t, &mut now, &mut delivered, ms(6000), 13e6, ms(150)));
        assert!(asked.iter().all(|&n| n <= 8), "asked for {asked:?} on a full link");
    }

    #[test]
    fn never_far_below_the_best_fixed_count() {
        for rate in [20.0, 100.0, 400.0] {
            for delay_ms in [5, 10, 25, 50] {
                let link = Link::new(rate, Duration::from_millis(2 * delay_ms), 100, 65536);
                let length = Duration::from_secs(60);
                let best =
                    (1..=32).map(|n| run(&mut Fixed(n), &mut link.clone(), length).goodput_mbit_after(Duration::ZERO)).fold(0.0, f64::max);
                let ours = run(&mut auto(), &mut link.clone(), length).goodput_mbit_after(Duration::ZERO);
                assert!(ours >= 0.9 * best, "{rate} Mbit/s, {delay_ms} ms: {ours:.1} vs best fixed {best:.1}");
            }
        }
    }

    #[test]
    fn adds_no_streams_when_the_disks_are_the_bottleneck() {
        let mut t = auto();
        let mut delivered = 0;
        for i in 0..400u64 {
            delivered += 50_000;
            let o = Observation {
                now: Duration::from_millis(i * 50),
                delivered,
                rtt: Duration::from_millis(20),
                window: 65536,
                streams: t.n,
                starved: if i % 2 == 0 { 0.9 } else { 0.2 },
                staged: if i % 2 == 0 { 0.0 } else { 0.95 },
                ..Default::default()
            };
            if let Some(n) = t.observe(&o) {
                assert!(n <= 4, "grew to {n}");
            }
        }
    }
}
