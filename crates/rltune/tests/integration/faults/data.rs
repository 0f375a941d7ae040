//! Prompt datasets and SFT / reward-model datasets with bad bytes, bad rows and huge lines.

use std::path::{Path, PathBuf};

use rltune::data::prompts::load_prompts;
use rltune::train::data::{read_reward_records, read_sft_records};

use super::{assert_contains_all, err_msg};

/// A 10 MB run of `a`.
fn ten_mb() -> String {
    "a".repeat(10 << 20)
}

/// Writes `bytes` to `name` in `dir`.
fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn prompts_err(path: &Path) -> String {
    err_msg(load_prompts(path.to_str().unwrap(), "text", None), &format!("loading {}", path.display()))
}

#[test]
fn bad_prompt_datasets_name_the_file_and_row() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, &str, Vec<u8>, Vec<&str>)> = vec![
        (
            "invalid UTF-8 in JSON lines",
            "p.jsonl",
            b"{\"text\": \"fine\"}\n{\"text\": \"caf\xe9\"}\n".to_vec(),
            vec!["p.jsonl", "line 2", "UTF-8", "re-encode"],
        ),
        (
            "invalid UTF-8 in a JSON array",
            "p.json",
            b"[{\"text\": \"fine\"},\n {\"text\": \"\xff\"}]".to_vec(),
            vec!["p.json", "line 2", "UTF-8", "re-encode"],
        ),
        (
            "invalid UTF-8 in CSV",
            "p.csv",
            b"id,text\n1,fine\n2,caf\xe9\n".to_vec(),
            vec!["p.csv", "line 3", "UTF-8"],
        ),
        ("only empty lines", "p.jsonl", b"\n   \n\n".to_vec(), vec!["p.jsonl", "no rows"]),
        ("an empty CSV text", "p.csv", b"id,text\n1,fine\n2,\n".to_vec(), vec!["p.csv", "line 3", "empty"]),
        (
            "missing column in JSON lines",
            "p.jsonl",
            b"{\"text\": \"a\"}\n{\"review\": \"b\"}\n".to_vec(),
            vec!["p.jsonl", "line 2", "no column \"text\"", "\"review\"", "text column"],
        ),
        (
            "missing column in a JSON array",
            "p.json",
            b"[{\"text\": \"a\"}, {\"review\": \"b\"}]".to_vec(),
            vec!["p.json", "row 2", "no column \"text\"", "\"review\""],
        ),
        (
            "missing column in CSV",
            "p.csv",
            b"id,review\n1,b\n".to_vec(),
            vec!["p.csv", "line 2", "no column \"text\"", "\"review\""],
        ),
        (
            "a number where the text belongs",
            "p.jsonl",
            b"{\"text\": 42}\n".to_vec(),
            vec!["p.jsonl", "line 1", "\"text\" is 42, not a string"],
        ),
        (
            "a row that is not an object",
            "p.jsonl",
            b"[\"text\"]\n".to_vec(),
            vec!["p.jsonl", "line 1", "JSON object"],
        ),
        (
            "a 10 MB row that is not an object",
            "p.jsonl",
            format!("\"{}\"\n", ten_mb()).into_bytes(),
            vec!["p.jsonl", "line 1", "JSON object"],
        ),
        (
            "a 10 MB line of broken JSON",
            "p.jsonl",
            format!("{{\"text\": \"{}\n", ten_mb()).into_bytes(),
            vec!["p.jsonl", "line 1", "invalid JSON"],
        ),
    ];
    for (name, file, bytes, parts) in cases {
        println!("--- {name}");
        let p = write(tmp.path(), file, &bytes);
        let err = prompts_err(&p);
        assert_contains_all(&err, &parts);
        assert!(err.len() < 2000, "{name}: the message quotes too much ({} bytes)", err.len());
    }
}

#[test]
fn a_10_mb_prompt_loads_whole() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    let big = ten_mb();
    let p = write(tmp.path(), "p.jsonl", format!("{{\"text\": \"short\"}}\n{{\"text\": \"{big}\"}}\n"));
    let rows = load_prompts(p.to_str().unwrap(), "text", None).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].text.len(), big.len());
}

