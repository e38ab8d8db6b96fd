//! Worker processes: `memsave plan` and `memsave bench` measure each configuration in a process
//! of its own, so that each peak is its own. [`spawn`] starts one; the worker tells the command
//! that started it what it does as JSON lines on its standard output ([`Report`]), read back as
//! typed values, never as text. Its standard error (the training log, warnings) is kept for the
//! parent to show.

use std::io::{BufRead, BufReader, Lines, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;

use memsave::{Error, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// One line of a worker's standard output.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Report<T> {
    /// `done` steps are done.
    Step {
        /// Steps done so far.
        done: u64,
    },
    /// The work is done: its result.
    Done(T),
    /// The work failed: the error, in words.
    Failed(String),
}

/// Sends `report` to the parent: one line on standard output.
pub fn send<T: Serialize>(report: &Report<T>) -> Result<()> {
    let line = serde_json::to_string(report).map_err(|e| Error::state("the worker's report", e))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .map_err(|e| Error::Data(format!("the process that started this one has gone: {e}")))
}

/// Runs a worker's `body`; its error, if any, is also sent as [`Report::Failed`].
pub fn serve(body: impl FnOnce() -> Result<()>) -> Result<()> {
    body().inspect_err(|error| {
        let _ = send(&Report::<()>::Failed(error.to_string()));
    })
}

/// The worker's side of pacing: waits for the parent's word before a step. An error once the
/// parent has gone.
pub fn wait_for_turn() -> Result<()> {
    let mut line = String::new();
    if std::io::stdin().read_line(&mut line).unwrap_or(0) == 0 {
        return Err(Error::Data(
            "the command that started this run has gone".into(),
        ));
    }
    Ok(())
}

/// A running worker whose final report is a `T`.
pub struct Worker<T> {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    stderr: Option<JoinHandle<String>>,
    outcome: Option<std::result::Result<T, String>>,
}

/// How a worker ended.
pub struct Finished<T> {
    /// Its result, or why there is none, in words.
    pub result: std::result::Result<T, String>,
    /// Its warnings (`memsave: warning: ...` lines of its standard error).
    pub warnings: Vec<String>,
}

/// Starts `command` as the worker `what` (named in errors); its input stays open for pacing.
pub fn spawn<T>(what: &str, mut command: Command) -> Result<Worker<T>> {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .map_err(|e| Error::Data(format!("could not start {what}: {e}")))?;
    let mut stderr = child.stderr.take().expect("piped");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    Ok(Worker {
        what: what.to_string(),
        stdin: child.stdin.take(),
        lines: BufReader::new(child.stdout.take().expect("piped")).lines(),
        child,
        stderr: Some(stderr),
        outcome: None,
    })
}

impl<T: DeserializeOwned> Worker<T> {
    /// Lets a paced worker run its next step and waits for it: the steps done, or `None` once
    /// it has ended.
    pub fn step(&mut self) -> Option<u64> {
        let stdin = self.stdin.as_mut()?;
        if writeln!(stdin, "go").and_then(|()| stdin.flush()).is_err() {
            self.stdin = None;
            return None;
        }
        let done = self.next_step();
        if done.is_none() {
            self.stdin = None;
        }
        done
    }

    /// Reads reports up to the next step; `None` at the final report or the end of output.
    fn next_step(&mut self) -> Option<u64> {
        while let Some(Ok(line)) = self.lines.next() {
            // Anything else on the output (a library's print) is not a report.
            match serde_json::from_str::<Report<T>>(&line) {
                Ok(Report::Step { done }) => return Some(done),
                Ok(Report::Done(result)) => {
                    self.outcome = Some(Ok(result));
                    return None;
                }
                Ok(Report::Failed(message)) => {
                    self.outcome = Some(Err(message));
                    return None;
                }
                Err(_) => {}
            }
        }
        None
    }

    /// Waits for the worker to end: its result, or its error in words (its own report, else
    /// the end of its standard error).
    pub fn finish(mut self) -> Result<Finished<T>> {
        drop(self.stdin.take());
        while self.outcome.is_none() && self.next_step().is_some() {}
        let status = self
            .child
            .wait()
            .map_err(|e| Error::Data(format!("{}: {e}", self.what)))?;
        let stderr = self
            .stderr
            .take()
            .and_then(|handle| handle.join().ok())
            .unwrap_or_default();
        let warnings = stderr
            .lines()
            .filter(|line| line.starts_with("memsave: warning"))
            .map(str::to_string)
            .collect();
        let result = match self.outcome.take() {
            Some(Ok(result)) if status.success() => Ok(result),
            Some(Err(message)) => Err(message),
            _ => Err(unreported(status, &stderr)),
        };
        Ok(Finished { result, warnings })
    }
}

/// Why a worker that sent no result ended: its status and the end of its standard error.
fn unreported(status: ExitStatus, stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().collect();
    let tail = lines[lines.len().saturating_sub(20)..].join("\n");
    format!("it ended ({status}) without a result: {tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_one_json_object_a_line_and_read_back_typed() {
        let line = serde_json::to_string(&Report::<Vec<u32>>::Step { done: 3 }).unwrap();
        assert_eq!(line, r#"{"step":{"done":3}}"#);
        let done = serde_json::to_string(&Report::Done(vec![1u32, 2])).unwrap();
        assert_eq!(
            serde_json::from_str::<Report<Vec<u32>>>(&done).unwrap(),
            Report::Done(vec![1, 2])
        );
        let failed = serde_json::to_string(&Report::<()>::Failed("no".into())).unwrap();
        assert_eq!(
            serde_json::from_str::<Report<()>>(&failed).unwrap(),
            Report::Failed("no".into())
        );
    }

    #[test]
    fn a_worker_that_dies_without_a_report_is_named_with_its_last_words() {
        let mut command = Command::new("sh");
        command.args(["-c", "echo not a report; echo boom >&2; exit 3"]);
        let worker = spawn::<()>("the `sh` run", command).unwrap();
        let finished = worker.finish().unwrap();
        let message = finished.result.unwrap_err();
        assert!(
            message.contains("boom") && message.contains('3'),
            "{message}"
        );
    }

    #[test]
    fn a_paced_worker_steps_then_reports_its_result() {
        let mut command = Command::new("sh");
        command.args([
            "-c",
            r#"read a; echo '{"step":{"done":1}}'; read b; echo '{"done":7}'"#,
        ]);
        let mut worker = spawn::<u32>("the `sh` run", command).unwrap();
        assert_eq!(worker.step(), Some(1));
        assert_eq!(worker.step(), None);
        assert_eq!(worker.finish().unwrap().result, Ok(7));
    }
}
