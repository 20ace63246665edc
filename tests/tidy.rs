//! Tidy: the repository's house rules, checked by `cargo test` (after rust-analyzer's
//! `xtask/src/tidy.rs`). [`tidy`] walks the workspace from `CARGO_MANIFEST_DIR` (skipping
//! `target/`, `dist/` and hidden directories) and reports every violation at once, each naming
//! the file (and line) and the fix. Each rule is a function over file text or paths, tested below
//! on synthetic input: it fails when the rule is broken and passes on good input.
//!
//! | rule | what it checks |
//! |---|---|
//! | [`unsafe_violations`], [`unsafe_lint_violations`] | `unsafe` only in [`UNSAFE_FILES`] (STYLE.md §5); there every `unsafe {}` and `unsafe impl` has a `// SAFETY:` comment on the lines just above, every `unsafe fn` a `# Safety` doc section; every crate root denies `unsafe_code` itself or takes the workspace's `unsafe_code = "deny"` |
//! | [`anyhow_dependency_violations`], [`anyhow_source_violations`] | no `anyhow` in the `[dependencies]` or `src/` of [`LIBRARY_CRATES`] (STYLE.md §8) |
//! | [`cpu_device_violations`] | candle's `Device::Cpu` only in [`CPU_DEVICE_FILES`], tests, benches, examples |
//! | [`architecture_path_violations`] | every repository path ARCHITECTURE.md names in backticks exists |
//! | [`ignore_violations`] | no `#[ignore]` (STYLE.md §9: hardware-dependent tests skip loudly instead) |
//! | [`docs_lint_violations`], [`crate_doc_violations`] | `missing_docs = "warn"` in `[workspace.lints.rust]`, `[lints] workspace = true` in every member, a `//!` doc at the top of every crate root |
//! | [`ordering_call_violations`] | the runtime (`src/runtime/`) calls the device's ordering and copy methods only in [`ORDERING_FILE`], where each call has a name the test hook can leave out (`tests/ordering.rs` leaves out each) |
//! | [`skip_violations`] | a skip goes through the one helper (`oogc_swapper::skip`, `python/tests/skips.py`) |
//! | [`static_state_violations`] | no `static` item in the non-test code of [`STATELESS_FILES`] (`src/dist.rs`: the ranks are a value passed down, never process-global) |
//! | [`process_exit_violations`] | no `process::exit` outside `cli/`: the library returns errors and the binary decides to exit (or `MPI_Abort`) |
//! | [`file_size_violations`] | no file of the root crate's `src/` over [`MAX_SRC_LINES`] lines, `src/runtime/mod.rs` under [`MAX_RUNTIME_MOD_LINES`] |
//! | [`markdown_link_violations`] | every relative link of the book (`docs/src/`), README.md, ARCHITECTURE.md and `docs/*.md` names a file that exists, and its `#anchor` a heading there ([`anchor`]: mdBook's and GitHub's ids); no book page links a Markdown file outside the book (mdBook would link its `.html`) |
//! | [`the_books_config_reference_is_the_generated_one`] | `docs/src/reference/config.md` is what `oogc config --reference` prints |
//! | [`runtime_facade_violations`] | `Runtime` a façade: at most [`MAX_RUNTIME_FIELDS`] fields and [`MAX_RUNTIME_PUB_METHODS`] public methods over its `impl` blocks in `src/runtime/` |
//!
//! Comments, doc comments and string literals are not code ([`code_only`]): a word in a comment
//! or a doc example (`# anyhow::Ok(())` in a doc test, which builds with the dev-dependencies)
//! breaks no rule. Test code is not library code ([`non_test_code`]): a file named `tests.rs` or
//! `*_tests.rs`, or a trailing `#[cfg(test)] mod name { .. }`, may use `anyhow` and `Device::Cpu`.

use std::path::{Path, PathBuf};

/// The files that may hold `unsafe` (STYLE.md §5), each with why. Add a file here, with its
/// reason, only with a `#![allow(unsafe_code)]` at its top and a `// SAFETY:` on every block.
const UNSAFE_FILES: &[(&str, &str)] = &[
    ("swapper/src/device/cuda.rs", "CUDA driver calls through cudarc, driver-pinned host memory"),
    ("swapper/src/nvme/uring.rs", "io_uring submission entries that point at owned buffers"),
    ("optimizer/src/simd.rs", "std::arch loads and stores, calls into #[target_feature] functions after detection"),
    ("swapper/src/huge_malloc.rs", "the oogc binary's GlobalAlloc over System, madvise and mallopt"),
    (
        "models/tests/attention_memory.rs",
        "a test binary's counting GlobalAlloc over System: the attention core's peak bytes against the plan's bound",
    ),
    (
        "models/src/hf/mmap.rs",
        "memory-maps a Hugging Face checkpoint's safetensors shards read-only for one header parse or one unit's copy",
    ),
    (
        "src/data/cache.rs",
        "memory-maps the token cache read-only (memmap2::Mmap::map: the file must not shrink while mapped)",
    ),
    (
        "src/runtime/cuda.rs",
        "turns cudarc's per-slice event tracking off when `[device] event_tracking = false` (the runtime orders its streams itself)",
    ),
    (
        "tests/device_plan.rs",
        "a counting GlobalAlloc over System: the peak bytes candle's composed backward allocates, against the device plan",
    ),
    (
        "python/src/dlpack.rs",
        "DLPack FFI: DLManagedTensor structs and Python capsules handing pinned unit memory to torch and reading tensors in place",
    ),
];

/// Crates that are libraries (relative directories; `.` is the `oogc` crate): `anyhow` only in
/// the binary (`cli/`), tests, benches and examples (STYLE.md §8).
const LIBRARY_CRATES: &[&str] = &[".", "swapper", "optimizer", "prefetch", "moe-placement", "models", "bench"];

/// Non-test files that may build candle tensors on `Device::Cpu` because their compute is the
/// CPU's by nature, each with why. Test code, `tests/`, `benches/` and `examples/` need no entry.
/// (The models' fused CPU kernels dispatch on `Tensor::device().is_cpu()` and name no device.)
const CPU_DEVICE_FILES: &[(&str, &str)] = &[
    ("src/runtime/mod.rs", "the sim device's compute is candle on this CPU, by definition"),
    (
        "src/runtime/fetch.rs",
        "`fetch_host` computes a cold MoE expert on the CPU from its host copy (the CPU-compute path of experts)",
    ),
    (
        "src/train/moe.rs",
        "a CPU-placed expert (Fiddler's placement) computes on the CPU by nature: its tokens move there",
    ),
    (
        "src/runtime/tensor.rs",
        "the sim device's memory is host memory and its compute the CPU: its buffers become CPU tensors",
    ),
    ("bench/src/probe.rs", "the compute probe times candle's CPU, the sim device's compute, for the planner"),
    (
        "cli/src/gpu_check/common.rs",
        "oogc gpu-check compares the device against the CPU (check 3's f64 oracle and CPU f32) and the sim device \
         computes on it",
    ),
];

/// Directories never walked: build outputs and hidden directories (`.git`, `.ci` holds no Rust).
const SKIP_DIRS: &[&str] = &["target", "dist"];

/// File extensions that make a backticked word in ARCHITECTURE.md a path.
const PATH_EXTENSIONS: &[&str] = &["rs", "toml", "md", "sh", "json", "py"];

