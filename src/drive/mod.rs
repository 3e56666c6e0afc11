//! Floor drive: what runs a probe — decode's side (run), prefill's side (serve), the isolation
//! matrix (ab) and the probe's own speed (bench).

pub mod ab;
pub mod bench;
pub mod run;
pub mod serve;
