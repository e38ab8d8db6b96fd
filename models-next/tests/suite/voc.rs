//! Pascal VOC: the synthetic set read back, the reader's errors, the pipeline, the background
//! loader (under a watchdog), and the mAP on hand-computed cases.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use burn::prelude::Device;
use memsave_models_next::data::voc::loader::{DatasetType, VocDatasetConfig, VocDetection};
use memsave_models_next::data::voc::pipeline::{Pipeline, Step};
use memsave_models_next::data::voc::synth::{write_synthetic_voc, SYNTH_CLASSES};
use memsave_models_next::data::voc::{class_index, read_split, OneOrMany, VocImage, VocObject};
use memsave_models_next::eval::voc::{read_detections, voc_map, ApMode, DetectionRecord};

fn watchdog<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(seconds))
        .expect("hung: no answer within the watchdog's time")
}

fn synth(dir: &Path, images: usize, seed: u64) -> std::path::PathBuf {
    write_synthetic_voc(dir, images, seed).unwrap()
}

fn split(root: &Path, name: &str) -> Vec<VocImage> {
    read_split(&root.join(format!("ImageSets/Main/{name}.txt")), root).unwrap()
}

#[test]
fn the_synthetic_set_is_real_voc_and_deterministic() {
    let _turn = super::common::one_at_a_time();
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let root = synth(a.path(), 12, 7);
    let trainval = split(&root, "trainval");
    let test = split(&root, "test");
    assert_eq!((trainval.len(), test.len()), (9, 3));
    let objects: Vec<&VocObject> = trainval
        .iter()
        .chain(&test)
        .flat_map(|i| &i.objects)
        .collect();
    assert!(objects.len() >= 12, "1 to 3 objects per image");
    let synth_labels: Vec<usize> = SYNTH_CLASSES
        .iter()
        .map(|c| class_index(c).unwrap())
        .collect();
    for image in trainval.iter().chain(&test) {
        let decoded = image::open(&image.path).unwrap();
        assert_eq!(
            (decoded.width() as usize, decoded.height() as usize),
            (image.width, image.height)
        );
        for o in &image.objects {
            assert!(synth_labels.contains(&o.label));
            assert!(o.bbox[0] >= 1.0 && o.bbox[2] <= image.width as f32 && o.bbox[0] < o.bbox[2]);
        }
    }
    // The same seed gives the same bytes; another seed other images.
    let again = synth(b.path(), 12, 7);
    let other = synth(c.path(), 12, 8);
    for file in [
        "JPEGImages/000005.jpg",
        "Annotations/000005.xml",
        "ImageSets/Main/test.txt",
    ] {
        assert_eq!(
            std::fs::read(root.join(file)).unwrap(),
            std::fs::read(again.join(file)).unwrap(),
            "{file}"
        );
    }
    assert_ne!(
        std::fs::read(root.join("JPEGImages/000005.jpg")).unwrap(),
        std::fs::read(other.join("JPEGImages/000005.jpg")).unwrap()
    );
    // An existing set is never overwritten.
    let before = std::fs::read(root.join("Annotations/000001.xml")).unwrap();
    let error = write_synthetic_voc(a.path(), 12, 9)
        .unwrap_err()
        .to_string();
    assert!(error.contains("already exists"), "{error}");
    assert_eq!(
        std::fs::read(root.join("Annotations/000001.xml")).unwrap(),
        before
    );
}

