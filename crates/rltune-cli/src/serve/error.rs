//! HTTP errors as OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`.

use serde_json::{json, Value};

/// An error answered to a client: the status and OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// What is wrong and, where there is one, the fix.
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `not_found_error`, `server_error`, …
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, …).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: a bad request, naming the field.
    pub fn bad(message: String, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message,
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 400 with `code: context_length_exceeded` (OpenAI's answer to a prompt too long).
    pub fn context_length(message: String, param: &str) -> Self {
        Self { code: Some("context_length_exceeded"), ..Self::bad(message, Some(param)) }
    }

    /// 404: no such route or model.
    pub fn not_found(message: String, code: &'static str, param: Option<&str>) -> Self {
        Self {
            status: 404,
            message,
            kind: "not_found_error",
            param: param.map(str::to_string),
            code: Some(code),
        }
    }

    /// 405: the route exists, not with this method.
    pub fn method_not_allowed(method: &str, path: &str, allowed: &str) -> Self {
        Self {
            status: 405,
            message: format!("{method} is not allowed on {path}; use {allowed}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: 413,
            message: format!(
                "the request body is over the server's limit of {limit} bytes (--max-body-bytes)"
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 500: the server failed (the model worker reports why).
    pub fn internal(message: String) -> Self {
        Self { status: 500, message, kind: "server_error", param: None, code: None }
    }

    /// 503: the server is busy or shutting down; try again.
    pub fn unavailable(message: String) -> Self {
        Self { status: 503, message, kind: "server_error", param: None, code: Some("unavailable") }
    }

    /// OpenAI's error object.
    pub fn to_json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_serialize_as_openai_error_objects() {
        let e = ApiError::context_length("too long".into(), "prompt");
        assert_eq!(e.status, 400);
        assert_eq!(
            e.to_json(),
            json!({"error": {"message": "too long", "type": "invalid_request_error", "param": "prompt",
                             "code": "context_length_exceeded"}})
        );
        let e = ApiError::method_not_allowed("GET", "/v1/completions", "POST");
        assert_eq!((e.status, e.to_json()["error"]["param"].clone()), (405, Value::Null));
    }
}
