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

use std::collections::HashMap;
use std::sync::Arc;

/// One tenant's claim on this step's prompt tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantDemand {
    pub tenant: Arc<str>,
    pub weight: u32,
    /// Prompt tokens its sequences could compute this step.
    pub want: usize,
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
        for d in demands.iter() {
            if d.granted >= d.want {
                self.deficits.remove(&d.tenant);
            }
        }
        self.clamp();
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
            granted: 0,
        }
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
