//! README.md's fenced code blocks and the command lines in them, so the README's examples are
//! run by tests as written there (not from copies that could drift).
//!
//! Shared by `tests/readme.rs` (runs the examples against the binary and a live server) and
//! the binary's own unit tests (`src/readme_commands.rs`: every `kvgate` command line parses).

#![allow(dead_code)] // each includer uses a different part

/// The README's text.
pub fn readme() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("reading {path}: {error}"))
}

/// One fenced code block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The info string after the opening fence (`sh`, `python`, `console`, …).
    pub lang: String,
    /// The lines between the fences, each ending in `\n`.
    pub body: String,
    /// 1-based line of the opening fence, for messages.
    pub line: usize,
}

/// Every ```-fenced block of `markdown`, in order. An unclosed fence is a broken README.
pub fn blocks(markdown: &str) -> Vec<Block> {
    let mut found = Vec::new();
    let mut open: Option<Block> = None;
    for (index, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) => {
                open = Some(Block {
                    lang: info.trim().to_owned(),
                    body: String::new(),
                    line: index + 1,
                })
            }
            (Some(_), Some(_)) => found.extend(open.take()),
            (Some(block), None) => {
                block.body.push_str(line);
                block.body.push('\n');
            }
            (None, None) => {}
        }
    }
    if let Some(block) = open {
        panic!("README.md:{}: code block is never closed", block.line);
    }
    found
}

/// The blocks in `lang`.
pub fn blocks_in(markdown: &str, lang: &str) -> Vec<Block> {
    blocks(markdown)
        .into_iter()
        .filter(|block| block.lang == lang)
        .collect()
}

/// The one block in `lang` whose text contains `marker`; a README without exactly one is a
/// failure, so a test never silently stops checking an example.
pub fn the_block(markdown: &str, lang: &str, marker: &str) -> Block {
    let mut matching: Vec<Block> = blocks_in(markdown, lang)
        .into_iter()
        .filter(|block| block.body.contains(marker))
        .collect();
    assert_eq!(
        matching.len(),
        1,
        "README.md must have exactly one ```{lang} block containing {marker:?}"
    );
    matching.remove(0)
}

/// The shell command lines of a block: `\`-continued lines joined, comments and blank lines
/// dropped. In a `console` block only `$ `-prompted lines are commands (the rest is output).
pub fn commands(block: &Block) -> Vec<String> {
    let console = block.lang == "console";
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.body.lines() {
        let line = if current.is_empty() {
            let trimmed = line.trim_start();
            if console {
                match trimmed.strip_prefix("$ ") {
                    Some(command) => command,
                    None => continue,
                }
            } else if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            } else {
                trimmed
            }
        } else {
            line.trim()
        };
        match line.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head.trim_end());
                current.push(' ');
            }
            None => {
                current.push_str(line);
                commands.push(std::mem::take(&mut current));
            }
        }
    }
    if !current.is_empty() {
        commands.push(current);
    }
    commands
}

/// The output lines a `console` block shows after its first command (and its `\`-continued
/// lines).
pub fn console_output(block: &Block) -> String {
    let mut lines = block.body.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("$ ") {
            let mut continued = line.trim_end().ends_with('\\');
            while continued {
                continued = lines
                    .next()
                    .is_some_and(|next| next.trim_end().ends_with('\\'));
            }
            break;
        }
    }
    lines.map(|line| format!("{line}\n")).collect()
}
