//! Hand-written notes in docs/benchmarks.md that a full run keeps: what a
//! run's figures mean, where the time goes, why a goal is not met. The
//! generated text has a slot for each ([`slot`]); when the file is written
//! again, each slot takes the block of the same name from the file being
//! replaced ([`keep`]), markers included, so that analysis written by hand is
//! not lost to the next `cargo xtask bench`. A kept block still quotes the
//! figures of the run it was written for: the bench says which blocks it
//! kept, to be read again against the new figures.

use std::fmt::Write as _;

const OPEN: &str = "<!-- notes: ";
const CLOSE: &str = "<!-- /notes: ";
const END: &str = " -->";

/// The (empty) block that marks where the notes named `name` go: two lines.
pub fn slot(md: &mut String, name: &str) {
    let _ = writeln!(md, "{OPEN}{name}{END}\n{CLOSE}{name}{END}");
}

/// `new` with each slot's block replaced by the block of the same name in
/// `old` (the file being replaced), and the names of the blocks kept with
/// any text in them. A slot `old` has no block for stays empty; a block of
/// `old` without a slot in `new` is dropped (returned in the second list).
pub fn keep(old: &str, new: &str) -> (String, Vec<String>, Vec<String>) {
    let mut out = String::with_capacity(new.len() + old.len());
    let mut kept = Vec::new();
    let mut rest = new;
    let mut used = Vec::new();
    while let Some(b) = next_block(rest) {
        out.push_str(b.before);
        match named(old, &b.name) {
            Some(block) => {
                if !body(block, &b.name).trim().is_empty() {
                    kept.push(b.name.clone());
                }
                out.push_str(block);
            }
            None => out.push_str(b.block),
        }
        used.push(b.name);
        rest = b.after;
    }
    out.push_str(rest);
    let mut dropped = Vec::new();
    let mut scan = old;
    while let Some(b) = next_block(scan) {
        if !used.contains(&b.name) && !body(b.block, &b.name).trim().is_empty() {
            dropped.push(b.name);
        }
        scan = b.after;
    }
    (out, kept, dropped)
}

struct Block<'a> {
    before: &'a str,
    name: String,
    /// Markers included.
    block: &'a str,
    after: &'a str,
}

/// The first whole block in `s`.
fn next_block(s: &str) -> Option<Block<'_>> {
    let start = s.find(OPEN)?;
    let name_end = start + OPEN.len() + s[start + OPEN.len()..].find(END)?;
    let name = s[start + OPEN.len()..name_end].to_string();
    let close = format!("{CLOSE}{name}{END}");
    let end = name_end + s[name_end..].find(&close)? + close.len();
    Some(Block {
        before: &s[..start],
        name,
        block: &s[start..end],
        after: &s[end..],
    })
}

/// The block named `name` in `s`, markers included.
fn named<'a>(s: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("{OPEN}{name}{END}");
    let close = format!("{CLOSE}{name}{END}");
    let start = s.find(&open)?;
    let end = start + s[start..].find(&close)? + close.len();
    Some(&s[start..end])
}

/// A block's text between its markers.
fn body<'a>(block: &'a str, name: &str) -> &'a str {
    let open = format!("{OPEN}{name}{END}");
    let close = format!("{CLOSE}{name}{END}");
    block
        .strip_prefix(open.as_str())
        .and_then(|b| b.strip_suffix(close.as_str()))
        .unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generated() -> String {
        let mut md = String::from("# Benchmarks\n\nfigures A\n\n");
        slot(&mut md, "about");
        md.push_str("\n| table |\n\n");
        slot(&mut md, "analysis");
        md.push_str("\n## Control plane\n");
        md
    }

    #[test]
    fn a_new_run_keeps_the_hand_written_blocks_around_its_new_figures() {
        let old = generated()
            .replace("figures A", "figures OLD")
            .replace(
                "<!-- notes: analysis -->\n",
                "<!-- notes: analysis -->\nWhere the time goes: 0.86x.\n",
            )
            .replace(
                "<!-- notes: about -->\n",
                "<!-- notes: about -->\nOne full run.\n",
            );
        let (md, kept, dropped) = keep(&old, &generated());
        assert!(md.contains("figures A") && !md.contains("figures OLD"), "{md}");
        assert!(
            md.contains("<!-- notes: about -->\nOne full run.\n<!-- /notes: about -->\n\n| table |"),
            "{md}"
        );
        assert!(
            md.contains("<!-- notes: analysis -->\nWhere the time goes: 0.86x.\n<!-- /notes: analysis -->\n\n## Control"),
            "{md}"
        );
        assert_eq!(kept, ["about", "analysis"]);
        assert!(dropped.is_empty());
        // Kept again by the run after: nothing is lost or doubled.
        let (again, _, _) = keep(&md, &generated());
        assert_eq!(again, md);
    }

    #[test]
    fn slots_without_notes_stay_empty_and_orphaned_notes_are_reported() {
        let (md, kept, dropped) = keep("no markers at all", &generated());
        assert_eq!(md, generated());
        assert!(kept.is_empty() && dropped.is_empty());
        let old = "<!-- notes: gone -->\nold analysis\n<!-- /notes: gone -->\n";
        let (md, kept, dropped) = keep(old, &generated());
        assert_eq!(md, generated());
        assert!(kept.is_empty());
        assert_eq!(dropped, ["gone"]);
    }

    #[test]
    fn the_notes_in_docs_benchmarks_md_survive_the_next_run() {
        // The file as the next run would generate it: the same figures, its
        // slots empty.
        let doc = include_str!("../../../../docs/benchmarks.md");
        let mut generated = String::new();
        let mut rest = doc;
        let mut names = Vec::new();
        while let Some(b) = next_block(rest) {
            generated.push_str(b.before);
            slot(&mut generated, &b.name);
            // The closing marker's line end is in `after`.
            generated.truncate(generated.len() - 1);
            names.push(b.name);
            rest = b.after;
        }
        generated.push_str(rest);
        assert_eq!(names, ["about-this-run", "per-packet", "where-the-time-goes"]);
        let (md, kept, dropped) = keep(doc, &generated);
        assert_eq!(md, doc);
        assert_eq!(kept, names);
        assert!(dropped.is_empty());
    }

    #[test]
    fn a_block_cut_short_is_left_as_generated() {
        // An opening marker without its closing one is not a block: the
        // generated slot stays, nothing of the old file is spliced in.
        let old = "<!-- notes: about -->\nhalf a note\n";
        let (md, kept, _) = keep(old, &generated());
        assert_eq!(md, generated());
        assert!(kept.is_empty());
    }
}
