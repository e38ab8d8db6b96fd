//! The segment outputs and taps memsave made on this thread, by node id: a segment whose input
//! or parameter is one of them marks "no gradient" for it rather than registering nothing (the
//! node's step consumes a gradient). Burn 0.22 gives no weak handle to a node, so the set keeps the newest
//! `LIMIT` ids (ids only grow): an input made more than `LIMIT` segment outputs ago is taken
//! for a Burn op's, and gets zeros (its true value) where it would have got none.

use std::cell::RefCell;
use std::collections::{HashSet, VecDeque};

use burn::backend::autodiff::NodeId;

const LIMIT: usize = 1 << 16;

thread_local! {
    static OURS: RefCell<(HashSet<u64>, VecDeque<u64>)> = RefCell::new(Default::default());
}

pub(crate) fn insert(id: NodeId) {
    OURS.with(|ours| {
        let (set, order) = &mut *ours.borrow_mut();
        if set.insert(id.value) {
            order.push_back(id.value);
        }
        while order.len() > LIMIT {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
    });
}

pub(crate) fn contains(id: NodeId) -> bool {
    OURS.with(|ours| ours.borrow().0.contains(&id.value))
}
