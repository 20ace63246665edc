//! Routing traces: which experts each step's router chose, for replay (`oogc bench moe`).
//!
//! Format `oogc-routing-1`, JSON Lines. The first line is the header
//!
//! ```text
//! {"format":"oogc-routing-1","blocks":B,"experts":E,"top_k":k,"expert_params":n,"expert_bytes":b,"flops_per_token":f,"tokens_per_step":T}
//! ```
//!
//! (`expert_bytes`: bytes of one expert's compute copy; `flops_per_token`: FLOPs of one token
//! through one expert, forward + backward; `tokens_per_step`: tokens per step entering each
//! block, so each block routes `k·T` assignments), then one object per (step, block, expert)
//! that received tokens, steps in non-decreasing order:
//!
//! ```text
//! {"step":s,"block":b,"expert":e,"tokens":n}
//! ```
//!
//! Experts with 0 tokens are left out. The trainer writes it with [`RoutingTraceWriter`]; the
//! benchmark reads it with [`read_trace`].

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::cost::ExpertShape;
use crate::error::{Error, Result};

/// The `format` of the header.
pub const TRACE_FORMAT: &str = "oogc-routing-1";

/// The first line of a trace: the model's MoE shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// MoE blocks.
    pub blocks: u32,
    /// Experts per block.
    pub experts: u32,
    /// Experts per token (top-k routing).
    pub top_k: u32,
    /// Parameters of one expert.
    pub expert_params: u64,
    /// Bytes of one expert's compute copy (what a fetch moves).
    pub expert_bytes: u64,
    /// FLOPs of one token through one expert, forward + backward (recompute included).
    pub flops_per_token: f64,
    /// Tokens per step entering each block.
    pub tokens_per_step: u64,
}

impl TraceHeader {
    /// A header with the format filled in.
    pub fn new(
        blocks: u32,
        experts: u32,
        top_k: u32,
        expert_params: u64,
        expert_bytes: u64,
        flops_per_token: f64,
        tokens_per_step: u64,
    ) -> Self {
        Self {
            format: TRACE_FORMAT.into(),
            blocks,
            experts,
            top_k,
            expert_params,
            expert_bytes,
            flops_per_token,
            tokens_per_step,
        }
    }

    /// The expert shape for a [`crate::CostModel`] (gradients as large as the compute copy).
    pub fn expert_shape(&self) -> ExpertShape {
        ExpertShape {
            param_bytes: self.expert_bytes,
            grad_bytes: self.expert_bytes,
            flops_per_token: self.flops_per_token,
        }
    }

    fn validate(&self, line: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::TraceFormat { line, reason });
        if self.format != TRACE_FORMAT {
            return bad(format!("format `{}` is not `{TRACE_FORMAT}`", self.format));
        }
        if self.blocks == 0 || self.experts == 0 {
            return bad(format!("{} blocks of {} experts: both must be at least 1", self.blocks, self.experts));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!("top_k {} must be in 1..={}", self.top_k, self.experts));
        }
        if self.expert_bytes == 0 || !(self.flops_per_token.is_finite() && self.flops_per_token > 0.0) {
            return bad("expert_bytes and flops_per_token must be positive".into());
        }
        Ok(())
    }
}

/// One line after the header: `tokens` of step `step` went to `expert` of `block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingRecord {
    /// Training step.
    pub step: u64,
    /// MoE block.
    pub block: u32,
    /// Expert within the block.
    pub expert: u32,
    /// Tokens routed (> 0).
    pub tokens: u64,
}

/// Writes a trace: the header at construction, then [`RoutingTraceWriter::record`] per step and
/// block. Call [`RoutingTraceWriter::finish`] to flush and see write errors.
#[derive(Debug)]
pub struct RoutingTraceWriter<W: Write> {
    out: W,
    header: TraceHeader,
    last_step: Option<u64>,
}

fn io(e: std::io::Error) -> Error {
    Error::Io { path: None, source: e }
}

