//! The house's rules, read from the source (issue 34): no import cycle between kvprobe's
//! modules, and `unsafe` only where the crate root allows it. Each rule's checker is also run
//! on a planted graph or file, so the rule can fail.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source without comments (`//` to the end of a line, outside string literals that
/// hold `://`, as URLs do).
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| {
            let mut cut = l.len();
            let mut from = 0;
            while let Some(i) = l[from..].find("//") {
                let at = from + i;
                if at > 0 && l.as_bytes()[at - 1] == b':' {
                    from = at + 2;
                    continue;
                }
                cut = at;
                break;
            }
            &l[..cut]
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module of kvprobe's a file of `src/` belongs to, by its place: `src/FLOOR/NAME.rs` or
/// `src/FLOOR/NAME/...` is module NAME; a floor's folder that is itself a module (its name in
/// [`kvprobe::FLOORS`]: `report`, `sweep`, `peer`, `scenario`) owns its `mod.rs` and every
/// file below it that is not a module of its own (`report/junit.rs` is `junit`;
/// `scenario/connectors/tier.rs` is `scenario`); `src/error.rs` is `error`. `None` for the
/// crate roots, the binary's `cli/` and a floor's `mod.rs` that only declares its modules.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let parts: Vec<String> =
        rel.components().map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    let modules: BTreeSet<&str> = kvprobe::FLOORS.iter().flat_map(|(_, ms)| ms.iter().copied()).collect();
    match parts.as_slice() {
        [one] => (one == "error").then(|| one.clone()),
        [top, ..] if top == "cli" => None,
        [top, rest @ ..] => {
            if matches!(top.as_str(), "peer" | "scenario")
                || rest.len() == 1 && rest[0] == "mod" && modules.contains(top.as_str())
            {
                return Some(top.clone());
            }
            if rest[0] == "mod" {
                return None;
            }
            if modules.contains(rest[0].as_str()) {
                Some(rest[0].clone())
            } else {
                modules.contains(top.as_str()).then(|| top.clone())
            }
        }
        [] => None,
    }
}

/// The module a path `crate::A::B...` names: `B` where `A` is a floor's folder (or the
/// `report` module holding `junit` and `dump`) and `B` one of its modules, else `A` when it
/// is a module (a name re-exported at the crate root), else none.
fn named_module(a: &str, b: Option<&str>, modules: &BTreeSet<&str>, floors: &BTreeSet<&str>) -> Option<String> {
    match b {
        Some(b) if (floors.contains(a) || a == "report") && modules.contains(b) => Some(b.to_string()),
        _ => modules.contains(a).then(|| a.to_string()),
    }
}

/// Module → the other modules it names as `crate::NAME` or `crate::FLOOR::NAME`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let re = regex::Regex::new(r"crate::([a-z_][a-z0-9_]*)(?:::([a-z_][a-z0-9_]*))?").unwrap();
    let modules: BTreeSet<&str> = kvprobe::FLOORS.iter().flat_map(|(_, ms)| ms.iter().copied()).collect();
    let floors: BTreeSet<&str> = kvprobe::FLOORS.iter().map(|(f, _)| *f).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(m) = module_of(src, f) else { continue };
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        let e = g.entry(m.clone()).or_default();
        for c in re.captures_iter(&code) {
            if let Some(n) = named_module(&c[1], c.get(2).map(|x| x.as_str()), &modules, &floors)
                && n != m
            {
                e.insert(n);
            }
        }
    }
    g
}

