//! Live bytes by the code that allocated them: a *tag* is current while a [`scope`] runs, and
//! every block allocated then (on any thread) is charged to it until it is freed. Between a
//! forward and its backward, the bytes still live under a layer's tag are what that layer keeps
//! for backward (plus its output, if the next layer keeps it: bytes are charged to the layer
//! that allocated them). This is how memsave's memory audit, the benchmark's breakdown and the
//! planner's profile measure, without estimating from shapes.
//!
//! Scopes nest: the tag is the path of the open scopes (`layer2.1.conv2`). With no
//! [`super::CountingAllocator`] installed, scopes cost a name lookup and measure nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::allocator::{CURRENT_TAG, SNAPSHOT, SNAPSHOT_TAGS, TAGS, TAG_AT_PEAK, TAG_LIVE};

/// Tag names by id (id 0: untagged).
static NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// The open scopes on this thread.
    static PATH: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    /// Ids of the paths seen by this thread.
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
}

fn names() -> std::sync::MutexGuard<'static, Vec<String>> {
    NAMES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The id of a tag path, registered on first use; 0 once every id is taken.
fn id_of(path: &str) -> u32 {
    if let Some(id) = IDS.with(|ids| ids.borrow().get(path).copied()) {
        return id;
    }
    let mut names = names();
    if names.is_empty() {
        names.push(String::new());
    }
    let id = match names.iter().position(|name| name == path) {
        Some(id) => id as u32,
        None if names.len() < TAGS => {
            names.push(path.to_string());
            (names.len() - 1) as u32
        }
        None => 0,
    };
    drop(names);
    IDS.with(|ids| ids.borrow_mut().insert(path.to_string(), id));
    id
}

/// Runs `f` with `name` appended to the current tag path: blocks it allocates, on any thread,
/// are charged to that path until freed. Returns what `f` returns.
pub fn scope<R>(name: &str, f: impl FnOnce() -> R) -> R {
    let path = PATH.with(|path| {
        let mut path = path.borrow_mut();
        path.push(name.to_string());
        path.join(".")
    });
    let previous = CURRENT_TAG.swap(id_of(&path), Ordering::Relaxed);
    struct Restore(u32);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT_TAG.store(self.0, Ordering::Relaxed);
            PATH.with(|path| path.borrow_mut().pop());
        }
    }
    let _restore = Restore(previous);
    f()
}

/// The current tag path (`""` outside every scope).
pub fn scope_path() -> String {
    PATH.with(|path| path.borrow().join("."))
}

/// Live bytes under one tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagBytes {
    /// The tag path; `""` for blocks allocated outside every scope.
    pub tag: String,
    /// Bytes allocated under it and not yet freed.
    pub live: i64,
}

/// Live bytes of every tag that has some, in the order the tags were first seen (the order of
/// the forward pass), untagged first.
pub fn live_by_tag() -> Vec<TagBytes> {
    let names = names();
    let count = names.len().max(1);
    (0..count)
        .filter_map(|id| {
            let live = TAG_LIVE[id].load(Ordering::Relaxed) as i64;
            (live != 0).then(|| TagBytes {
                tag: names.get(id).cloned().unwrap_or_default(),
                live,
            })
        })
        .collect()
}

/// Keep (or stop keeping) the live bytes per tag at each new peak, for [`peak_by_tag`]. Costs a
/// copy of a few hundred counters whenever the peak rises.
pub fn snapshot_peaks(on: bool) {
    SNAPSHOT.store(on, Ordering::Relaxed);
}

/// Live bytes per tag at the last peak (since [`super::reset_peak`], while [`snapshot_peaks`]
/// is on), in the order the tags were first seen; the first 256 tags only.
pub fn peak_by_tag() -> Vec<TagBytes> {
    let names = names();
    let count = names.len().clamp(1, SNAPSHOT_TAGS);
    (0..count)
        .filter_map(|id| {
            let live = TAG_AT_PEAK[id].load(Ordering::Relaxed) as i64;
            (live != 0).then(|| TagBytes {
                tag: names.get(id).cloned().unwrap_or_default(),
                live,
            })
        })
        .collect()
}

/// The id of the tag new blocks get now (any thread's open scope): cheap, for samplers.
pub(super) fn current_tag_id() -> u32 {
    CURRENT_TAG.load(Ordering::Relaxed)
}

/// The path of tag `id` (`""` for untagged or unknown ids).
pub(super) fn tag_name(id: u32) -> String {
    names().get(id as usize).cloned().unwrap_or_default()
}
