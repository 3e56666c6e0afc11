//! Floor evidence: what a vendor receives and checks — bundles, `report check`, `report
//! show/diff`, the environment capture and `--redact`.

pub mod bundle;
pub mod capture;
pub mod check;
pub mod inspect;
pub mod redact;