/// A cycle of `g` as the modules along it (first = last), or `None`.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first search with colours: 1 on the path, 2 done.
    fn dfs(
        v: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        colour: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        colour.insert(v.to_string(), 1);
        path.push(v.to_string());
        for w in g.get(v).into_iter().flatten() {
            match colour.get(w.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = path.iter().position(|x| x == w).unwrap();
                    let mut c = path[at..].to_vec();
                    c.push(w.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = dfs(w, g, colour, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        colour.insert(v.to_string(), 2);
        None
    }
    let mut colour = BTreeMap::new();
    for v in g.keys() {
        if colour.get(v.as_str()).copied().unwrap_or(0) == 0
            && let Some(c) = dfs(v, g, &mut colour, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = module_graph(&src);
    assert!(g.len() >= 30 && g.contains_key("scenario") && g["run"].contains("pool"), "{g:?}");
    assert_eq!(find_cycle(&g), None, "an import cycle between kvprobe's modules");
    // The checker finds a planted cycle: the report naming the run (report → run → report).
    let mut planted = g.clone();
    planted.get_mut("report").unwrap().insert("run".into());
    let c = find_cycle(&planted).expect("the planted cycle is found");
    assert!(c.contains(&"report".to_string()) && c.first() == c.last(), "{c:?}");
}

#[test]
fn the_report_depends_on_nothing_that_drives_a_run() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = module_graph(&src);
    // Everything the report reaches, directly or not.
    let mut seen = BTreeSet::new();
    let mut todo = vec!["report".to_string()];
    while let Some(v) = todo.pop() {
        for w in &g[&v] {
            if seen.insert(w.clone()) {
                todo.push(w.clone());
            }
        }
    }
    for driver in ["run", "serve", "ab", "bench", "scenario", "peer", "report_check", "bundle", "show"] {
        assert!(g.contains_key(driver), "{driver} is no module of the graph (renamed?): the check would hold vacuously");
        assert!(!seen.contains(driver), "report reaches {driver}: {seen:?}");
    }
}

#[test]
fn unsafe_code_is_denied_at_the_crate_roots_and_every_block_says_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let main = std::fs::read_to_string(root.join("src/main.rs")).unwrap();
    assert!(lib.contains("#![deny(unsafe_code)]") && main.contains("#![deny(unsafe_code)]"));
    assert!(lib.contains("#![deny(clippy::undocumented_unsafe_blocks)]"));
    // The modules allowed: FFI and OS calls, each allow written on its `mod` line in a
    // folder's mod.rs.
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut allowed = BTreeSet::new();
    for f in files.iter().filter(|f| f.ends_with("mod.rs") || f.ends_with("lib.rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for w in lines.windows(2) {
            if w[0].starts_with("#[allow(unsafe_code)]") {
                allowed.insert(w[1].strip_prefix("pub mod ").expect("an allow on a module").trim_end_matches(';').to_string());
            }
        }
    }
    let allowed: BTreeSet<&str> = allowed.iter().map(String::as_str).collect();
    assert_eq!(allowed, BTreeSet::from(["child", "cuda", "hostmem", "interrupt", "nixl", "process"]));
}

/// The `KVPROBE_TEST_*` string literals of `text`'s code (comments left out).
fn test_hook_literals(text: &str) -> Vec<String> {
    let re = regex::Regex::new(r#""(KVPROBE_TEST_[A-Z_]*)"#).unwrap();
    re.captures_iter(&code_of(text)).map(|c| c[1].to_string()).collect()
}

#[test]
fn every_test_hook_is_named_in_the_registry_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let registry = src.join("sys/test_hooks.rs");
    for f in &files {
        if *f != registry {
            let found = test_hook_literals(&std::fs::read_to_string(f).unwrap());
            assert!(found.is_empty(), "{}: names {found:?} outside src/sys/test_hooks.rs", f.display());
        }
    }
    // The registry lists each name it defines, and documents each in its table.
    let text = std::fs::read_to_string(&registry).unwrap();
    let defined: BTreeSet<String> = test_hook_literals(&text).into_iter().collect();
    let listed: BTreeSet<String> = kvprobe::test_hooks::ALL.iter().map(|s| s.to_string()).collect();
    assert_eq!(defined, listed);
    for name in &listed {
        let stem = name.trim_end_matches('_');
        assert!(text.lines().any(|l| l.starts_with("//! | `") && l.contains(stem)), "{name} not in the table");
    }
    // The checker sees a planted literal.
    assert_eq!(test_hook_literals("let v = std::env::var(\"KVPROBE_TEST_NEW\"); // \"KVPROBE_TEST_NOT\""), ["KVPROBE_TEST_NEW"]);
}

#[test]
fn main_rs_is_thin() {
    // Parse, set the environment, dispatch, exit: the subcommands live in src/cli/.
    let main = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/main.rs")).unwrap();
    assert!(main.lines().count() <= 250, "src/main.rs has {} lines", main.lines().count());
    assert!(main.contains("mod cli;"));
}

/// The imports of `g` that run up a floor of `floors`: (module, module it imports).
fn upward(g: &BTreeMap<String, BTreeSet<String>>, floors: &[(&str, &[&str])]) -> Vec<(String, String)> {
    let floor: BTreeMap<&str, usize> =
        floors.iter().enumerate().flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i))).collect();
    let mut up = Vec::new();
    for (a, bs) in g {
        for b in bs {
            if floor[a.as_str()] < floor[b.as_str()] {
                up.push((a.clone(), b.clone()));
            }
        }
    }
    up
}

