//! Pascal VOC: the devkit's layout (`Annotations/*.xml`, `JPEGImages/*.jpg`,
//! `ImageSets/Main/<split>.txt`), the 20 classes and the `difficult` flag, read with roxmltree;
//! MMDetection's pipeline ([`pipeline`]); batches made in background threads ([`loader`]); and a
//! synthetic data set in the same format ([`synth`]).
//!
//! Every problem with the files is an error naming the file (and the object or field): a
//! malformed XML, a missing image, an unknown class, a box outside its image.

pub mod loader;
pub mod pipeline;
pub mod synth;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::memsave::{Error, Result};

/// The 20 VOC classes, in the devkit's (and MMDetection's) order.
pub const VOC_CLASSES: [&str; 20] = [
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
];

/// The index of a class name.
pub fn class_index(name: &str) -> Option<usize> {
    VOC_CLASSES.iter().position(|c| *c == name)
}

/// One annotated object.
#[derive(Clone, Debug, PartialEq)]
pub struct VocObject {
    /// Index into [`VOC_CLASSES`].
    pub label: usize,
    /// `[xmin, ymin, xmax, ymax]` as written (the devkit's 1-based inclusive pixels).
    pub bbox: [f32; 4],
    /// Marked difficult: left out of training, ignored by the evaluation.
    pub difficult: bool,
}

/// One image and its objects.
#[derive(Clone, Debug, PartialEq)]
pub struct VocImage {
    /// The file stem (`000005`).
    pub id: String,
    /// The JPEG.
    pub path: PathBuf,
    /// Pixels.
    pub width: usize,
    /// Pixels.
    pub height: usize,
    /// The objects.
    pub objects: Vec<VocObject>,
}

fn data_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Data(format!("{}: {message}", path.display()))
}

/// The largest annotation file read (a VOC annotation is a few KiB).
pub const MAX_ANNOTATION_BYTES: u64 = 4 << 20;
/// The deepest nesting of elements read (a VOC annotation's is 4: annotation, object, bndbox,
/// xmin); deeper files are refused before the XML parser, which recurses per level, sees them.
pub const MAX_ANNOTATION_DEPTH: usize = 64;
/// The most XML nodes read from one annotation file.
pub const MAX_ANNOTATION_NODES: u32 = 1 << 20;

/// The deepest nesting of elements in `text`, counted without parsing (tags, comments,
/// declarations and CDATA told apart by their first characters); stops counting past `limit`.
fn nesting_depth(text: &str, limit: usize) -> usize {
    let bytes = text.as_bytes();
    let (mut depth, mut deepest, mut at) = (0usize, 0usize, 0usize);
    while let Some(offset) = bytes[at..].iter().position(|&b| b == b'<') {
        let start = at + offset;
        let rest = &bytes[start..];
        if rest.starts_with(b"<!--") {
            at = find(bytes, start, b"-->");
        } else if rest.starts_with(b"<![CDATA[") {
            at = find(bytes, start, b"]]>");
        } else if rest.starts_with(b"<?") || rest.starts_with(b"<!") {
            at = find(bytes, start, b">");
        } else if rest.starts_with(b"</") {
            depth = depth.saturating_sub(1);
            at = find(bytes, start, b">");
        } else {
            let end = find(bytes, start, b">");
            if !(end >= 2 && bytes[end - 2] == b'/') {
                depth += 1;
                deepest = deepest.max(depth);
                if deepest > limit {
                    return deepest;
                }
            }
            at = end;
        }
        if at >= bytes.len() {
            break;
        }
    }
    deepest
}

/// The position just after the first `pattern` at or after `from` (the end if none).
fn find(bytes: &[u8], from: usize, pattern: &[u8]) -> usize {
    bytes[from..]
        .windows(pattern.len())
        .position(|w| w == pattern)
        .map_or(bytes.len(), |i| from + i + pattern.len())
}

