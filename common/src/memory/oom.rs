//! Out of memory on a device, recognised. Where memsave allocates (activation offload's host
//! budget, the checks before a run) it knows by type ([`crate::Error::OutOfMemory`]); where
//! Burn's device allocators run out, they panic (CubeCL: "can't allocate buffer of size"), and
//! this is the one documented place that reads such a panic and turns it into the error:
//! [`from_panic`], which the runner calls on a step's panic. A panic that is not one goes on as
//! it was.

use std::any::Any;

/// What [`from_panic`] hands back: the panic, where it was not an out-of-memory one.
pub type Payload = Box<dyn Any + Send>;

/// The bytes an out-of-memory panic of a step asked for (0 where it does not say), where the
/// panic `payload` is one, or where the device's own thread (wgpu's server) reported one since
/// [`other_thread_panics`] was last read (the thread that waited only learns that "an error
/// happened"); else the payload, to resume.
pub fn from_panic(payload: Payload) -> Result<u64, Payload> {
    let own = crate::panic_text(payload.as_ref()).unwrap_or_default();
    let message = if is_out_of_memory_panic(own) {
        own.to_string()
    } else {
        match other_thread_panics()
            .into_iter()
            .find(|text| is_out_of_memory_panic(text))
        {
            Some(text) => text,
            None => return Err(payload),
        }
    };
    Ok(out_of_memory_size(&message).unwrap_or(0))
}

/// Whether a panic message is a device allocator's out-of-memory report (CubeCL:
/// "can't allocate buffer of size", "out-of-memory error"; CUDA's `CUDA_ERROR_OUT_OF_MEMORY`).
pub fn is_out_of_memory_panic(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("can't allocate buffer of size")
        || lower.contains("out-of-memory")
        || lower.contains("out of memory")
        || lower.contains("cuda_error_out_of_memory")
}

/// Panics on other threads since [`other_thread_panics`] last took them: a CubeCL runtime's
/// server thread (wgpu's) panics where its allocator cannot find room, and the thread that waits
/// for its result only learns that "an error happened during execution".
static OTHER_PANICS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps the message of every panic on a thread other than this one (the runner's), the panic
/// hook that was there still called. Installed once per process.
#[doc(hidden)]
pub fn watch_other_threads() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let runner = std::thread::current().id();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().id() != runner {
                let text = crate::panic_text(info.payload())
                    .map(str::to_string)
                    .unwrap_or_else(|| info.to_string());
                let mut panics = OTHER_PANICS.lock().unwrap_or_else(|e| e.into_inner());
                if panics.len() < 64 {
                    panics.push(text);
                }
            }
            previous(info)
        }));
    });
}

/// The panics [`watch_other_threads`] kept since the last call, emptied.
#[doc(hidden)]
pub fn other_thread_panics() -> Vec<String> {
    std::mem::take(&mut *OTHER_PANICS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The size an out-of-memory panic names (`can't allocate buffer of size: N`), if any.
pub fn out_of_memory_size(message: &str) -> Option<u64> {
    let rest = message.split("buffer of size").nth(1)?;
    let digits: String = rest
        .trim_start_matches([':', ' '])
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}
