//! The commands around a model that are not serving it: converting a checkpoint, making a
//! synthetic one, checking a machine, planning memory, counting parameters, and measuring
//! quality against a reference.

pub mod convert;
pub mod doctor;
pub mod evaluate;
pub mod info;
pub mod plan;
pub mod quality;
pub mod synth;
