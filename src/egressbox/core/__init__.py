"""The pure floor: hosts, addresses, rules, the policy and the decision; no I/O."""
