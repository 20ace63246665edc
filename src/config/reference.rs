//! The config reference and the example config, generated from the config types' doc comments
//! (`oogc config --reference`, `oogc config --example`; the book's `reference/config.md`).
//!
//! The source of every table and key is the code: this module reads the doc comments, field
//! names, types and `#[serde(default)]` attributes of the structs in `src/config/` and of
//! `oogc_models::llama::LlamaConfig` (their source text, embedded at compile time), so a key
//! added, renamed or documented anew shows in the reference at the next build; a test in
//! `tests/tidy.rs` fails when the book's copy differs.
//!
//! | column | from |
//! |---|---|
//! | key | the field's name (serde uses the names as written) |
//! | type | the field's Rust type as TOML sees it (`ByteSize`: a size, `PathBuf`: a path, ...) |
//! | unit | the type (sizes: bytes) or the name's suffix (`_gbps`: GB/s, `_us`: µs, `_gflops`: GFLOP/s) |
//! | default | the doc's `Default: ...` sentence; "required" for a field without `#[serde(default)]` |
//! | meaning | the rest of the doc comment |

use std::fmt::Write as _;

const MOD_RS: &str = include_str!("mod.rs");
const MODEL_RS: &str = include_str!("model.rs");
const WORKLOAD_RS: &str = include_str!("workload.rs");
const DEVICE_RS: &str = include_str!("device.rs");
const MEMORY_RS: &str = include_str!("memory.rs");

/// Where the book keeps the generated reference, relative to the repository root.
pub const REFERENCE_PATH: &str = "docs/src/reference/config.md";

/// The command that regenerates [`REFERENCE_PATH`] (run in the repository root).
pub const REGENERATE: &str = "cargo run -p oogc-cli -- config --reference > docs/src/reference/config.md";

/// One table of the reference: its TOML header, the struct that holds its keys, and how it shows.
struct Section {
    /// The TOML header, e.g. `budgets` or `model.moe`.
    table: String,
    /// A qualifier shown after the header (the model family), empty for none.
    qualifier: &'static str,
    /// The struct's source file and name.
    source: &'static str,
    item: String,
    /// Whether the whole table is optional (commented out in the example).
    optional: bool,
}

/// The sections: the model's forms first (its family, the GPT's keys, the Llama family's, the
/// GPT's MoE blocks), then one per other field of [`super::TrainConfig`], in its order, each
/// the struct of the field's type (found in `workload.rs`, `device.rs` or `memory.rs`).
///
/// # Panics
/// When a field's type is not a struct of those files (a new file: add it here).
fn sections() -> Vec<Section> {
    let section = |table: &str, qualifier, source, item: &str, optional| Section {
        table: table.into(),
        qualifier,
        source,
        item: item.into(),
        optional,
    };
    let llama = "family = \"llama\" | \"mistral\" | \"qwen2\" | \"qwen3\" | \"mixtral\"";
    let mut out = vec![
        section("model", "", MODEL_RS, "ModelConfig", false),
        section("model", "family = \"gpt\"", MODEL_RS, "GptModelConfig", false),
        section("model", llama, oogc_models::llama::CONFIG_SOURCE, "LlamaConfig", true),
        section("model.moe", "", MODEL_RS, "MoeModelConfig", true),
    ];
    for field in parse_item(MOD_RS, "TrainConfig").members.into_iter().filter(|f| f.name != "model") {
        let head = format!("pub struct {} {{", field.ty);
        let source = [WORKLOAD_RS, DEVICE_RS, MEMORY_RS]
            .into_iter()
            .find(|src| src.contains(&head))
            .unwrap_or_else(|| panic!("no `{head}` in src/config/: add its file to reference.rs"));
        out.push(section(&field.name, "", source, &field.ty, false));
    }
    out
}

/// Example values of the required keys (the example config must load).
const REQUIRED_EXAMPLES: &[(&str, &str)] = &[
    ("model.d_model", "128"),
    ("model.n_layer", "4"),
    ("model.n_head", "4"),
    ("model.moe.experts", "4"),
    ("model.hidden_size", "128"),
    ("model.intermediate_size", "344"),
    ("model.num_hidden_layers", "4"),
    ("model.num_attention_heads", "4"),
    ("model.vocab_size", "0"),
    ("data.path", "\"../../shared/data/tinyshakespeare.txt\""),
    ("train.batch_size", "16"),
    ("train.seq_len", "128"),
    ("train.steps", "600"),
    ("budgets.gpu", "\"2MiB\""),
];

