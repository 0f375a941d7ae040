//! Tests of the row reader: column mapping, text files, `save_to_disk` directories and their
//! errors, Arrow IPC written here (the `datasets` files are compared in the integration test
//! `datasets_parity.rs`).

use serde_json::json;

use super::*;

fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        let p = dir.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

fn read(path: &Path, opts: &DataOptions) -> Result<Vec<Row>> {
    read_rows(path.to_str().unwrap(), opts)
}

#[test]
fn columns_are_renamed_and_a_missing_one_is_named() {
    let d = dir_with(&[("q.jsonl", "{\"question\": \"2+2?\", \"solution\": \"4\"}\n{\"q\": \"x\"}\n")]);
    let mut columns = ColumnMap::default();
    columns.0.insert("prompt".into(), "question".into());
    columns.0.insert("answer".into(), "solution".into());
    let opts = DataOptions { columns, ..Default::default() };
    let e = read(&d.path().join("q.jsonl"), &opts).unwrap_err().to_string();
    assert!(
        e.contains("q.jsonl line 2") && e.contains("no column \"solution\"") && e.contains("[data] columns"),
        "{e}"
    );
    std::fs::write(d.path().join("q.jsonl"), "{\"question\": \"2+2?\", \"solution\": \"4\", \"id\": 1}\n")
        .unwrap();
    let rows = read(&d.path().join("q.jsonl"), &opts).unwrap();
    assert_eq!(rows[0].to_value(), json!({"prompt": "2+2?", "answer": "4", "id": 1}));
}

#[test]
fn text_files_are_one_row_per_line() {
    let d = dir_with(&[("t.txt", "one two\n\n  \nthree\n")]);
    let rows = read(&d.path().join("t.txt"), &DataOptions::default()).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.to_value()).collect::<Vec<_>>(),
        [json!({"text": "one two"}), json!({"text": "three"})]
    );
    assert!(rows[1].origin.ends_with("t.txt line 4"), "{}", rows[1].origin);
}

#[test]
fn json_lines_with_nan_say_why() {
    let d = dir_with(&[("n.jsonl", "{\"x\": 1}\n{\"x\": NaN}\n")]);
    let e = read(&d.path().join("n.jsonl"), &DataOptions::default()).unwrap_err().to_string();
    assert!(e.contains("n.jsonl line 2") && e.contains("NaN or Infinity"), "{e}");
}

#[test]
fn save_to_disk_directories_that_are_broken_are_named() {
    let d = dir_with(&[("dd/dataset_dict.json", "{\"splits\": [\"train\"]}"), ("dd/train/state.json", "{}")]);
    let e = read(&d.path().join("dd"), &DataOptions::default()).unwrap_err().to_string();
    assert!(e.contains("state.json") && e.contains("_data_files"), "{e}");
    let opts = DataOptions { split: Some("test".into()), ..Default::default() };
    let e = read(&d.path().join("dd"), &opts).unwrap_err().to_string();
    assert!(e.contains("no split \"test\"") && e.contains("\"train\""), "{e}");
    let d = dir_with(&[("dd/dataset_dict.json", "[1]")]);
    let e = read(&d.path().join("dd"), &DataOptions::default()).unwrap_err().to_string();
    assert!(e.contains("dataset_dict.json") && e.contains("\"splits\""), "{e}");
    let d = dir_with(&[(
        "s/state.json",
        "{\"_data_files\": [{\"filename\": \"data-00000-of-00001.arrow\"}], \"_indices_data_files\": [{\"filename\": \"i.arrow\"}]}",
    )]);
    let e = read(&d.path().join("s"), &DataOptions::default()).unwrap_err().to_string();
    assert!(e.contains("flatten_indices"), "{e}");
}

#[cfg(feature = "arrow")]
mod arrow_files {
    use std::sync::Arc;

    use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Fields, Schema};

    use super::*;

    /// A batch with a text column, an integer column and a `messages` column (list of structs).
    fn batch() -> RecordBatch {
        let fields = Fields::from(vec![
            Field::new("content", DataType::Utf8, true),
            Field::new("role", DataType::Utf8, true),
        ]);
        let mut messages = ListBuilder::new(StructBuilder::from_fields(fields.clone(), 2));
        for (role, content) in [("user", "Hi"), ("assistant", "Hello")] {
            let s = messages.values();
            s.field_builder::<StringBuilder>(0).unwrap().append_value(content);
            s.field_builder::<StringBuilder>(1).unwrap().append_value(role);
            s.append(true);
        }
        messages.append(true);
        let s = messages.values();
        s.field_builder::<StringBuilder>(0).unwrap().append_null();
        s.field_builder::<StringBuilder>(1).unwrap().append_value("user");
        s.append(true);
        messages.append(true);
        let messages: ArrayRef = Arc::new(messages.finish());
        let schema = Schema::new(vec![
            Field::new("text", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
            Field::new("messages", messages.data_type().clone(), true),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(StringArray::from(vec![Some("a"), None])),
                Arc::new(Int64Array::from(vec![1, -2])),
                messages,
            ],
        )
        .unwrap()
    }

    #[test]
    fn arrow_stream_and_file_formats_become_json_rows() {
        let d = tempfile::tempdir().unwrap();
        let b = batch();
        let stream = d.path().join("data-00000-of-00001.arrow");
        let mut w =
            arrow_ipc::writer::StreamWriter::try_new(std::fs::File::create(&stream).unwrap(), &b.schema())
                .unwrap();
        w.write(&b).unwrap();
        w.finish().unwrap();
        let file = d.path().join("f.arrow");
        let mut w =
            arrow_ipc::writer::FileWriter::try_new(std::fs::File::create(&file).unwrap(), &b.schema())
                .unwrap();
        w.write(&b).unwrap();
        w.finish().unwrap();
        let want = vec![
            json!({"text": "a", "n": 1, "messages": [
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}),
            json!({"text": null, "n": -2, "messages": [{"role": "user", "content": null}]}),
        ];
        for p in [&stream, &file] {
            let rows = read(p, &DataOptions::default()).unwrap();
            assert_eq!(rows.iter().map(|r| r.to_value()).collect::<Vec<_>>(), want, "{}", p.display());
            assert!(rows[1].origin.ends_with(".arrow row 2"), "{}", rows[1].origin);
        }
        // A `Dataset.save_to_disk` directory around the stream file.
        std::fs::write(
            d.path().join("state.json"),
            "{\"_data_files\": [{\"filename\": \"data-00000-of-00001.arrow\"}]}",
        )
        .unwrap();
        let rows = read(d.path(), &DataOptions::default()).unwrap();
        assert_eq!(rows.len(), 2);
        std::fs::write(d.path().join("bad.arrow"), b"not arrow at all").unwrap();
        let e = read(&d.path().join("bad.arrow"), &DataOptions::default()).unwrap_err().to_string();
        assert!(e.contains("bad.arrow") && e.contains("invalid Arrow"), "{e}");
    }
}