/// Parses one annotation file; `image` is where its JPEG should be. A file larger, deeper or
/// with more nodes than the bounds above is an error naming it, never handed to the parser.
pub fn parse_annotation(xml_path: &Path, id: &str, image: PathBuf) -> Result<VocImage> {
    let size = std::fs::metadata(xml_path)
        .map_err(|e| data_error(xml_path, e))?
        .len();
    if size > MAX_ANNOTATION_BYTES {
        return Err(data_error(
            xml_path,
            format!(
                "{size} bytes: larger than any VOC annotation (at most {MAX_ANNOTATION_BYTES} are read)"
            ),
        ));
    }
    let text = std::fs::read_to_string(xml_path).map_err(|e| data_error(xml_path, e))?;
    let depth = nesting_depth(&text, MAX_ANNOTATION_DEPTH);
    if depth > MAX_ANNOTATION_DEPTH {
        return Err(data_error(
            xml_path,
            format!(
                "elements nested more than {MAX_ANNOTATION_DEPTH} levels deep: not a VOC \
                 annotation (its nesting is 4)"
            ),
        ));
    }
    let options = roxmltree::ParsingOptions {
        nodes_limit: MAX_ANNOTATION_NODES,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&text, options)
        .map_err(|e| Error::data_file(xml_path, "malformed XML", e))?;
    let root = doc.root_element();
    if root.tag_name().name() != "annotation" {
        return Err(data_error(
            xml_path,
            format!(
                "the root element is <{}>, not <annotation>",
                root.tag_name().name()
            ),
        ));
    }
    fn child<'a, 'i>(node: roxmltree::Node<'a, 'i>, name: &str) -> Option<roxmltree::Node<'a, 'i>> {
        node.children()
            .find(|c| c.is_element() && c.tag_name().name() == name)
    }
    let number = |node: roxmltree::Node<'_, '_>, name: &str, what: &str| -> Result<f32> {
        let text = child(node, name)
            .and_then(|n| n.text())
            .ok_or_else(|| data_error(xml_path, format!("{what}: no <{name}>")))?;
        text.trim()
            .parse::<f32>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| {
                data_error(
                    xml_path,
                    format!("{what}: <{name}> is `{}`, not a number", text.trim()),
                )
            })
    };
    let size = child(root, "size").ok_or_else(|| data_error(xml_path, "no <size>"))?;
    let width = number(size, "width", "<size>")?;
    let height = number(size, "height", "<size>")?;
    if !(width >= 1.0 && height >= 1.0) {
        return Err(data_error(
            xml_path,
            format!("<size> is {width} x {height}"),
        ));
    }
    let mut objects = Vec::new();
    for (k, object) in root
        .children()
        .filter(|c| c.is_element() && c.tag_name().name() == "object")
        .enumerate()
    {
        let what = format!("object {}", k + 1);
        let name = child(object, "name")
            .and_then(|n| n.text())
            .map(str::trim)
            .ok_or_else(|| data_error(xml_path, format!("{what}: no <name>")))?;
        let label = class_index(name).ok_or_else(|| {
            data_error(
                xml_path,
                format!(
                    "{what}: unknown class `{name}` (the VOC classes: {})",
                    VOC_CLASSES.join(", ")
                ),
            )
        })?;
        // Absent is 0, as in the devkit; present, it must say 0 or 1.
        let difficult = match child(object, "difficult").map(|n| n.text().unwrap_or("").trim()) {
            None | Some("0") => false,
            Some("1") => true,
            Some("") => {
                return Err(data_error(
                    xml_path,
                    format!("{what} ({name}): <difficult> is empty, not 0 or 1"),
                ));
            }
            Some(other) => {
                return Err(data_error(
                    xml_path,
                    format!("{what} ({name}): <difficult> is `{other}`, not 0 or 1"),
                ));
            }
        };
        let what = format!("{what} ({name})");
        let bndbox = child(object, "bndbox")
            .ok_or_else(|| data_error(xml_path, format!("{what}: no <bndbox>")))?;
        let bbox = [
            number(bndbox, "xmin", &what)?,
            number(bndbox, "ymin", &what)?,
            number(bndbox, "xmax", &what)?,
            number(bndbox, "ymax", &what)?,
        ];
        if bbox[0] < 0.0
            || bbox[1] < 0.0
            || bbox[2] > width
            || bbox[3] > height
            || bbox[0] > bbox[2]
            || bbox[1] > bbox[3]
        {
            return Err(data_error(
                xml_path,
                format!("{what}: the box {bbox:?} is not inside the {width} x {height} image"),
            ));
        }
        objects.push(VocObject {
            label,
            bbox,
            difficult,
        });
    }
    Ok(VocImage {
        id: id.to_string(),
        path: image,
        width: width as usize,
        height: height as usize,
        objects,
    })
}

