//! Arrow IPC files as rows: the `data-0000x-of-0000n.arrow` files of a `datasets`
//! `save_to_disk` directory (the IPC stream format), or an IPC file (`ARROW1` magic).
//!
//! Values become JSON: strings, numbers, booleans, nulls, lists (`Sequence`) and structs (a
//! message `{"role", "content"}`); a dictionary column gives its values. Binary, temporal and
//! decimal columns are errors naming the column.

use std::io::BufReader;
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use serde_json::{Map, Value};

use super::Row;
use crate::error::{Error, Result};

/// Reads every record batch of `path` into rows.
pub(super) fn read_arrow(path: &Path) -> Result<Vec<Row>> {
    let bad =
        |e: arrow_schema::ArrowError| Error::data(path.display(), format!("invalid Arrow IPC data: {e}"));
    let open = || std::fs::File::open(path).map_err(|e| Error::io(path, e));
    let mut magic = [0u8; 6];
    let is_file = {
        use std::io::Read;
        open()?.read_exact(&mut magic).is_ok() && &magic == b"ARROW1"
    };
    let batches: Vec<RecordBatch> = if is_file {
        arrow_ipc::reader::FileReader::try_new(open()?, None)
            .map_err(bad)?
            .collect::<std::result::Result<_, _>>()
            .map_err(bad)?
    } else {
        arrow_ipc::reader::StreamReader::try_new(BufReader::new(open()?), None)
            .map_err(bad)?
            .collect::<std::result::Result<_, _>>()
            .map_err(bad)?
    };
    let mut rows = Vec::new();
    for batch in &batches {
        let schema = batch.schema();
        for i in 0..batch.num_rows() {
            let origin = format!("{} row {}", path.display(), rows.len() + 1);
            let mut fields = Map::new();
            for (field, column) in schema.fields().iter().zip(batch.columns()) {
                let v = value_at(column.as_ref(), i).map_err(|m| {
                    Error::data(
                        &origin,
                        format!(
                            "column {:?}: {m}; convert it to text or numbers before saving",
                            field.name()
                        ),
                    )
                })?;
                fields.insert(field.name().clone(), v);
            }
            rows.push(Row { fields, origin });
        }
    }
    Ok(rows)
}

fn num<T: Into<serde_json::Number>>(x: T) -> Value {
    Value::Number(x.into())
}

fn float(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Element `i` of `a` as JSON.
fn value_at(a: &dyn Array, i: usize) -> std::result::Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let list = |values: &dyn Array| -> std::result::Result<Value, String> {
        (0..values.len())
            .map(|j| value_at(values, j))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Value::Array)
    };
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => num(a.as_primitive::<Int8Type>().value(i)),
        DataType::Int16 => num(a.as_primitive::<Int16Type>().value(i)),
        DataType::Int32 => num(a.as_primitive::<Int32Type>().value(i)),
        DataType::Int64 => num(a.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => num(a.as_primitive::<UInt8Type>().value(i)),
        DataType::UInt16 => num(a.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt32 => num(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt64 => num(a.as_primitive::<UInt64Type>().value(i)),
        DataType::Float16 => float(a.as_primitive::<Float16Type>().value(i).to_f64()),
        DataType::Float32 => float(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => a.as_string::<i32>().value(i).into(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i).into(),
        DataType::Utf8View => a.as_string_view().value(i).into(),
        DataType::List(_) => list(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i).as_ref())?,
        DataType::FixedSizeList(_, _) => list(a.as_fixed_size_list().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut obj = Map::new();
            for (f, col) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), value_at(col.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        DataType::Dictionary(key, _) => {
            let (keys, values) = match key.as_ref() {
                DataType::Int8 => dict_key(a.as_dictionary::<Int8Type>(), i),
                DataType::Int16 => dict_key(a.as_dictionary::<Int16Type>(), i),
                DataType::Int32 => dict_key(a.as_dictionary::<Int32Type>(), i),
                DataType::Int64 => dict_key(a.as_dictionary::<Int64Type>(), i),
                DataType::UInt8 => dict_key(a.as_dictionary::<UInt8Type>(), i),
                DataType::UInt16 => dict_key(a.as_dictionary::<UInt16Type>(), i),
                DataType::UInt32 => dict_key(a.as_dictionary::<UInt32Type>(), i),
                DataType::UInt64 => dict_key(a.as_dictionary::<UInt64Type>(), i),
                other => return Err(format!("dictionary keys of type {other} are not supported")),
            };
            value_at(values, keys)?
        }
        other => return Err(format!("values of Arrow type {other} are not supported")),
    })
}

/// The value index of element `i` of a dictionary array, and its values.
fn dict_key<K: ArrowDictionaryKeyType>(d: &arrow_array::DictionaryArray<K>, i: usize) -> (usize, &dyn Array) {
    // `key` is None only for a null entry, which `value_at` answered before.
    (d.key(i).unwrap_or(0), d.values().as_ref())
}