#[test]
fn every_module_stands_on_a_floor_and_imports_nothing_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut g = module_graph(&src);
    g.remove("cli"); // the binary's command line stands on every floor
    let floors = kvprobe::FLOORS;
    let assigned: Vec<&str> = floors.iter().flat_map(|(_, ms)| ms.iter().copied()).collect();
    let unique: BTreeSet<&str> = assigned.iter().copied().collect();
    assert_eq!(unique.len(), assigned.len(), "a module on two floors: {assigned:?}");
    let modules: BTreeSet<&str> = g.keys().map(String::as_str).collect();
    assert_eq!(modules, unique, "every module of src/ on exactly one floor of kvprobe::FLOORS");
    assert_eq!(upward(&g, floors), Vec::<(String, String)>::new(), "imports running up a floor");
    // A planted upward import is found: the fingerprint (core) naming the pool (mem).
    let mut planted = g.clone();
    planted.get_mut("fingerprint").unwrap().insert("pool".into());
    assert_eq!(upward(&planted, floors), [("fingerprint".to_string(), "pool".to_string())]);
}

#[test]
fn each_floor_is_a_folder_holding_its_modules() {
    // Only lib.rs, main.rs and error.rs at the top of src/; each module's file in the folder
    // of its floor; every file of src/ (but the roots, the binary's cli/ and the floors' own
    // mod.rs) belongs to a module of FLOORS.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let top: BTreeSet<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
        .collect();
    assert_eq!(top, BTreeSet::from(["error.rs".to_string(), "lib.rs".to_string(), "main.rs".to_string()]));
    let floor_of: BTreeMap<&str, &str> = kvprobe::FLOORS.iter().flat_map(|(f, ms)| ms.iter().map(move |m| (*m, *f))).collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = BTreeSet::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
        match module_of(&src, f) {
            Some(m) if m == "error" => {}
            Some(m) => {
                assert_eq!(first, floor_of[m.as_str()], "{}: module {m} outside its floor's folder", rel.display());
                found.insert(m);
            }
            None => assert!(
                matches!(rel.to_str().unwrap(), "lib.rs" | "main.rs") || first == "cli" || rel.ends_with("mod.rs"),
                "{}: a file of no module",
                rel.display()
            ),
        }
    }
    found.insert("error".into());
    assert_eq!(found.len(), floor_of.len(), "modules with a file: {found:?}");
}

#[test]
fn the_architecture_page_names_every_floor_and_module() {
    // docs/ARCHITECTURE.md's table follows kvprobe::FLOORS: a module added, moved or renamed
    // without the page fails here.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let table: Vec<&str> = page.lines().filter(|l| l.starts_with("| ")).collect();
    for (floor, modules) in kvprobe::FLOORS {
        let row = table
            .iter()
            .find(|l| l.starts_with(&format!("| {floor} |")))
            .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md has no row for the floor {floor}"));
        assert!(row.contains(&format!("`src/{floor}/`")), "{floor}: {row}");
        for m in *modules {
            assert!(row.contains(&format!("`{m}`")), "docs/ARCHITECTURE.md: the {floor} row does not name {m}: {row}");
        }
    }
}
