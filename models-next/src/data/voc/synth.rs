//! A small synthetic data set in Pascal VOC's format, so that everything runs offline: JPEG
//! images of a few VOC classes drawn as distinct shapes and colours on a textured background,
//! the devkit's XML (small objects marked `difficult`, as VOC's annotators did), and the
//! `trainval` / `test` split lists. The same seed gives the same bytes.

use std::io::Write;
use std::path::{Path, PathBuf};

use image::codecs::jpeg::JpegEncoder;
use image::{Rgb, RgbImage};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::class_index;
use crate::detection::boxes::iou;
use crate::memsave::{Error, Result};

/// The classes drawn, each a shape and a colour.
pub const SYNTH_CLASSES: [&str; 4] = ["car", "dog", "person", "bottle"];

/// Objects narrower or shorter than this are marked difficult.
const DIFFICULT_BELOW: u32 = 18;

struct Object {
    class: usize,
    /// 0-based pixel columns `x0..x1`, rows `y0..y1`.
    rect: [u32; 4],
}

fn draw(image: &mut RgbImage, object: &Object, rng: &mut StdRng) {
    let [x0, y0, x1, y1] = object.rect;
    let (w, h) = ((x1 - x0) as f32, (y1 - y0) as f32);
    let jitter =
        |rng: &mut StdRng, c: u8| (c as i32 + rng.random_range(-12..=12)).clamp(0, 255) as u8;
    for y in y0..y1 {
        for x in x0..x1 {
            let (u, v) = ((x - x0) as f32 / w, (y - y0) as f32 / h);
            let colour = match SYNTH_CLASSES[object.class] {
                // A red body with dark windows on its upper half.
                "car" => {
                    if v < 0.45 && (u * 4.0).fract() < 0.7 && v > 0.1 {
                        Some([40, 40, 60])
                    } else {
                        Some([200, 30, 30])
                    }
                }
                // A brown ellipse.
                "dog" => ((u - 0.5).powi(2) / 0.25 + (v - 0.5).powi(2) / 0.25 <= 1.0)
                    .then_some([150, 95, 40]),
                // A blue body under a round skin-coloured head.
                "person" => {
                    if v < 0.25 {
                        ((u - 0.5).abs() < 0.3).then_some([230, 190, 150])
                    } else {
                        Some([30, 60, 210])
                    }
                }
                // A green bottle with a white label.
                _ => {
                    if (0.45..0.6).contains(&v) {
                        Some([235, 235, 235])
                    } else if v < 0.2 && (u - 0.5).abs() > 0.2 {
                        None
                    } else {
                        Some([30, 160, 60])
                    }
                }
            };
            if let Some([r, g, b]) = colour {
                image.put_pixel(x, y, Rgb([jitter(rng, r), jitter(rng, g), jitter(rng, b)]));
            }
        }
    }
}

fn background(width: u32, height: u32, rng: &mut StdRng) -> RgbImage {
    let base: [f32; 3] = [
        rng.random_range(90.0..170.0),
        rng.random_range(90.0..170.0),
        rng.random_range(90.0..170.0),
    ];
    let slope: [f32; 2] = [rng.random_range(-0.3..0.3), rng.random_range(-0.3..0.3)];
    RgbImage::from_fn(width, height, |x, y| {
        let shade = slope[0] * x as f32 + slope[1] * y as f32;
        let mut px = [0u8; 3];
        for (c, v) in px.iter_mut().enumerate() {
            *v = (base[c] + shade + rng.random_range(-20.0..20.0)).clamp(0.0, 255.0) as u8;
        }
        Rgb(px)
    })
}