/// One or several paths (MMDetection concatenates VOC2007 and VOC2012 this way).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One.
    One(PathBuf),
    /// Several, matched pairwise.
    Many(Vec<PathBuf>),
}

impl OneOrMany {
    /// The paths.
    pub fn paths(&self) -> Vec<PathBuf> {
        match self {
            OneOrMany::One(p) => vec![p.clone()],
            OneOrMany::Many(p) => p.clone(),
        }
    }
}

/// Reads the split list `ann_file` (`VOC2007/ImageSets/Main/trainval.txt`) of the devkit
/// directory `img_prefix` (`VOC2007/`): every listed image's annotation, its JPEG checked to
/// exist.
pub fn read_split(ann_file: &Path, img_prefix: &Path) -> Result<Vec<VocImage>> {
    let list = std::fs::read_to_string(ann_file)
        .map_err(|e| Error::data_file(ann_file, "cannot read the split list", e))?;
    // A byte-order mark is not part of the first id (Python's `utf-8-sig`).
    let list = list.strip_prefix('\u{feff}').unwrap_or(&list);
    let mut images = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (number, line) in list.lines().enumerate() {
        let id = line.split_whitespace().next().unwrap_or_default();
        if id.is_empty() {
            continue;
        }
        // Listed twice, an image would train twice and its objects count twice in the mAP.
        if !seen.insert(id) {
            return Err(data_error(
                ann_file,
                format!("line {}: image `{id}` is listed twice", number + 1),
            ));
        }
        let xml = img_prefix.join("Annotations").join(format!("{id}.xml"));
        let jpeg = img_prefix.join("JPEGImages").join(format!("{id}.jpg"));
        if !xml.is_file() {
            return Err(data_error(
                &xml,
                format!(
                    "missing: the annotation of image `{id}` listed in {}",
                    ann_file.display()
                ),
            ));
        }
        if !jpeg.is_file() {
            return Err(data_error(
                &jpeg,
                format!("missing: the image `{id}` listed in {}", ann_file.display()),
            ));
        }
        images.push(parse_annotation(&xml, id, jpeg)?);
    }
    if images.is_empty() {
        return Err(data_error(ann_file, "lists no image"));
    }
    Ok(images)
}

/// Reads several splits, each `ann_file` with the `img_prefix` at the same position.
pub fn read_splits(ann_file: &OneOrMany, img_prefix: &OneOrMany) -> Result<Vec<VocImage>> {
    let (lists, prefixes) = (ann_file.paths(), img_prefix.paths());
    if lists.len() != prefixes.len() {
        return Err(Error::invalid(
            "data.img_prefix",
            format!(
                "{} prefixes for {} annotation lists",
                prefixes.len(),
                lists.len()
            ),
        ));
    }
    let mut images = Vec::new();
    for (list, prefix) in lists.iter().zip(&prefixes) {
        images.extend(read_split(list, prefix)?);
    }
    Ok(images)
}