#[test]
fn malformed_or_inconsistent_files_are_errors_naming_them() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 8, 1);
    let list = root.join("ImageSets/Main/trainval.txt");
    let xml = root.join("Annotations/000001.xml");
    let original = std::fs::read_to_string(&xml).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (original.replace("</annotation>", ""), "malformed XML"),
        (
            original
                .replacen("<name>", "<name>unicorn", 1)
                .replacen("unicorn", "unicorn", 1),
            "unknown class",
        ),
        (original.replacen("<xmax>", "<xmax>9", 1), "not inside"),
        (
            original.replacen("<difficult>0", "<difficult>maybe", 1),
            "difficult",
        ),
        (original.replace("<width>", "<width>x"), "not a number"),
    ];
    for (text, words) in cases {
        std::fs::write(&xml, &text).unwrap();
        let error = read_split(&list, &root).unwrap_err().to_string();
        assert!(error.contains("000001.xml"), "{error}");
        assert!(error.contains(words), "{words}: {error}");
    }
    std::fs::write(&xml, original).unwrap();
    std::fs::remove_file(root.join("JPEGImages/000002.jpg")).unwrap();
    let error = read_split(&list, &root).unwrap_err().to_string();
    assert!(
        error.contains("000002.jpg") && error.contains("missing"),
        "{error}"
    );
    let error = read_split(&root.join("ImageSets/Main/val.txt"), &root)
        .unwrap_err()
        .to_string();
    assert!(error.contains("val.txt"), "{error}");
}

#[test]
fn hostile_annotations_and_split_lists_are_errors_naming_the_file_never_an_abort() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 8, 1);
    let list = root.join("ImageSets/Main/trainval.txt");
    let xml = root.join("Annotations/000001.xml");
    let original = std::fs::read_to_string(&xml).unwrap();
    // Nested far deeper than the XML parser's recursion can take (it overflowed the stack).
    let levels = 200_000;
    let nested = format!(
        "{}{}{}",
        "<a>".repeat(levels),
        original,
        "</a>".repeat(levels)
    );
    std::fs::write(&xml, &nested).unwrap();
    let started = std::time::Instant::now();
    let error = watchdog(60, {
        let (list, root) = (list.clone(), root.clone());
        move || read_split(&list, &root).unwrap_err().to_string()
    });
    assert!(
        error.contains("000001.xml") && error.contains("nested"),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Deep but within the bound still parses (and is then not a VOC annotation).
    let shallow = format!("{}{}{}", "<a>".repeat(10), original, "</a>".repeat(10));
    std::fs::write(&xml, &shallow).unwrap();
    let error = read_split(&list, &root).unwrap_err().to_string();
    assert!(error.contains("not <annotation>"), "{error}");
    // Larger than any annotation.
    let padding = " ".repeat(5 << 20);
    std::fs::write(&xml, format!("{original}<!--{padding}-->")).unwrap();
    let error = read_split(&list, &root).unwrap_err().to_string();
    assert!(
        error.contains("000001.xml") && error.contains("bytes"),
        "{error}"
    );
    // An empty <difficult> is malformed (an absent one is 0, as in the devkit).
    let empty = original.replacen("<difficult>0</difficult>", "<difficult></difficult>", 1);
    assert_ne!(empty, original, "the fixture has a <difficult>");
    std::fs::write(&xml, &empty).unwrap();
    let error = read_split(&list, &root).unwrap_err().to_string();
    assert!(
        error.contains("000001.xml") && error.contains("<difficult> is empty"),
        "{error}"
    );
    std::fs::write(&xml, &original).unwrap();

    // A byte-order mark is not part of the first id.
    let ids = std::fs::read_to_string(&list).unwrap();
    let first = ids.split_whitespace().next().unwrap().to_string();
    let expected = read_split(&list, &root).unwrap();
    std::fs::write(&list, format!("\u{feff}{ids}")).unwrap();
    let with_bom = read_split(&list, &root).unwrap();
    assert_eq!(with_bom, expected);
    assert_eq!(with_bom[0].id, first);
    // An image listed twice is an error naming the list, the line and the id.
    std::fs::write(&list, format!("{ids}{first}\n")).unwrap();
    let error = read_split(&list, &root).unwrap_err().to_string();
    assert!(
        error.contains("trainval.txt") && error.contains(&format!("`{first}` is listed twice")),
        "{error}"
    );
}

