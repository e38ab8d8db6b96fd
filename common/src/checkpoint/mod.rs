//! The switches of checkpointing in a model: the `with_cp` flag a block carries
//! ([`HasWithCp`]), the modules through which it is switched on ([`CheckpointModule`], which
//! `#[memsave::model]` implements), the segments' identities and paths, and setting the flags by
//! hand or by path; which `#[with_cp]` types ran in a run ([`reached`]), the planner's
//! recorder of a step ([`profile`]) and the choice made as a segment is entered ([`dynamic`]).
//! The same on both Burns.

pub mod dynamic;
pub mod profile;
mod reached;

pub use reached::{note, reached, set_unused_with_cp, unreached, unused_with_cp};

/// A module with a `with_cp` flag, read by its `#[with_cp]` methods (MMCV's `with_cp`).
///
/// `#[memsave::model]` implements it for a struct with a field `with_cp: bool` (Burn's derive
/// keeps a `bool` as a constant of the module); by hand:
/// `impl HasWithCp for Block { fn with_cp(&self) -> bool { self.with_cp } }`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no `with_cp` flag, so `#[with_cp]` cannot be used on its methods",
    label = "this method reads `self.with_cp`",
    note = "put `#[memsave::model]` on the struct and give it a field `with_cp: bool` (start it \
            at `false`; `set_with_cp` or the config switches it on)"
)]
pub trait HasWithCp {
    /// The module's own flag.
    fn with_cp(&self) -> bool;
}

/// A module in which checkpointing can be switched on: it has a `with_cp` flag, or fields
/// marked `#[with_cp]` that lead to one.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be checkpointed: nothing in it has a `with_cp` switch",
    label = "checkpointing is switched on in this `{Self}`",
    note = "a checkpointable block is a `#[memsave::model]` struct with a field `with_cp: bool` \
            and a `#[with_cp]` method (its forward), and a model reaches its blocks through \
            fields marked `#[with_cp]`; Burn's layers have no such switch: checkpoint the block \
            that contains them"
)]
pub trait CheckpointModule: Sized {
    /// Whether the module is itself a checkpointed segment (`Marked`: it has the `with_cp` flag,
    /// or it is an enum of blocks) or only leads to some (`Unmarked`: a container, such as a
    /// backbone whose stem runs plainly). On Burn 0.21 the first-layer guard of `#[auto_fp16]`
    /// asks it of the field that receives the network's input.
    type Mark: Default;

    /// Sets every `with_cp` flag of this module and of its `#[with_cp]` fields to `on`.
    fn set_with_cp(self, on: bool) -> Self;

    /// Sets the `with_cp` flag of each segment below this module to `on(its path)`, where the
    /// path of this module is `path` and a marked field's is `path.field` (`Vec` items by
    /// index: `encoder.blocks.1`; an enum's variant adds nothing). See [`set_with_cp_paths`].
    fn set_with_cp_by_path(self, _path: &str, _on: &dyn Fn(&str) -> bool) -> Self {
        self
    }

    /// Calls `visit` with the path and identity of each segment (a module with a `with_cp`
    /// flag) at or below this module, reached through `#[with_cp]` fields, in field order.
    fn visit_segments(&self, _path: &str, _visit: &mut dyn FnMut(&str, SegmentId)) {}
}

/// Which module a segment runs: its address and type while the model is not moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentId {
    address: usize,
    type_name: &'static str,
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

    /// The module's type as `std::any::type_name` gives it.
    pub fn full_type_name(&self) -> &'static str {
        self.type_name
    }
}

/// `a::b::Block<burn::X>` -> `Block`.
pub fn short_name(name: &str) -> String {
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
pub fn segment_name(module: &str, method: &str) -> String {
    match method {
        "" => short_name(module),
        method => format!("{}::{method}", short_name(module)),
    }
}

/// The module paths of the segments of `model` (`blocks.0`, ...), in field order.
pub fn segment_paths<M: CheckpointModule>(model: &M) -> Vec<String> {
    let mut paths = Vec::new();
    model.visit_segments("", &mut |path, _| paths.push(path.to_string()));
    paths
}

/// A path given to [`set_with_cp_paths`] that names no segment of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSegment {
    /// The path given.
    pub path: String,
    /// The model's segments closest to it (at most six).
    pub close: Vec<String>,
    /// How many segments the model has.
    pub segments: usize,
}