fn annotation(id: &str, width: u32, height: u32, objects: &[Object]) -> String {
    let mut xml = format!(
        "<annotation>\n\t<folder>VOC2007</folder>\n\t<filename>{id}.jpg</filename>\n\t<source>\n\t\t<database>memsave synthetic VOC</database>\n\t\t<annotation>memsave</annotation>\n\t\t<image>synthetic</image>\n\t</source>\n\t<size>\n\t\t<width>{width}</width>\n\t\t<height>{height}</height>\n\t\t<depth>3</depth>\n\t</size>\n\t<segmented>0</segmented>\n"
    );
    for o in objects {
        let [x0, y0, x1, y1] = o.rect;
        let difficult = (x1 - x0).min(y1 - y0) < DIFFICULT_BELOW;
        // The devkit's convention: 1-based, inclusive.
        xml.push_str(&format!(
            "\t<object>\n\t\t<name>{}</name>\n\t\t<pose>Unspecified</pose>\n\t\t<truncated>0</truncated>\n\t\t<difficult>{}</difficult>\n\t\t<bndbox>\n\t\t\t<xmin>{}</xmin>\n\t\t\t<ymin>{}</ymin>\n\t\t\t<xmax>{}</xmax>\n\t\t\t<ymax>{}</ymax>\n\t\t</bndbox>\n\t</object>\n",
            SYNTH_CLASSES[o.class],
            difficult as u8,
            x0 + 1,
            y0 + 1,
            x1,
            y1
        ));
    }
    xml.push_str("</annotation>\n");
    xml
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `images` images to `dir/VOC2007` (`Annotations`, `JPEGImages`,
/// `ImageSets/Main/{trainval,test}.txt`; every fourth image is a test image). The set is
/// built in a temporary folder beside it and renamed into place: an existing `VOC2007` is
/// never touched (an error says so), and a failure leaves nothing half-written.
pub fn write_synthetic_voc(dir: &Path, images: usize, seed: u64) -> Result<PathBuf> {
    if images < 4 {
        return Err(Error::invalid(
            "--images",
            format!("at least 4 (3 to train, 1 to test), got {images}"),
        ));
    }
    debug_assert!(SYNTH_CLASSES.iter().all(|c| class_index(c).is_some()));
    let target = dir.join("VOC2007");
    if target.exists() {
        return Err(Error::Data(format!(
            "{}: already exists: memsave does not overwrite a data set; remove it or choose \
             another folder",
            target.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    let staging = dir.join(format!(".VOC2007.partial-{}", std::process::id()));
    let result = write_into(&staging, images, seed)
        .and_then(|()| std::fs::rename(&staging, &target).map_err(|e| io_error(&target, e)));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result.map(|()| target)
}

fn write_into(root: &Path, images: usize, seed: u64) -> Result<()> {
    let annotations = root.join("Annotations");
    let jpegs = root.join("JPEGImages");
    let lists = root.join("ImageSets").join("Main");
    for d in [&annotations, &jpegs, &lists] {
        std::fs::create_dir_all(d).map_err(|e| io_error(d, e))?;
    }
    let (mut trainval, mut test) = (String::new(), String::new());
    for i in 1..=images {
        let id = format!("{i:06}");
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
        let (width, height) = (
            rng.random_range(200..=320u32),
            rng.random_range(150..=240u32),
        );
        let mut image = background(width, height, &mut rng);
        let mut objects: Vec<Object> = Vec::new();
        let count = rng.random_range(1..=3);
        for _ in 0..count {
            for _attempt in 0..20 {
                let class = rng.random_range(0..SYNTH_CLASSES.len());
                let size = rng.random_range(16..=96u32) as f32;
                let aspect: f32 = match SYNTH_CLASSES[class] {
                    "car" => 0.55,
                    "dog" => 0.75,
                    "person" => 2.2,
                    _ => 2.6,
                };
                let (w, h) = ((size / aspect.sqrt()) as u32, (size * aspect.sqrt()) as u32);
                let (w, h) = (w.clamp(8, width - 2), h.clamp(8, height - 2));
                let x0 = rng.random_range(0..width - w);
                let y0 = rng.random_range(0..height - h);
                let rect = [x0, y0, x0 + w, y0 + h];
                let as_box = |r: &[u32; 4]| [r[0] as f32, r[1] as f32, r[2] as f32, r[3] as f32];
                if objects
                    .iter()
                    .all(|o| iou(&as_box(&o.rect), &as_box(&rect)) < 0.1)
                {
                    objects.push(Object { class, rect });
                    break;
                }
            }
        }
        for object in &objects {
            draw(&mut image, object, &mut rng);
        }
        let jpeg_path = jpegs.join(format!("{id}.jpg"));
        let file = std::fs::File::create(&jpeg_path).map_err(|e| io_error(&jpeg_path, e))?;
        let mut writer = std::io::BufWriter::new(file);
        JpegEncoder::new_with_quality(&mut writer, 90)
            .encode_image(&image)
            .map_err(|e| Error::data_file(&jpeg_path, "cannot encode the image", e))?;
        writer.flush().map_err(|e| io_error(&jpeg_path, e))?;
        let xml_path = annotations.join(format!("{id}.xml"));
        std::fs::write(&xml_path, annotation(&id, width, height, &objects))
            .map_err(|e| io_error(&xml_path, e))?;
        let list = if i % 4 == 0 { &mut test } else { &mut trainval };
        list.push_str(&id);
        list.push('\n');
    }
    for (name, text) in [("trainval.txt", &trainval), ("test.txt", &test)] {
        let path = lists.join(name);
        std::fs::write(&path, text).map_err(|e| io_error(&path, e))?;
    }
    Ok(())
}