#[test]
fn a_truncated_jpeg_or_one_claiming_more_pixels_is_an_error_naming_it() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 4, 3);
    let image = split(&root, "trainval")[0].clone();
    let p = Pipeline::train([160, 120]);
    let whole = std::fs::read(&image.path).unwrap();
    p.apply(&image, false).expect("the whole file decodes");
    // Cut to a half and to a third: the decoder alone would fill the rest without a word.
    for keep in [whole.len() / 2, whole.len() / 3] {
        std::fs::write(&image.path, &whole[..keep]).unwrap();
        let error = p.apply(&image, false).unwrap_err().to_string();
        assert!(
            error.contains(&image.path.display().to_string()) && error.contains("truncated"),
            "{keep} bytes: {error}"
        );
    }
    // A header claiming 8000 x 8000 (the start-of-frame's height and width) in the same bytes.
    let mut claiming = whole.clone();
    let sof = claiming
        .windows(2)
        .position(|w| w[0] == 0xFF && (0xC0..=0xC2).contains(&w[1]))
        .expect("a start-of-frame marker");
    claiming[sof + 5..sof + 9].copy_from_slice(&[0x1F, 0x40, 0x1F, 0x40]);
    std::fs::write(&image.path, &claiming).unwrap();
    let error = p.apply(&image, false).unwrap_err().to_string();
    assert!(
        error.contains(&image.path.display().to_string()) && error.contains("claims more pixels"),
        "{error}"
    );
    std::fs::write(&image.path, &whole).unwrap();
    p.apply(&image, false)
        .expect("the whole file decodes again");
}

#[test]
fn the_pipeline_resizes_keeping_the_ratio_flips_normalises_and_pads() {
    let _turn = super::common::one_at_a_time();
    let p = Pipeline::train([1000, 600]);
    assert_eq!(p.resized_shape([375, 500]), ([600, 800], [1.6, 1.6]));
    assert_eq!(p.resized_shape([500, 375]).0, [800, 600]);
    assert_eq!(p.resized_shape([300, 1200]).0, [250, 1000]);

    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 4, 3);
    let image = &split(&root, "trainval")[0];
    let p = Pipeline::train([160, 120]);
    let (pixels, meta, boxes, labels) = p.apply(image, false).unwrap();
    let (flipped_pixels, flipped, fboxes, _) = p.apply(image, true).unwrap();
    let ([h, w], [ws, hs]) = p.resized_shape([image.height, image.width]);
    assert_eq!(meta.img_shape, [h, w]);
    assert_eq!(meta.pad_shape, [h.div_ceil(32) * 32, w.div_ceil(32) * 32]);
    assert_eq!(pixels.len(), 3 * meta.pad_shape[0] * meta.pad_shape[1]);
    assert!(flipped.flip && !meta.flip);
    let kept: Vec<&VocObject> = image.objects.iter().filter(|o| !o.difficult).collect();
    assert_eq!(boxes.len(), kept.len());
    for ((b, f), o) in boxes.iter().zip(&fboxes).zip(&kept) {
        assert!((b[0] - o.bbox[0] * ws).abs() < 1e-3 && (b[3] - o.bbox[3] * hs).abs() < 1e-3);
        assert!((f[0] - (w as f32 - b[2])).abs() < 1e-3 && (f[2] - (w as f32 - b[0])).abs() < 1e-3);
    }
    assert_eq!(labels, kept.iter().map(|o| o.label).collect::<Vec<_>>());
    // The padding is zero; the flip mirrors each row.
    let [ph, pw] = meta.pad_shape;
    assert_eq!(pixels[(ph - 1) * pw + pw - 1], 0.0);
    let (row, c) = (h / 2, 1);
    for x in 0..w {
        let a = pixels[(c * ph + row) * pw + x];
        let b = flipped_pixels[(c * ph + row) * pw + (w - 1 - x)];
        assert!((a - b).abs() < 1e-5, "column {x}");
    }
    // ImageNet normalisation: values within a few standard deviations of 0.
    assert!(pixels.iter().all(|v| v.abs() < 3.0));
}