impl RoutingTraceWriter<BufWriter<std::fs::File>> {
    /// Creates (truncates) `path` and writes the header.
    ///
    /// # Errors
    /// [`Error::Io`] naming the path; [`Error::TraceFormat`] for a bad header.
    pub fn create(path: &Path, header: TraceHeader) -> Result<Self> {
        let file = std::fs::File::create(path).map_err(|e| Error::Io { path: Some(path.into()), source: e })?;
        Self::new(BufWriter::new(file), header)
    }
}

impl<W: Write> RoutingTraceWriter<W> {
    /// Writes the header to `out`.
    ///
    /// # Errors
    /// [`Error::TraceFormat`] for a bad header (format, zero blocks or experts, top-k out of
    /// range, non-positive sizes); [`Error::Io`].
    pub fn new(mut out: W, header: TraceHeader) -> Result<Self> {
        header.validate(1)?;
        serde_json::to_writer(&mut out, &header).map_err(|e| io(e.into()))?;
        out.write_all(b"\n").map_err(io)?;
        Ok(Self { out, header, last_step: None })
    }

    /// The header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// Writes one line per expert of `block` with tokens in `tokens_per_expert` (zeros are left
    /// out). Steps must not go backwards.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a block or slice length that does not match the header;
    /// [`Error::Config`] for a step smaller than the last one; [`Error::Io`].
    pub fn record(&mut self, step: u64, block: u32, tokens_per_expert: &[u64]) -> Result<()> {
        if block >= self.header.blocks {
            return Err(Error::OutOfRange { what: "block", index: block.into(), len: self.header.blocks.into() });
        }
        if tokens_per_expert.len() != self.header.experts as usize {
            return Err(Error::OutOfRange {
                what: "tokens_per_expert.len()",
                index: tokens_per_expert.len() as u64,
                len: self.header.experts.into(),
            });
        }
        if self.last_step.is_some_and(|l| step < l) {
            return Err(crate::error::config(
                "step",
                format!("{step} after step {:?}: steps must not go backwards", self.last_step),
            ));
        }
        self.last_step = Some(step);
        for (e, &tokens) in tokens_per_expert.iter().enumerate() {
            if tokens > 0 {
                let r = RoutingRecord { step, block, expert: e as u32, tokens };
                serde_json::to_writer(&mut self.out, &r).map_err(|e| io(e.into()))?;
                self.out.write_all(b"\n").map_err(io)?;
            }
        }
        Ok(())
    }

    /// Flushes and returns the writer.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn finish(mut self) -> Result<W> {
        self.out.flush().map_err(io)?;
        Ok(self.out)
    }
}

/// A trace in memory: the header and, per step present, the tokens of every (block, expert).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingTrace {
    /// The header.
    pub header: TraceHeader,
    /// `(step, tokens)` in step order; `tokens[block * experts + expert]`.
    pub steps: Vec<(u64, Vec<u64>)>,
}

impl RoutingTrace {
    /// An empty trace of `header`'s shape.
    pub fn new(header: TraceHeader) -> Self {
        Self { header, steps: Vec::new() }
    }

    /// The tokens of `block`'s experts in the step at `index` (not the step number).
    ///
    /// # Panics
    /// When out of range.
    pub fn tokens(&self, index: usize, block: u32) -> &[u64] {
        let e = self.header.experts as usize;
        &self.steps[index].1[block as usize * e..(block as usize + 1) * e]
    }

    /// Writes the trace in the `oogc-routing-1` format.
    ///
    /// # Errors
    /// As [`RoutingTraceWriter`].
    pub fn write_to<W: Write>(&self, out: W) -> Result<W> {
        let mut w = RoutingTraceWriter::new(out, self.header.clone())?;
        for (step, tokens) in &self.steps {
            for b in 0..self.header.blocks {
                let e = self.header.experts as usize;
                w.record(*step, b, &tokens[b as usize * e..(b as usize + 1) * e])?;
            }
        }
        w.finish()
    }
}

