//! How the crate's top-level modules depend on each other, read from the
//! `crate::` paths in `src/` (comments left out), how long its functions
//! are, and how long the Rust files of the crate, its tests, benchmarks and
//! examples are. Run it alone with `cargo nextest run --test architecture
//! --no-capture`; it prints the graph and the functions over the limit.
//!
//! The goal is layers without back-edges: config (plain validated data, a
//! leaf), then the outbox contract, envelope and database helpers, then
//! sources and sinks, then the pipeline, then the operations and the CLI. No
//! module may lie on a dependency cycle, and config may import only modules
//! that import nothing from the crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The layers, lowest first. A module imports modules of its own layer or
/// of the layers below it, never above; within a layer the cycle test keeps
/// the order, and sources and sinks never import each other.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves: configuration and small shared values",
        &["backoff", "config", "errors", "shutdown", "sql"],
    ),
    (
        "the outbox contract, envelope, database, replication client, telemetry",
        &[
            "db",
            "dead_letter",
            "envelope",
            "outbox",
            "replication",
            "telemetry",
        ],
    ),
    ("sources and sinks", &["sink", "source"]),
    ("the pipeline and its simulation", &["relay", "sim"]),
    ("operator commands", &["ops"]),
    ("the command line", &["cli"]),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// The top-level module names `crate::` paths in `code` refer to.
fn referenced(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::b, c, d::{e, f}}`: the first segment of each
                // top-level item.
                let mut depth = 0;
                let mut item = String::new();
                for ch in group.chars() {
                    match ch {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            out.extend(first_segment(&item));
                            item.clear();
                            continue;
                        }
                        _ => {}
                    }
                    if depth == 0 {
                        item.push(ch);
                    }
                }
                out.extend(first_segment(&item));
            } else {
                out.extend(first_segment(rest));
            }
        }
    }
    out
}

fn first_segment(path: &str) -> Option<String> {
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

fn module_graph() -> Graph {
    let files = sources();
    let modules: BTreeSet<String> = files
        .iter()
        .map(|(file, _)| top_module(file))
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut graph = Graph::new();
    for (file, code) in &files {
        let top = top_module(file);
        if !modules.contains(&top) {
            continue; // lib.rs, main.rs
        }
        let targets = graph.entry(top.clone()).or_default();
        for m in referenced(code) {
            if m != top && modules.contains(&m) {
                targets.insert(m);
            }
        }
    }
    graph
}

/// The top-level module a file under `src/` belongs to.
fn top_module(file: &str) -> String {
    let first = Path::new(file).components().next().unwrap().as_os_str();
    let first = first.to_string_lossy();
    first.strip_suffix(".rs").unwrap_or(&first).to_owned()
}

/// Tarjan's strongly connected components; only those with a cycle.
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn the_reference_reader_sees_groups_and_skips_comments() {
    let code = "use crate::{config::Config, db, outbox::{A, B}};\n\
                // crate::relay is only mentioned\n\
                let x = crate::sink::make();";
    let got: Vec<String> = referenced(code).into_iter().collect();
    assert_eq!(got, ["config", "db", "outbox", "sink"]);
}

#[test]
fn the_cycle_finder_sees_a_cycle_and_only_it() {
    let mut graph = Graph::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        graph.entry(from.into()).or_default().insert(to.into());
    }
    let found = cycles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].iter().collect::<Vec<_>>(), ["a", "b", "c"]);
}

fn print(graph: &Graph) {
    for (from, to) in graph {
        println!(
            "{from} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
}

#[test]
fn no_dependency_cycles_between_modules() {
    let graph = module_graph();
    print(&graph);
    let components = cycles(&graph);
    assert!(
        components.is_empty(),
        "these modules depend on each other in a cycle: {components:?}; depend downwards only (config, then outbox/envelope/db, then sources and sinks, then the pipeline, then operations and the CLI)"
    );
}

#[test]
fn modules_import_only_their_layer_and_those_below() {
    let graph = module_graph();
    let unplaced: Vec<&String> = graph.keys().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "{unplaced:?} belong to no layer: add each to LAYERS in tests/architecture.rs"
    );
    let upward: Vec<String> = graph
        .iter()
        .flat_map(|(from, tos)| tos.iter().map(move |to| (from, to)))
        .filter(|(from, to)| layer_of(to) > layer_of(from))
        .map(|(from, to)| {
            format!(
                "{from} -> {to} ({} imports {})",
                LAYERS[layer_of(from).unwrap()].0,
                LAYERS[layer_of(to).unwrap()].0
            )
        })
        .collect();
    assert!(
        upward.is_empty(),
        "imports from a higher layer: {upward:?}; move what both need down a layer"
    );
    for (a, b) in [("source", "sink"), ("sink", "source")] {
        assert!(
            !graph.get(a).is_some_and(|to| to.contains(b)),
            "{a} imports {b}: sources and sinks never import each other"
        );
    }
}

#[test]
fn config_is_a_leaf() {
    let graph = module_graph();
    let leaves: BTreeSet<&String> = graph
        .iter()
        .filter(|(_, to)| to.is_empty())
        .map(|(m, _)| m)
        .collect();
    let config = &graph["config"];
    let above: Vec<_> = config.iter().filter(|m| !leaves.contains(m)).collect();
    assert!(
        above.is_empty(),
        "config imports {above:?}, which import more of the crate; configuration is plain validated data: move the value type it needs into config (or a leaf module)"
    );
}

/// The longest a function may be, in lines from `fn` to its closing brace,
/// unless a `// long:` comment above it gives the reason.
const MAX_FUNCTION_LINES: usize = 80;