#[test]
fn skip_bad_images_leaves_the_damaged_ones_out_and_is_off_by_default() {
    let _turn = super::common::one_at_a_time();
    use memsave_next::train::DataSource;
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 16, 5);
    let images = split(&root, "trainval");
    let damaged = &images[1].path;
    let whole = std::fs::read(damaged).unwrap();
    std::fs::write(damaged, &whole[..whole.len() / 2]).unwrap();
    let config = |skip: bool| VocDatasetConfig {
        kind: DatasetType::VOCDataset,
        ann_file: OneOrMany::One(root.join("ImageSets/Main/trainval.txt")),
        img_prefix: OneOrMany::One(root.clone()),
        pipeline: None,
        skip_bad_images: skip,
    };
    let skipping =
        VocDetection::new(&config(true), "data.train", false, 1, 0, 0, Device::flex()).unwrap();
    assert_eq!(skipping.batches_per_epoch(), images.len() - 1);
    for index in 0..skipping.batches_per_epoch() {
        skipping
            .batch(0, index, &Device::flex())
            .expect("only whole images are left");
    }
    // Off (the default): the damaged image is an error naming it when its batch is made.
    let strict =
        VocDetection::new(&config(false), "data.train", false, 1, 0, 0, Device::flex()).unwrap();
    assert_eq!(strict.batches_per_epoch(), images.len());
    let errors: Vec<String> = (0..strict.batches_per_epoch())
        .filter_map(|index| {
            strict
                .batch(0, index, &Device::flex())
                .err()
                .map(|e| e.to_string())
        })
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains(&damaged.display().to_string()) && errors[0].contains("truncated"));
}

#[test]
fn background_workers_give_the_batches_made_in_place_without_hanging() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 16, 5);
    let config = VocDatasetConfig {
        kind: DatasetType::VOCDataset,
        ann_file: OneOrMany::One(root.join("ImageSets/Main/trainval.txt")),
        img_prefix: OneOrMany::One(root.clone()),
        pipeline: None,
        skip_bad_images: false,
    };
    watchdog(120, move || {
        use memsave_next::train::DataSource;
        let inline =
            VocDetection::new(&config, "data.train", true, 3, 0, 11, Device::flex()).unwrap();
        let workers =
            VocDetection::new(&config, "data.train", true, 3, 2, 11, Device::flex()).unwrap();
        assert_eq!(inline.batches_per_epoch(), 4, "12 images in batches of 3");
        let mut flips = 0;
        for (epoch, index) in [(0, 0), (0, 1), (0, 3), (1, 0), (0, 2), (3, 1)] {
            let a = inline.host(epoch, index).unwrap();
            let b = workers.host(epoch, index).unwrap();
            assert_eq!(a.metas, b.metas, "({epoch}, {index})");
            assert_eq!(a.pixels, b.pixels, "({epoch}, {index})");
            assert_eq!(a.shape[2] % 32, 0);
            flips += a.metas.iter().filter(|m| m.flip).count();
        }
        assert!(flips > 0 && flips < 18, "about half flipped: {flips}");
        let error = workers.host(0, 4).unwrap_err().to_string();
        assert!(error.contains("no batch 4"), "{error}");
        drop(workers);
    });
}

fn image(id: &str, objects: &[(usize, [f32; 4], bool)]) -> VocImage {
    VocImage {
        id: id.into(),
        path: Default::default(),
        width: 100,
        height: 100,
        objects: objects
            .iter()
            .map(|&(label, bbox, difficult)| VocObject {
                label,
                bbox,
                difficult,
            })
            .collect(),
    }
}

fn det(image: &str, class: &str, score: f32, bbox: [f32; 4]) -> DetectionRecord {
    DetectionRecord {
        image: image.into(),
        class: class.into(),
        score,
        bbox,
    }
}

