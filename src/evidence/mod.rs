//! Floor evidence: what a vendor receives and checks — bundles, `report check`, `report
//! show/diff`, the environment capture and `--redact`.

pub mod bundle;
pub mod env_capture;
pub mod redact;
pub mod report_check;
pub mod show;
