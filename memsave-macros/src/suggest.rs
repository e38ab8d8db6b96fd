//! "Did you mean" for misspelt names.

/// The candidate closest to `name`, when it is close enough to be a likely typo.
pub fn closest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(name, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len() / 2).max(2))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// `` `a`, `b` and `c` ``.
pub fn list<S: AsRef<str>>(names: &[S]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{}`", n.as_ref())).collect();
    match quoted.as_slice() {
        [] => "none".to_string(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {}", init.join(", "), last),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_sibling_option() {
        assert_eq!(
            closest("out_fp16", &["apply_to", "args", "out_fp32"]),
            Some("out_fp32")
        );
        assert_eq!(
            closest("aply_to", &["apply_to", "args", "out_fp32"]),
            Some("apply_to")
        );
        assert_eq!(closest("banana", &["apply_to", "args", "out_fp32"]), None);
    }

    #[test]
    fn lists_names() {
        assert_eq!(list(&["x"]), "`x`");
        assert_eq!(list(&["x", "y", "z"]), "`x`, `y` and `z`");
    }
}