fn ap_of(result: &memsave_models_next::eval::voc::MapResult, class: &str) -> f32 {
    result.classes.iter().find(|c| c.class == class).unwrap().ap
}

#[test]
fn map_on_hand_computed_cases() {
    let _turn = super::common::one_at_a_time();
    let dog = class_index("dog").unwrap();
    let cat = class_index("cat").unwrap();
    let g1 = [10.0, 10.0, 40.0, 40.0];
    let g2 = [50.0, 50.0, 90.0, 80.0];
    let images = vec![
        image("a", &[(dog, g1, false)]),
        image("b", &[(dog, g2, false)]),
    ];
    // A hit, a duplicate of it (a false positive), a hit: recall .5 .5 1, precision 1 .5 .67.
    let dets = vec![
        det("a", "dog", 0.9, g1),
        det("a", "dog", 0.8, [11.0, 10.0, 40.0, 41.0]),
        det("b", "dog", 0.7, g2),
    ];
    let eleven = voc_map(&images, &dets, 0.5, ApMode::ElevenPoints).unwrap();
    assert!(
        (eleven.map - (6.0 + 5.0 * 2.0 / 3.0) / 11.0).abs() < 1e-5,
        "{}",
        eleven.map
    );
    let area = voc_map(&images, &dets, 0.5, ApMode::Area).unwrap();
    assert!(
        (area.map - (0.5 + 0.5 * 2.0 / 3.0)).abs() < 1e-5,
        "{}",
        area.map
    );
    assert!(area.to_string().ends_with("mAP: 0.8333"), "{area}");
    // A miss instead of the duplicate: the same curve.
    let miss = vec![
        det("a", "dog", 0.9, g1),
        det("a", "dog", 0.8, [60.0, 0.0, 90.0, 20.0]),
        det("b", "dog", 0.7, g2),
    ];
    assert!((voc_map(&images, &miss, 0.5, ApMode::Area).unwrap().map - area.map).abs() < 1e-6);

    // Several classes: dog perfect, cat never detected, bird detected but absent (left out).
    let images = vec![image("a", &[(dog, g1, false), (cat, g2, false)])];
    let dets = vec![det("a", "dog", 0.9, g1), det("a", "bird", 0.8, g2)];
    let result = voc_map(&images, &dets, 0.5, ApMode::Area).unwrap();
    assert_eq!(
        (
            ap_of(&result, "dog"),
            ap_of(&result, "cat"),
            ap_of(&result, "bird")
        ),
        (1.0, 0.0, 0.0)
    );
    assert!(
        (result.map - 0.5).abs() < 1e-6,
        "bird has no ground truth: {}",
        result.map
    );

    // No detections at all.
    assert_eq!(
        voc_map(&images, &[], 0.5, ApMode::ElevenPoints)
            .unwrap()
            .map,
        0.0
    );

    // Difficult objects: finding one is neither a hit nor a false positive; a class whose
    // objects are all difficult is left out.
    let images = vec![image(
        "a",
        &[(dog, g1, false), (dog, g2, true), (cat, g2, true)],
    )];
    let dets = vec![
        det("a", "dog", 0.95, g2),
        det("a", "dog", 0.9, g1),
        det("a", "cat", 0.9, g2),
    ];
    let result = voc_map(&images, &dets, 0.5, ApMode::Area).unwrap();
    assert_eq!(ap_of(&result, "dog"), 1.0);
    assert_eq!(
        result
            .classes
            .iter()
            .find(|c| c.class == "cat")
            .unwrap()
            .num_gts,
        0
    );
    assert_eq!(result.map, 1.0);
    let all_difficult = vec![image("a", &[(dog, g1, true)])];
    assert_eq!(
        voc_map(
            &all_difficult,
            &[det("a", "dog", 0.9, g1)],
            0.5,
            ApMode::Area
        )
        .unwrap()
        .map,
        0.0
    );

    // The devkit's inclusive pixels: [1, 1, 10, 10] against [1, 1, 10, 20] overlap 100 / 200.
    let images = vec![image("a", &[(dog, [1.0, 1.0, 10.0, 20.0], false)])];
    let result = voc_map(
        &images,
        &[det("a", "dog", 0.9, [1.0, 1.0, 10.0, 10.0])],
        0.5,
        ApMode::Area,
    )
    .unwrap();
    assert_eq!(result.map, 1.0, "IoU 0.5 with the + 1 (0.47 without)");

    // A detection of an image outside the split is an error.
    let error = voc_map(&images, &[det("zz", "dog", 0.9, g1)], 0.5, ApMode::Area)
        .unwrap_err()
        .to_string();
    assert!(error.contains("zz"), "{error}");
}