/// A documented item (struct field or enum variant) as read from the source.
#[derive(Debug, Clone, PartialEq)]
struct Member {
    name: String,
    /// The Rust type; empty for an enum variant.
    ty: String,
    doc: Vec<String>,
    /// Whether serde fills it in when absent.
    has_default: bool,
}

/// A struct or enum as read from the source: its doc lines and members.
#[derive(Debug, Clone, PartialEq)]
struct Item {
    doc: Vec<String>,
    members: Vec<Member>,
}

/// Reads the struct or enum `name` from rustfmt-formatted `source`: its `///` lines, and each
/// member's `///` lines, name, type and whether a `#[serde(default...)]` attribute precedes it.
///
/// # Panics
/// When `source` has no `pub struct name {` or `pub enum name {` (a renamed type: the tests catch
/// it before a user does).
fn parse_item(source: &str, name: &str) -> Item {
    let mut doc: Vec<String> = Vec::new();
    let mut default = false;
    let mut lines = source.lines();
    let head = [format!("pub struct {name} {{"), format!("pub enum {name} {{")];
    for line in lines.by_ref() {
        let t = line.trim();
        if let Some(d) = t.strip_prefix("///") {
            doc.push(d.strip_prefix(' ').unwrap_or(d).to_string());
        } else if t.starts_with("#[") {
        } else if head.iter().any(|h| t == h) {
            let mut item = Item { doc: std::mem::take(&mut doc), members: Vec::new() };
            for line in lines.by_ref() {
                let t = line.trim();
                if line.starts_with('}') {
                    return item;
                }
                if let Some(d) = t.strip_prefix("///") {
                    doc.push(d.strip_prefix(' ').unwrap_or(d).to_string());
                } else if t.starts_with("#[") {
                    default |= t.starts_with("#[serde(") && t.contains("default");
                } else if let Some((field, ty)) = t.strip_prefix("pub ").and_then(|f| f.split_once(": ")) {
                    let ty = ty.trim_end_matches(',').to_string();
                    item.members.push(Member {
                        name: field.into(),
                        ty,
                        doc: std::mem::take(&mut doc),
                        has_default: default,
                    });
                    default = false;
                } else if line.starts_with("    ") && !line.starts_with("     ") && !t.is_empty() {
                    let variant: String = t.chars().take_while(|c| c.is_alphanumeric()).collect();
                    if !variant.is_empty() {
                        item.members.push(Member {
                            name: variant,
                            ty: String::new(),
                            doc: std::mem::take(&mut doc),
                            has_default: false,
                        });
                    }
                }
            }
            return item;
        } else {
            doc.clear();
        }
    }
    panic!("no `pub struct {name}` or `pub enum {name}` in the config sources: update src/config/reference.rs")
}

/// Intra-doc links become plain code: `` [`X`] `` → `` `X` ``, `crate::` → `oogc::`.
fn plain(text: &str) -> String {
    text.replace("[`crate::", "[`oogc::").replace("[`", "`").replace("`]", "`")
}

/// What a section shows of its type's doc: the first paragraph and the TOML examples (the rest
/// is for Rust callers).
fn section_doc(doc: &[String]) -> Vec<String> {
    let first = doc.iter().position(|l| l.is_empty()).unwrap_or(doc.len());
    let mut out: Vec<String> = doc[..first].to_vec();
    let mut in_toml = false;
    for line in &doc[first..] {
        if line.starts_with("```toml") {
            in_toml = true;
            out.push(String::new());
        }
        if in_toml {
            out.push(line.clone());
        }
        if line == "```" {
            in_toml = false;
        }
    }
    out
}

