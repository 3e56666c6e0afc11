//! The multi-connector (vLLM's MultiConnector): fans a request out to the NIXL connector and
//! the tier connector and counts their completions. Prefill's blocks of a request may be
//! freed only when every connector that touched them has reported done: the NIXL READ's
//! notification arrived, and every save of the tier has copied its block. This is the one
//! place that decides, so the orderings that break the rule are here too, each behind its
//! unfenced mechanism (`--race`):
//!
//! - free-on-first-completion: the stacked scenario frees at the first connector's
//!   completion (the field reports' MultiConnector bug);
//! - save-after-free: freed once the READ is done, with saves still queued;
//! - load-into-reading: blocks whose READ is pending are lent to the next tier loads.

use crate::core::mechanism::{Mechanism, Races, Scenario};

/// What each connector has reported for one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completions {
    /// The NIXL READ's notification arrived (or the scenario moves nothing over NIXL).
    pub(crate) nixl: bool,
    /// Every save the tier connector took for the request has run.
    pub(crate) tier: bool,
    /// The tier connector took saves for the request at all.
    pub(crate) had_saves: bool,
    /// The request's blocks were already lent out early.
    pub(crate) lent: bool,
}

/// The multi-connector's verdict on a request's prefill blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Keep them.
    Hold,
    /// Free them; `Some(m)` when only unfenced mechanism `m` allowed it now.
    Free(Option<Mechanism>),
    /// Keep them owned but lend them to the next tier loads (load-into-reading).
    Lend,
}

/// The multi-connector of a scenario run.
pub(crate) struct MultiConnector {
    scenario: Scenario,
    races: Races,
}

impl MultiConnector {
    /// The multi-connector of `scenario`, with `races` unfenced.
    pub(crate) fn new(scenario: Scenario, races: Races) -> MultiConnector {
        MultiConnector { scenario, races }
    }

    /// What to do with a request's prefill blocks given its completions so far.
    pub(crate) fn verdict(&self, c: Completions) -> Verdict {
        if c.nixl && c.tier {
            Verdict::Free(None)
        } else if self.races.unfenced(Mechanism::SaveAfterFree) && c.nixl && !c.tier {
            Verdict::Free(Some(Mechanism::SaveAfterFree))
        } else if self.races.unfenced(Mechanism::FreeOnFirstCompletion)
            && self.scenario == Scenario::Stacked
            && c.had_saves
            && (c.nixl || c.tier)
        {
            Verdict::Free(Some(Mechanism::FreeOnFirstCompletion))
        } else if self.races.unfenced(Mechanism::LoadIntoReading) && !c.nixl && !c.lent {
            Verdict::Lend
        } else {
            Verdict::Hold
        }
    }
}
