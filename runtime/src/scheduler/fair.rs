//! Weighted deficit round robin over prompt tokens, between the tenants that have prefill
//! waiting.
//!
//! Every step is one round. Each tenant with demand earns `budget × weight / Σ weights` tokens
//! of credit (its deficit, carried across steps with its fractional part) and is granted what
//! its credit covers, up to its demand; a tenant whose prompts cannot even be admitted this
//! step (every slot taken) earns nothing but keeps what it has, so its turn still comes. Tokens a satisfied tenant leaves are shared again among
//! the rest by weight, so the round never idles budget that someone could use. A tenant whose
//! demand is met keeps no credit (as in DRR, an emptied queue forgets its deficit): only
//! tenants that stay backlogged build up a claim, and over many steps backlogged tenants get
//! tokens in proportion to their weights. Credit is bounded by one full step in either
//! direction, so a tenant that could not use its share (its sequences waited for KV blocks)
//! cannot later take over many steps in a burst.
//!
//! **A short prompt borrows to finish.** Shares alone would spread a tenant's short prompt over
//! several steps (weight 2 of 5 of a 30-token step is 12 tokens: a 41-token chat takes four
//! steps), and every step it waits is a whole step of its time to first token. So after the
//! round, a tenant whose next prompt could finish within [`BORROW_STEPS`] steps takes what it
//! needs to finish (at most the whole step) from the tenants granted the most, as a debt: its
//! deficit goes negative by what it borrowed and the lenders' rise by the same, so while it
//! stays backlogged it repays from its next shares, and over many steps the weights hold. A
//! tenant owing more than [`MAX_DEBT_STEPS`] of a full step does not borrow, so a stream of
//! short prompts from one tenant gets its share and no more; debt is forgotten with the tenant
//! when it has no sequence left (as DRR forgets an emptied queue's deficit).

use std::collections::HashMap;
use std::sync::Arc;

/// A prompt may borrow when its remaining tokens fit in this many of the current steps.
pub const BORROW_STEPS: usize = 2;
/// A tenant owing more than this share of a full step (the scheduler's token budget) does
/// not borrow.
const MAX_DEBT_STEPS: f64 = 0.5;

/// One tenant's claim on this step's prompt tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantDemand {
    pub tenant: Arc<str>,
    pub weight: u32,
    /// Prompt tokens its sequences could compute this step.
    pub want: usize,
    /// Tokens that would complete its next prompt (the first of its sequences in prefill
    /// order, when that one's whole remaining prompt fits in a step's per-sequence cap); 0
    /// when none can.
    pub finish: usize,
    /// Tokens it is granted (set by [`TenantShares::split`]).
    pub granted: usize,
}

/// Deficits of the tenants with prefill waiting.
#[derive(Debug, Clone, Default)]
pub struct TenantShares {
    deficits: HashMap<Arc<str>, f64>,
    /// Bound of |deficit|: one step's full token budget.
    limit: f64,
}

impl TenantShares {
    pub fn new(step_budget: usize) -> TenantShares {
        TenantShares {
            deficits: HashMap::new(),
            limit: step_budget.max(1) as f64,
        }
    }

