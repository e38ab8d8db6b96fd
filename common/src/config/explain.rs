//! Error text: serde's message about a key, made into one that names the key and says what to
//! write instead (the closest valid key or type, the expected type in words).

/// serde's message at `path`, with the key and, for a misspelt key or type, the closest valid
/// one. A runtime type's own check (`invalid value for `field`: ...`) is put under the key.
pub(super) fn explain(path: String, message: String) -> String {
    let key = if path == "." { String::new() } else { path };
    // The TOML deserializer adds its own "in `key`" line: the path says it already.
    let message = message
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    if let Some(rest) = message.strip_prefix("invalid value for `") {
        if let Some((field, what)) = rest.split_once("`: ") {
            let full = if key.is_empty() || key.ends_with(field) {
                key.clone()
            } else {
                format!("{key}.{field}")
            };
            return format!("`{full}`: {what}");
        }
    }
    let (what, rest) = if let Some(rest) = message.strip_prefix("unknown field `") {
        ("key", rest)
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        ("type", rest)
    } else {
        let message = message
            .replace("expected usize", "expected a non-negative integer")
            .replace("expected u64", "expected a non-negative integer")
            .replace("expected f64", "expected a number");
        return if key.is_empty() {
            message
        } else {
            format!("`{key}`: {message}")
        };
    };
    let (name, expected) = rest.split_once('`').unwrap_or((rest, ""));
    let candidates: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    let full = if what == "key" && (key == name || key.ends_with(&format!(".{name}"))) {
        key.clone()
    } else if what == "key" && !key.is_empty() {
        format!("{key}.{name}")
    } else if what == "key" {
        name.to_string()
    } else {
        format!("{key} = \"{name}\"")
    };
    let suggestion = candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(name, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len() / 3).max(2))
        .min_by_key(|(distance, _)| *distance);
    // A value of a key that is not a `type` (`weight_dtype`, `policy`, ...) is a value.
    let what = if what == "type" && !(key.is_empty() || key == "type" || key.ends_with(".type")) {
        "value"
    } else {
        what
    };
    let choices = || {
        candidates
            .iter()
            .map(|c| format!("`{c}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match suggestion {
        // A value's choices are few: all of them, beside the closest.
        Some((_, close)) if what == "value" => format!(
            "unknown {what} `{full}`; did you mean `{close}`? (one of {})",
            choices()
        ),
        Some((_, close)) => format!("unknown {what} `{full}`; did you mean `{close}`?"),
        None => format!(
            "unknown {what} `{full}`; expected one of {}",
            candidates
                .iter()
                .map(|c| format!("`{c}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