/// `doc`'s lines as one paragraph.
fn joined(doc: &[String]) -> String {
    plain(doc.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ").trim())
}

/// Splits a field's doc into (meaning, default): the default is the text after `Default:` (or
/// `Default (...):`) up to the end of its sentence; the meaning is the rest.
fn split_default(doc: &str) -> (String, Option<String>) {
    let Some(start) = doc.find("Default:").or_else(|| doc.find("Default (")) else {
        return (doc.to_string(), None);
    };
    let Some(colon) = doc[start..].find(':').map(|c| start + c + 1) else {
        return (doc.to_string(), None);
    };
    let rest = &doc[colon..];
    let end = rest.find(". ").map_or_else(|| rest.trim_end().len(), |e| e + 1);
    let value = rest[..end].trim().trim_end_matches('.').to_string();
    let meaning = format!("{} {}", doc[..start].trim(), rest[end..].trim()).trim().to_string();
    (meaning, Some(value))
}

/// The TOML type (with "optional" dropped: the default column says what absence means).
fn toml_type(ty: &str) -> String {
    let ty = ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')).unwrap_or(ty);
    match ty {
        "usize" | "u64" => "integer",
        "f64" | "f32" => "float",
        "bool" => "bool",
        "PathBuf" => "path",
        "ByteSize" => "size",
        "Vec<PathBuf>" => "array of paths",
        "Vec<usize>" => "array of integers",
        "[f32; 2]" => "[float, float]",
        "DeviceUnits" => "integer or `\"auto\"`",
        "RopeScaling" => "inline table",
        _ => "string",
    }
    .to_string()
}

/// The unit of a key: from its type (sizes) or its name's suffix.
fn unit(name: &str, ty: &str) -> &'static str {
    if ty.contains("ByteSize") {
        "bytes (`\"8GiB\"`, `\"512 MiB\"` or a count)"
    } else if name.ends_with("_gbps") {
        "GB/s (10⁹ B/s)"
    } else if name.ends_with("_us") {
        "µs"
    } else if name.ends_with("_gflops") {
        "GFLOP/s (10⁹ FLOP/s)"
    } else if name.ends_with("steps") || name.ends_with("interval") {
        "steps"
    } else {
        ""
    }
}

/// A key of the reference.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    name: String,
    ty: String,
    unit: &'static str,
    /// `None`: required.
    default: Option<String>,
    meaning: String,
    doc: Vec<String>,
}

/// The keys of a section (the `[model]` section's are `family` and `init`, from the variants).
fn keys(section: &Section, item: &Item) -> Vec<Key> {
    if section.item == "ModelConfig" {
        let variants = |src: &str, name: &str| parse_item(src, name).members;
        let family: Vec<String> = variants(MODEL_RS, "ModelConfig").into_iter().flat_map(|v| v.doc).collect();
        let init = variants(MODEL_RS, "LlamaModelConfig").into_iter().find(|v| v.name == "Init").map(|v| v.doc);
        return vec![
            Key {
                name: "family".into(),
                ty: "string".into(),
                unit: "",
                default: Some("`\"gpt\"`".into()),
                meaning: joined(&family),
                doc: family,
            },
            Key {
                name: "init".into(),
                ty: "path".into(),
                unit: "",
                default: Some("none (from scratch)".into()),
                meaning: joined(init.as_deref().unwrap_or_default()),
                doc: init.unwrap_or_default(),
            },
        ];
    }
    item.members
        .iter()
        // `[model.moe]` has its own section; the Llama family's `family` is the `[model]` section's.
        .filter(|m| !(m.ty.contains("MoeModelConfig") || section.item == "LlamaConfig" && m.name == "family"))
        .map(|m| {
            let (meaning, documented) = split_default(&joined(&m.doc));
            let default = match (m.has_default, section.item.as_str(), m.name.as_str()) {
                // The loader sets the vocabulary from the tokenizer when it is absent.
                (_, "LlamaConfig", "vocab_size") => Some("0: the tokenizer's".into()),
                (_, "LlamaConfig", "num_local_experts") => Some("required with `family = \"mixtral\"`".into()),
                (false, ..) => None,
                (true, ..) => Some(documented.unwrap_or_else(|| "none".into())),
            };
            Key {
                name: m.name.clone(),
                ty: toml_type(&m.ty),
                unit: unit(&m.name, &m.ty),
                default,
                meaning,
                doc: m.doc.clone(),
            }
        })
        .collect()
}

fn header(section: &Section) -> String {
    if section.qualifier.is_empty() {
        format!("[{}]", section.table)
    } else {
        format!("[{}] ({})", section.table, section.qualifier)
    }
}