#[test]
fn bad_sft_and_reward_datasets_name_the_file_and_line() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    type Reader = fn(&Path) -> rltune::Result<usize>;
    let sft: Reader = |p| read_sft_records(p).map(|v| v.len());
    let reward: Reader = |p| read_reward_records(p).map(|v| v.len());
    /// Name, reader, file name, contents, what the message must hold.
    type Case = (&'static str, Reader, &'static str, Vec<u8>, Vec<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "SFT .txt, invalid UTF-8",
            sft,
            "s.txt",
            b"fine\n\nna\xefve\n".to_vec(),
            vec!["s.txt", "line 3", "UTF-8", "re-encode"],
        ),
        (
            "SFT .jsonl, invalid UTF-8",
            sft,
            "s.jsonl",
            b"{\"text\": \"\xc3\x28\"}\n".to_vec(),
            vec!["s.jsonl", "line 1", "UTF-8", "re-encode"],
        ),
        ("SFT, only empty lines", sft, "s.jsonl", b"\n \n\t\n".to_vec(), vec!["s.jsonl", "no rows"]),
        (
            "SFT, missing text",
            sft,
            "s.jsonl",
            b"{\"text\": \"a\"}\n{\"body\": \"b\"}\n".to_vec(),
            vec!["s.jsonl", "line 2", "missing \"text\""],
        ),
        (
            "SFT, prompt without completion",
            sft,
            "s.jsonl",
            b"{\"prompt\": \"a\"}\n".to_vec(),
            vec!["s.jsonl", "line 1", "without \"completion\""],
        ),
        (
            "SFT, a number where text belongs",
            sft,
            "s.jsonl",
            b"{\"text\": \"a\"}\n{\"text\": 7}\n".to_vec(),
            vec!["s.jsonl", "line 2", "field \"text\" is 7, not a string"],
        ),
        (
            "SFT, a number where the completion belongs",
            sft,
            "s.jsonl",
            b"{\"prompt\": \"a\", \"completion\": 3.5}\n".to_vec(),
            vec!["s.jsonl", "line 1", "field \"completion\" is 3.5, not a string"],
        ),
        (
            "SFT, a 10 MB line of broken JSON",
            sft,
            "s.jsonl",
            format!("{{\"text\": \"{}\n", ten_mb()).into_bytes(),
            vec!["s.jsonl", "line 1", "expected"],
        ),
        (
            "reward, invalid UTF-8",
            reward,
            "r.jsonl",
            b"{\"text\": \"\xff\", \"label\": 1}\n".to_vec(),
            vec!["r.jsonl", "line 1", "UTF-8"],
        ),
        (
            "reward, a number where chosen belongs",
            reward,
            "r.jsonl",
            b"{\"chosen\": 1, \"rejected\": \"b\"}\n".to_vec(),
            vec!["r.jsonl", "line 1", "field \"chosen\" is 1, not a string"],
        ),
        (
            "reward, a list as label",
            reward,
            "r.jsonl",
            b"{\"text\": \"a\", \"label\": [1]}\n".to_vec(),
            vec!["r.jsonl", "line 1", "label [1]", "class name"],
        ),
        (
            "reward, missing rejected",
            reward,
            "r.jsonl",
            b"{\"chosen\": \"a\"}\n".to_vec(),
            vec!["r.jsonl", "line 1", "without \"rejected\""],
        ),
    ];
    for (name, read, file, bytes, parts) in cases {
        println!("--- {name}");
        let p = write(tmp.path(), file, &bytes);
        let err = err_msg(read(&p), name);
        assert_contains_all(&err, &parts);
        assert!(err.len() < 2000, "{name}: the message quotes too much ({} bytes)", err.len());
    }
}

#[test]
fn a_10_mb_sft_line_loads_whole() {
    crate::common::install();
    let tmp = tempfile::tempdir().unwrap();
    let p = write(tmp.path(), "s.txt", format!("short\n{}\n", ten_mb()));
    let recs = read_sft_records(&p).unwrap();
    assert_eq!(recs.len(), 2);
}
