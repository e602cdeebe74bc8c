//! Errors answered in OpenAI's shape (or Anthropic's, on its routes).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered in OpenAI's shape.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) kind: &'static str,
    pub(super) message: String,
    /// In Anthropic's shape instead.
    pub(super) anthropic: bool,
    /// OpenAI's stable `code` for the error (`model_not_found`), where it has one.
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn anthropic(mut self) -> Self {
        self.anthropic = true;
        self
    }

    pub(super) fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        tracing::info!(status = self.status.as_u16(), kind = self.kind, message = %self.message, "request refused");
        let body = if self.anthropic {
            let kind = if self.kind == "server_error" {
                "api_error"
            } else {
                self.kind
            };
            json!({"type": "error", "error": {"type": kind, "message": self.message}})
        } else {
            json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.code}})
        };
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

pub(super) fn error(
    status: StatusCode,
    kind: &'static str,
    message: impl Into<String>,
) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
        anthropic: false,
        code: None,
    }
}

pub(super) fn bad(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}
