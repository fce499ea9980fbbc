//! Conversation overflow: render the whole conversation, and if it does not fit and the tenant
//! allows `truncate_oldest`, drop the fewest oldest non-system turns that make it fit. System
//! prompts and the newest turn are always kept; a turn is a user message and the replies after
//! it, so the conversation never restarts with an orphaned assistant reply.

use super::{Limits, PromptCodec, TemplateTurn, ValidationError, prompt_fits};
use crate::policy::Overflow;

/// A rendered, tokenized conversation and how many messages were dropped to make it fit.
pub(super) struct Fitted {
    pub(super) prompt_ids: Vec<u32>,
    pub(super) dropped_messages: usize,
}

/// Renders the whole conversation; if it is too long and the tenant allows truncation, drops
/// the fewest oldest turns that make it fit (binary search: the prompt shrinks as turns go).
pub(super) fn fit_conversation(
    turns: &[TemplateTurn],
    requested: Option<u32>,
    limits: &Limits,
    codec: &dyn PromptCodec,
) -> Result<Fitted, ValidationError> {
    let full = tokenize_turns(turns, codec)?;
    let fits = |ids: &[u32]| prompt_fits(ids.len(), requested, limits);
    if fits(&full) || limits.overflow == Overflow::Reject {
        return Ok(Fitted {
            prompt_ids: full,
            dropped_messages: 0,
        });
    }
    let starts = turn_starts(turns);
    // Dropping `k` turns removes the non-system messages before `starts[k]`; the newest turn
    // (k = starts.len() - 1) always stays. Find the smallest k that fits.
    let (mut lo, mut hi) = (1, starts.len().saturating_sub(1));
    let mut best: Option<(Vec<u32>, usize)> = None;
    while lo <= hi {
        let k = lo + (hi - lo) / 2;
        let kept = keep_from(turns, starts[k]);
        let ids = tokenize_turns(&kept, codec)?;
        if fits(&ids) {
            best = Some((ids, turns.len() - kept.len()));
            hi = k - 1;
        } else {
            lo = k + 1;
        }
    }
    let (prompt_ids, dropped_messages) = match best {
        Some(found) => found,
        // Not even the newest turn alone fits: report the full prompt's numbers.
        None => (full, 0),
    };
    Ok(Fitted {
        prompt_ids,
        dropped_messages,
    })
}

/// Indices (into `turns`) where each non-system turn starts: at every user message, and at the
/// first non-system message if the conversation does not open with a user.
fn turn_starts(turns: &[TemplateTurn]) -> Vec<usize> {
    let mut starts = Vec::new();
    for (i, turn) in turns.iter().enumerate() {
        if turn.role == "system" {
            continue;
        }
        if starts.is_empty() || turn.role == "user" {
            starts.push(i);
        }
    }
    starts
}

/// Every system turn, plus the non-system turns from index `start` on.
fn keep_from(turns: &[TemplateTurn], start: usize) -> Vec<TemplateTurn> {
    turns
        .iter()
        .enumerate()
        .filter(|(i, t)| t.role == "system" || *i >= start)
        .map(|(_, t)| t.clone())
        .collect()
}

fn tokenize_turns(
    turns: &[TemplateTurn],
    codec: &dyn PromptCodec,
) -> Result<Vec<u32>, ValidationError> {
    codec.encode_chat(turns).map_err(|error| {
        if error.is_template_fault() {
            ValidationError::BrokenTemplate(error.to_string())
        } else {
            ValidationError::Template(error.to_string())
        }
    })
}