// ---------------------------------------------------------------------------------------------
// Reading Rust text.

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` with comments, string literals and char literals blanked out (newlines kept, so line
/// numbers hold): what the compiler reads as code. Lifetimes stay; raw strings (`r#".."#`, `br".."`)
/// and nested block comments are understood.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < c.len() {
        let (ch, next) = (c[i], c.get(i + 1).copied());
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
        } else if ch == '"' {
            out.push(' ');
            i += 1;
            while i < c.len() {
                let x = c[i];
                out.push(blank(x));
                i += 1;
                if x == '\\' && i < c.len() {
                    out.push(blank(c[i]));
                    i += 1;
                } else if x == '"' {
                    break;
                }
            }
        } else if ch == 'r'
            && matches!(next, Some('"' | '#'))
            && (i == 0 || !is_ident(c[i - 1]) || (c[i - 1] == 'b' && (i < 2 || !is_ident(c[i - 2]))))
        {
            let mut j = i + 1;
            while c.get(j) == Some(&'#') {
                j += 1;
            }
            let hashes = j - i - 1;
            if c.get(j) != Some(&'"') {
                out.push(ch); // a raw identifier, `r#type`
                i += 1;
                continue;
            }
            // Blank up to the closing quote followed by as many `#`.
            let mut k = j + 1;
            while k < c.len() && !(c[k] == '"' && (1..=hashes).all(|h| c.get(k + h) == Some(&'#'))) {
                k += 1;
            }
            let end = (k + 1 + hashes).min(c.len());
            out.extend(c[i..end].iter().map(|&x| blank(x)));
            i = end;
        } else if ch == '\'' && next == Some('\\') {
            // An escaped char literal: '\n', '\'', '\u{..}'.
            let mut k = i + 3;
            while k < c.len() && c[k] != '\'' {
                k += 1;
            }
            let end = (k + 1).min(c.len());
            out.extend(c[i..end].iter().map(|&x| blank(x)));
            i = end;
        } else if ch == '\'' && c.get(i + 2) == Some(&'\'') {
            out.push_str("   "); // 'x'
            i += 3;
        } else {
            out.push(ch); // code, or a lifetime's quote
            i += 1;
        }
    }
    out
}