/// Functions over the limit without a `// long:` reason, as `(file, name)`
/// relative to `src/`: work left, which may only shrink.
const KNOWN_LONG_FUNCTIONS: &[(&str, &str)] = &[];

/// `code` with comments, strings and character literals blanked (newlines
/// kept), so braces and `fn` can be found by scanning.
fn code_only(code: &str) -> String {
    let chars: Vec<char> = code.chars().collect();
    let mut out = String::with_capacity(code.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let start = i;
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !chars[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            i = j + 1;
            while i < chars.len() {
                if chars[i] == '"' && (0..hashes).all(|h| chars.get(i + 1 + h) == Some(&'#')) {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            i += 2;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3;
        } else {
            out.push(c);
            i += 1;
            continue;
        }
        let end = i.min(chars.len());
        out.extend(chars[start..end].iter().map(|&c| blank(c)));
    }
    out
}

/// `(name, first line, lines)` of every function with a body in `code`.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let clean = code_only(code);
    let bytes = clean.as_bytes();
    let line_at = |at: usize| clean[..at].matches('\n').count();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = clean[from..].find("fn ").map(|a| a + from) {
        from = at + 3;
        let word_start =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        if !word_start {
            continue;
        }
        let name: String = clean[at + 3..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue; // `fn(..)` pointer types
        }
        let Some(open) = clean[at..].find(['{', ';']).map(|o| o + at) else {
            continue;
        };
        if bytes[open] == b';' {
            continue; // a declaration without a body
        }
        let mut depth = 0;
        let mut close = open;
        for (i, b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let first = line_at(at);
        found.push((name, first, line_at(close) - first + 1));
    }
    found
}

/// Whether the lines above line `first` (its doc comments and attributes)
/// hold a `// long:` reason.
fn has_reason(lines: &[&str], first: usize) -> bool {
    lines[..first]
        .iter()
        .rev()
        .map(|l| l.trim_start())
        .take_while(|l| l.starts_with("//") || l.starts_with("#["))
        .any(|l| l.starts_with("// long:"))
}

/// Every `.rs` file under `src/`, as (path relative to `src/`, text).
fn sources() -> Vec<(String, String)> {
    rust_files("src")
}

/// Every `.rs` file under `folder` of the package: (path relative to the
/// folder, its text), sorted by path.
fn rust_files(folder: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(folder);
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let file = path.strip_prefix(&root).unwrap().to_string_lossy();
                out.push((file.into_owned(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn long_functions() -> Vec<(String, String, usize)> {
    let mut out = Vec::new();
    for (file, code) in sources() {
        let lines: Vec<&str> = code.lines().collect();
        for (name, first, len) in functions(&code) {
            if len > MAX_FUNCTION_LINES && !has_reason(&lines, first) {
                out.push((file.clone(), name, len));
            }
        }
    }
    out.sort();
    out
}

/// The most lines a Rust file may have, in the crate and in what is built
/// beside it (tests, benchmarks, examples): past it, split by topic.
const MAX_FILE_LINES: usize = 600;

/// The folders [`MAX_FILE_LINES`] holds for.
const LIMITED_FOLDERS: &[&str] = &["src", "tests", "benches", "examples"];

#[test]
fn files_stay_under_600_lines() {
    let long: Vec<(String, usize)> = LIMITED_FOLDERS
        .iter()
        .flat_map(|folder| {
            rust_files(folder)
                .into_iter()
                .map(move |(file, code)| (format!("{folder}/{file}"), code.lines().count()))
        })
        .filter(|(_, n)| *n > MAX_FILE_LINES)
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines: {long:?}; split each by topic before it becomes the place everything goes"
    );
}

#[test]
fn the_function_reader_skips_strings_comments_and_declarations() {
    let code = "fn a() {\n    let s = \"}\"; // }\n    let c = '}';\n}\ntrait T { fn b(&self); }\nfn c<'a>(x: &'a str) -> &'a str {\n    r#\"{\"#;\n    x\n}\n";
    let got: Vec<(String, usize, usize)> = functions(code);
    assert_eq!(got, [("a".to_owned(), 0, 4), ("c".to_owned(), 5, 4)]);
}

#[test]
fn functions_fit_on_a_screen() {
    let long = long_functions();
    for (file, name, len) in &long {
        println!("{len:>4} {file} {name}");
    }
    let known: BTreeSet<(String, String)> = KNOWN_LONG_FUNCTIONS
        .iter()
        .map(|(f, n)| ((*f).to_owned(), (*n).to_owned()))
        .collect();
    let found: BTreeSet<(String, String)> = long
        .iter()
        .map(|(f, n, _)| (f.clone(), n.clone()))
        .collect();
    let new: Vec<_> = found.difference(&known).collect();
    let gone: Vec<_> = known.difference(&found).collect();
    assert!(
        new.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines: {new:?}; split them, or say why not in a `// long:` comment above"
    );
    assert!(
        gone.is_empty(),
        "now short enough (or explained), take them off KNOWN_LONG_FUNCTIONS: {gone:?}"
    );
}
