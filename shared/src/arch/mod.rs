//! One file per architecture. Each `Config` mirrors the Hugging Face `config.json` field for field
//! (defaults as in transformers' `configuration_<arch>.py`) and converts to a [`ModelSpec`]; the
//! keys the architectures share, and what is built from them, are read once in [`common`]:
//!
//! - [`common`]: the shared keys (sizes, router top-k, MLA, shared experts, RoPE, token ids),
//!   their defaults per architecture, and the [`ModelSpec`] pieces built from them.
//! - [`glm_moe_dsa`], [`deepseek_v3`], [`qwen3_moe`]: each architecture's own keys and rules.
//! - [`names`]: the tensor names of the checkpoints.
//!
//! [`ModelSpec`]: crate::config::ModelSpec

pub mod common;
pub mod deepseek_v3;
pub mod glm_moe_dsa;
pub mod names;
pub mod qwen3_moe;

use std::path::Path;

use crate::config::ModelSpec;
use crate::error::LoadError;

impl ModelSpec {
    /// Reads `dir/config.json` and dispatches on `model_type`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        Self::from_json(&text, &path)
    }

    /// Parses a config.json text; `path` is only used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, LoadError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| LoadError::config(path, format!("invalid JSON: {e}")))?;
        let mt = v
            .get("model_type")
            .and_then(|m| m.as_str())
            .ok_or_else(|| LoadError::config(path, "no string `model_type`"))?;
        let spec = match mt {
            "glm_moe_dsa" => glm_moe_dsa::spec(v, path)?,
            "deepseek_v3" | "kimi_k2" => deepseek_v3::spec(v, path)?,
            "qwen3_moe" => qwen3_moe::spec(v, path)?,
            other => {
                return Err(LoadError::config(
                    path,
                    format!(
                    "unknown model_type `{other}` (charm runs glm_moe_dsa, deepseek_v3, qwen3_moe)"
                ),
                ))
            }
        };
        spec.validate(path)?;
        Ok(spec)
    }
}