/// `code` (from [`code_only`]) without a trailing `#[cfg(test)] mod name { .. }` (blanked, lines
/// kept); all of it blank for a test file (`tests.rs`, `*_tests.rs`).
fn non_test_code(path: &str, code: &str) -> String {
    let name = path.rsplit('/').next().unwrap_or(path);
    if name == "tests.rs" || name.ends_with("_tests.rs") {
        return code.chars().map(|ch| if ch == '\n' { '\n' } else { ' ' }).collect();
    }
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = rest[at + "#[cfg(test)]".len()..].trim_start();
        let is_inline_mod = after.strip_prefix("pub ").unwrap_or(after).starts_with("mod ")
            && after.find(['{', ';']).is_some_and(|k| after.as_bytes()[k] == b'{');
        if !is_inline_mod {
            out.push_str(&rest[..at + 1]);
            rest = &rest[at + 1..];
            continue;
        }
        out.push_str(&rest[..at]);
        // Blank to the brace that closes the module.
        let open = at + rest[at..].find('{').expect("checked above");
        let mut depth = 0usize;
        let mut end = rest.len();
        for (k, b) in rest.bytes().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.extend(rest[at..end].chars().map(|ch| if ch == '\n' { '\n' } else { ' ' }));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Where `word` occurs in `code` as a whole word: (1-based line, byte offset just after it).
fn find_word(code: &str, word: &str) -> Vec<(usize, usize)> {
    code.match_indices(word)
        .filter(|&(at, _)| {
            let before = code[..at].chars().next_back();
            let after = code[at + word.len()..].chars().next();
            !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
        })
        .map(|(at, _)| (code[..at].matches('\n').count() + 1, at + word.len()))
        .collect()
}

/// The comment and attribute lines just above 1-based line `line` of `text`, nearest first.
fn lines_above(text: &str, line: usize) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    lines[..line - 1]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#["))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rule 1: `unsafe` is fenced.

/// `unsafe` outside [`UNSAFE_FILES`]; inside them, an `unsafe` block or impl without a
/// `// SAFETY:` comment on the lines just above (attributes may stand between), or an
/// `unsafe fn` without a `# Safety` doc section.
fn unsafe_violations(path: &str, text: &str) -> Vec<String> {
    let code = code_only(text);
    let fenced = UNSAFE_FILES.iter().any(|(f, _)| *f == path);
    let mut out = Vec::new();
    if !fenced {
        if let Some((line, _)) = find_word(&code, "unsafe").first() {
            out.push(format!(
                "{path}:{line}: `unsafe` outside the fenced files ({}); use a safe API, or fence the file in \
                 UNSAFE_FILES (tests/tidy.rs) with its reason",
                UNSAFE_FILES.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(", ")
            ));
        }
        if let Some((line, _)) = find_word(&code, "unsafe_code").iter().find(|&&(_, end)| {
            let head = &code[..end - "unsafe_code".len()];
            head.trim_end().trim_end_matches('(').trim_end().ends_with("allow")
        }) {
            out.push(format!("{path}:{line}: `allow(unsafe_code)` outside the fenced files"));
        }
        return out;
    }
    for (line, end) in find_word(&code, "unsafe") {
        let next = code[end..].trim_start();
        let word: String = next.chars().take_while(|&ch| is_ident(ch)).collect();
        let above = lines_above(text, line);
        if next.starts_with('{') || word == "impl" {
            if !above.iter().any(|l| l.starts_with("// SAFETY:")) {
                let what = if word == "impl" { "`unsafe impl`" } else { "`unsafe` block" };
                out.push(format!(
                    "{path}:{line}: {what} without a `// SAFETY:` comment on the line(s) just above: say why it is sound"
                ));
            }
        } else if word == "fn" && !above.iter().any(|l| l.starts_with("///") && l.contains("# Safety")) {
            out.push(format!(
                "{path}:{line}: `unsafe fn` without a `# Safety` section in its docs: state what the caller must uphold"
            ));
        }
    }
    out
}

/// A crate root that does not deny `unsafe_code`: neither `#![deny(unsafe_code)]` (or `forbid`)
/// in `root_text`, nor the workspace's `unsafe_code = "deny"` reaching it through
/// `[lints] workspace = true` in its `manifest`.
fn unsafe_lint_violations(root_path: &str, root_text: &str, manifest: &str, workspace_manifest: &str) -> Vec<String> {
    let code: String = code_only(root_text).split_whitespace().collect();
    if code.contains("#![deny(unsafe_code)]") || code.contains("#![forbid(unsafe_code)]") {
        return Vec::new();
    }
    let level = workspace_lint_level(workspace_manifest, "unsafe_code");
    if matches!(level.as_deref(), Some("deny" | "forbid")) && lints_workspace(manifest) {
        return Vec::new();
    }
    vec![format!(
        "{root_path}: `unsafe_code` is not denied: add `#![deny(unsafe_code)]`, or `[lints] workspace = true` to the \
         crate's Cargo.toml with `unsafe_code = \"deny\"` in the root's `[workspace.lints.rust]`"
    )]
}

/// The level of rustc lint `lint` in the root manifest's `[workspace.lints.rust]`
/// (`lint = "deny"` or `lint = { level = "deny", .. }`).
fn workspace_lint_level(workspace_manifest: &str, lint: &str) -> Option<String> {
    let workspace: toml::Table = workspace_manifest.parse().ok()?;
    let v = workspace.get("workspace")?.get("lints")?.get("rust")?.get(lint)?;
    v.as_str().or_else(|| v.get("level")?.as_str()).map(str::to_string)
}

/// Whether a member's `manifest` takes the workspace lints (`[lints] workspace = true`).
fn lints_workspace(manifest: &str) -> bool {
    let m: toml::Table = manifest.parse().unwrap_or_default();
    m.get("lints").and_then(|l| l.get("workspace")).and_then(|w| w.as_bool()) == Some(true)
}

// ---------------------------------------------------------------------------------------------
// Rule 2: no anyhow in library crates.

/// `anyhow` among the `[dependencies]` (or `[target.*.dependencies]`) of a library crate's
/// `manifest`; dev-dependencies may have it.
fn anyhow_dependency_violations(manifest_path: &str, manifest: &str) -> Vec<String> {
    let m: toml::Table = match manifest.parse() {
        Ok(m) => m,
        Err(e) => return vec![format!("{manifest_path}: not TOML: {e}")],
    };
    let mut tables: Vec<&toml::Value> = m.get("dependencies").into_iter().collect();
    if let Some(targets) = m.get("target").and_then(|t| t.as_table()) {
        tables.extend(targets.values().filter_map(|t| t.get("dependencies")));
    }
    if tables.iter().any(|t| t.get("anyhow").is_some()) {
        vec![format!(
            "{manifest_path}: `anyhow` in [dependencies] of a library crate: return the crate's one `thiserror` enum \
             (STYLE.md §8); anyhow belongs in [dev-dependencies] and the binary"
        )]
    } else {
        Vec::new()
    }
}

/// `anyhow` in the non-test code of a library crate's source file (comments and doc examples
/// aside).
fn anyhow_source_violations(path: &str, text: &str) -> Vec<String> {
    let code = non_test_code(path, &code_only(text));
    find_word(&code, "anyhow")
        .first()
        .map(|(line, _)| {
            format!("{path}:{line}: `anyhow` in a library crate: return the crate's `Error` (STYLE.md §8)")
        })
        .into_iter()
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rule 3: `Device::Cpu` only where CPU-only code belongs.

fn is_test_path(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    ["tests/", "benches/", "examples/"].iter().any(|d| path.starts_with(d) || path.contains(&format!("/{d}")))
        || name == "tests.rs"
        || name.ends_with("_tests.rs")
}

/// Lines of the non-test code of `text` that name `Device::Cpu`.
fn cpu_device_lines(path: &str, text: &str) -> Vec<usize> {
    let code = non_test_code(path, &code_only(text));
    code.match_indices("Device::Cpu")
        .filter(|&(at, _)| {
            !code[..at].chars().next_back().is_some_and(is_ident)
                && !code[at + "Device::Cpu".len()..].chars().next().is_some_and(is_ident)
        })
        .map(|(at, _)| code[..at].matches('\n').count() + 1)
        .collect()
}

/// `Device::Cpu` outside test code and [`CPU_DEVICE_FILES`].
fn cpu_device_violations(path: &str, text: &str) -> Vec<String> {
    let listed = CPU_DEVICE_FILES.iter().any(|(f, _)| *f == path);
    if listed || is_test_path(path) {
        return Vec::new();
    }
    cpu_device_lines(path, text)
        .first()
        .map(|line| {
            format!(
                "{path}:{line}: `Device::Cpu` in code that should run on the compute device: take the device from \
                 the caller (the runtime's compute device), or, if this code is CPU-only by nature, add the file to \
                 CPU_DEVICE_FILES (tests/tidy.rs) with why"
            )
        })
        .into_iter()
        .collect()
}

/// Entries of the `Device::Cpu` lists whose file no longer names it (or is gone): `uses(path)`
/// says whether the file's non-test code does.
fn stale_cpu_device_entries(uses: &dyn Fn(&str) -> bool) -> Vec<String> {
    CPU_DEVICE_FILES
        .iter()
        .filter(|(f, _)| !uses(f))
        .map(|(f, _)| format!("{f}: listed for `Device::Cpu` in tests/tidy.rs but names none: remove the entry"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rule 4: ARCHITECTURE.md names paths that exist.

/// A backticked word of ARCHITECTURE.md that looks like a repository path: (line, path, the
/// code map's crate source directory it may be relative to).
#[derive(Debug, PartialEq)]
struct NamedPath {
    line: usize,
    path: String,
    base: Option<String>,
}

/// The repository paths that `md` names in backticks (outside fenced code blocks). A word is a
/// path when it holds only path characters and ends with `/`, has an extension of
/// [`PATH_EXTENSIONS`], or starts with an existing top-level entry (`is_top(first component)`);
/// under a `### \`crate/\`` heading of the code map a bare Rust file name (`tier.rs`) is one
/// too, relative to that crate's `src/` (elsewhere a bare name is relative to something the
/// sentence names, and not checked). Words under `../` (outside the repository), `target/` and
/// `dist/` (build outputs) are not checked.
fn architecture_paths(md: &str, is_top: &dyn Fn(&str) -> bool) -> Vec<NamedPath> {
    let mut out = Vec::new();
    let (mut in_fence, mut in_code_map, mut base) = (false, false, None::<String>);
    let mut span: Option<(usize, String)> = None;
    for (n, line) in md.lines().enumerate() {
        let n = n + 1;
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        if span.is_none() {
            if let Some(h) = line.strip_prefix("## ") {
                in_code_map = h.trim() == "Code map";
                base = None;
            } else if let Some(h) = line.strip_prefix("### ") {
                base = None;
                if in_code_map {
                    let first = h.split('`').nth(1).unwrap_or("");
                    if let Some(dir) = first.strip_suffix('/') {
                        base = Some(if dir == "src" { "src/".into() } else { format!("{dir}/src/") });
                    }
                }
            }
        }
        // Inline code spans may run over a line break.
        for (k, piece) in line.split('`').enumerate() {
            if k > 0 {
                span = match span.take() {
                    None => Some((n, String::new())),
                    Some((at, word)) => {
                        if let Some(p) = as_repo_path(&word, base.is_some(), is_top) {
                            out.push(NamedPath { line: at, path: p, base: base.clone() });
                        }
                        None
                    }
                };
            }
            if let Some((_, word)) = span.as_mut() {
                word.push_str(piece);
            }
        }
        if let Some((_, word)) = span.as_mut() {
            word.push(' ');
        }
    }
    out
}

fn as_repo_path(word: &str, in_crate_section: bool, is_top: &dyn Fn(&str) -> bool) -> Option<String> {
    let w = word.trim();
    if w.is_empty() || !w.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c)) {
        return None;
    }
    if ["../", "target/", "dist/", "./"].iter().any(|p| w.starts_with(p)) || !w.chars().any(|c| c.is_alphanumeric()) {
        return None;
    }
    let last = w.trim_end_matches('/').rsplit('/').next().unwrap_or(w);
    let has_ext = last.rsplit_once('.').is_some_and(|(stem, ext)| !stem.is_empty() && PATH_EXTENSIONS.contains(&ext));
    let first = w.split('/').next().unwrap_or(w);
    let looks = if w.contains('/') {
        w.ends_with('/') || has_ext || is_top(first)
    } else {
        in_crate_section && last.ends_with(".rs")
    };
    looks.then(|| w.to_string())
}

/// Each path of [`architecture_paths`] that does not exist (`exists(relative path)`), tried from
/// the repository root and, in the code map, from the crate's `src/`.
fn architecture_path_violations(md: &str, exists: &dyn Fn(&str) -> bool) -> Vec<String> {
    architecture_paths(md, &|first| exists(first))
        .into_iter()
        .filter(|p| !exists(&p.path) && !p.base.as_ref().is_some_and(|b| exists(&format!("{b}{}", p.path))))
        .map(|p| {
            let also = p.base.as_ref().map_or(String::new(), |b| format!(" (nor does {b}{})", p.path));
            format!(
                "ARCHITECTURE.md:{}: names `{}`, which does not exist{also}: fix the path or the page",
                p.line, p.path
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rule 5: no #[ignore].

/// An `#[ignore]` (or `cfg_attr(.., ignore)`) attribute in `text`.
fn ignore_violations(path: &str, text: &str) -> Vec<String> {
    let code = code_only(text);
    let mut out = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let squeezed: String = line.split_whitespace().collect();
        let cfg_attr_ignore = squeezed.contains("#[cfg_attr(") && !find_word(&squeezed, "ignore").is_empty();
        if squeezed.contains("#[ignore") || cfg_attr_ignore {
            out.push(format!(
                "{path}:{}: `#[ignore]`: a test that cannot run here skips loudly (prints `skipped: <why>`) instead \
                 (STYLE.md §9)",
                n + 1
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Rule 6: docs on public items.

/// The workspace's `missing_docs` lint is not `warn` (or stricter), or a member's `manifest` does
/// not take the workspace lints.
fn docs_lint_violations(workspace_manifest: &str, members: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    let level = workspace_lint_level(workspace_manifest, "missing_docs");
    if !matches!(level.as_deref(), Some("warn" | "deny" | "forbid")) {
        out.push(
            "Cargo.toml: `[workspace.lints.rust]` lacks `missing_docs = \"warn\"` (CI's clippy -D warnings makes it \
             an error)"
                .to_string(),
        );
    }
    for (path, manifest) in members {
        if !lints_workspace(manifest) {
            out.push(format!("{path}: lacks `[lints] workspace = true` (missing_docs, unsafe_code, clippy lints)"));
        }
    }
    out
}

/// A crate root whose first non-blank line is not a `//!` doc.
fn crate_doc_violations(path: &str, text: &str) -> Vec<String> {
    match text.lines().find(|l| !l.trim().is_empty()) {
        Some(l) if l.starts_with("//!") => Vec::new(),
        _ => vec![format!("{path}: a crate root starts with a `//!` doc: what the crate owns (STYLE.md §14)")],
    }
}

// ---------------------------------------------------------------------------------------------
// The workspace.

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `.rs` file under `dir`, as paths relative to the root with `/` separators.
fn rust_files(dir: &Path, rel: &str, out: &mut Vec<String>) {
    files_ending(dir, rel, ".rs", out);
}

/// Every file under `dir` (repository path `rel`, "" for the root) whose name ends with
/// `suffix`, as repository paths in name order, skipping hidden directories and [`SKIP_DIRS`].
fn files_ending(dir: &Path, rel: &str, suffix: &str, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap()).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
        let ty = e.file_type().unwrap();
        if ty.is_dir() && !name.starts_with('.') && !SKIP_DIRS.contains(&name.as_str()) {
            files_ending(&e.path(), &rel, suffix, out);
        } else if ty.is_file() && name.ends_with(suffix) {
            out.push(rel);
        }
    }
}

/// The workspace members' directories (`.` for the root package).
fn members(workspace_manifest: &str) -> Vec<String> {
    let m: toml::Table = workspace_manifest.parse().expect("the root Cargo.toml is TOML");
    let members = m["workspace"]["members"].as_array().expect("workspace.members");
    members.iter().map(|v| v.as_str().expect("a member path").trim_end_matches('/').to_string()).collect()
}

fn in_dir(dir: &str, rel: &str) -> String {
    if dir == "." {
        rel.to_string()
    } else {
        format!("{dir}/{rel}")
    }
}

/// A member's crate roots: its library and binaries (Cargo's defaults or `[lib]`/`[[bin]] path`).
fn crate_roots(dir: &str, manifest: &str) -> Vec<String> {
    let m: toml::Table = manifest.parse().expect("a member's Cargo.toml is TOML");
    let mut roots = Vec::new();
    let lib = m.get("lib").and_then(|l| l.get("path")).and_then(|p| p.as_str()).unwrap_or("src/lib.rs");
    roots.push(in_dir(dir, lib));
    for bin in m.get("bin").and_then(|b| b.as_array()).into_iter().flatten() {
        roots.push(in_dir(dir, bin.get("path").and_then(|p| p.as_str()).unwrap_or("src/main.rs")));
    }
    roots.push(in_dir(dir, "src/main.rs"));
    roots.sort();
    roots.dedup();
    roots.into_iter().filter(|r| root().join(r).is_file()).collect()
}

#[test]
fn tidy() {
    let started = std::time::Instant::now();
    let workspace_manifest = read("Cargo.toml");
    let member_dirs = members(&workspace_manifest);
    let manifests: Vec<(String, String)> = member_dirs
        .iter()
        .map(|d| {
            let p = in_dir(d, "Cargo.toml");
            let text = read(&p);
            (p, text)
        })
        .collect();
    let mut files = Vec::new();
    rust_files(&root(), "", &mut files);
    let texts: Vec<(String, String)> = files
        .into_iter()
        .map(|f| {
            let text = read(&f);
            (f, text)
        })
        .collect();
    let mut v = Vec::new();

    // 1. unsafe
    for (path, text) in &texts {
        v.extend(unsafe_violations(path, text));
    }
    for (f, _) in UNSAFE_FILES {
        if !texts.iter().any(|(p, _)| p == f) {
            v.push(format!("{f}: listed in UNSAFE_FILES (tests/tidy.rs) but missing: remove the entry"));
        }
    }
    for (dir, (manifest_path, manifest)) in member_dirs.iter().zip(&manifests) {
        let roots = crate_roots(dir, manifest);
        if roots.is_empty() {
            v.push(format!("{manifest_path}: no crate root found"));
        }
        for r in roots {
            let text = read(&r);
            v.extend(unsafe_lint_violations(&r, &text, manifest, &workspace_manifest));
            v.extend(crate_doc_violations(&r, &text));
        }
    }

    // 2. anyhow
    for dir in LIBRARY_CRATES {
        assert!(member_dirs.iter().any(|m| m == dir), "LIBRARY_CRATES names {dir}, not a workspace member");
        let manifest_path = in_dir(dir, "Cargo.toml");
        v.extend(anyhow_dependency_violations(&manifest_path, &read(&manifest_path)));
        let src = in_dir(dir, "src/");
        for (path, text) in texts.iter().filter(|(p, _)| p.starts_with(&src)) {
            v.extend(anyhow_source_violations(path, text));
        }
    }

    // 3. Device::Cpu
    for (path, text) in &texts {
        v.extend(cpu_device_violations(path, text));
    }
    v.extend(stale_cpu_device_entries(&|f| texts.iter().any(|(p, t)| p == f && !cpu_device_lines(p, t).is_empty())));

    // 4. ARCHITECTURE.md
    v.extend(architecture_path_violations(&read("ARCHITECTURE.md"), &|p| root().join(p).exists()));

    // 5. #[ignore]
    for (path, text) in &texts {
        v.extend(ignore_violations(path, text));
    }

    // 6. docs
    v.extend(docs_lint_violations(&workspace_manifest, &manifests));

    // 7. the runtime's ordering calls
    for (path, text) in &texts {
        v.extend(ordering_call_violations(path, text));
    }
    assert!(texts.iter().any(|(p, _)| p == ORDERING_FILE), "{ORDERING_FILE} is missing: update ORDERING_FILE");

    // 8. skips through the one helper
    for (path, text) in &texts {
        v.extend(skip_violations(path, text));
    }
    // 9. no process-global state where the ranks live; 10. exits only in the binary
    for (path, text) in &texts {
        v.extend(static_state_violations(path, text));
        v.extend(process_exit_violations(path, text));
    }
    for f in STATELESS_FILES {
        assert!(texts.iter().any(|(p, _)| p == f), "{f} is missing: update STATELESS_FILES");
    }
    // 11. file sizes; 12. the runtime's façade
    for (path, text) in &texts {
        v.extend(file_size_violations(path, text));
    }
    let runtime_files: Vec<(&str, &str)> =
        texts.iter().filter(|(p, _)| p.starts_with("src/runtime/")).map(|(p, t)| (p.as_str(), t.as_str())).collect();
    v.extend(runtime_facade_violations(&runtime_files));
    let py_dir = root().join("python/tests");
    for entry in std::fs::read_dir(&py_dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".py") {
            let rel = format!("python/tests/{name}");
            v.extend(skip_violations(&rel, &read(&rel)));
        }
    }

    assert!(v.is_empty(), "tidy: {} problem(s):\n{}\n", v.len(), v.join("\n"));
    // Checked on the workspace, not timed on a loaded machine: a hint, not a failure.
    let secs = started.elapsed().as_secs_f64();
    if secs > 1.0 {
        eprintln!("tidy took {secs:.2} s over {} files: keep it under 1 s", texts.len());
    }
}

// ---------------------------------------------------------------------------------------------
// Rule 8: a skip goes through the one helper (`oogc_swapper::skip`, `python/tests/skips.py`),
// which says it past the harness's capture, counts it and refuses it where it is required.

/// The helpers themselves, and this file (the rule's examples).
const SKIP_HELPERS: &[&str] = &["swapper/src/skip.rs", "python/tests/skips.py", "tests/tidy.rs"];

/// A skip written by hand in `text` (Rust or Python): a print of a `skipped` line, or pytest's
/// own `importorskip` / `pytest.skip`.
fn skip_violations(path: &str, text: &str) -> Vec<String> {
    if SKIP_HELPERS.contains(&path) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let squeezed: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
        let lower = squeezed.to_lowercase();
        let printed = ["println!(\"skipped", "eprintln!(\"skipped", "print(\"skipped", "print(f\"skipped"]
            .iter()
            .any(|p| lower.contains(p));
        let pytest = !lower.trim_start().starts_with('#')
            && (squeezed.contains("pytest.importorskip(") || squeezed.contains("pytest.skip("));
        if printed || pytest {
            out.push(format!(
                "{path}:{}: a skip by hand: skip through `oogc_swapper::skip::skip` (Rust) or `skips.skip`/`skips.need` \
                 (Python), which print past the capture, count it in OOGC_SKIP_LOG and honour OOGC_REQUIRE",
                n + 1
            ));
        }
    }
    out
}

#[test]
fn a_skip_by_hand_fails() {
    let rust = "fn t() {\n    println!(\"skipped: io_uring unavailable\");\n    eprintln!(\"SKIPPED x\");\n}\n";
    assert_eq!(skip_violations("swapper/tests/nvme.rs", rust).len(), 2);
    let py = "transformers = pytest.importorskip(\"transformers\")\n    pytest.skip(\"no gloo\")\n";
    assert_eq!(skip_violations("python/tests/test_x.py", py).len(), 2);
    // Through the helpers, or in the helpers themselves: fine.
    let good = "skip(Capability::IoUring, \"nvme\", &why);\ntransformers = need(\"transformers\", \"t\", \"why\")\n";
    assert!(skip_violations("swapper/tests/nvme.rs", good).is_empty());
    assert!(skip_violations("python/tests/skips.py", py).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Rule 9: no `static` state where the ranks live; rule 10: `process::exit` only in the binary.

/// Files whose non-test code holds no `static` item: the run's ranks and collectives are a value
/// (`dist::Ranks`) made by the entry point and passed down, never process-global state.
const STATELESS_FILES: &[&str] = &["src/dist.rs"];

/// A `static` item (not a `'static` lifetime) in the non-test code of a [`STATELESS_FILES`] file.
fn static_state_violations(path: &str, text: &str) -> Vec<String> {
    if !STATELESS_FILES.contains(&path) {
        return Vec::new();
    }
    let code = non_test_code(path, &code_only(text));
    find_word(&code, "static")
        .into_iter()
        .filter(|&(_, end)| !code[..end - "static".len()].ends_with('\''))
        .map(|(line, _)| {
            format!(
                "{path}:{line}: a `static` item: the ranks are a value (`dist::Ranks`, made by the entry point and \
                 passed down), not process-global state; hold it in a value instead"
            )
        })
        .collect()
}

/// `process::exit` (or `exit` imported from `std::process`) in the code of a file outside
/// `cli/`: the library returns an error and the binary decides to exit (or to end every rank,
/// `dist::Ranks::abort`).
fn process_exit_violations(path: &str, text: &str) -> Vec<String> {
    if path.starts_with("cli/") {
        return Vec::new();
    }
    let code = code_only(text);
    let mut v = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let imported = line.contains("use std::process::") && !find_word(line, "exit").is_empty();
        if line.contains("process::exit") || imported {
            v.push(format!(
                "{path}:{}: `process::exit` outside cli/: return an error and let the binary decide to exit (or \
                 end every rank with `dist::Ranks::abort`)",
                n + 1
            ));
        }
    }
    v
}

#[test]
fn static_state_in_the_ranks_module_fails() {
    let bad = "static WORLD: OnceLock<World> = OnceLock::new();\npub static mut N: u32 = 0;\n";
    let v = static_state_violations("src/dist.rs", bad);
    assert!(v.len() == 2 && v[0].starts_with("src/dist.rs:1"), "{v:?}");
    // A `'static` lifetime, a comment, a string, a test module or another file: fine.
    let good = "fn op(&self) -> &'static str { \"static\" } // no static here\n\
                #[cfg(test)]\nmod tests {\n    static N: u32 = 0;\n}\n";
    assert!(
        static_state_violations("src/dist.rs", good).is_empty(),
        "{:?}",
        static_state_violations("src/dist.rs", good)
    );
    assert!(static_state_violations("src/hooks.rs", bad).is_empty());
}

#[test]
fn process_exit_outside_the_binary_fails() {
    let bad = "fn f() {\n    std::process::exit(1)\n}\n";
    let v = process_exit_violations("src/dist.rs", bad);
    assert!(v.len() == 1 && v[0].starts_with("src/dist.rs:2"), "{v:?}");
    assert_eq!(process_exit_violations("python/src/ranks.rs", "use std::process::{abort, exit};\n").len(), 1);
    // In the binary, in a comment or a string, or `abort`: fine.
    assert!(process_exit_violations("cli/src/train.rs", bad).is_empty());
    let good = "// process::exit is the CLI's\nconst S: &str = \"process::exit\";\nfn g() { std::process::abort() }\n";
    assert!(process_exit_violations("src/hooks.rs", good).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Rules 11 and 12: files a reader can hold, and the runtime a façade over parts (issue 39).

/// Lines a file of the root crate's `src/` may have.
const MAX_SRC_LINES: usize = 800;
/// Lines `src/runtime/mod.rs` must stay under.
const MAX_RUNTIME_MOD_LINES: usize = 600;
/// Fields `Runtime` may have.
const MAX_RUNTIME_FIELDS: usize = 12;
/// Public methods `Runtime` may have (over every `impl Runtime` block of `src/runtime/`).
const MAX_RUNTIME_PUB_METHODS: usize = 25;

/// A file of the root crate's `src/` longer than [`MAX_SRC_LINES`] lines, or `src/runtime/mod.rs`
/// not under [`MAX_RUNTIME_MOD_LINES`].
fn file_size_violations(path: &str, text: &str) -> Vec<String> {
    if !path.starts_with("src/") {
        return Vec::new();
    }
    let lines = text.lines().count();
    let (limit, over) = if path == "src/runtime/mod.rs" {
        (MAX_RUNTIME_MOD_LINES, lines >= MAX_RUNTIME_MOD_LINES)
    } else {
        (MAX_SRC_LINES, lines > MAX_SRC_LINES)
    };
    if over {
        vec![format!("{path}: {lines} lines, over the {limit} a file may have: split it along a seam into a module")]
    } else {
        Vec::new()
    }
}

/// The body of the first `{ .. }` block that follows `start` in `code` (brace-matched), or `None`.
fn block_after(code: &str, start: usize) -> Option<&str> {
    let open = start + code[start..].find('{')?;
    let mut depth = 0usize;
    for (i, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&code[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `Runtime`'s fields (in `src/runtime/mod.rs`) over [`MAX_RUNTIME_FIELDS`], or its public
/// methods over every `impl Runtime` block of `files` (path, text) over
/// [`MAX_RUNTIME_PUB_METHODS`]. Top-level items of a block are those at its first depth.
fn runtime_facade_violations(files: &[(&str, &str)]) -> Vec<String> {
    let mut v = Vec::new();
    let mut methods = Vec::new();
    for (path, text) in files {
        let code = non_test_code(path, &code_only(text));
        if let Some(at) = code.find("pub struct Runtime {") {
            let body = block_after(&code, at).unwrap_or_default();
            let fields = top_level_lines(body).filter(|l| l.contains(':') && l.ends_with(',')).count();
            if fields > MAX_RUNTIME_FIELDS {
                v.push(format!(
                    "{path}: `Runtime` has {fields} fields, over {MAX_RUNTIME_FIELDS}: group them into a part with one job \
                     (the unit table, the step, the schedule, the tiers)"
                ));
            }
        }
        let mut from = 0;
        while let Some(at) = code[from..].find("impl Runtime {").map(|i| i + from) {
            let body = block_after(&code, at).unwrap_or_default();
            methods.extend(
                top_level_lines(body)
                    .filter_map(|l| l.strip_prefix("pub fn ").map(|r| r.split(['(', '<']).next().unwrap_or("")))
                    .map(|name| format!("{path}: {name}")),
            );
            from = at + 1;
        }
    }
    if methods.len() > MAX_RUNTIME_PUB_METHODS {
        v.push(format!(
            "`Runtime` has {} public methods, over {MAX_RUNTIME_PUB_METHODS}: move queries to a read-only view \
             (`Runtime::units`, `Runtime::memory`) or merge calls:\n  {}",
            methods.len(),
            methods.join("\n  ")
        ));
    }
    v
}

/// The trimmed lines of `body` at its first brace depth (a struct's fields, an impl's items).
fn top_level_lines(body: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0i32;
    body.lines().filter_map(move |line| {
        let at_top = depth == 0;
        depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
        at_top.then(|| line.trim())
    })
}

#[test]
fn a_long_file_and_a_big_runtime_fail() {
    let long = "fn f() {}\n".repeat(MAX_SRC_LINES + 1);
    assert_eq!(file_size_violations("src/plan.rs", &long).len(), 1);
    assert!(file_size_violations("src/plan.rs", &"\n".repeat(MAX_SRC_LINES)).is_empty());
    assert!(file_size_violations("tests/train.rs", &long).is_empty(), "tests are not src/");
    assert_eq!(file_size_violations("src/runtime/mod.rs", &"\n".repeat(MAX_RUNTIME_MOD_LINES)).len(), 1);

    let fields: String = (0..=MAX_RUNTIME_FIELDS).map(|k| format!("    f{k}: u8,\n")).collect();
    let nested = "    g: Vec<u8>,\n    h: Option<Box<dyn Fn(u8) -> u8>>,\n";
    let big = format!("pub struct Runtime {{\n{fields}}}\n");
    assert_eq!(runtime_facade_violations(&[("src/runtime/mod.rs", &big)]).len(), 1);
    let small = format!("pub struct Runtime {{\n{nested}}}\n");
    assert!(runtime_facade_violations(&[("src/runtime/mod.rs", &small)]).is_empty());

    // Public methods count over every `impl Runtime` block; nested items and private ones do not.
    let block = |n: usize| -> String {
        let fns: String =
            (0..n).map(|k| format!("    pub fn m{k}(&self) {{\n        fn inner() {{}}\n    }}\n")).collect();
        format!("impl Runtime {{\n{fns}    fn private(&self) {{}}\n}}\n")
    };
    let half = MAX_RUNTIME_PUB_METHODS / 2 + 1;
    let (a, b) = (block(half), block(half));
    let v = runtime_facade_violations(&[("src/runtime/a.rs", &a), ("src/runtime/b.rs", &b)]);
    assert!(v.len() == 1 && v[0].contains("src/runtime/b.rs: m0"), "{v:?}");
    assert!(runtime_facade_violations(&[("src/runtime/a.rs", &a)]).is_empty());
}

// ---------------------------------------------------------------------------------------------
// The runtime's ordering calls

/// The one file of the runtime that calls the device's ordering and copy methods
/// (`OrderingCall`, `Order`).
const ORDERING_FILE: &str = "src/runtime/ordering.rs";

/// The device's methods that order compute and copies, or copy, or allocate device memory.
const DEVICE_ORDERING_METHODS: &[&str] = &[
    "record_compute_event",
    "compute_waits_for",
    "compute_waits_for_copies",
    "copy_waits_for",
    "copy_waits_for_compute",
    "alloc_for_compute",
    "alloc",
    "htod",
    "dtoh",
    "htod_after",
    "dtoh_after",
    "free_after",
];

/// Calls of [`DEVICE_ORDERING_METHODS`] on the device (`device.`, `device().`, `dev.`) in a runtime
/// file other than [`ORDERING_FILE`]: each should go through `Order`, which names it.
fn ordering_call_violations(path: &str, text: &str) -> Vec<String> {
    if !path.starts_with("src/runtime/") || path == ORDERING_FILE {
        return Vec::new();
    }
    let code = non_test_code(path, &code_only(text));
    let mut v = Vec::new();
    for (n, line) in code.lines().enumerate() {
        for receiver in ["device.", "device().", "dev."] {
            for m in DEVICE_ORDERING_METHODS {
                let call = format!("{receiver}{m}(");
                if line.contains(&call) {
                    v.push(format!(
                        "{path}:{}: `{call}..)` outside {ORDERING_FILE}: make it through `Order` (a named OrderingCall \
                         the test hook can leave out), or add an Order method for it",
                        n + 1
                    ));
                }
            }
        }
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Each rule on synthetic input: it fails when broken, passes when kept.

#[test]
fn a_device_ordering_call_outside_the_ordering_file_fails() {
    let bad = "fn f(device: &Device) { let e = device.record_compute_event()?; }\n";
    assert_eq!(ordering_call_violations("src/runtime/grads.rs", bad).len(), 1);
    let bad = "fn f(&self) { self.residency.device().free_after(b, None)?; }\n";
    assert_eq!(ordering_call_violations("src/runtime/mod.rs", bad).len(), 1);
    // Through `Order`, in the ordering file, in comments, or outside the runtime: fine.
    let good = "fn f(device: &Device) { self.order.alloc_for_compute(device, call, 8)?; } // device.alloc(8)\n";
    assert!(ordering_call_violations("src/runtime/grads.rs", good).is_empty());
    assert!(ordering_call_violations(ORDERING_FILE, bad).is_empty());
    assert!(ordering_call_violations("cli/src/gpu_check/transfers.rs", bad).is_empty());
}

#[test]
fn code_only_blanks_comments_strings_and_chars_but_keeps_lines_and_lifetimes() {
    let src = "let a = \"unsafe { }\"; // unsafe\n/* unsafe /* nested */ unsafe */ fn f<'a>(x: &'a str) {}\n\
               let c = '{'; let d = '\\''; let r = r#\"unsafe \"quoted\" \"#; let b = br\"unsafe\";\nunsafe {}";
    let code = code_only(src);
    assert_eq!(code.lines().count(), src.lines().count());
    assert_eq!(find_word(&code, "unsafe"), vec![(4, code.len() - 3)]);
    assert!(code.contains("fn f<'a>(x: &'a str)"), "{code}");
    assert_eq!(code.matches('{').count(), 2, "{code}");
    // A raw identifier is code.
    assert!(code_only("let r#type = 1;").contains("r#type"));
}

#[test]
fn non_test_code_drops_a_trailing_test_module_and_test_files() {
    let src = "fn lib() {}\n#[cfg(test)]\nmod tests {\n    use anyhow::Result;\n    fn t() { {} }\n}\nfn after() {}\n";
    let code = non_test_code("src/x.rs", &code_only(src));
    assert_eq!(code.lines().count(), src.lines().count());
    assert!(code.contains("fn lib()") && code.contains("fn after()") && !code.contains("anyhow"), "{code}");
    // `#[cfg(test)] mod tests;` (a file) and a `#[cfg(test)] fn` stay.
    let src = "#[cfg(test)]\nmod tests;\n#[cfg(test)]\nfn helper() { anyhow() }\n";
    assert!(non_test_code("src/x.rs", &code_only(src)).contains("anyhow"));
    assert!(!non_test_code("src/gpt/moe_tests.rs", "anyhow").contains("anyhow"));
}

#[test]
fn unsafe_outside_the_fence_fails() {
    let fenced = UNSAFE_FILES[0].0;
    let v = unsafe_violations("src/runtime.rs", "fn f() {\n    // SAFETY: fine.\n    unsafe { g() }\n}\n");
    assert!(v.len() == 1 && v[0].contains("src/runtime.rs:3") && v[0].contains("outside"), "{v:?}");
    let v = unsafe_violations("models/src/mmap.rs", "#![allow(unsafe_code)]\n");
    assert!(v.len() == 1 && v[0].contains("allow(unsafe_code)"), "{v:?}");
    // Words in comments and strings, and the deny lint, are not `unsafe` code.
    let ok = "#![deny(unsafe_code)]\n//! No `unsafe` here.\nconst S: &str = \"unsafe {\";\n";
    assert_eq!(unsafe_violations("src/lib.rs", ok), Vec::<String>::new());
    assert_eq!(unsafe_violations(fenced, ok), Vec::<String>::new());
}

#[test]
fn unsafe_without_its_safety_comment_fails() {
    let f = UNSAFE_FILES[0].0;
    let good = "#![allow(unsafe_code)]\n\
                fn f() {\n\
                    // SAFETY: the pointer is valid for `n` bytes,\n\
                    // and nothing else holds it.\n\
                    #[cfg(not(feature = \"x\"))]\n\
                    let p = unsafe { g() };\n\
                }\n\
                // SAFETY: owned alone.\n\
                unsafe impl Send for X {}\n\
                /// Adds.\n\
                ///\n\
                /// # Safety\n\
                /// AVX2 present.\n\
                #[target_feature(enable = \"avx2\")]\n\
                pub(super) unsafe fn add() {}\n";
    assert_eq!(unsafe_violations(f, good), Vec::<String>::new());
    let v = unsafe_violations(f, "fn f() {\n    // the pointer is valid\n    let p = unsafe { g() };\n}\n");
    assert!(v.len() == 1 && v[0].contains(":3:") && v[0].contains("SAFETY"), "{v:?}");
    // A SAFETY comment above a blank line or code does not count.
    let v = unsafe_violations(f, "// SAFETY: fine.\nlet x = 1;\nlet p = unsafe { g() };\n");
    assert_eq!(v.len(), 1, "{v:?}");
    let v = unsafe_violations(f, "unsafe impl Sync for X {}\n");
    assert!(v.len() == 1 && v[0].contains("unsafe impl"), "{v:?}");
    let v = unsafe_violations(f, "/// Adds.\n#[inline]\npub unsafe fn add() {}\n");
    assert!(v.len() == 1 && v[0].contains("# Safety"), "{v:?}");
}

#[test]
fn a_crate_root_without_the_unsafe_lint_fails() {
    let ws = "[workspace.lints.rust]\nunsafe_code = \"deny\"\n";
    let member = "[package]\nname = \"x\"\n[lints]\nworkspace = true\n";
    let bare = "[package]\nname = \"x\"\n";
    assert!(unsafe_lint_violations("x/src/lib.rs", "//! X.\n", member, ws).is_empty());
    assert!(unsafe_lint_violations("x/src/lib.rs", "//! X.\n#![forbid(unsafe_code)]\n", bare, "").is_empty());
    assert_eq!(unsafe_lint_violations("x/src/lib.rs", "//! X.\n", bare, ws).len(), 1);
    assert_eq!(unsafe_lint_violations("x/src/lib.rs", "//! X.\n", member, "[workspace]\n").len(), 1);
    // A commented-out attribute is no lint.
    assert_eq!(unsafe_lint_violations("x/src/lib.rs", "// #![deny(unsafe_code)]\n", bare, ws).len(), 1);
}

#[test]
fn anyhow_in_a_library_fails() {
    let v = anyhow_dependency_violations("x/Cargo.toml", "[dependencies]\nanyhow = { workspace = true }\n");
    assert_eq!(v.len(), 1, "{v:?}");
    let v = anyhow_dependency_violations("x/Cargo.toml", "[target.'cfg(unix)'.dependencies]\nanyhow = \"1\"\n");
    assert_eq!(v.len(), 1, "{v:?}");
    let ok = "[dependencies]\nthiserror = \"2\"\n[dev-dependencies]\nanyhow = \"1\"\n";
    assert!(anyhow_dependency_violations("x/Cargo.toml", ok).is_empty());

    let v = anyhow_source_violations("x/src/a.rs", "pub fn f() -> anyhow::Result<()> { Ok(()) }\n");
    assert!(v.len() == 1 && v[0].contains("x/src/a.rs:1"), "{v:?}");
    // A doc example's hidden `# anyhow::Ok(())` line, a comment, a test module: fine.
    let ok = "//! ```\n//! # anyhow::Ok(())\n//! ```\n/// as `anyhow` would\npub fn f() {}\n\
              #[cfg(test)]\nmod tests {\n    fn t() -> anyhow::Result<()> { Ok(()) }\n}\n";
    assert!(anyhow_source_violations("x/src/a.rs", ok).is_empty());
}

#[test]
fn device_cpu_outside_its_lists_fails() {
    let text = "fn tokens() -> Tensor { Tensor::new(ids, &candle_core::Device::Cpu) }\n";
    let v = cpu_device_violations("src/data.rs", text);
    assert!(v.len() == 1 && v[0].contains("src/data.rs:1"), "{v:?}");
    let v = cpu_device_violations("models/src/gpt/mod.rs", "use candle_core::Device;\nlet d = Device::Cpu;\n");
    assert!(v.len() == 1 && v[0].contains(":2"), "{v:?}");
    // Listed files, test code, comments, and other names are fine.
    assert!(cpu_device_violations(CPU_DEVICE_FILES[0].0, text).is_empty());
    for p in ["tests/runtime.rs", "models/src/gpt/tests.rs", "benches/adam.rs", "examples/e.rs", "swapper/tests/x.rs"] {
        assert!(cpu_device_violations(p, text).is_empty(), "{p}");
    }
    let ok = "//! On `Device::Cpu` the fused kernels run.\nlet d = Device::Cuda0;\nlet e = MyDevice::Cpus; let f = MyDevice::Cpu;\n\
              #[cfg(test)]\nmod tests {\n    const D: Device = Device::Cpu;\n}\n";
    assert!(cpu_device_violations("models/src/kernels.rs", ok).is_empty());
    // An entry whose file no longer names it is stale.
    let stale = stale_cpu_device_entries(&|f| f != CPU_DEVICE_FILES[0].0);
    assert!(stale.len() == 1 && stale[0].contains(CPU_DEVICE_FILES[0].0), "{stale:?}");
    assert!(stale_cpu_device_entries(&|_| true).is_empty());
}

#[test]
fn architecture_md_naming_a_missing_path_fails() {
    let repo = [
        "src",
        "src/plan.rs",
        "swapper",
        "swapper/src",
        "swapper/src/tier.rs",
        "swapper/src/device/mod.rs",
        ".ci",
        ".ci/run",
        "swapper/tests",
        "swapper/tests/nvme.rs",
        "README.md",
    ];
    let exists = |p: &str| repo.contains(&p.trim_end_matches('/'));
    let md = "# A\n\n## Entry points\n\n- `src/plan.rs`: plans. `.ci/run`: CI. `../shared/DESIGN.md`, `dist/x/`, \
              `oogc=trace`, `h2d`/`d2h`, `Arc<Mutex<..>>`, `README.md`.\n- `swapper/tests/nvme.rs`, `nvme.rs`.\n\
              \n## Code map\n\n### `swapper/` (`oogc-swapper`)\n\n- `tier.rs`: tiers. `device/mod.rs`: the \
              trait, `OutOfMemory { tier,\n  requested_bytes }`.\n\n```\nfetch(u) `src/nope.rs`\n```\n";
    assert_eq!(architecture_path_violations(md, &exists), Vec::<String>::new());
    let names: Vec<String> = architecture_paths(md, &|f| exists(f)).into_iter().map(|p| p.path).collect();
    assert_eq!(names, ["src/plan.rs", ".ci/run", "swapper/tests/nvme.rs", "swapper/", "tier.rs", "device/mod.rs"]);

    let bad = "## Entry points\n\n- `src/main.rs`: the CLI; `src/bench/`.\n\n## Code map\n\n### `src/` (`oogc`)\n\n\
               | `model/` | the GPT |\n| `plan.rs`, `bench/step.rs` | |\n";
    let v = architecture_path_violations(bad, &exists);
    assert_eq!(v.len(), 4, "{v:?}");
    assert!(v[0].starts_with("ARCHITECTURE.md:3: names `src/main.rs`"), "{v:?}");
    assert!(v[1].contains("`src/bench/`"), "{v:?}");
    assert!(v[2].starts_with("ARCHITECTURE.md:9: names `model/`") && v[2].contains("src/model/"), "{v:?}");
    assert!(v[3].contains("`bench/step.rs`"), "{v:?}");
}

#[test]
fn ignore_attributes_fail() {
    let v = ignore_violations("tests/x.rs", "#[test]\n#[ignore]\nfn slow() {}\n");
    assert!(v.len() == 1 && v[0].contains("tests/x.rs:2"), "{v:?}");
    assert_eq!(ignore_violations("tests/x.rs", "#[test]\n#[ignore = \"needs a GPU\"]\nfn g() {}\n").len(), 1);
    assert_eq!(ignore_violations("tests/x.rs", "#[cfg_attr(not(feature = \"cuda\"), ignore)]\nfn g() {}\n").len(), 1);
    let ok = "// #[ignore] is not used here\nconst S: &str = \"#[ignore]\";\n#[test]\nfn ignored_paths() {}\n";
    assert!(ignore_violations("tests/x.rs", ok).is_empty());
}

#[test]
fn missing_docs_lints_and_crate_docs_fail_when_missing() {
    let ws = "[workspace.lints.rust]\nmissing_docs = \"warn\"\n";
    let member = ("x/Cargo.toml".to_string(), "[package]\nname = \"x\"\n[lints]\nworkspace = true\n".to_string());
    let bare = ("y/Cargo.toml".to_string(), "[package]\nname = \"y\"\n".to_string());
    assert!(docs_lint_violations(ws, std::slice::from_ref(&member)).is_empty());
    let v = docs_lint_violations(ws, &[member.clone(), bare]);
    assert!(v.len() == 1 && v[0].starts_with("y/Cargo.toml"), "{v:?}");
    let v = docs_lint_violations("[workspace.lints.rust]\nmissing_docs = \"allow\"\n", &[member]);
    assert!(v.len() == 1 && v[0].contains("missing_docs"), "{v:?}");

    assert!(crate_doc_violations("x/src/lib.rs", "\n//! The x crate.\npub mod a;\n").is_empty());
    assert_eq!(crate_doc_violations("x/src/lib.rs", "/// Not a crate doc.\npub mod a;\n").len(), 1);
    assert_eq!(crate_doc_violations("x/src/main.rs", "#![deny(unsafe_code)]\n//! Late.\n").len(), 1);
}

// ---------------------------------------------------------------------------------------------
// The docs: the book's config reference and every relative Markdown link.

/// The book's config reference is the generated one (`oogc config --reference`).
#[test]
fn the_books_config_reference_is_the_generated_one() {
    use oogc::config::reference::{reference_markdown, REFERENCE_PATH, REGENERATE};
    let committed = std::fs::read_to_string(root().join(REFERENCE_PATH)).unwrap_or_default();
    let generated = reference_markdown();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(|| committed.lines().count().min(generated.lines().count()) + 1, |i| i + 1);
        panic!(
            "{REFERENCE_PATH} differs from the config types' doc comments (first at line {line}).\nfix: regenerate \
             it in the repository root: {REGENERATE}"
        );
    }
}

/// The id a heading gets (mdBook's `normalize_id`, GitHub's likewise for these headings):
/// lowercase, alphanumerics, `-` and `_` kept, spaces to `-`, everything else dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// The Markdown text outside fenced code blocks and inline code, line by line.
fn markdown_prose(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code spans: every other backtick-delimited piece.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        out.push((i + 1, prose));
    }
    out
}

/// The anchors of a Markdown file's headings (repeated ones get `-1`, `-2`, ... as in mdBook).
fn anchors(text: &str) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let id = anchor(line.trim_start_matches('#'));
        let n = seen
            .iter()
            .filter(|s| {
                s.as_str() == id
                    || s.strip_prefix(id.as_str()).is_some_and(|r| r.starts_with('-') && r[1..].parse::<u32>().is_ok())
            })
            .count();
        seen.push(if n == 0 { id } else { format!("{id}-{n}") });
    }
    seen
}

/// Every relative link `[text](target)` of `text` (the Markdown file `path`, relative to the
/// root) whose file does not exist, or whose `#anchor` no heading of its file has. `read` gives
/// a file's text (None: no such file).
fn markdown_link_violations(path: &str, text: &str, read: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let dir = Path::new(path).parent().unwrap_or(Path::new(""));
    let mut out = Vec::new();
    for (line, prose) in markdown_prose(text) {
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            rest = &rest[end..];
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, hash) = target.split_once('#').map_or((target, None), |(f, h)| (f, Some(h)));
            let resolved = if file.is_empty() { path.to_string() } else { normalize(&dir.join(file)) };
            let Some(body) = read(&resolved) else {
                out.push(format!("{path}:{line}: the link `{target}` names {resolved}, which does not exist"));
                continue;
            };
            let resolved_md = resolved.ends_with(".md");
            // mdBook turns a link to a `.md` file into one to its `.html`, which only the book's
            // own pages have.
            if path.starts_with("docs/src/") && resolved_md && !resolved.starts_with("docs/src/") {
                out.push(format!(
                    "{path}:{line}: the link `{target}` leaves the book for a Markdown file, which mdBook links \
                     as {}: name the file in backticks instead",
                    resolved.replace(".md", ".html")
                ));
                continue;
            }
            if let Some(hash) = hash.filter(|_| resolved_md) {
                if !anchors(&body).iter().any(|a| a == hash) {
                    out.push(format!(
                        "{path}:{line}: the link `{target}`: {resolved} has no heading with the id `{hash}`"
                    ));
                }
            }
        }
    }
    out
}

/// `a/b/../c` → `a/c` (a path relative to the root, `/` separators).
fn normalize(p: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in p.components() {
        match c {
            // Above the root: kept, so that the file is not found.
            std::path::Component::ParentDir => match parts.last().map(String::as_str) {
                None | Some("..") => parts.push("..".into()),
                Some(_) => drop(parts.pop()),
            },
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => {}
        }
    }
    parts.join("/")
}

#[test]
fn every_relative_markdown_link_resolves() {
    let mut files = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    files_ending(&root().join("docs"), "docs", ".md", &mut files);
    assert!(files.iter().any(|f| f == "docs/src/SUMMARY.md"), "no book: {files:?}");
    // A directory or a file that is not Markdown (an image, a config) only has to exist.
    let read = |rel: &str| {
        let p = root().join(rel);
        if p.is_dir() || (p.is_file() && !rel.ends_with(".md")) {
            Some(String::new())
        } else {
            std::fs::read_to_string(p).ok()
        }
    };
    let v: Vec<String> = files.iter().flat_map(|f| markdown_link_violations(f, &read(f).unwrap(), &read)).collect();
    assert!(v.is_empty(), "broken links (fix the target, or the heading it names):\n{}", v.join("\n"));
}

#[test]
fn a_broken_link_or_anchor_fails() {
    let files = |rel: &str| match rel {
        "docs/a.md" => Some("# Title\n## The GPU: `cuda:N`\n## Notes\n## Notes\n".to_string()),
        "docs/b.txt" => Some(String::new()),
        _ => None,
    };
    let good = "[a](a.md) [t](a.md#title) [g](a.md#the-gpu-cudan) [n](a.md#notes-1) [b](b.txt) \
                [w](https://x.org/y) [s](#here)\n# Here\n```\n[no](code.md)\n```\n`[no](span.md)`\n";
    assert_eq!(
        markdown_link_violations("docs/x.md", good, &|r| if r == "docs/x.md" { Some(good.into()) } else { files(r) }),
        Vec::<String>::new()
    );
    for bad in ["[m](missing.md)", "[a](a.md#nope)", "[u](../a.md)", "[s](#nowhere)"] {
        let v =
            markdown_link_violations("docs/x.md", bad, &|r| if r == "docs/x.md" { Some(bad.into()) } else { files(r) });
        assert_eq!(v.len(), 1, "{bad}: {v:?}");
    }
    // From a book page, a Markdown file outside the book is refused; another file is not.
    let book = |r: &str| if r == "docs/a.md" || r == "docs/b.txt" { files(r) } else { None };
    assert_eq!(markdown_link_violations("docs/src/p.md", "[a](../a.md)", &book).len(), 1);
    assert_eq!(markdown_link_violations("docs/src/p.md", "[b](../b.txt)", &book), Vec::<String>::new());
}
