//! Events, not stderr: the library crates write nothing to stdout or stderr: their warnings, notices and log lines
//! are `tracing` events with target `memsave`. A run that warns, with no subscriber installed,
//! leaves stderr empty (checked in a process of its own: this test binary run again); with a
//! subscriber, the events arrive with their fields.

use std::sync::{Arc, Mutex};

use super::common;
use common::trap::Net;
use common::AB;
use memsave::checkpoint::{set_unused_with_cp, set_with_cp, ActivationOffload, UnusedWithCp};
use memsave::hooks::{LoggerHook, LrSchedule, LrUpdaterHook, OffloadHook, OptimizerHook};
use memsave::models::data::{SyntheticClassification, SyntheticClassificationConfig};
use memsave::train::{OptimizerKind, RunLength, Runner};
use memsave::RunContext;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Two iterations of a run that warns (a block switched on without a `#[with_cp]` method:
/// [`common::trap`], in a run that says to warn), gives a notice (activation offload on the CPU: nothing to offload
/// to) and logs (the logger hook's lines). Returns the run's warnings.
fn a_run_that_warns() -> Vec<String> {
    let device = Default::default();
    let net = Net::<AB>::new(&device);
    let dir = std::env::temp_dir().join(format!(
        "memsave-events-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let run = RunContext::named("warns");
    run.scope(|| {
        set_unused_with_cp(UnusedWithCp::Warn);
        let mut runner = Runner::new(
            set_with_cp(net, true),
            OptimizerKind::sgd(0.0),
            Box::new(OptimizerHook::new()),
            SyntheticClassification::<AB>::new(
                SyntheticClassificationConfig::new(4, 8, 8),
                4,
                device,
            )
            .unwrap(),
            RunLength::Iters(2),
            &dir,
            Default::default(),
        )
        .unwrap();
        runner.register_hook(Box::new(LrUpdaterHook {
            schedule: LrSchedule::constant(0.01),
        }));
        runner.register_hook(Box::new(LoggerHook::new(1)));
        runner.register_hook(Box::new(OffloadHook::new(ActivationOffload::default())));
        runner.run().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        runner.state().warnings().to_vec()
    })
    .unwrap()
}

/// The child's half of the test below: runs only in the process it starts.
#[test]
fn child_a_run_that_warns() {
    if std::env::var_os("MEMSAVE_EVENTS_CHILD").is_none() {
        return;
    }
    for warning in a_run_that_warns() {
        println!("child saw the warning: {warning}");
    }
}

#[test]
fn a_library_run_that_warns_writes_nothing_to_stderr_without_a_subscriber() {
    let output = common::watchdog(300, || {
        std::process::Command::new(std::env::current_exe().expect("this test binary"))
            .args([
                "--exact",
                "run_context::events::child_a_run_that_warns",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("MEMSAVE_EVENTS_CHILD", "1")
            .output()
            .expect("the test binary runs again")
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("child saw the warning: checkpointing is switched on in `Unmarked`"),
        "the child's run warned: {stdout}"
    );
    assert_eq!(stderr, "", "the library wrote to stderr");
}

/// What the subscriber below keeps of an event.
#[derive(Clone, Debug)]
struct Seen {
    target: String,
    level: tracing::Level,
    fields: Vec<(String, String)>,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value.as_str())
    }
}

#[derive(Clone, Default)]
struct Keep(Arc<Mutex<Vec<Seen>>>);

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Keep {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields(Vec::new());
        event.record(&mut fields);
        self.0.lock().unwrap().push(Seen {
            target: event.metadata().target().to_string(),
            level: *event.metadata().level(),
            fields: fields.0,
        });
    }
}

#[test]
fn with_a_subscriber_the_events_arrive_with_their_fields() {
    let keep = Keep::default();
    let subscriber = tracing_subscriber::registry().with(keep.clone());
    let warnings = common::watchdog(300, move || {
        tracing::subscriber::with_default(subscriber, a_run_that_warns)
    });
    let seen = keep.0.lock().unwrap().clone();
    let memsave: Vec<&Seen> = seen.iter().filter(|e| e.target == "memsave").collect();
    let unused = memsave
        .iter()
        .find(|e| e.level == tracing::Level::WARN && e.field("types").is_some())
        .unwrap_or_else(|| panic!("the with_cp warning: {memsave:#?}"));
    assert!(
        unused.field("types").unwrap().contains("Unmarked"),
        "{unused:?}"
    );
    assert!(
        unused
            .field("message")
            .is_some_and(|m| m.contains("no `#[with_cp]` method")),
        "{unused:?}"
    );
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let notice = memsave
        .iter()
        .find(|e| e.field("key") == Some("offload.activations"))
        .unwrap_or_else(|| panic!("the offload notice: {memsave:#?}"));
    assert_eq!(notice.level, tracing::Level::INFO, "{notice:?}");
    let lines: Vec<&&Seen> = memsave
        .iter()
        .filter(|e| e.field("kind") == Some("log"))
        .collect();
    assert_eq!(lines.len(), 2, "a log line an iteration: {memsave:#?}");
    assert!(
        lines[0]
            .field("message")
            .is_some_and(|m| m.starts_with("Iter [1/2]")),
        "{lines:?}"
    );
    let progress = memsave
        .iter()
        .filter(|e| e.field("kind") == Some("progress"))
        .count();
    assert!(progress >= 2, "progress events: {memsave:#?}");
}