impl UnknownSegment {
    /// What is wrong, without the key's name: "`x` is not a checkpointable segment of this
    /// model; its N segments include `a`, `b`".
    pub fn detail(&self) -> String {
        let close: Vec<String> = self.close.iter().map(|p| format!("`{p}`")).collect();
        format!(
            "`{}` is not a checkpointable segment of this model; its {} segments include {}",
            self.path,
            self.segments,
            if close.is_empty() {
                "none".to_string()
            } else {
                close.join(", ")
            }
        )
    }
}

/// `with_cp: ` and [`UnknownSegment::detail`].
impl std::fmt::Display for UnknownSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "with_cp: {}", self.detail())
    }
}

impl std::error::Error for UnknownSegment {}

/// Checkpoints exactly the segments of `model` whose paths are in `paths` (as
/// [`segment_paths`] names them), and no other. A path that names no segment is an error that
/// lists the closest ones, and `model` is not changed.
pub fn set_with_cp_paths<M: CheckpointModule>(
    model: M,
    paths: &[String],
) -> Result<M, UnknownSegment> {
    let known = segment_paths(&model);
    if let Some(path) = paths.iter().find(|path| !known.contains(path)) {
        let mut close: Vec<String> = known
            .iter()
            .filter(|known| known.starts_with(path.as_str()) || path.starts_with(known.as_str()))
            .take(6)
            .cloned()
            .collect();
        if close.is_empty() {
            close = known.iter().take(6).cloned().collect();
        }
        return Err(UnknownSegment {
            path: path.clone(),
            close,
            segments: known.len(),
        });
    }
    Ok(model.set_with_cp_by_path("", &|path| paths.iter().any(|p| p == path)))
}

/// Switches checkpointing on (or off) in `model`: its `with_cp` flag and, through every field
/// marked `#[with_cp]`, the flags of the blocks below (MMCV's `with_cp=True` on a backbone).
pub fn set_with_cp<M: CheckpointModule>(model: M, on: bool) -> M {
    model.set_with_cp(on)
}

impl<T: CheckpointModule> CheckpointModule for Vec<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.into_iter()
            .map(|module| module.set_with_cp(on))
            .collect()
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        self.into_iter()
            .enumerate()
            .map(|(index, module)| module.set_with_cp_by_path(&join_index(path, index), on))
            .collect()
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        for (index, module) in self.iter().enumerate() {
            module.visit_segments(&join_index(path, index), visit);
        }
    }
}

impl<T: CheckpointModule> CheckpointModule for Option<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.map(|module| module.set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        self.map(|module| module.set_with_cp_by_path(path, on))
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        if let Some(module) = self {
            module.visit_segments(path, visit);
        }
    }
}

impl<T: CheckpointModule> CheckpointModule for Box<T> {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        Box::new((*self).set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        Box::new((*self).set_with_cp_by_path(path, on))
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        (**self).visit_segments(path, visit);
    }
}

impl<T: CheckpointModule, const N: usize> CheckpointModule for [T; N] {
    type Mark = T::Mark;

    fn set_with_cp(self, on: bool) -> Self {
        self.map(|module| module.set_with_cp(on))
    }

    fn set_with_cp_by_path(self, path: &str, on: &dyn Fn(&str) -> bool) -> Self {
        let mut index = 0;
        self.map(|module| {
            index += 1;
            module.set_with_cp_by_path(&join_index(path, index - 1), on)
        })
    }

    fn visit_segments(&self, path: &str, visit: &mut dyn FnMut(&str, SegmentId)) {
        for (index, module) in self.iter().enumerate() {
            module.visit_segments(&join_index(path, index), visit);
        }
    }
}

