//! `GET /`: the chat page and the dashboard, one HTML page with its script and style sheet
//! embedded in the binary (nothing is fetched from elsewhere; no build step). The page itself
//! needs no key: everything it shows comes from the API and `/v1/status`, which do, and it asks
//! for the key when they refuse.
//!
//! Model output reaches the page only as text nodes (the Markdown renderer builds elements and
//! never parses HTML), and the content security policy allows no inline or foreign script.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::error;

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("style.css");

/// Scripts and styles from this origin only; no plugins, frames or foreign connections.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                      connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub(super) async fn index() -> Response {
    asset(INDEX, "text/html; charset=utf-8")
}

/// `/page/app.js` and `/page/style.css`.
pub(super) async fn file(Path(name): Path<String>) -> Response {
    match name.as_str() {
        "app.js" => asset(SCRIPT, "text/javascript; charset=utf-8"),
        "style.css" => asset(STYLE, "text/css; charset=utf-8"),
        _ => error(StatusCode::NOT_FOUND, "not_found_error", "no such file").into_response(),
    }
}
