//! What models-next's tests share: their turns and a watchdog (a segment's recomputation runs a backward
//! inside a backward step, under graph locks: a mistake there hangs).

/// This test's turn: the tests of the binary run one at a time. Flex's random generator is one
/// for the process and the tests seed it; the counting allocator counts the whole process and
/// some tests read it. Held until the guard drops.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `f` on a thread of its own, in its turn ([`one_at_a_time`]), and fails if it has not
/// ended after `seconds`.
pub fn watchdog(seconds: u64, f: impl FnOnce() + Send + 'static) {
    let _turn = one_at_a_time();
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