#[test]
fn impossible_detections_are_errors_naming_the_entry_not_misses() {
    let _turn = super::common::one_at_a_time();
    let images = vec![image("a", &[(11, [10.0, 10.0, 40.0, 40.0], false)])];
    let fine = [det("a", "dog", 0.9, [0.0, 0.0, 100.0, 100.0])];
    assert!(voc_map(&images, &fine, 0.5, ApMode::Area).is_ok());
    for (bbox, words) in [
        ([40.0, 10.0, 10.0, 40.0], "inverted"),
        ([10.0, 40.0, 40.0, 10.0], "inverted"),
        ([200.0, 200.0, 300.0, 300.0], "wholly outside"),
        ([-50.0, -50.0, -10.0, -10.0], "wholly outside"),
        ([0.0, 0.0, 1e9, 50.0], "farther outside"),
    ] {
        let dets = [fine[0].clone(), det("a", "dog", 0.5, bbox)];
        let error = voc_map(&images, &dets, 0.5, ApMode::Area)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("detection 1")
                && error.contains("image `a`")
                && error.contains("class `dog`")
                && error.contains(words),
            "{bbox:?}: {error}"
        );
    }
}

#[test]
fn detections_files_are_checked() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dets.json");
    std::fs::write(
        &path,
        r#"[{"image": "000001", "class": "dog", "score": 0.9, "box": [1, 2, 3, 4]}]"#,
    )
    .unwrap();
    assert_eq!(
        read_detections(&path).unwrap()[0].bbox,
        [1.0, 2.0, 3.0, 4.0]
    );
    for (text, words) in [
        (
            r#"[{"image": "1", "class": "unicorn", "score": 0.9, "box": [1, 2, 3, 4]}]"#,
            "unknown class",
        ),
        (
            r#"[{"image": "1", "class": "dog", "score": 0.9, "box": [1, 2, 3]}]"#,
            "not a detections file",
        ),
        ("{", "not a detections file"),
    ] {
        std::fs::write(&path, text).unwrap();
        let error = read_detections(&path).unwrap_err().to_string();
        assert!(
            error.contains("dets.json") && error.contains(words),
            "{error}"
        );
    }
}

