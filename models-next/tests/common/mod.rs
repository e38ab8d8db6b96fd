//! What models-next's tests share: a watchdog (a segment's recomputation runs a backward
//! inside a backward step, under graph locks: a mistake there hangs).

/// Runs `f` on a thread of its own and fails if it has not ended after `seconds`. One test at a
/// time: Flex's random generator is one for the process, the tests seed it, and some read the
/// counting allocator.
pub fn watchdog(seconds: u64, f: impl FnOnce() + Send + 'static) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (sender, receiver) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        f();
        let _ = sender.send(());
    });
    match receiver.recv_timeout(std::time::Duration::from_secs(seconds)) {
        Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("no result after {seconds} s: a hang")
        }
    }
}