/// What `#[memsave::model]`'s output names; not an API.
#[doc(hidden)]
pub mod __private {
    /// `path.name`, or `name` at the root.
    pub fn join_path(path: &str, name: &str) -> String {
        if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        }
    }

    /// A module that is itself a segment (the answer of `__memsave_mark_FIELD` for a field
    /// marked `#[with_cp]`).
    #[derive(Default)]
    pub struct Marked;

    /// A module that only leads to segments (the answer for any other field).
    #[derive(Default)]
    pub struct Unmarked;

    /// The fields of a `#[memsave::model]` type `M` without a `with_cp` flag or a marked field:
    /// the type its "no field marked" bound is on, so that the compiler reports that bound's
    /// message (it names the fields) rather than `CheckpointModule`'s.
    pub struct FieldsOf<M>(core::marker::PhantomData<M>);

    /// `(&MarkProbe(&self.field)).cp_mark()`: the field type's `CheckpointModule::Mark` if it
    /// has one, else `Unmarked` (autoref specialisation: [`MarkViaTrait`] is found first,
    /// [`MarkViaFallback`] one reference deeper). `#[auto_fp16]`'s first-layer guard asks it.
    pub struct MarkProbe<'a, T: ?Sized>(pub &'a T);

    /// The probe's answer for a type that is a [`CheckpointModule`](super::CheckpointModule).
    pub trait MarkViaTrait {
        /// The type's mark.
        type Mark: Default;
        /// The mark.
        fn cp_mark(&self) -> Self::Mark {
            Default::default()
        }
    }

    impl<T: super::CheckpointModule> MarkViaTrait for MarkProbe<'_, T> {
        type Mark = T::Mark;
    }

    /// The probe's answer for any other type.
    pub trait MarkViaFallback {
        /// `Unmarked`.
        fn cp_mark(&self) -> Unmarked {
            Unmarked
        }
    }

    impl<T: ?Sized> MarkViaFallback for &MarkProbe<'_, T> {}

    /// `Marked` only when both are.
    pub trait Both {
        /// `Marked` or `Unmarked`.
        type Out: Default;
    }

    impl Both for (Marked, Marked) {
        type Out = Marked;
    }

    impl Both for (Marked, Unmarked) {
        type Out = Unmarked;
    }

    impl Both for (Unmarked, Marked) {
        type Out = Unmarked;
    }

    impl Both for (Unmarked, Unmarked) {
        type Out = Unmarked;
    }

    /// The field is marked `#[with_cp]` (`field`) and its type is a segment (`ty`).
    pub fn both<A, B>(_field: A, _ty: B) -> <(A, B) as Both>::Out
    where
        (A, B): Both,
    {
        Default::default()
    }
}

fn join_index(path: &str, index: usize) -> String {
    __private::join_path(path, &index.to_string())
}

/// What a run does when a module's `with_cp` switch is on but no `#[with_cp]` method of it ran
/// in the first step (config: `unused_with_cp`, top level).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnusedWithCp {
    /// The step ends with an error naming the types (the default: training on without
    /// checkpointing would use the memory the switch was meant to save).
    #[default]
    Error,
    /// A warning naming them, once, and the run goes on without checkpointing them.
    Warn,
}

/// The error (or warning) for the types switched on whose `#[with_cp]` method never ran.
pub fn no_segment_message(types: &[String]) -> String {
    let list = types
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "checkpointing is switched on in {list}, but no `#[with_cp]` method of {} ran in the \
         first step, so nothing was checkpointed: mark the method that computes the block \
         (its forward) `#[with_cp]`, or switch its `with_cp` off (a run that should go on \
         without it: `unused_with_cp = \"warn\"` in the config, \
         `memsave::checkpoint::set_unused_with_cp(UnusedWithCp::Warn)` in its run, \
         `Memsave::unused_with_cp(..)` with burn-train)",
        if types.len() == 1 { "it" } else { "them" }
    )
}