/// MMDetection 2.x's `Resize` with several scales, as a config writes it.
fn multiscale_steps(resize: serde_json::Value) -> Result<Pipeline, String> {
    let steps = serde_json::json!([
        { "type": "LoadImageFromFile" },
        resize,
        { "type": "Normalize", "mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375] },
        { "type": "Pad", "size_divisor": 32 },
    ]);
    let steps: Vec<Step> = serde_json::from_value(steps).map_err(|e| e.to_string())?;
    Pipeline::from_steps(&steps, "data.train.pipeline").map_err(|e| e.to_string())
}

#[test]
fn multiscale_range_draws_each_edge_between_the_two_scales_and_value_one_of_them() {
    let _turn = super::common::one_at_a_time();
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let range = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[640, 320], [640, 640]], "multiscale_mode": "range"
    }))
    .unwrap();
    // The largest image it makes: what the memory check and the footprint use.
    assert_eq!(range.img_scale, [640, 640]);
    let mut rng = StdRng::seed_from_u64(1);
    let drawn: Vec<[usize; 2]> = (0..400)
        .map(|_| range.draw_scale(|n| rng.random_range(0..n)))
        .collect();
    assert!(drawn
        .iter()
        .all(|s| s[0] == 640 && (320..=640).contains(&s[1])));
    let shorts: std::collections::HashSet<usize> = drawn.iter().map(|s| s[1]).collect();
    assert!(
        shorts.len() > 150,
        "uniform over 321 values: {}",
        shorts.len()
    );
    assert!(shorts.contains(&320) || shorts.contains(&640) || shorts.len() > 200);
    // The default mode is "range".
    let default = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[640, 320], [640, 640]]
    }))
    .unwrap();
    assert_eq!(default.multiscale, range.multiscale);

    let value = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[320, 320], [480, 480], [640, 640]],
        "multiscale_mode": "value"
    }))
    .unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    let picked: std::collections::HashSet<[usize; 2]> = (0..60)
        .map(|_| value.draw_scale(|n| rng.random_range(0..n)))
        .collect();
    assert_eq!(picked.len(), 3, "{picked:?}");
    assert!(picked
        .iter()
        .all(|s| [320, 480, 640].contains(&s[0]) && s[0] == s[1]));

    // One scale is one scale, as before.
    let single =
        multiscale_steps(serde_json::json!({ "type": "Resize", "img_scale": [320, 240] })).unwrap();
    assert_eq!(
        single.draw_scale(|_| unreachable!("nothing to draw")),
        [320, 240]
    );

    // Bad input names the key and what is allowed.
    let error = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[640, 320], [640, 640]], "multiscale_mode": "ranges"
    }))
    .unwrap_err();
    assert!(
        error.contains("data.train.pipeline[1].multiscale_mode")
            && error.contains("\"range\" or \"value\""),
        "{error}"
    );
    let error = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[640, 320], [640, 480], [640, 640]]
    }))
    .unwrap_err();
    assert!(
        error.contains("data.train.pipeline[1].img_scale") && error.contains("two"),
        "{error}"
    );
    let error =
        multiscale_steps(serde_json::json!({ "type": "Resize", "img_scale": [] })).unwrap_err();
    assert!(
        error.contains("img_scale") && error.contains("empty"),
        "{error}"
    );
    let error = multiscale_steps(serde_json::json!({
        "type": "Resize", "img_scale": [[640, 0], [640, 640]]
    }))
    .unwrap_err();
    assert!(error.contains("has a zero"), "{error}");
}

#[test]
fn multiscale_batches_vary_in_size_and_pad_to_their_largest_image() {
    let _turn = super::common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 12, 4);
    let steps: Vec<Step> = serde_json::from_value(serde_json::json!([
        { "type": "LoadImageFromFile" },
        { "type": "LoadAnnotations" },
        { "type": "Resize", "img_scale": [[160, 64], [160, 160]], "keep_ratio": true },
        { "type": "RandomFlip", "flip_ratio": 0.5 },
        { "type": "Normalize", "mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375] },
        { "type": "Pad", "size_divisor": 32 },
    ]))
    .unwrap();
    let config = VocDatasetConfig {
        kind: DatasetType::VOCDataset,
        ann_file: OneOrMany::One(root.join("ImageSets/Main/trainval.txt")),
        img_prefix: OneOrMany::One(root.clone()),
        pipeline: Some(steps),
        skip_bad_images: false,
    };
    watchdog(120, move || {
        let inline =
            VocDetection::new(&config, "data.train", true, 2, 0, 11, Device::flex()).unwrap();
        let workers =
            VocDetection::new(&config, "data.train", true, 2, 2, 11, Device::flex()).unwrap();
        let mut shapes = std::collections::HashSet::new();
        for (epoch, index) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 3), (3, 4)] {
            let a = inline.host(epoch, index).unwrap();
            let b = workers.host(epoch, index).unwrap();
            // The draws are the image's and the epoch's: the same whichever worker made it.
            assert_eq!(a.metas, b.metas, "({epoch}, {index})");
            // Every image within the largest scale, the batch padded to its largest.
            for meta in &a.metas {
                let [h, w] = meta.img_shape;
                assert!(h.max(w) <= 160 && h.min(w) <= 160, "{meta:?}");
                assert!(meta.pad_shape[0] <= a.shape[2] && meta.pad_shape[1] <= a.shape[3]);
            }
            let largest = a.metas.iter().map(|m| m.pad_shape[0]).max().unwrap();
            assert_eq!(a.shape[2], largest);
            assert_eq!(a.shape[2] % 32, 0);
            shapes.insert([a.shape[2], a.shape[3]]);
        }
        assert!(shapes.len() > 1, "batches of one size only: {shapes:?}");
    });
}