    /// Grants `budget` tokens among `demands` (one entry per tenant), setting each `granted`.
    /// Tenants absent from `demands` keep their credit (they may have prompts that cannot be
    /// admitted this step, e.g. every slot is taken) but earn none.
    pub fn split(&mut self, budget: usize, demands: &mut [TenantDemand]) {
        for d in demands.iter_mut() {
            d.granted = 0;
        }
        let mut remaining = budget;
        while remaining > 0 {
            let weight: f64 = demands
                .iter()
                .filter(|d| d.granted < d.want)
                .map(|d| f64::from(d.weight.max(1)))
                .sum();
            if weight == 0.0 {
                break;
            }
            let round = remaining as f64;
            for d in demands.iter().filter(|d| d.granted < d.want) {
                let deficit = self.deficits.entry(Arc::clone(&d.tenant)).or_insert(0.0);
                *deficit += round * f64::from(d.weight.max(1)) / weight;
            }
            // The largest claim is served first, so a budget that cannot cover every claim
            // goes to whoever has waited longest for it, not to whoever is listed first.
            let mut order: Vec<usize> = (0..demands.len())
                .filter(|&i| demands[i].granted < demands[i].want)
                .collect();
            order.sort_by(|&a, &b| {
                self.deficit(&demands[b].tenant)
                    .total_cmp(&self.deficit(&demands[a].tenant))
            });
            let mut gave = 0;
            for i in order {
                let d = &mut demands[i];
                let Some(deficit) = self.deficits.get_mut(&d.tenant) else {
                    continue;
                };
                let owed = deficit.max(0.0).floor() as usize;
                let give = owed.min(d.want - d.granted).min(remaining);
                *deficit -= give as f64;
                d.granted += give;
                remaining -= give;
                gave += give;
            }
            if gave == 0 {
                // Only fractions are owed: the largest claim takes what is left, paying for it,
                // so a budget smaller than the number of tenants still moves someone forward.
                let best = demands
                    .iter_mut()
                    .filter(|d| d.granted < d.want)
                    .max_by(|a, b| {
                        let da = self.deficits.get(&a.tenant).copied().unwrap_or(0.0);
                        let db = self.deficits.get(&b.tenant).copied().unwrap_or(0.0);
                        da.total_cmp(&db)
                    });
                let Some(d) = best else { break };
                let give = remaining.min(d.want - d.granted);
                if let Some(deficit) = self.deficits.get_mut(&d.tenant) {
                    *deficit -= give as f64;
                }
                d.granted += give;
                remaining -= give;
            }
        }
        self.lend_to_finishers(demands);
        for d in demands.iter() {
            // A satisfied tenant forgets its credit, not a debt it just took on.
            if d.granted >= d.want && self.deficit(&d.tenant) > -1.0 {
                self.deficits.remove(&d.tenant);
            }
        }
        self.clamp();
    }

    /// The borrowing pass of the module docs: shortest finish first, each from the largest
    /// grants.
    fn lend_to_finishers(&mut self, demands: &mut [TenantDemand]) {
        let budget: usize = demands.iter().map(|d| d.granted).sum();
        let mut borrowers: Vec<usize> = (0..demands.len())
            .filter(|&i| {
                let d = &demands[i];
                d.finish > d.granted
                    && d.finish <= d.want
                    && d.finish <= budget.saturating_mul(BORROW_STEPS)
            })
            .collect();
        borrowers.sort_by_key(|&i| demands[i].finish);
        for b in borrowers {
            if self.deficit(&demands[b].tenant) < -self.limit * MAX_DEBT_STEPS {
                continue;
            }
            let Some(gap) = demands[b]
                .finish
                .min(budget)
                .checked_sub(demands[b].granted)
            else {
                continue;
            };
            // Never past the bound the deficits are clamped to: a clamped debt would be
            // forgiven, and the weights would no longer hold.
            let room = (self.deficit(&demands[b].tenant) + self.limit).max(0.0) as usize;
            let mut gap = gap.min(room);
            let lendable: usize = (0..demands.len())
                .filter(|&i| i != b)
                .map(|i| demands[i].granted)
                .sum();
            if gap > lendable {
                continue;
            }
            while gap > 0 {
                let Some(lender) = (0..demands.len())
                    .filter(|&i| i != b && demands[i].granted > 0)
                    .max_by_key(|&i| demands[i].granted)
                else {
                    break;
                };
                // Take from the largest grant down to the next largest, so several lenders
                // share the loan instead of one paying it all.
                let next = (0..demands.len())
                    .filter(|&i| i != b && i != lender)
                    .map(|i| demands[i].granted)
                    .max()
                    .unwrap_or(0);
                let take = gap.min((demands[lender].granted - next).max(1));
                demands[lender].granted -= take;
                *self
                    .deficits
                    .entry(Arc::clone(&demands[lender].tenant))
                    .or_insert(0.0) += take as f64;
                let borrower = self
                    .deficits
                    .entry(Arc::clone(&demands[b].tenant))
                    .or_insert(0.0);
                *borrower -= take as f64;
                demands[b].granted += take;
                gap -= take;
            }
        }
    }

