//! Tests of prompt loading: each format, each error, split selection, the hub cache offline,
//! and the length sampler.

use std::path::Path;

use rand::SeedableRng;
use serde_json::json;

use super::*;
use crate::data::hub::{parse_hub_id, Hub};
use crate::data::rows::read_file;
use crate::models::hub::HubOptions;

/// Writes `files` (name, contents) into a fresh temporary directory.
fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        let p = dir.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

fn load(dir: &Path, name: &str, column: &str) -> Result<Vec<PromptRow>> {
    load_prompts(dir.join(name).to_str().unwrap(), column, None)
}

fn err(dir: &Path, name: &str, column: &str) -> String {
    load(dir, name, column).unwrap_err().to_string()
}

#[test]
fn jsonl_rows_keep_the_whole_row_as_meta() {
    let d = dir_with(&[(
        "p.jsonl",
        "{\"q\": \"What is 2+2?\", \"answer\": \"4\", \"n\": 1}\n\n{\"q\": \"Hi\"}\n",
    )]);
    let rows = load(d.path(), "p.jsonl", "q").unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].text, "What is 2+2?");
    assert_eq!(rows[0].meta, json!({"q": "What is 2+2?", "answer": "4", "n": 1}));
    assert_eq!(rows[1], PromptRow { text: "Hi".into(), meta: json!({"q": "Hi"}) });
}