#[test]
fn two_peers_shards_read_the_whole_epoch_batch_by_batch() {
    let _turn = super::common::one_at_a_time();
    use memsave_models_next::data::synthetic::{
        SyntheticClassification, SyntheticClassificationConfig,
    };
    use memsave_next::parallel::Shard;
    use memsave_next::train::DataSource;
    let dir = tempfile::tempdir().unwrap();
    let root = synth(dir.path(), 16, 2);
    let config = VocDatasetConfig {
        kind: DatasetType::VOCDataset,
        ann_file: OneOrMany::One(root.join("ImageSets/Main/trainval.txt")),
        img_prefix: OneOrMany::One(root.clone()),
        pipeline: None,
        skip_bad_images: false,
    };
    // PyTorch's DistributedSampler: batch i of two peers reading batches of 2 holds batch i of
    // one process reading batches of 4, in the same shuffled order.
    let whole = VocDetection::new(&config, "data.train", true, 4, 0, 7, Device::flex()).unwrap();
    let peers: Vec<VocDetection> = (0..2)
        .map(|rank| {
            VocDetection::new_shard(
                &config,
                "data.train",
                true,
                2,
                0,
                7,
                Shard { rank, world: 2 },
                Device::flex(),
            )
            .unwrap()
        })
        .collect();
    assert_eq!(whole.batches_per_epoch(), 3, "12 training images");
    for epoch in 0..2 {
        for index in 0..whole.batches_per_epoch() {
            let ids = |data: &VocDetection| -> Vec<String> {
                let batch = data.batch(epoch, index, &Device::flex()).unwrap();
                batch.metas.into_iter().map(|m| m.id).collect()
            };
            let mut joined = ids(&peers[0]);
            joined.extend(ids(&peers[1]));
            let (mut joined, mut expected) = (joined, ids(&whole));
            joined.sort();
            expected.sort();
            assert_eq!(joined, expected, "epoch {epoch}, batch {index}");
        }
    }
    // The classification set the same way: 12 samples of 12 classes, each label its sample's.
    let set = |shard: Shard, batch: usize| {
        SyntheticClassification::new(
            SyntheticClassificationConfig::new(batch, 12, 16),
            12,
            Device::flex(),
        )
        .unwrap()
        .with_shard(shard)
    };
    let labels = |data: &SyntheticClassification, index: usize| -> Vec<i64> {
        let batch = data.batch(1, index, &Device::flex()).unwrap();
        batch.labels.into_data().iter::<i64>().collect()
    };
    let whole = set(Shard::whole(), 4);
    let halves = [
        set(Shard { rank: 0, world: 2 }, 2),
        set(Shard { rank: 1, world: 2 }, 2),
    ];
    assert_eq!(halves[0].batches_per_epoch(), whole.batches_per_epoch());
    for index in 0..whole.batches_per_epoch() {
        let mut joined = labels(&halves[0], index);
        joined.extend(labels(&halves[1], index));
        let mut expected = labels(&whole, index);
        joined.sort();
        expected.sort();
        assert_eq!(joined, expected, "batch {index}");
    }
}