    /// Settles a tenant's account after the step: it was granted `granted` tokens and computed
    /// `used` (fewer when its sequences could not get blocks or a slot, more when it took
    /// tokens others left unused). The difference is credited or charged.
    pub fn settle(&mut self, tenant: &Arc<str>, granted: usize, used: usize) {
        if granted == used {
            return;
        }
        let deficit = self.deficits.entry(Arc::clone(tenant)).or_insert(0.0);
        *deficit += granted as f64 - used as f64;
        self.clamp();
    }

    fn clamp(&mut self) {
        let limit = self.limit;
        for deficit in self.deficits.values_mut() {
            *deficit = deficit.clamp(-limit, limit);
        }
    }

    /// Forgets the tenants `keep` rejects (those with no sequence left), so the table stays
    /// as small as the set of live tenants.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.deficits.retain(|tenant, _| keep(tenant));
    }

    /// Current credit of a tenant (tests and reports).
    pub fn deficit(&self, tenant: &str) -> f64 {
        self.deficits.get(tenant).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(tenant: &str, weight: u32, want: usize) -> TenantDemand {
        TenantDemand {
            tenant: tenant.into(),
            weight,
            want,
            finish: 0,
            granted: 0,
        }
    }

    fn finishing(tenant: &str, weight: u32, want: usize, finish: usize) -> TenantDemand {
        TenantDemand {
            finish,
            ..demand(tenant, weight, want)
        }
    }

    #[test]
    fn a_prompt_that_can_finish_now_borrows_and_repays() {
        let mut shares = TenantShares::new(512);
        // Weight 2 of 5 of 60 tokens is 24: the 41-token chat borrows 17 from the flood.
        let mut demands = vec![demand("flood", 3, 5000), finishing("chat", 2, 41, 41)];
        shares.split(60, &mut demands);
        assert_eq!((demands[0].granted, demands[1].granted), (19, 41));
        assert_eq!(shares.deficit("chat"), -17.0);
        assert_eq!(shares.deficit("flood"), 17.0);
        // A prompt that needs two whole steps takes the whole of each while its debt is small.
        let mut shares = TenantShares::new(512);
        let mut demands = vec![demand("flood", 3, 5000), finishing("chat", 2, 41, 41)];
        shares.split(30, &mut demands);
        assert_eq!((demands[0].granted, demands[1].granted), (0, 30));
        assert_eq!(shares.deficit("chat"), -18.0, "12 of its own, 18 borrowed");
        let mut demands = vec![demand("flood", 3, 5000), finishing("chat", 2, 11, 11)];
        shares.split(30, &mut demands);
        assert_eq!(demands[1].granted, 11, "finished in the second step");
        // One that would need more than two steps gets its share.
        let mut shares = TenantShares::new(512);
        let mut demands = vec![demand("flood", 3, 5000), finishing("chat", 2, 150, 150)];
        shares.split(60, &mut demands);
        assert_eq!(demands[1].granted, 24);
        // So does a tenant that owes more than half a full step, and no debt goes past the
        // bound (where it would be forgiven).
        let mut shares = TenantShares::new(100);
        let mut granted = Vec::new();
        for _ in 0..4 {
            let mut demands = vec![demand("flood", 1, 5000), finishing("chat", 1, 90, 90)];
            shares.split(90, &mut demands);
            granted.push(demands[1].granted);
            assert!(shares.deficit("chat") >= -100.0);
        }
        // 45 own + 45 borrowed (owes 45); again (owes 90); then 45 earned leaves it owing 45,
        // under half of 100: a loan up to the bound (10); then owing 100 − 45 = 55: its share.
        assert_eq!(granted, [90, 90, 55, 0]);
    }

    #[test]
    fn borrowing_keeps_the_weights_over_many_steps() {
        let mut shares = TenantShares::new(512);
        let mut totals = [0usize; 2];
        for _ in 0..2000 {
            // Both always backlogged; b's next prompt could always finish with 40 tokens.
            let mut demands = vec![demand("a", 3, 10_000), finishing("b", 1, 10_000, 40)];
            shares.split(64, &mut demands);
            assert_eq!(demands.iter().map(|d| d.granted).sum::<usize>(), 64);
            totals[0] += demands[0].granted;
            totals[1] += demands[1].granted;
        }
        let share_b = totals[1] as f64 / (totals[0] + totals[1]) as f64;
        assert!((share_b - 0.25).abs() < 0.01, "{totals:?}");
    }

    #[test]
    fn backlogged_tenants_share_by_weight_over_many_steps() {
        let mut shares = TenantShares::new(512);
        let mut totals = [0usize; 3];
        // Awkward budgets, so the fractions matter.
        for step in 0..1000 {
            let budget = 13 + step % 50;
            let mut demands = vec![
                demand("a", 3, 10_000),
                demand("b", 2, 10_000),
                demand("c", 1, 10_000),
            ];
            shares.split(budget, &mut demands);
            let granted: usize = demands.iter().map(|d| d.granted).sum();
            assert_eq!(granted, budget, "the whole budget is used");
            for (t, d) in totals.iter_mut().zip(&demands) {
                *t += d.granted;
            }
        }
        let all: usize = totals.iter().sum();
        for (total, weight) in totals.iter().zip([3.0, 2.0, 1.0]) {
            let share = *total as f64 / all as f64;
            let expected = weight / 6.0;
            assert!(
                (share - expected).abs() / expected < 0.01,
                "{totals:?}: {share} vs {expected}"
            );
        }
    }

    #[test]
    fn a_small_demand_is_met_and_the_rest_goes_to_the_others() {
        let mut shares = TenantShares::new(512);
        let mut demands = vec![demand("flood", 3, 5000), demand("chat", 2, 40)];
        shares.split(200, &mut demands);
        assert_eq!((demands[0].granted, demands[1].granted), (160, 40));
        assert_eq!(
            shares.deficit("chat"),
            0.0,
            "a satisfied tenant keeps no credit"
        );
        // A budget smaller than the chat's share of it: it gets its weight's part.
        let mut demands = vec![demand("flood", 3, 5000), demand("chat", 2, 40)];
        shares.split(50, &mut demands);
        assert_eq!((demands[0].granted, demands[1].granted), (30, 20));
    }

    #[test]
    fn a_budget_smaller_than_the_tenants_still_moves_someone() {
        let mut shares = TenantShares::new(512);
        let mut served = HashMap::new();
        for _ in 0..30 {
            let mut demands: Vec<_> = ["a", "b", "c", "d", "e"]
                .iter()
                .map(|t| demand(t, 1, 100))
                .collect();
            shares.split(1, &mut demands);
            let winners: Vec<_> = demands.iter().filter(|d| d.granted > 0).collect();
            assert_eq!(winners.len(), 1);
            *served.entry(winners[0].tenant.to_string()).or_insert(0) += 1;
        }
        assert_eq!(served.len(), 5, "every tenant's turn comes: {served:?}");
        assert!(served.values().all(|n| (5..=7).contains(n)), "{served:?}");
    }

    #[test]
    fn unused_grants_are_credited_within_bounds() {
        let mut shares = TenantShares::new(100);
        let mut demands = vec![demand("a", 1, 1000), demand("b", 1, 1000)];
        shares.split(100, &mut demands);
        shares.settle(&Arc::from("a"), demands[0].granted, 0);
        assert_eq!(shares.deficit("a"), 50.0);
        for _ in 0..10 {
            shares.settle(&Arc::from("a"), 50, 0);
        }
        assert_eq!(shares.deficit("a"), 100.0, "bounded by one step");
        let mut demands = vec![demand("a", 1, 1000), demand("b", 1, 1000)];
        shares.split(100, &mut demands);
        assert!(demands[0].granted > demands[1].granted);
    }
}
