//! Hand-written notes in docs/benchmarks.md that a full run keeps: what a
//! run's figures mean, where the time goes, why a goal is not met. The
//! generated text has a slot for each ([`slot`]); when the file is written
//! again, each slot takes the block of the same name from the file being
//! replaced ([`keep`]), markers included, so that analysis written by hand is
//! not lost to the next `cargo xtask bench`. When the old file's notes
//! cannot all be carried over (a malformed marker, a block with no slot),
//! the bench leaves the file alone and writes the run beside it. A kept
//! block still quotes the figures of the run it was written for: the bench
//! says which blocks it kept, to be read again against the new figures.

use std::fmt::Write as _;

const OPEN: &str = "<!-- notes: ";
const CLOSE: &str = "<!-- /notes: ";
const END: &str = " -->";

/// The (empty) block that marks where the notes named `name` go: two lines.
pub fn slot(md: &mut String, name: &str) {
    let _ = writeln!(md, "{OPEN}{name}{END}\n{CLOSE}{name}{END}");
}

/// What [`keep`] made: the file to write, and the names of the blocks it
/// carried over with text in them.
pub struct Kept {
    pub md: String,
    pub kept: Vec<String>,
}

/// `new` with each slot's block replaced by the block of the same name in
/// `old` (the file being replaced). A slot `old` has no block for stays
/// empty. Refused, saying why, when `old`'s notes cannot all be carried
/// over: a marker that is not part of a well-formed block (unclosed, an odd
/// name, a marker inside a block), a name used twice, or a block with text
/// and no slot in `new`. The caller then leaves the file alone.
pub fn keep(old: &str, new: &str) -> Result<Kept, String> {
    let old_parts = parse(old).map_err(|e| format!("the file being replaced: {e}"))?;
    let new_parts = parse(new).map_err(|e| format!("the generated text: {e}"))?;
    let old_blocks: Vec<(&str, &str, &str)> = old_parts
        .iter()
        .filter_map(|p| match *p {
            Part::Block { name, block, body } => Some((name, block, body)),
            Part::Text(_) => None,
        })
        .collect();
    let slots: Vec<&str> = new_parts
        .iter()
        .filter_map(|p| match *p {
            Part::Block { name, .. } => Some(name),
            Part::Text(_) => None,
        })
        .collect();
    let orphans: Vec<&str> = old_blocks
        .iter()
        .filter(|(name, _, body)| !slots.contains(name) && !body.trim().is_empty())
        .map(|(name, _, _)| *name)
        .collect();
    if !orphans.is_empty() {
        return Err(format!("notes {orphans:?} have no place in the generated text"));
    }
    let mut md = String::with_capacity(new.len() + old.len());
    let mut kept = Vec::new();
    for part in &new_parts {
        match *part {
            Part::Text(t) => md.push_str(t),
            Part::Block { name, block, .. } => match old_blocks.iter().find(|(n, _, _)| *n == name) {
                Some((_, old_block, body)) => {
                    if !body.trim().is_empty() {
                        kept.push(name.to_string());
                    }
                    md.push_str(old_block);
                }
                None => md.push_str(block),
            },
        }
    }
    Ok(Kept { md, kept })
}

#[derive(Clone, Copy)]
enum Part<'a> {
    Text(&'a str),
    /// `block` with its markers, `body` between them.
    Block {
        name: &'a str,
        block: &'a str,
        body: &'a str,
    },
}