#[test]
fn json_reads_arrays_and_json_lines() {
    let d = dir_with(&[
        ("a.json", " [{\"text\": \"a\"}, {\"text\": \"b\", \"x\": [1]}]"),
        ("l.JSON", "{\"text\": \"c\"}\n"),
    ]);
    let rows = load(d.path(), "a.json", "text").unwrap();
    assert_eq!(rows.iter().map(|r| r.text.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(rows[1].meta["x"], json!([1]));
    assert_eq!(load(d.path(), "l.JSON", "text").unwrap()[0].text, "c");
    let d = dir_with(&[("a.json", "[{\"text\": \"a\"}, {\"t\": \"b\"}]")]);
    let e = err(d.path(), "a.json", "text");
    assert!(e.contains("row 2") && e.contains("\"t\""), "{e}");
}

#[test]
fn csv_rows_are_string_maps_from_the_header() {
    let csv = "prompt,answer\n\"Hello, world\",42\nsecond line,\"multi\nline\"\n";
    let d = dir_with(&[("p.csv", csv)]);
    let rows = load(d.path(), "p.csv", "prompt").unwrap();
    assert_eq!(rows[0].text, "Hello, world");
    assert_eq!(rows[0].meta, json!({"prompt": "Hello, world", "answer": "42"}));
    assert_eq!(rows[1].meta["answer"], "multi\nline");
}

#[test]
fn csv_errors_name_header_and_line() {
    let d = dir_with(&[
        ("h.csv", "question,answer\nq,a\n"),
        ("r.csv", "text,b\nx,1\ny\n"),
        ("e.csv", "text,b\nx,1\n  ,2\n"),
    ]);
    let e = err(d.path(), "h.csv", "prompt");
    assert!(e.contains("h.csv line 2") && e.contains("\"answer\", \"question\""), "{e}");
    let e = err(d.path(), "r.csv", "text");
    assert!(e.contains("r.csv") && e.contains("line: 3"), "{e}");
    let e = err(d.path(), "e.csv", "text");
    assert!(e.contains("line 3") && e.contains("empty"), "{e}");
}

#[test]
fn jsonl_errors_name_the_line_and_columns() {
    let d = dir_with(&[
        ("missing.jsonl", "{\"text\": \"ok\"}\n{\"prompt\": \"x\", \"id\": 2}\n"),
        ("empty.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"  \"}\n"),
        ("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": oops}\n"),
        ("number.jsonl", "{\"text\": 5}\n"),
        ("array.jsonl", "[\"text\"]\n"),
        ("none.jsonl", "\n\n"),
    ]);
    let cases = [
        (
            "missing.jsonl",
            &["missing.jsonl line 2", "no column \"text\"", "columns present: \"id\", \"prompt\""][..],
        ),
        ("empty.jsonl", &["line 3", "is empty"]),
        ("bad.jsonl", &["bad.jsonl line 2", "invalid JSON"]),
        ("number.jsonl", &["line 1", "is 5, not a string"]),
        ("array.jsonl", &["line 1", "JSON object"]),
        ("none.jsonl", &["no rows"]),
    ];
    for (file, wants) in cases {
        let e = err(d.path(), file, "text");
        for want in wants {
            assert!(e.contains(want), "{file}: want {want:?} in {e}");
        }
    }
}

#[test]
fn missing_files_and_unknown_extensions_are_named() {
    let d = dir_with(&[("p.xml", "hello\n")]);
    let e = err(d.path(), "p.xml", "text");
    assert!(e.contains("p.xml") && e.contains(".jsonl, .json, .csv, .parquet, .arrow"), "{e}");
    let e = err(d.path(), "nope.jsonl", "text");
    assert!(e.contains("nope.jsonl") && e.contains("no such data file"), "{e}");
    // Looks like `owner/name` but has a data extension: a missing local file, not a hub id.
    let e = load_prompts("data/prompts.jsonl", "text", None).unwrap_err().to_string();
    assert!(e.starts_with("data/prompts.jsonl: no such data file"), "{e}");
}

#[cfg(feature = "parquet")]
#[test]
fn parquet_rows_become_json_objects() {
    use std::sync::Arc;

    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;

    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("train-00000-of-00001.parquet");
    let schema = "message schema { REQUIRED BYTE_ARRAY text (UTF8); REQUIRED INT64 id; }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut writer = SerializedFileWriter::new(std::fs::File::create(&path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut col = group.next_column().unwrap().unwrap();
    let texts = [ByteArray::from("first prompt"), ByteArray::from("")];
    col.typed::<ByteArrayType>().write_batch(&texts, None, None).unwrap();
    col.close().unwrap();
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<Int64Type>().write_batch(&[7, 8], None, None).unwrap();
    col.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
    let e = load(d.path(), "train-00000-of-00001.parquet", "text").unwrap_err().to_string();
    assert!(e.contains("row 2") && e.contains("empty"), "{e}");
    let e = load(d.path(), "train-00000-of-00001.parquet", "prompt").unwrap_err().to_string();
    assert!(e.contains("row 1") && e.contains("\"id\", \"text\""), "{e}");
    std::fs::write(d.path().join("bad.parquet"), b"not parquet").unwrap();
    assert!(err(d.path(), "bad.parquet", "text").contains("invalid Parquet"));
}

#[cfg(feature = "parquet")]
#[test]
fn parquet_reads_text_and_other_columns() {
    // A snappy file as `datasets` writes it is read through the same row API; see above for the
    // writer. Here: the happy path on a one-row file.
    use std::sync::Arc;

    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;

    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("p.parquet");
    let schema = "message schema { OPTIONAL BYTE_ARRAY review (UTF8); OPTIONAL BYTE_ARRAY label (UTF8); }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props =
        Arc::new(WriterProperties::builder().set_compression(parquet::basic::Compression::SNAPPY).build());
    let mut writer = SerializedFileWriter::new(std::fs::File::create(&path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for value in ["a fine film", "pos"] {
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&[ByteArray::from(value)], Some(&[1]), None).unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
    let rows = load(d.path(), "p.parquet", "review").unwrap();
    assert_eq!(
        rows,
        vec![PromptRow {
            text: "a fine film".into(),
            meta: json!({"review": "a fine film", "label": "pos"})
        }]
    );
}

#[cfg(not(feature = "parquet"))]
#[test]
fn parquet_without_the_feature_says_how_to_enable_it() {
    let d = dir_with(&[("p.parquet", "PAR1")]);
    let e = err(d.path(), "p.parquet", "text");
    assert!(
        e.contains("`parquet` cargo feature") && e.contains("rltune-cli") && e.contains("to_json"),
        "{e}"
    );
}

#[test]
fn directories_load_the_split_files() {
    let d = dir_with(&[
        ("data/train-00000-of-00002.jsonl", "{\"text\": \"t1\"}\n"),
        ("data/train-00001-of-00002.jsonl", "{\"text\": \"t2\"}\n"),
        ("data/test-00000-of-00001.jsonl", "{\"text\": \"e1\"}\n"),
        ("README.md", "# card\n"),
        (".hidden/train.jsonl", "{\"text\": \"hidden\"}\n"),
    ]);
    let src = d.path().to_str().unwrap();
    let texts =
        |split| load_prompts(src, "text", split).unwrap().into_iter().map(|r| r.text).collect::<Vec<_>>();
    assert_eq!(texts(None), ["t1", "t2"]);
    assert_eq!(texts(Some("test")), ["e1"]);
    let e = load_prompts(src, "text", Some("validation")).unwrap_err().to_string();
    assert!(e.contains("no data files for split \"validation\"") && e.contains("data/test-00000"), "{e}");
    let one = dir_with(&[("prompts.csv", "text\nhello\n")]);
    assert_eq!(load_prompts(one.path().to_str().unwrap(), "text", None).unwrap()[0].text, "hello");
}

#[test]
fn select_split_files_follows_hub_layouts() {
    let files = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let hub = files(&[
        ".gitattributes",
        "README.md",
        "plain_text/train-00000-of-00001.parquet",
        "plain_text/test-00000-of-00001.parquet",
        "plain_text/unsupervised-00000-of-00001.parquet",
    ]);
    assert_eq!(select_split_files(&hub, None).unwrap(), ["plain_text/train-00000-of-00001.parquet"]);
    assert_eq!(select_split_files(&hub, Some("test")).unwrap(), ["plain_text/test-00000-of-00001.parquet"]);
    let dirs = files(&["train/0001.jsonl", "train/0000.jsonl", "test/0000.jsonl", "training.jsonl"]);
    assert_eq!(select_split_files(&dirs, Some("train")).unwrap(), ["train/0000.jsonl", "train/0001.jsonl"]);
    let flat = files(&["train.csv", "train_extra.csv", "validation.csv"]);
    assert_eq!(select_split_files(&flat, None).unwrap(), ["train.csv", "train_extra.csv"]);
    let configs = files(&["a/train.jsonl", "b/train.jsonl"]);
    let e = select_split_files(&configs, None).unwrap_err().to_string();
    assert!(e.contains("several folders") && e.contains("a/train.jsonl, b/train.jsonl"), "{e}");
    let e = select_split_files(&files(&["README.md"]), None).unwrap_err().to_string();
    assert!(e.contains("no data files") && e.contains("1 files"), "{e}");
}

#[test]
fn hub_ids_are_told_from_paths() {
    assert_eq!(parse_hub_id("stanfordnlp/imdb"), Some(("stanfordnlp/imdb", None)));
    assert_eq!(parse_hub_id("o/n:data/x.jsonl"), Some(("o/n", Some("data/x.jsonl"))));
    for not_hub in ["./a/b", "/abs/x", "a/b/c", "data/prompts.jsonl", "o/n:", "noslash", "o/n n"] {
        assert_eq!(parse_hub_id(not_hub), None, "{not_hub}");
    }
}

/// A hub cache holding dataset `o/prompts` at a fake commit, with `files`.
fn hub_cache(files: &[(&str, &str)]) -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("datasets--o--prompts");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc123").unwrap();
    for (name, text) in files {
        let p = repo.join("snapshots/abc123").join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    cache
}

#[test]
fn hub_datasets_load_offline_from_the_cache() {
    let cache = hub_cache(&[
        ("data/train-00000-of-00001.jsonl", "{\"question\": \"q1\", \"answer\": \"a1\"}\n"),
        ("data/test-00000-of-00001.jsonl", "{\"question\": \"q2\", \"answer\": \"a2\"}\n"),
        ("README.md", "card"),
    ]);
    let options =
        HubOptions { offline: true, cache_dir: Some(cache.path().to_path_buf()), ..HubOptions::default() };
    let hub = Hub::new(options).unwrap();
    let load = |id: &str, file: Option<&str>, split: Option<&str>| -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for f in hub.files(id, file, split)? {
            rows.extend(read_file(&f)?);
        }
        Ok(rows)
    };
    let rows = load("o/prompts", None, None).unwrap();
    assert_eq!(rows[0].to_value(), json!({"question": "q1", "answer": "a1"}));
    let rows = load("o/prompts", Some("data/test-00000-of-00001.jsonl"), None).unwrap();
    assert_eq!(rows[0].fields["question"], "q2");
    let e = load("o/prompts", Some("data/missing.jsonl"), None).unwrap_err().to_string();
    assert!(
        e.contains("\"data/missing.jsonl\"") && e.contains("HF_HUB_OFFLINE") && e.contains("local path"),
        "{e}"
    );
    let e = load("o/other", None, None).unwrap_err().to_string();
    assert!(
        e.contains("\"o/other\"") && e.contains("file list") && e.contains("o/other:path/in/repo.jsonl"),
        "{e}"
    );
    let e = load("o/prompts", None, Some("dev")).unwrap_err().to_string();
    assert!(e.contains("hub dataset \"o/prompts\"") && e.contains("split \"dev\""), "{e}");
}

#[test]
fn length_sampler_is_uniform_over_min_to_max_exclusive() {
    let s = LengthSampler::new(2, 8).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut counts = [0usize; 10];
    for _ in 0..6000 {
        counts[s.sample(&mut rng)] += 1;
    }
    assert_eq!(&counts[..2], &[0, 0]);
    assert_eq!(&counts[8..], &[0, 0], "max is exclusive");
    assert!(counts[2..8].iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
    assert_eq!((s.min(), s.max()), (2, 8));
    let e = LengthSampler::new(4, 4).unwrap_err().to_string();
    assert!(e.contains("exclusive"), "{e}");
    // Same seed, same lengths.
    let draw = |seed| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..5).map(|_| s.sample(&mut rng)).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
}

#[test]
fn truncate_to_sampled_length_keeps_a_prefix() {
    let ids: Vec<u32> = (10..30).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let s = LengthSampler::new(2, 5).unwrap();
    for _ in 0..20 {
        let q = truncate_to_sampled_length(&ids, &s, &mut rng);
        assert!((2..5).contains(&q.len()) && ids.starts_with(q));
    }
    let short = [1u32];
    assert_eq!(truncate_to_sampled_length(&short, &s, &mut rng), &[1]);
}
