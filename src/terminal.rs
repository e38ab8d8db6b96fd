//! What the command line prints of the library's events. The library crates print nothing:
//! their warnings, notices, training log lines and progress are `tracing` events with target
//! `memsave` ([`memsave::run`]); this subscriber prints them as the lines users know
//! (`memsave: warning: ...`, the log lines as they are) and draws the progress bar. Other
//! crates' events (Burn's, burn-collective's) go through `tracing-subscriber`'s formatter, at
//! `warn` unless `RUST_LOG` says otherwise.

use std::fmt::Write as _;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// Installs the subscriber for the process (once; a second call changes nothing).
pub fn install() {
    let others = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(others)
                .with_filter(filter_fn(|meta| !is_memsave(meta.target()))),
        )
        .with(Terminal::default().with_filter(filter_fn(|meta| is_memsave(meta.target()))))
        .try_init();
}

fn is_memsave(target: &str) -> bool {
    target == "memsave" || target.starts_with("memsave::")
}

/// Prints memsave's events and draws the progress bar of a run.
#[derive(Default)]
struct Terminal {
    bar: Mutex<Option<ProgressBar>>,
}

/// The fields of one of memsave's events that the terminal reads.
#[derive(Default)]
struct Fields {
    message: String,
    kind: String,
    iter: Option<u64>,
    max_iters: Option<u64>,
    done: bool,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => {
                let _ = write!(self.message, "{value:?}");
            }
            "kind" => {
                let _ = write!(self.kind, "{value:?}");
            }
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message.push_str(value),
            "kind" => self.kind.push_str(value),
            _ => {}
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "iter" => self.iter = Some(value),
            "max_iters" => self.max_iters = Some(value),
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_u64(field, value.max(0) as u64);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "done" {
            self.done = value;
        }
    }
}

impl<S: Subscriber> Layer<S> for Terminal {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut bar = self
            .bar
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if fields.kind == "progress" {
            progress(&mut bar, &fields);
            return;
        }
        let line = match (fields.kind.as_str(), *event.metadata().level()) {
            ("log", _) => fields.message,
            (_, Level::ERROR) => format!("memsave: error: {}", fields.message),
            (_, Level::WARN) => format!("memsave: warning: {}", fields.message),
            (_, Level::INFO) => format!("memsave: {}", fields.message),
            // Debug and trace events are for a subscriber of the user's.
            _ => return,
        };
        match bar.as_ref() {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => eprintln!("{line}"),
        }
    }
}

/// A progress event: the bar made at a run's start, moved, cleared at its end.
fn progress(bar: &mut Option<ProgressBar>, fields: &Fields) {
    if fields.done {
        if let Some(bar) = bar.take() {
            bar.finish_and_clear();
        }
        return;
    }
    let (Some(iter), Some(max_iters)) = (fields.iter, fields.max_iters) else {
        return;
    };
    let bar = bar.get_or_insert_with(|| {
        let bar = ProgressBar::with_draw_target(Some(max_iters), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} iters  {elapsed} < {eta}")
                .expect("a valid template"),
        );
        bar
    });
    bar.set_position(iter);
}
