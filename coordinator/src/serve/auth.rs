//! The API key: `Authorization: Bearer KEY` or Anthropic's `x-api-key`, compared in constant
//! time.

use axum::http::{header, HeaderMap, StatusCode};

use super::error::{error, ApiError};
use super::Shared;

/// Constant-time comparison of a presented key with the configured one.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

pub(super) fn authorized(s: &Shared, h: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.opts.api_key else {
        return Ok(());
    };
    // `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`
    let given = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
        .unwrap_or("");
    if same_key(given.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (Authorization: Bearer KEY)",
        ))
    }
}
