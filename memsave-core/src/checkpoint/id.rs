//! Which module a segment runs, and its type's short name.

/// Which module a segment runs: its address and type while the model is not moved (what the
/// planner's profile links its measurements to module paths by).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentId {
    pub(super) address: usize,
    pub(super) type_name: &'static str,
}

impl SegmentId {
    /// The identity of `module`.
    pub fn of<M>(module: &M) -> SegmentId {
        SegmentId {
            address: module as *const M as usize,
            type_name: std::any::type_name::<M>(),
        }
    }

    /// The module's type, short (`Bottleneck`).
    pub fn type_name(&self) -> String {
        short_name(self.type_name)
    }
}

/// `a::b::Block<burn::X>` -> `Block`.
pub(crate) fn short_name(name: &str) -> String {
    let mut depth = 0;
    let mut outer = String::new();
    for c in name.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 => outer.push(c),
            _ => {}
        }
    }
    outer.rsplit("::").next().unwrap_or(name).to_string()
}

/// `Type::method` (or `Type` for an unnamed segment), for messages.
pub(crate) fn segment_name(module: &str, method: &str) -> String {
    match method {
        "" => short_name(module),
        method => format!("{}::{method}", short_name(module)),
    }
}