/// Reads a trace in the `oogc-routing-1` format. Blank lines are skipped. A last line without
/// its newline that is not a record (the writer was killed mid-line) is tolerated: left out,
/// with a warning giving its byte offset.
///
/// # Errors
/// [`Error::TraceFormat`] naming the line for a missing or bad header, a line that is not a
/// record, a block or expert out of range, a step that goes backwards, a repeated (step, block,
/// expert) or 0 tokens; [`Error::Io`].
pub fn read_trace<R: BufRead>(input: R) -> Result<RoutingTrace> {
    read_trace_named(input, None)
}

fn read_trace_named<R: BufRead>(mut input: R, name: Option<&Path>) -> Result<RoutingTrace> {
    let mut trace: Option<RoutingTrace> = None;
    let mut buf = Vec::new();
    let (mut n, mut offset) = (0usize, 0u64);
    loop {
        buf.clear();
        let read = input.read_until(b'\n', &mut buf).map_err(io)?;
        if read == 0 {
            break;
        }
        n += 1;
        let line_offset = offset;
        offset += read as u64;
        let torn = buf.last() != Some(&b'\n');
        match parse_line(&mut trace, &buf, n) {
            Ok(()) => {}
            Err(e @ Error::TraceFormat { .. }) if torn && trace.is_some() => {
                let file =
                    name.map_or_else(|| "routing trace".to_string(), |p| format!("routing trace {}", p.display()));
                tracing::warn!(
                    "{file}: torn last line {n} at byte offset {line_offset} ({read} bytes, no newline: the run was \
                     killed while writing it) ignored: {e}"
                );
                break;
            }
            Err(e) => return Err(e),
        }
    }
    trace.ok_or(Error::TraceFormat { line: 1, reason: "empty trace: no header".into() })
}

/// One line of a trace: the header (when `trace` is still `None`) or a record.
fn parse_line(trace: &mut Option<RoutingTrace>, bytes: &[u8], n: usize) -> Result<()> {
    let bad = |reason: String| Error::TraceFormat { line: n, reason };
    let line = std::str::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8: {e}")))?;
    if line.trim().is_empty() {
        return Ok(());
    }
    let Some(t) = trace.as_mut() else {
        let h: TraceHeader = serde_json::from_str(line).map_err(|e| bad(format!("not a header: {e}")))?;
        h.validate(n)?;
        *trace = Some(RoutingTrace::new(h));
        return Ok(());
    };
    let r: RoutingRecord = serde_json::from_str(line).map_err(|e| bad(format!("not a record: {e}")))?;
    let (blocks, experts) = (t.header.blocks, t.header.experts);
    if r.block >= blocks || r.expert >= experts {
        return Err(bad(format!("block {} expert {} outside {blocks} blocks of {experts} experts", r.block, r.expert)));
    }
    if r.tokens == 0 {
        return Err(bad("a record with 0 tokens (leave such experts out)".into()));
    }
    match t.steps.last() {
        Some(&(s, _)) if r.step < s => return Err(bad(format!("step {} after step {s}", r.step))),
        Some(&(s, _)) if r.step == s => {}
        _ => t.steps.push((r.step, vec![0; blocks as usize * experts as usize])),
    }
    let slot = &mut t.steps.last_mut().expect("pushed above").1[(r.block * experts + r.expert) as usize];
    if *slot != 0 {
        return Err(bad(format!("step {} block {} expert {} appears twice", r.step, r.block, r.expert)));
    }
    *slot = r.tokens;
    Ok(())
}