/// `s` cut into text and blocks, in order; an error names the first line
/// where a marker is not part of a well-formed block.
fn parse(s: &str) -> Result<Vec<Part<'_>>, String> {
    let line = |at: usize| s[..at].matches('\n').count() + 1;
    let mut parts = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    let mut at = 0;
    while let Some(found) = s[at..].find(OPEN) {
        let start = at + found;
        if let Some(stray) = s[at..start].find(CLOSE) {
            return Err(format!(
                "line {}: a closing marker without its opening one",
                line(at + stray)
            ));
        }
        let name_start = start + OPEN.len();
        let name = s[name_start..]
            .split_once(END)
            .map(|(n, _)| n)
            .filter(|n| {
                !n.is_empty()
                    && n.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
            .ok_or_else(|| {
                format!(
                    "line {}: a marker whose name is not letters, digits, '-' or '_'",
                    line(start)
                )
            })?;
        if names.contains(&name) {
            return Err(format!("line {}: a second block named {name:?}", line(start)));
        }
        let body_start = name_start + name.len() + END.len();
        let close = format!("{CLOSE}{name}{END}");
        let body_end = body_start
            + s[body_start..]
                .find(&close)
                .ok_or_else(|| format!("line {}: block {name:?} is never closed", line(start)))?;
        let body = &s[body_start..body_end];
        if let Some(inner) = body.find(OPEN).or_else(|| body.find(CLOSE)) {
            return Err(format!(
                "line {}: a marker inside block {name:?}",
                line(body_start + inner)
            ));
        }
        let end = body_end + close.len();
        parts.push(Part::Text(&s[at..start]));
        parts.push(Part::Block {
            name,
            block: &s[start..end],
            body,
        });
        names.push(name);
        at = end;
    }
    if let Some(stray) = s[at..].find(CLOSE) {
        return Err(format!(
            "line {}: a closing marker without its opening one",
            line(at + stray)
        ));
    }
    parts.push(Part::Text(&s[at..]));
    Ok(parts)
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

    fn with_notes(md: &str) -> String {
        md.replace(
            "<!-- notes: analysis -->\n",
            "<!-- notes: analysis -->\nWhere the time goes: 0.86x.\n",
        )
        .replace(
            "<!-- notes: about -->\n",
            "<!-- notes: about -->\nOne full run.\n",
        )
    }

    #[test]
    fn a_new_run_keeps_the_hand_written_blocks_around_its_new_figures() {
        let old = with_notes(&generated()).replace("figures A", "figures OLD");
        let Kept { md, kept } = keep(&old, &generated()).unwrap();
        assert_eq!(md, with_notes(&generated()));
        assert_eq!(kept, ["about", "analysis"]);
        // Kept again by the run after: nothing is lost, doubled or moved.
        assert_eq!(keep(&md, &generated()).unwrap().md, md);
    }

    #[test]
    fn slots_without_notes_stay_empty() {
        let Kept { md, kept } = keep("no markers at all", &generated()).unwrap();
        assert_eq!(md, generated());
        assert!(kept.is_empty());
        // An empty block without a slot is no loss.
        let old = "<!-- notes: gone -->\n<!-- /notes: gone -->\n";
        assert_eq!(keep(old, &generated()).unwrap().md, generated());
    }

    #[test]
    fn notes_that_cannot_all_be_kept_refuse_the_write() {
        let refused = |old: &str, why: &str| {
            let e = keep(old, &generated())
                .err()
                .unwrap_or_else(|| panic!("kept {old:?}"));
            assert!(e.contains(why), "{old:?}: {e}");
        };
        refused(
            "<!-- notes: gone -->\nold analysis\n<!-- /notes: gone -->\n",
            "no place",
        );
        refused(
            "x\n<!-- notes: about -->\nhalf a note\n",
            "line 2: block \"about\" is never closed",
        );
        refused("<!-- notes: about-->\ntext\n<!-- /notes: about -->\n", "name");
        refused("<!-- notes: a b -->\ntext\n<!-- /notes: a b -->\n", "name");
        refused(
            "<!-- notes: about -->\nsee <!-- notes: analysis -->\n<!-- /notes: about -->\n",
            "a marker inside block \"about\"",
        );
        refused(
            "<!-- notes: about -->\nt\n<!-- /notes: analysis -->\n<!-- /notes: about -->\n",
            "a marker inside",
        );
        refused(
            "<!-- notes: about -->\na\n<!-- /notes: about -->\n<!-- notes: about -->\nb\n<!-- /notes: about -->\n",
            "a second block",
        );
        refused(
            "text\n<!-- /notes: about -->\n",
            "line 2: a closing marker without",
        );
    }

    #[test]
    fn the_markers_in_docs_benchmarks_md_are_well_formed_and_round_trip() {
        // The file with its blocks emptied (what the next run generates,
        // figures aside) gets its notes back, unchanged.
        let doc = include_str!("../../docs/benchmarks.md");
        let mut emptied = String::new();
        let mut names = Vec::new();
        for part in parse(doc).unwrap() {
            match part {
                Part::Text(t) => emptied.push_str(t),
                Part::Block { name, .. } => {
                    slot(&mut emptied, name);
                    // The closing marker's line end is in the next text.
                    emptied.pop();
                    names.push(name);
                }
            }
        }
        assert_eq!(names, ["about-this-run", "per-packet", "where-the-time-goes"]);
        let Kept { md, kept } = keep(doc, &emptied).unwrap();
        assert_eq!(md, doc);
        assert_eq!(kept, names);
    }
}