/// The config reference as Markdown: an introduction, then per table its doc comment and a table
/// of its keys (key, type, unit, default, meaning). What [`REFERENCE_PATH`] holds.
pub fn reference_markdown() -> String {
    let mut out = String::new();
    out.push_str("# Config reference\n\n");
    let _ = writeln!(
        out,
        "<!-- Generated from the config types' doc comments (src/config/, oogc-models' LlamaConfig) by `oogc config \
         --reference`; do not edit. Regenerate: `{REGENERATE}` -->\n"
    );
    for line in MOD_RS.lines().map_while(|l| l.strip_prefix("//!")) {
        let line = line.strip_prefix(' ').unwrap_or(line);
        if line.starts_with("Every table") {
            break;
        }
        let _ = writeln!(out, "{}", plain(line));
    }
    out.push_str("`oogc config --example` prints a commented config with every key, to start from.\n");
    for section in &sections() {
        let item = parse_item(section.source, &section.item);
        let _ = writeln!(out, "\n## `{}`\n", header(section));
        for line in &section_doc(&item.doc) {
            let _ = writeln!(out, "{}", plain(line));
        }
        out.push_str("\n| key | type | unit | default | meaning |\n|---|---|---|---|---|\n");
        for k in keys(section, &item) {
            let default = k.default.as_deref().unwrap_or("required");
            let cells = [format!("`{}`", k.name), k.ty, k.unit.to_string(), default.to_string(), k.meaning];
            let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
    }
    out
}

/// Prefixes each of `lines` with `# ` (a TOML comment); the lines of a code block are indented
/// by two more spaces (so that a key set there is not taken for one of the example's), its fences
/// left out.
fn commented(out: &mut String, lines: &[String], indent: &str) {
    let mut in_code = false;
    for l in lines {
        if l.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let pad = if l.is_empty() {
            ""
        } else if in_code {
            "   "
        } else {
            " "
        };
        let _ = writeln!(out, "{indent}#{pad}{}", plain(l));
    }
}

/// A commented TOML config with every table and key: required keys set to example values (the
/// main job's shape: the byte-level GPT), optional ones commented out at their default value
/// (when it has a TOML form) or with their type. It loads with [`super::TrainConfig::load`] as
/// written; uncommenting a default changes nothing.
pub fn example_toml() -> String {
    // The defaults as TOML values: the example's required keys loaded, then written back.
    let required: String = render_example(&toml::Table::new(), &toml::Table::new());
    let defaults = super::TrainConfig::from_toml_str(&required)
        .ok()
        .and_then(|c| toml::Table::try_from(&c).ok())
        .unwrap_or_default();
    let llama = toml::Table::try_from(oogc_models::llama::LlamaConfig::new(0, 128, 344, 4, 4)).unwrap_or_default();
    render_example(&defaults, &llama)
}

/// A TOML literal of `v`, floats in their shortest form (an f32 written back as f64 is
/// `0.949999988079071`: shown as `0.95`).
fn literal(v: &toml::Value) -> String {
    match v {
        toml::Value::Float(f) => {
            let short = if (*f as f32) as f64 == *f { format!("{}", *f as f32) } else { format!("{f}") };
            if short.contains(['.', 'e', 'n', 'i']) {
                short
            } else {
                format!("{short}.0")
            }
        }
        toml::Value::Array(a) => format!("[{}]", a.iter().map(literal).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

/// The example with `defaults` (the loaded config written back) and `llama` (a Llama config's
/// defaults) as the values of the commented-out keys.
fn render_example(defaults: &toml::Table, llama: &toml::Table) -> String {
    let mut out = String::from(
        "# oogc training config: every table and key (`oogc config --example`; the reference: \
         `oogc config --reference`).\n# Required keys are set; the others are commented out at their default.\n",
    );
    for section in &sections() {
        let item = parse_item(section.source, &section.item);
        let off = if section.optional { "# " } else { "" };
        out.push('\n');
        if section.item == "GptModelConfig" || section.item == "LlamaConfig" {
            let instead = if section.item == "LlamaConfig" { ", in place of the GPT's" } else { "" };
            let _ = writeln!(out, "# {} keys{instead}:", header(section));
        } else {
            commented(&mut out, &section_doc(&item.doc), "");
            let _ = writeln!(out, "{off}[{}]", section.table);
        }
        let table = if section.item == "LlamaConfig" {
            Some(llama)
        } else {
            section.table.split('.').try_fold(defaults, |t, k| t.get(k)?.as_table())
        };
        for k in keys(section, &item) {
            commented(&mut out, &k.doc, off);
            let example = REQUIRED_EXAMPLES.iter().find(|(key, _)| *key == format!("{}.{}", section.table, k.name));
            match (&k.default, example) {
                (None, Some((_, v))) => {
                    let _ = writeln!(out, "{off}{} = {v}", k.name);
                }
                _ => match table.and_then(|t| t.get(&k.name)) {
                    Some(v) => {
                        let _ = writeln!(out, "# {} = {}", k.name, literal(v));
                    }
                    None => {
                        let _ = writeln!(out, "# {} = <{}>", k.name, k.ty.replace('`', ""));
                    }
                },
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;

    #[test]
    fn the_example_loads_and_its_defaults_are_the_loaders() {
        let example = example_toml();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("example.toml");
        std::fs::write(&path, &example).unwrap();
        let cfg = TrainConfig::load(&path).unwrap_or_else(|e| panic!("{e}\n{example}"));
        assert_eq!(cfg.model.gpt().map(|g| g.d_model), Some(128));
        // Uncomment every `# key = value` of a table that is not itself commented out: the same
        // config (the written defaults are the loader's).
        let mut in_optional = false;
        let mut uncommented = String::new();
        let mut count = 0;
        for line in example.lines() {
            in_optional = if line.starts_with('[') {
                false
            } else {
                in_optional || line.starts_with("# [model.moe]") || line.starts_with("# [model] (family = \"llama\"")
            };
            match line.strip_prefix("# ") {
                Some(kv) if !in_optional && kv.contains(" = ") && !kv.contains(" = <") && !kv.starts_with('[') => {
                    let key = kv.split(" = ").next().unwrap_or_default();
                    if key.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit()) {
                        count += 1;
                        uncommented.push_str(kv);
                        uncommented.push('\n');
                        continue;
                    }
                }
                _ => {}
            }
            uncommented.push_str(line);
            uncommented.push('\n');
        }
        assert!(count >= 30, "only {count} defaults written:\n{example}");
        let explicit = TrainConfig::from_toml_str(&uncommented).unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
        let mut implicit = TrainConfig::from_toml_str(&example).unwrap();
        implicit.data.path = explicit.data.path.clone();
        assert_eq!(explicit, implicit, "{uncommented}");
    }

    #[test]
    fn every_table_and_every_written_key_is_in_the_reference() {
        let md = reference_markdown();
        let top = parse_item(MOD_RS, "TrainConfig");
        for table in top.members.iter().map(|m| &m.name) {
            assert!(md.contains(&format!("## `[{table}]")), "no section for [{table}]");
        }
        // Every key the loaded example writes back (serde's names) has a row in its section.
        let cfg = TrainConfig::from_toml_str(&example_toml()).unwrap();
        let written = toml::Table::try_from(&cfg).unwrap();
        let mut rows = 0;
        for (table, value) in &written {
            for key in value.as_table().unwrap().keys() {
                let row = format!("| `{key}` |");
                let section = md.split("\n## ").find(|s| s.starts_with(&format!("`[{table}]")) && s.contains(&row));
                assert!(section.is_some(), "[{table}] {key} is not in the reference");
                rows += 1;
            }
        }
        assert!(rows > 40, "{rows}");
        let llama = oogc_models::llama::LlamaConfig::new(8, 16, 32, 2, 2);
        let llama_section = md.split("\n## ").find(|s| s.starts_with("`[model] (family = \"llama\"")).unwrap();
        for key in toml::Table::try_from(&llama).unwrap().keys().filter(|k| *k != "family") {
            assert!(llama_section.contains(&format!("| `{key}` |")), "the Llama key {key} is not in the reference");
        }
    }

    #[test]
    fn every_optional_key_documents_its_default() {
        for section in sections().iter().filter(|s| s.item != "LlamaConfig") {
            for m in parse_item(section.source, &section.item).members {
                let doc = joined(&m.doc);
                let documented =
                    split_default(&doc).1.is_some() || m.ty.starts_with("Option<") || m.ty.starts_with("Vec<");
                assert!(!m.has_default || documented, "[{}] {}: no `Default:` in its doc", section.table, m.name);
            }
        }
    }

    #[test]
    fn defaults_and_types_are_read_from_the_doc_and_the_type() {
        let (meaning, default) = split_default("Peak learning rate. Default: 1e-3.");
        assert_eq!((meaning.as_str(), default.as_deref()), ("Peak learning rate.", Some("1e-3")));
        let (meaning, default) = split_default("Heads. Default (`None`): `n`. Must divide d.");
        assert_eq!((meaning.as_str(), default.as_deref()), ("Heads. Must divide d.", Some("`n`")));
        assert_eq!(toml_type("Option<ByteSize>"), "size");
        assert_eq!(unit("link_gbps", "f64"), "GB/s (10⁹ B/s)");
        let item = parse_item(MEMORY_RS, "PrefetchSection");
        let names: Vec<&str> = item.members.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["depth", "host_depth", "overlap_optimizer"]);
        assert!(item.members.iter().all(|m| m.has_default));
    }
}