/// [`read_trace`] from a file (a torn last line's warning names the file).
///
/// # Errors
/// As [`read_trace`]; [`Error::Io`] naming the path.
pub fn read_trace_file(path: &Path) -> Result<RoutingTrace> {
    let file = std::fs::File::open(path).map_err(|e| Error::Io { path: Some(path.into()), source: e })?;
    read_trace_named(BufReader::new(file), Some(path)).map_err(|e| match e {
        Error::Io { path: None, source } => Error::Io { path: Some(path.into()), source },
        e => e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> TraceHeader {
        TraceHeader::new(2, 3, 2, 1000, 4000, 8000.0, 5)
    }

    #[test]
    fn round_trip() {
        let mut w = RoutingTraceWriter::new(Vec::new(), header()).unwrap();
        w.record(0, 0, &[5, 5, 0]).unwrap();
        w.record(0, 1, &[0, 10, 0]).unwrap();
        w.record(3, 1, &[1, 0, 9]).unwrap();
        let bytes = w.finish().unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        let first = text.lines().next().unwrap();
        assert_eq!(
            first,
            r#"{"format":"oogc-routing-1","blocks":2,"experts":3,"top_k":2,"expert_params":1000,"expert_bytes":4000,"flops_per_token":8000.0,"tokens_per_step":5}"#
        );
        assert_eq!(text.lines().nth(1).unwrap(), r#"{"step":0,"block":0,"expert":0,"tokens":5}"#);
        assert_eq!(text.lines().count(), 1 + 5, "zeros are left out");
        let t = read_trace(&bytes[..]).unwrap();
        assert_eq!(t.header, header());
        assert_eq!(t.steps.len(), 2);
        assert_eq!(t.tokens(0, 0), &[5, 5, 0]);
        assert_eq!(t.tokens(0, 1), &[0, 10, 0]);
        assert_eq!((t.steps[1].0, t.tokens(1, 0), t.tokens(1, 1)), (3, &[0, 0, 0][..], &[1, 0, 9][..]));
        let again = read_trace(&t.write_to(Vec::new()).unwrap()[..]).unwrap();
        assert_eq!(again, t);
    }

    #[test]
    fn bad_traces_name_the_line() {
        let h = serde_json::to_string(&header()).unwrap();
        for (body, line, what) in [
            ("".to_string(), 1, "empty"),
            (r#"{"format":"x","blocks":1}"#.to_string(), 1, "header"),
            (format!("{h}\n{{\"step\":0,\"block\":2,\"expert\":0,\"tokens\":1}}"), 2, "outside"),
            (format!("{h}\n{{\"step\":1,\"block\":0,\"expert\":0,\"tokens\":1}}\n{{\"step\":0,\"block\":0,\"expert\":1,\"tokens\":1}}"), 3, "after step"),
            (format!("{h}\n\n{{\"step\":0,\"block\":0,\"expert\":0,\"tokens\":1}}\n{{\"step\":0,\"block\":0,\"expert\":0,\"tokens\":2}}"), 4, "twice"),
            (format!("{h}\n{{\"step\":0,\"block\":0,\"expert\":0,\"tokens\":0}}"), 2, "0 tokens"),
            (format!("{h}\nnot json"), 2, "not a record"),
        ] {
            // Complete lines (a torn last line, without its newline, is tolerated).
            match read_trace(format!("{body}\n").as_bytes()) {
                Err(Error::TraceFormat { line: l, reason }) => {
                    assert_eq!(l, line, "{body}: {reason}");
                    assert!(reason.contains(what), "{reason} lacks {what}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        let mut w = RoutingTraceWriter::new(Vec::new(), header()).unwrap();
        assert!(w.record(0, 5, &[1, 1, 1]).is_err());
        assert!(w.record(0, 0, &[1]).is_err());
        w.record(2, 0, &[1, 1, 1]).unwrap();
        assert!(w.record(1, 0, &[1, 1, 1]).is_err());
    }

    #[test]
    fn a_torn_last_line_is_tolerated_but_a_bad_complete_line_is_not() {
        let h = serde_json::to_string(&header()).unwrap();
        let whole = format!("{h}\n{{\"step\":0,\"block\":0,\"expert\":0,\"tokens\":5}}\n");
        let torn = format!("{whole}{{\"step\":1,\"block\":0,\"exp");
        let t = read_trace(torn.as_bytes()).unwrap();
        assert_eq!(t, read_trace(whole.as_bytes()).unwrap());
        assert_eq!(t.steps.len(), 1);
        // The same text with its newline is a complete line: an error naming it.
        let bad = format!("{torn}\n");
        assert!(matches!(read_trace(bad.as_bytes()), Err(Error::TraceFormat { line: 3, .. })));
        // A torn header is not a trace.
        assert!(read_trace(&h.as_bytes()[..10]).is_err());
    }
}
